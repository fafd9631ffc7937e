"""One node process (``georep node``): ``serve`` wires the server's services, the Kafka listener and
``/metrics`` over one data dir. It sits above both front ends, the gRPC services of ``georep/server`` and the
Kafka listener of ``georep/kafka``, which it starts side by side."""
