"""``python3 -m localkafka fetch|start|stop|status``: the local Kafka manager's command line
(``localkafka.cli``), standard library only, so CI runs it before the package is installed."""

import sys

from localkafka.cli import main

sys.exit(main())
