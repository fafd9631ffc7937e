"""The Raft journal is fdatasynced before anything counts on it (issue 20, item 11).

A metadata command is acknowledged once a majority holds it in its journal; a node that lost power must still hold
every entry it counted in or answered for. Two views on three real pysyncobj stores: in this process, no Raft
message leaves a node while its journal holds an entry that is not fdatasynced; and in a child process under
``strace``, the journal files get their ``fdatasync`` calls.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.site_state import CreateTopic
from cluster.topics import TopicSpec
from georep.security.raft_secret import new_secret
from tests.support.raft import Site, ok

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


class Ledger:
    """Per thread: journal entries added and not fdatasynced yet, and the messages sent meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unsynced: dict[int, int] = {}  # thread -> entries added since its last journal fdatasync
        self.adds = 0
        self.syncs = 0
        self.sends = 0
        self.early: list[str] = []  # sends while their thread had unsynced entries

    def added(self) -> None:
        with self.lock:
            me = threading.get_ident()
            self.unsynced[me] = self.unsynced.get(me, 0) + 1
            self.adds += 1

    def synced(self, fd: int) -> None:
        if is_journal(fd_path(fd)):
            with self.lock:
                self.unsynced.pop(threading.get_ident(), None)
                self.syncs += 1

    def sent(self, sock: socket.socket) -> None:
        with self.lock:
            self.sends += 1
            pending = self.unsynced.get(threading.get_ident(), 0)
            if pending:
                self.early.append(f"a message to {sock.getpeername()} with {pending} entries not fdatasynced")


def test_no_raft_message_leaves_a_node_before_its_journal_is_fdatasynced(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger()
    for name in ("fdatasync", "fsync"):
        real: Callable[[int], None] = getattr(os, name)

        def sync(fd: int, real: Callable[[int], None] = real) -> None:
            real(fd)
            ledger.synced(fd)

        monkeypatch.setattr(os, name, sync)
    real_send = socket.socket.send

    def send(self: socket.socket, data: Any, *args: Any) -> int:
        ledger.sent(self)
        return real_send(self, data, *args)

    monkeypatch.setattr(socket.socket, "send", send)
    site.start()
    for store in site.running():
        raft_log = store._replica._SyncObj__raftLog
        real_add = raft_log.add

        def add(command: bytes, idx: int, term: int, real_add: Callable[[bytes, int, int], None] = real_add) -> None:
            ledger.added()
            real_add(command, idx, term)

        monkeypatch.setattr(raft_log, "add", add)
    leader = site.leader()
    for n in range(COMMANDS):  # through each node in turn: followers forward to the leader
        ok(site[(leader + n) % 3].propose(CreateTopic(TopicSpec(f"t{n}", 1))))
    site.converged()
    assert ledger.adds >= 3 * COMMANDS and ledger.sends > 0, (ledger.adds, ledger.sends)  # it watched the traffic
    assert not ledger.early, f"{len(ledger.early)} of {ledger.sends} messages left early: {ledger.early[:3]}"
    assert ledger.syncs > 0


CHILD = """
import sys
from pathlib import Path
from cluster.site_state import CreateTopic
from cluster.topics import TopicSpec
from georep.security.raft_secret import new_secret
from tests.support.raft import Site, ok

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


def test_strace_shows_each_node_fdatasync_its_journal(tmp_path: Path) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: apt-get install -y strace")
    trace = tmp_path / "strace.txt"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    run = subprocess.run(
        [strace, "-f", "-y", "-qq", "-e", "trace=fdatasync,fsync", "-e", "signal=none", "-o", str(trace),
         sys.executable, str(script), str(tmp_path / "site"), str(COMMANDS)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    calls = [m.groups() for m in map(SYNC_LINE.match, trace.read_text().splitlines()) if m]
    journal = [(call, path) for call, _, path in calls if is_journal(path)]
    per_node = {f"node{i}": sum(f"/node{i}/raft/" in path for _, path in journal) for i in range(3)}
    shown = "\n".join(line for line in trace.read_text().splitlines() if "journal" in line)[:2000]
    # Every command is fdatasynced by its leader before the leader counts itself, and by each follower before it
    # answers: at least one call per command, and every node's journal among them.
    assert {call for call, _ in journal} == {"fdatasync"} and len(journal) >= COMMANDS, shown
    assert all(count > 0 for count in per_node.values()), (per_node, shown)
