"""The ``georep`` command run as a user runs it: a subprocess of this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys


def georep(
    *args: str, stdin: bytes = b"", env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "georep.cli", *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()
