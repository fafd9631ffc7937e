"""The ``georep`` command: ``main`` is its entry point (``georep/cli/main.py``).

One module per command family: ``topics`` and ``records`` (the client
commands), ``node``, ``up``, ``status``, ``link``, ``group``, ``topology``,
``drill`` and ``demo``; ``output`` holds what they all print.
"""

import os

# gRPC's core logs each failed TLS handshake at INFO on stderr; the client explains the failure itself (what to
# pass), so a command shows that one line instead. Set GRPC_VERBOSITY to see gRPC's own logs again.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from georep.cli.main import main  # after the environment gRPC reads when it loads

__all__ = ["main"]
