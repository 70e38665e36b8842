#!/bin/sh
# Kafka's broker-api-versions tool (the compose healthcheck runs it), from the same jars.
exec java -Xmx128m -Dlog4j.configuration=file:/opt/kafka/config/log4j.properties -cp '/opt/kafka/libs/*' \
  kafka.admin.BrokerApiVersionsCommand "$@"
