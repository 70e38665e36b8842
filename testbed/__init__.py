"""Stand-ins for the world outside one process, for the tests and bench/: an S3 server
(``s3.MotoServer``), simulated hosts (``netns``: network namespaces on one switch, delayed by
``nfqdelay``), free ports (``ports``) and deadline polls (``wait``). No role imports it."""
