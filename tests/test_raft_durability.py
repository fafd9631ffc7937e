"""The Raft journal is fdatasynced before anything counts on it (issue 20, item 11).

A metadata command is acknowledged once a majority holds it in its journal; a node that lost power must still hold
every entry it counted in or answered for. Two views on three real pysyncobj stores: in this process, no node
answers for an entry (any message but a leader's append) nor counts itself in its commit (the leader) before the
entry is fdatasynced; and in a child process under ``strace``, the journal files get their ``fdatasync`` calls.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.site_state import CreateTopic
from georep.metadata.topics import TopicSpec
from georep.raft.store import MetadataUnavailable
from georep.security.raft_secret import new_secret
from tests.support.raft import Site, ok, wait_until

COMMANDS = 30
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path, password=new_secret())
    yield s
    s.close()


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def is_journal(path: str) -> bool:
    return "/raft/journal." in path and not path.endswith((".meta", ".tmp"))


class Node:
    """What one node added to its journal and fdatasynced (the highest entry index of each), and what it did
    before its fdatasync that counts on the entries: an answer sent, or a commit counted as the leader."""

    def __init__(self, site: Site, i: int, early: list[str]) -> None:
        self.store = site[i]
        self.name = f"node{i}"
        self.directory = f"/{self.name}/raft/"
        raft_log = self.store._replica._SyncObj__raftLog
        self.added = self.synced = raft_log[-1][1]  # what it held when watching began counts as synced
        self.adds = self.syncs = self.sends = self.commits = 0
        self.early = early
        self.lock = threading.Lock()

    def added_entry(self, idx: int) -> None:
        with self.lock:
            self.added = max(self.added, idx)
            self.adds += 1

    def fdatasynced(self) -> None:
        with self.lock:
            self.synced = self.added
            self.syncs += 1

    def sent(self, message: Any) -> None:
        with self.lock:
            self.sends += 1
            # A leader's append may leave first: Raft lets it write its log while replicating it, as long as it
            # counts itself in a commit only after its fdatasync (checked in committed()).
            kind = message.get("type") if isinstance(message, dict) else "handshake"
            if self.synced < self.added and kind != "append_entries":
                self.early.append(f"{self.name} sent {kind} with entries {self.synced + 1}..{self.added} unsynced")

    def committed(self, index: int) -> None:
        if not self.store.is_leader:
            return  # a follower applies what its leader committed; it answered for it only after its fdatasync
        with self.lock:
            self.commits += 1
            if index > self.synced:
                self.early.append(
                    f"{self.name}, the leader, counted itself in committing {index} with "
                    f"entries {self.synced + 1}..{self.added} unsynced"
                )


def watch(site: Site, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Node], list[str]]:
    """Wrap each node's journal and connections (whatever classes the code uses) and os.fdatasync/os.fsync."""
    early: list[str] = []
    nodes = [Node(site, i, early) for i in sorted(site.stores)]
    for name in ("fdatasync", "fsync"):
        real: Callable[[int], None] = getattr(os, name)

        def sync(fd: int, real: Callable[[int], None] = real) -> None:
            real(fd)
            path = fd_path(fd)
            for node in nodes:
                if is_journal(path) and node.directory in path:
                    node.fdatasynced()

        monkeypatch.setattr(os, name, sync)
    for node in nodes:
        replica = node.store._replica
        raft_log = replica._SyncObj__raftLog
        real_add, real_commit = raft_log.add, raft_log.setRaftCommitIndex

        def add(command: bytes, idx: int, term: int, node: Node = node, real_add: Any = real_add) -> None:
            real_add(command, idx, term)
            node.added_entry(idx)

        def commit(index: int, node: Node = node, real_commit: Any = real_commit) -> None:
            node.committed(index)
            real_commit(index)

        monkeypatch.setattr(raft_log, "add", add)
        monkeypatch.setattr(raft_log, "setRaftCommitIndex", commit)
        for conn in replica._SyncObj__transport._connections.values():
            real_send = conn.send

            def send(message: Any, node: Node = node, real_send: Any = real_send) -> None:
                node.sent(message)
                real_send(message)

            monkeypatch.setattr(conn, "send", send)
    return nodes, early


def test_no_raft_answer_or_commit_counts_on_an_entry_before_it_is_fdatasynced(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    site.start()
    leader = site.leader()
    nodes, early = watch(site, monkeypatch)
    for n in range(COMMANDS):  # through each node in turn: followers forward to the leader
        ok(site[(leader + n) % 3].propose(CreateTopic(TopicSpec(f"t{n}", 1))))
    site.converged()
    counts = {node.name: (node.adds, node.sends, node.commits) for node in nodes}
    # it watched the traffic: every node added every command and sent messages; the leader committed
    assert all(adds >= COMMANDS and sends > 0 for adds, sends, _ in counts.values()), counts
    assert nodes[leader].commits > 0, counts
    assert not early, f"{len(early)} answers or commits counted on unsynced entries: {early[:3]}"
    assert all(node.syncs > 0 for node in nodes)


CHILD = """
import sys
from pathlib import Path
from georep.raft.store import MetadataUnavailable
from cluster.site_state import CreateTopic
from georep.metadata.topics import TopicSpec
from georep.security.raft_secret import new_secret
from tests.support.raft import Site, ok, wait_until

site = Site(Path(sys.argv[1]), password=new_secret())
site.start()
try:
    leader = site.leader()
    for n in range(int(sys.argv[2])):
        ok(site[(leader + 1) % 3].propose(CreateTopic(TopicSpec(f"t{n}", 1))))
    site.converged()
finally:
    site.close()
"""
# "pid call(fd<path>) = 0", or "pid call(fd<path> <unfinished ...>" when another thread's call came in between
SYNC_LINE = re.compile(r"^\d+\s+(fdatasync|fsync)\((\d+)<([^>]*)>")


@pytest.mark.slow
def test_strace_shows_each_node_fdatasync_its_journal(tmp_path: Path) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: apt-get install -y strace")
    trace = tmp_path / "strace.txt"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    run = subprocess.run(
        [
            strace,
            "-f",
            "-y",
            "-qq",
            "-e",
            "trace=fdatasync,fsync",
            "-e",
            "signal=none",
            "-o",
            str(trace),
            sys.executable,
            str(script),
            str(tmp_path / "site"),
            str(COMMANDS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    calls = [m.groups() for m in map(SYNC_LINE.match, trace.read_text().splitlines()) if m]
    journal = [(call, path) for call, _, path in calls if is_journal(path)]
    per_node = {f"node{i}": sum(f"/node{i}/raft/" in path for _, path in journal) for i in range(3)}
    shown = "\n".join(line for line in trace.read_text().splitlines() if "journal" in line)[:2000]
    # Every command is fdatasynced by its leader before the leader counts itself, and by each follower before it
    # answers: at least one call per command, and every node's journal among them.
    assert {call for call, _ in journal} == {"fdatasync"} and len(journal) >= COMMANDS, shown
    assert all(count > 0 for count in per_node.values()), (per_node, shown)


def test_a_node_whose_journal_cannot_be_fdatasynced_leaves_its_group_which_goes_on(
    site: Site, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    site.start()
    leader = site.leader()
    broken_dir = f"/node{leader}/raft/"
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if broken_dir in fd_path(fd):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    # it never confirms the command (the others may commit it: its append left before its fdatasync failed)
    with caplog.at_level(logging.CRITICAL), pytest.raises(MetadataUnavailable):
        site[leader].propose(CreateTopic(TopicSpec("lost", 1)), timeout_s=2.0)
    assert f"the Raft journal {site.tmp_path}/node{leader}/raft/journal.log failed" in caplog.text
    assert "stops taking part in its site's metadata" in caplog.text
    survivors = [i for i in range(3) if i != leader]
    ok(site[survivors[0]].propose(CreateTopic(TopicSpec("after", 1)), timeout_s=10.0))
    wait_until(lambda: "after" in site[survivors[1]].topics(), "the other survivor applies it")
