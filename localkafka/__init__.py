"""Local Apache Kafka (KRaft) without Docker, standard library only: CI runs ``python3 -m
localkafka fetch`` before the package's dependencies are installed.

By idea, bottom up: ``paths`` (versions, cache dirs, errors, file helpers), ``render``
(server.properties, log4j, poms), ``fetch`` (the jars with ``mvn``, ``java``), ``probe``
(readiness, free ports), ``broker`` (``LocalKafka``: one node's lifecycle), ``cluster``
(``LocalCluster``: N nodes, one quorum), ``cli`` (``rlstream broker``, ``__main__``) and
``kafka_tools`` (Kafka's own command-line tools)::

    rlstream broker fetch   [--version V]
    rlstream broker start   [--port 9092] [--controller-port P] [--data-dir D]
                            [--nodes N] [--fresh] [--foreground] [--timeout 120]
    rlstream broker stop    [--port 9092] [--data-dir D] [--nodes N] [--timeout 30]
    rlstream broker status  [--port 9092] [--data-dir D] [--nodes N]
"""
