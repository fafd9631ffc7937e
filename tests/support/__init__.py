"""Test harness shared by several test modules: real node processes, batches, segment logs, the CLI.

Test modules import from here, never from each other; the fixtures are in ``tests/conftest.py``.
"""
