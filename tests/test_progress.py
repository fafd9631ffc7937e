"""The audit's progress display: the counts executors send the driver over UDP, the status line, and how it is
shown on a terminal, in a log, and not at all with --quiet. Spark's side (the stages of a real run, the counts
from executors on other processes) is checked on a cluster in tests/test_spark_cluster.py."""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator

import pyarrow as pa
import pytest

from spark_jobs.progress import (
    SITES_MAX,
    Listener,
    PlainProgress,
    Reporter,
    SilentProgress,
    SiteCount,
    Stage,
    TerminalProgress,
    progress_for,
    reported,
    status_line,
)
from tests.support.sites import wait_until


@pytest.fixture
def listener() -> Iterator[Listener]:
    one = Listener("127.0.0.1")
    try:
        yield one
    finally:
        one.close()


def test_readers_counts_reach_the_driver_summed_per_site(listener: Listener) -> None:
    first, second = Reporter(listener.address, every_s=0.0), Reporter(listener.address)
    first.add("a", 10, 400, 160_000)
    first.add("b", 5, 200, 80_000)
    second.add("a", 1, 40, 16_000)  # held until its close: at most one datagram per interval
    assert listener.snapshot().get("a", SiteCount()).items <= 15
    second.close()
    first.close()
    wait_until(
        "both readers' counts arrived",
        lambda: listener.snapshot() == {"a": SiteCount(11, 440, 176_000), "b": SiteCount(5, 200, 80_000)},
        10,
    )


def test_what_is_not_a_count_is_dropped(listener: Listener) -> None:
    host, port = listener.address.split(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for junk in (b"\xff\xfe", b"{}", b'{"s": "a", "n": "many", "w": 0, "b": 0}', b"[1, 2]"):
            s.sendto(junk, (host, int(port)))
    good = Reporter(listener.address, every_s=0.0)
    good.add("c", 1, 0, 100)
    good.close()
    wait_until("the good datagram arrived", lambda: "c" in listener.snapshot(), 10)
    assert listener.snapshot() == {"c": SiteCount(1, 0, 100)}


def test_a_flood_of_made_up_sites_does_not_grow_the_table(listener: Listener) -> None:
    for i in range(SITES_MAX + 5):
        listener.take(json.dumps({"s": f"s{i}", "n": 1, "w": 0, "b": 0}).encode())
    listener.take(json.dumps({"s": "s0", "n": 1, "w": 0, "b": 0}).encode())  # a counted site counts on
    counts = listener.snapshot()
    assert len(counts) == SITES_MAX and counts["s0"].items == 2


def test_a_reader_without_a_listener_reads_on() -> None:
    quiet = Reporter(None, every_s=0.0)
    quiet.add("a", 1, 2, 3)
    quiet.close()
    unreachable = Reporter("127.0.0.1:9", every_s=0.0)  # discard port: nobody listens
    unreachable.add("a", 1, 2, 3)
    unreachable.close()


def test_reported_passes_batches_through_and_counts_their_columns(listener: Listener) -> None:
    digests = pa.RecordBatch.from_pydict({"digest_bytes": [40, 41], "size_bytes": [16_000, 17_000]})
    files = pa.RecordBatch.from_pydict({"size_bytes": [1_000]})
    out = list(reported(iter([digests, digests]), {"progress": listener.address}, "a"))
    out += list(reported(iter([files]), {"progress": listener.address}, "b"))
    assert out == [digests, digests, files]
    wait_until("the counts arrived", lambda: len(listener.snapshot()) == 2, 10)
    assert listener.snapshot() == {"a": SiteCount(4, 162, 66_000), "b": SiteCount(1, 0, 1_000)}
    assert list(reported(iter([files]), {}, "b")) == [files]  # no listener: the rows alone


def test_the_status_line_names_stages_tasks_and_each_sites_counts() -> None:
    line = status_line(
        12.4,
        [Stage(4, "load", 3, 8, 2)],
        5,
        {"a": SiteCount(1_200, 48_000, 3_400_000), "b": SiteCount(30, 0, 1_500_000)},
    )
    assert line == (
        "12 s | stage 4: 3/8 tasks (2 running) | 5 stage(s) done | a 1,200 digests 0.05 MB of 3.40 MB"
        " | b 30 batches 1.50 MB"
    )


def test_plain_status_lines_come_at_a_pace_and_only_when_they_change() -> None:
    lines: list[str] = []
    plain = PlainProgress(lines.append, every_s=3600.0)
    plain.status("stage 1: 0/2 tasks")
    plain.status("stage 1: 1/2 tasks")  # within the hour: not shown
    plain.step("digests: site a: 3 batch digest(s)")
    assert lines == ["progress: stage 1: 0/2 tasks", "digests: site a: 3 batch digest(s)"]
    eager = PlainProgress(lines.append, every_s=0.0)
    eager.status("x")
    eager.status("x")
    eager.status("y")
    assert lines[2:] == ["progress: x", "progress: y"]


def test_on_a_terminal_the_status_is_one_line_redrawn_under_the_steps() -> None:
    screen = io.StringIO()
    term = TerminalProgress(screen)
    term.status("stage 1: 0/2 tasks")
    term.status("stage 1: 1/2 tasks")
    term.step("digests: site a: 3")
    term.clear()
    assert screen.getvalue() == (
        "\r\x1b[Kstage 1: 0/2 tasks"
        "\r\x1b[Kstage 1: 1/2 tasks"
        "\r\x1b[Kdigests: site a: 3\nstage 1: 1/2 tasks"  # the step above, the status redrawn below it
        "\r\x1b[K"
    )


def test_the_display_follows_the_output_and_quiet() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_for(True, stream=Tty()), SilentProgress)
    assert isinstance(progress_for(False, stream=Tty()), TerminalProgress)
    assert type(progress_for(False, stream=io.StringIO())) is PlainProgress
    assert type(progress_for(False, terminal=False, stream=Tty())) is PlainProgress
    assert type(progress_for(False, [].append, stream=Tty())) is PlainProgress  # the caller keeps the lines
