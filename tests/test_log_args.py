"""Issue 26: ``--log-level`` and ``--log-format json`` on ``georep node`` (and through ``georep up -- ...``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from georep.cli.log_args import JsonFormatter
from tests.support.cli import serve_once

GEOREP = [sys.executable, "-m", "georep.cli"]


def test_a_json_line_keeps_a_multi_line_message_and_the_exception_in_one_object() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord("georep.x", logging.ERROR, __file__, 1, "two\nlines %s", ("ü",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert (doc["level"], doc["logger"], doc["msg"]) == ("error", "georep.x", "two\nlines ü")
    assert "ValueError: bad\nthing" in doc["exc"] and doc["ts"].endswith("Z")


def node_log(tmp_path: Path, *flags: str) -> list[str]:
    """The stderr lines of a node started with ``flags``, once it served and stopped."""
    data = tmp_path / "-".join(flags)
    argv = [*GEOREP, "node", "--site", "a", "--listen", "127.0.0.1:0", "--data-dir", str(data), "--insecure", *flags]
    return [line for line in serve_once(argv, data).splitlines() if line.strip()]


def test_a_node_logs_one_json_object_a_line_at_the_level_asked(tmp_path: Path) -> None:
    lines = node_log(tmp_path, "--log-format", "json")
    docs = [json.loads(line) for line in lines]  # every line, or this raises
    assert {"ts", "level", "logger", "msg"} <= set(docs[0])
    assert any(d["level"] == "info" and d["logger"].startswith("georep") for d in docs)
    quiet = node_log(tmp_path, "--log-format", "json", "--log-level", "warning")
    assert all(json.loads(line)["level"] in ("warning", "error") for line in quiet)
    text = node_log(tmp_path)
    assert any(" INFO georep" in line for line in text) and not text[0].startswith("{")


def test_an_unknown_level_is_refused_naming_the_choices(tmp_path: Path) -> None:
    done = subprocess.run(
        [*GEOREP, "node", "--site", "a", "--data-dir", str(tmp_path), "--log-level", "loud"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "debug" in done.stderr and "loud" in done.stderr
