"""The ``georep`` command: ``main`` is its entry point (``georep/cli/main.py``).

One module per command family: ``topics`` and ``records`` (the client
commands), ``node``, ``up``, ``status``, ``link``, ``group``, ``topology``,
``drill`` and ``demo``; ``output`` holds what they all print.
"""

from georep.cli.main import main

__all__ = ["main"]
