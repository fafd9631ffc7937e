"""What a broker decides, sans I/O: the origin append (``append``), when an ack
may go and when to fsync (``acks``), where a fetch starts and what it hands out
(``fetch``), the fold of committed positions (``commits``), and the domain
errors (``errors``). The node (``georep/server/``) and the simulator
(``georep/sim/``) drive the same code."""
