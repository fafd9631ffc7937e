"""The site's metadata over Raft: :class:`RaftMetadataStore`, the shell around ``cluster/site_state.py``.

Every node of a site runs one pysyncobj ``SyncObj`` on its own Raft port (a
``host:port`` apart from its gRPC port) and lists the Raft ports of the other
nodes. pysyncobj orders the commands in a replicated log; every node applies
them, in that order, to its :class:`~cluster.site_state.SiteState`. The store
implements the ``MetadataStore`` port (``georep/metadata/store.py``) and adds
:meth:`RaftMetadataStore.propose` for every other command.

**Writes** (:meth:`RaftMetadataStore.propose`) go to the Raft leader, from any
node, and return once the command is committed (journaled on a majority) and
applied on *this* node, with the :class:`~cluster.site_state.Result` that the
state machine gave: a refusal is a value, not an exception. A write that
cannot be confirmed within its timeout raises :class:`NoRaftLeader` (no
majority reachable: it says how many nodes are) or :class:`CommitUnconfirmed`.
Neither means the command was not applied: it may still be committed later
(by a leader that had it in its log). Every command is a compare-and-set
(``CreateTopic``, ``ElectLeader``, ``ReplaceMember``) or idempotent (the
rest), so a retry never applies twice; but a compare-and-set may be refused
because its first try did apply, so the caller reads the state (after
:meth:`read_barrier`) rather than trust a retry's refusal. Retries that are
safe because the command certainly never entered a log (no leader known, or
a leader change that discarded it) are made here, within the timeout, and a
command is not sent while the last known leader is unreachable (pysyncobj
would send it into the void and report the outcome as unknown).

**Reads** are local and never block on the network: :meth:`state`,
:meth:`topics`, :meth:`get`. A follower may be behind the leader by the
commits it has not received yet (normally one heartbeat, 0.1 s; unbounded
while it is cut off), and even the node that believes it is the leader may
have been deposed without knowing for up to ``leader_step_down_s``. After a
:meth:`propose` returns, this node's state includes that command
(read-your-writes). Where a decision must not act on stale state (the
leadership controller, repair), call :meth:`read_barrier` first: once it
returns, the local state holds every command committed before the call.

**Files**, under ``<data dir>/raft/`` (mode 0700, files 0600: the state holds
ACLs and SCRAM credentials): the journal (``journal.log``, every log entry,
with ``journal.meta`` for the term, vote and commit index;
``georep.raft.journal``) and the full dump (``site-state.json``) written at
each log compaction and when the store is closed. The dump is JSON
(:data:`DUMP_FORMAT`): the state's
:meth:`~cluster.site_state.SiteState.snapshot` plus the two log entries
pysyncobj needs to resume its log after it, so it does not depend on pickled
classes. A restarted node loads the dump, replays the journal up to the commit
index it had recorded, and catches up from the leader. A data dir of an older
georep (pysyncobj's ``journal.bin``) is taken over at the first start.

**What survives what.** A command is committed once a majority of the nodes
hold it fdatasynced in their journals: no node answers the leader's append, and
the leader does not count itself, before its fdatasync (``georep.raft.journal``,
``georep.raft.transport``; one fdatasync per node for all the entries of a poll
pass or tick). So a committed command survives a crash of the process, of the
machine and of the whole site's power, as long as the disks keep what was
fdatasynced. A command whose :meth:`propose` raised may or may not be there.
The term and vote are fsynced before a vote leaves, a follower's truncation at
once, and a received dump before the journal it replaces is cleared.

**The Raft port** (``georep.raft.transport``) is pysyncobj's protocol over
connections of georep's own: a frame longer than the largest a member sends
(``georep.raft.frames``: 4 KiB before a message passes the secret's check,
about 2.3 MiB after) closes its connection at its header, connections that are
not a member's yet are capped and closed after a few seconds, and the node logs
what it closed. A command is refused before it is proposed if its entry would
exceed :data:`~georep.raft.frames.COMMAND_BYTES_MAX` (:class:`CommandTooLarge`).

**Membership** is dynamic (pysyncobj's ``dynamicMembershipChange``): the group
forms from the topology's nodes, and a node added later joins it while it
runs (:func:`join_running_group`, before the store starts: a fresh node asks
the members listed with it for their view of the group with pysyncobj's
``status`` utility message, and, if they run without it, asks the leader to
add it, the ``add`` message that ``syncobj_admin -add`` sends; the leader
appends the change to the log, one change at a time, and counts the new
member at once). Changes are log entries: every node applies them when they
reach its log, replays them from its journal at a restart, and keeps the
membership in its dump (``raft.cluster``), so a restarted node counts the
members it had, whatever its topology file lists. A node that is not a
member cannot disturb the group: the members drop connections from Raft
addresses they do not know, and a node that reaches nobody never runs for
election, so it can neither vote nor form a majority of its own.

**The Raft secret** (``password``; docs/security.md): pysyncobj seals every message on the Raft port, the utility
messages above included, as a Fernet token under a key derived from the site's secret, and closes a connection at
the first message that fails the check, before unpickling it. So a process without the secret can neither join,
vote, nor send a command, and learns nothing from the port. pysyncobj logs nothing about it; this store does
(``_CheckedEncryptor``), so a node given the wrong secret file shows in the logs of the nodes it tries.

pysyncobj facts this module relies on or works around (0.3.17):

* Commands in the log and messages between nodes are pickled. Without a
  secret, anyone who can connect to the Raft port can run code in the node;
  with one, only a holder of the secret gets a message unpickled. Either way
  the port binds only the given address (pysyncobj would bind 0.0.0.0), and
  should be reachable only from the site's nodes.
* With a secret, the key is PBKDF2-HMAC-SHA256 over it with a salt fixed in
  pysyncobj: the secret must be random (``georep.security.raft_secret``), not
  a word. One secret only: a node with the old one and a node with the new one
  cannot talk, so a change of secret is a stop of the site or a quorum gap.
* Its own journal (``FileJournal``) is written through mmap and never fsynced,
  its term and vote neither: it survives a crash of the process, not of the
  machine. It is replaced (``georep.raft.journal``; ``journal_sync=False``
  keeps it, for benchmarks only).
* Its ``TcpConnection`` buffers a frame whole, in a ``bytes`` copied at every
  read, before it checks the secret, and keeps an idle connection open for
  good; it is replaced (``georep.raft.transport``).
* A follower deletes every entry after an append's previous index, even the
  ones equal to the append's, and a leader sends a follower's next index back
  at each successful answer; both are corrected on the way in
  (``georep.raft.appends``).
* An exception in an applied command stops the replica at that entry (it is
  retried on every tick), so :meth:`_Replica.apply_command` never raises.
* The tick thread stops when the thread that built the ``SyncObj`` exits:
  build the store in the node's main thread.
* ``commandsWaitLeader`` is off: with no leader known, a command is refused at
  once (and retried here) instead of waiting in a queue, where it could be
  applied long after its caller gave up.
* A follower keeps pointing at a dead leader until a new one is elected (and
  for good while it is cut off from everyone): :attr:`leader_address` hides
  an unreachable leader, and :meth:`propose` waits for a reachable one.
* Defaults changed: a failed bind is retried forever in the background
  (here: ``RaftStartError`` at once), an unreachable node is retried every
  5 s (here 1 s), a leader cut off from the majority stays leader for 30 s
  (here 3 s). Only the node with the larger address string connects, so the
  retry interval is how long a restarted node may wait to be reconnected.
* Its followers draw their election timeouts at random in one window, and closed any connection that had
  received nothing for ``connectionTimeout`` at its next message, dropping that message: two followers exchange
  nothing while their leader lives, so the first vote request after its death was always lost, and each of the
  survivors ran. The death of a Raft leader cost two to four elections. Here the followers run in turn, its
  successor first (``georep.raft.elections``), a node that restarts lets the leader reach it before it runs,
  and a connection is closed for silence only when an append went unanswered (``georep.raft.transport``): one
  election per death of a leader, none while no node fails.
* A dump that fails to load is logged and skipped, and the node then runs on
  a journal whose start was compacted away: a wrong state, silently. The dump
  is therefore checked before the ``SyncObj`` starts (``RaftStartError``).
* Files left open: its journal's ``.meta`` file is read and never closed (with
  ``journal_sync=False``; the ``ResourceWarning`` is silenced at construction),
  and the dump file opened to send it to a follower is dropped without closing
  (:class:`_ClosingSerializer`).
"""

from __future__ import annotations

import base64
import enum
import functools
import hashlib
import json
import logging
import math
import os
import random
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pysyncobj.pickle as syncobj_pickle
from cryptography.fernet import InvalidToken
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjException, replicated
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.encryptor import getEncryptor
from pysyncobj.monotonic import monotonic as raft_clock
from pysyncobj.serializer import Serializer
from pysyncobj.utility import TcpUtility, UtilityException

from cluster.site_state import (
    Applied,
    Command,
    CommandBatch,
    CreateTopic,
    InvalidCommand,
    InvalidSnapshot,
    MergeTopicEntry,
    PutAcl,
    ReadBarrier,
    RefusalCode,
    Refused,
    Result,
    SiteState,
    command_from_dict,
)
from georep.metadata.store import AclRecord, TopicExists, UnknownTopic
from georep.metadata.topic_entry import Merged, TopicEntry, merge
from georep.metadata.topics import TopicSpec
from georep.raft import journal
from georep.raft.elections import election_timeout_s, first_election_timeout_s
from georep.raft.frames import APPEND_BATCH_BYTES, COMMAND_BYTES_MAX, DUMP_CHUNK_BYTES
from georep.raft.journal import DurableJournal, JournalDamaged, JournalHandle
from georep.raft.prevote import LogPosition, PreVoteRound, grants_pre_vote
from georep.raft.transport import GuardedTransport, RaftPortLimits
from georep.storage.durable_file import fsync_directory
from topology.filters import is_internal

logger = logging.getLogger(__name__)

RAFT_DIR = "raft"
JOURNAL_FILE = journal.JOURNAL_FILE
PYSYNCOBJ_JOURNAL_FILE = journal.PYSYNCOBJ_JOURNAL_FILE  # before issue 20; and with journal_sync=False
DUMP_FILE = "site-state.json"
DUMP_FORMAT = "georep-site-state-dump"
DUMP_FORMAT_VERSION = 2  # 2: with a SHA-256 of its contents
DUMP_FORMAT_VERSIONS_READ = (1, 2)
DUMP_CHECKSUM_KEY = "sha256"
PORT_MAX = 65535
REFUSED_LOG_INTERVAL_S = 30.0  # at most one warning this often about messages sealed with another Raft secret

T = TypeVar("T")

_PRE_VOTE = "pre_vote"  # georep's messages on the Raft port (prevote.py); pysyncobj ignores types it does not know
_PRE_VOTE_ANSWER = "pre_vote_response"
_RAFT_CANDIDATE = 1  # pysyncobj's _RAFT_STATE values, as onStateChanged passes them
_RAFT_LEADER = 2

# pysyncobj failures after which the command is certainly not in any log: retry within the timeout.
_NOT_IN_LOG = frozenset(
    {
        FAIL_REASON.QUEUE_FULL,  # never queued
        FAIL_REASON.MISSING_LEADER,  # no leader known: never sent
        FAIL_REASON.NOT_LEADER,  # sent to a node that is no longer the leader: it did not append it
        FAIL_REASON.DISCARDED,  # appended, then overwritten by a new leader's log: never applied
    }
)


class MetadataUnavailable(Exception):
    """A metadata write was not confirmed in time. It may still be applied: read the state before retrying."""


class NoRaftLeader(MetadataUnavailable):
    """No majority of the site's metadata nodes is reachable, so there is no Raft leader to commit the write."""

    def __init__(self, what: str, timeout_s: float, reachable: int, total: int, unreachable: list[str]) -> None:
        self.reachable = reachable
        self.total = total
        majority = total // 2 + 1
        super().__init__(
            f"no Raft leader: {reachable} of {total} metadata nodes reachable; a majority ({majority}) is needed. "
            f"Start the stopped nodes or restore the network to their Raft ports ({', '.join(unreachable) or '-'}). "
            f"The {what} was not confirmed within {timeout_s:g} s; it may still be applied once a majority is back, "
            "so read the state before retrying"
        )


class CommitUnconfirmed(MetadataUnavailable):
    """A leader exists but did not confirm the write in time, or changed while the write was in flight."""


class CommandTooLarge(ValueError):
    """A command too large to be a Raft log entry: every message between the site's nodes is bounded."""

    def __init__(self, what: str, size: int) -> None:
        self.size = size
        super().__init__(
            f"the {what} encodes to {size} bytes, over the {COMMAND_BYTES_MAX} bytes a metadata command may take "
            '(every message on the site\'s Raft port is bounded: docs/cluster.md, "Metadata: what survives what"); '
            "it cannot be stored: make it smaller (fewer or shorter names)"
        )


class CommandRefused(Exception):
    """A :meth:`RaftMetadataStore.create_topic` the state machine refused for a reason other than an existing topic."""

    def __init__(self, refused: Refused) -> None:
        self.refused = refused
        super().__init__(refused.reason)


def _refused_delete(held: TopicEntry | None, merged: TopicEntry) -> bool:
    """Whether ``merged`` deletes (or replaces by a later incarnation) the live ``held`` of one of georep's own
    topics, which the state machine refuses (``MergeTopicEntry``)."""
    deletes = held is not None and not held.deleted and (merged.deleted or merged.incarnation != held.incarnation)
    return deletes and is_internal(merged.name)


class RaftStartError(Exception):
    """The store cannot start: bad address, Raft port in use, unreadable dump. The message says what to do."""


@dataclass(frozen=True, slots=True)
class RaftTiming:
    """pysyncobj's timers, in seconds, plus the store's own. The defaults suit a LAN; tests shorten them."""

    election_timeout_min_s: float = 0.4  # a follower that hears no leader for a random time in [min, max] runs
    election_timeout_max_s: float = 1.4
    heartbeat_interval_s: float = 0.1  # the leader's append-entries period; below election_timeout_min_s / 3
    connection_timeout_s: float = 3.5  # a peer that answers no append for this long is cut off; >= election max
    reconnect_interval_s: float = 1.0  # between attempts to reach a node that is down (pysyncobj: 5 s)
    leader_step_down_s: float = 3.0  # a leader that hears no majority for this long steps down (pysyncobj: 30 s)
    tick_s: float = 0.05  # the tick thread's poll period
    write_timeout_s: float = 5.0  # propose()'s default timeout
    retry_interval_s: float = 0.05  # between tries of a write that certainly did not enter the log
    close_snapshot_timeout_s: float = 2.0  # how long close() waits for the final dump
    # A dump (log compaction) once the log holds more entries than this (pysyncobj's logCompactionMinEntries), or
    # every compaction_interval_s: a restart replays at most about this many entries after the dump.
    compaction_entries: int = 5_000
    compaction_interval_s: float = 300.0

    def __post_init__(self) -> None:
        # pysyncobj checks these with assert (gone under python -O); say which setting is wrong instead
        rules = [
            (self.heartbeat_interval_s > 0, "heartbeat_interval_s must be positive"),
            (
                self.election_timeout_min_s > 3 * self.heartbeat_interval_s,
                "election_timeout_min_s must exceed 3 * heartbeat_interval_s",
            ),
            (
                self.election_timeout_max_s > self.election_timeout_min_s,
                "election_timeout_max_s must exceed election_timeout_min_s",
            ),
            (
                self.connection_timeout_s >= self.election_timeout_max_s,
                "connection_timeout_s must be at least election_timeout_max_s",
            ),
            (
                self.leader_step_down_s > self.heartbeat_interval_s,
                "leader_step_down_s must exceed heartbeat_interval_s",
            ),
            (
                self.reconnect_interval_s >= 0
                and self.tick_s > 0
                and self.write_timeout_s > 0
                and self.retry_interval_s > 0
                and self.close_snapshot_timeout_s >= 0
                and self.compaction_interval_s > 0,
                "intervals and timeouts must be positive",
            ),
            (self.compaction_entries >= 2, "compaction_entries must be at least 2"),
        ]
        for ok, rule in rules:
            if not ok:
                raise ValueError(f"invalid Raft timing {self}: {rule}")

    @classmethod
    def for_session(cls, session_timeout_ms: int) -> RaftTiming:
        """Timers that let a new Raft leader take over well within ``session_timeout_ms`` (a node's liveness): a
        site that detects a dead node in a second must not spend longer electing the controller that acts on it.
        The defaults for sessions of 3 s and more."""
        if session_timeout_ms >= 3_000:
            return cls()
        election_min_s = max(0.15, session_timeout_ms / 5_000)
        return cls(
            election_timeout_min_s=election_min_s,
            election_timeout_max_s=2 * election_min_s,
            heartbeat_interval_s=election_min_s / 4,
            connection_timeout_s=max(1.0, 2 * election_min_s),
            reconnect_interval_s=0.2,
            leader_step_down_s=max(1.0, session_timeout_ms / 1_000),
        )

    def conf_kwargs(self) -> dict[str, Any]:
        return {
            "raftMinTimeout": self.election_timeout_min_s,
            "raftMaxTimeout": self.election_timeout_max_s,
            "appendEntriesPeriod": self.heartbeat_interval_s,
            "connectionTimeout": self.connection_timeout_s,
            "connectionRetryTime": self.reconnect_interval_s,
            "leaderFallbackTimeout": self.leader_step_down_s,
            "autoTickPeriod": self.tick_s,
            "logCompactionMinEntries": self.compaction_entries,
            "logCompactionMinTime": self.compaction_interval_s,
            # Send each command, and each new commit index, at once rather than at the next heartbeat: pysyncobj's
            # batching costs a commit up to three heartbeat periods (the command waits for the leader's tick, the
            # entry for its next append-entries, the follower for the commit index), about 150 ms, and a leader's
            # failover takes three commits (the election, the seal, the next segment). The metadata changes per
            # roll, leader change and heartbeat, so the messages it saves are few.
            "appendEntriesUseBatch": False,
        }


@dataclass(frozen=True, slots=True)
class RaftStatus:
    """What this node knows of the Raft group (for logs, metrics and the CLI)."""

    self_address: str
    leader_address: str | None  # None: no leader known, or the last known one is unreachable from here
    is_leader: bool
    reachable_nodes: int  # this node included
    total_nodes: int
    applied_index: int  # the last log entry applied to the local state
    commit_index: int  # the last log entry this node knows to be committed
    term: int = 0  # the Raft term this node is in: each election raises it by one at least


def _check_raft_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= PORT_MAX:
        raise RaftStartError(f"invalid Raft address {address!r}: use host:port, for example 10.0.0.7:9093")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise RaftStartError(f"cannot resolve the host of Raft address {address!r}: {e}") from None
    return address


# -- joining a running group ---------------------------------------------------------------------------------

JOIN_TIMEOUT_S = 30.0  # how long a new node tries to be added before it gives up with what to do
ASK_TIMEOUT_S = 2.0  # per member asked for its view of the group, or to add this node


class JoinFailed(RaftStartError):
    """A node new to a running site could not be added to its Raft group; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class GroupView:
    """What one running member says of its Raft group (pysyncobj's ``status`` utility message)."""

    answered_by: str
    leader: str | None  # the leader it follows; None while it knows of none
    members: frozenset[str]  # the Raft addresses of the voting members, itself included


class JoinStep(enum.Enum):
    START = "start"  # start the replica now: this node is a member, or no group runs yet
    JOIN = "join"  # a running group does not count this node: ask its leader to add it, then start
    WAIT = "wait"  # members answered, but none knows of a leader: ask again


def join_step(self_address: str, has_local_state: bool, views: Iterable[GroupView]) -> JoinStep:
    """Whether a node starting its Raft replica must first be added to a running group. Pure.

    A node that ran before keeps its membership in its journal and dump (pysyncobj replays the changes), so it starts.
    A fresh node starts if any member counts it (it was in the topology when the group formed, or its addition is
    committed), or if no member answered (the site is forming now, every node from the same topology). Otherwise it
    joins, once a member knows the leader. A fresh node that started without being added would never vote nor be
    counted: members drop connections from addresses they do not know, so it can neither join nor disturb them.
    """
    if has_local_state:
        return JoinStep.START
    answered = list(views)
    if not answered or any(self_address in v.members for v in answered):
        return JoinStep.START
    if any(v.leader is not None for v in answered):
        return JoinStep.JOIN
    return JoinStep.WAIT


def has_raft_state(data_dir: Path) -> bool:
    """The node's Raft replica ran in ``data_dir`` before (its journal or dump is there)."""
    raft_dir = data_dir / RAFT_DIR
    return any((raft_dir / name).exists() for name in (JOURNAL_FILE, PYSYNCOBJ_JOURNAL_FILE, DUMP_FILE))


def _utility(address: str, command: list[Any], timeout_s: float, password: bytes | None = None) -> Any:
    """One pysyncobj utility message to the Raft port at ``address`` (what ``syncobj_admin`` sends), sealed with
    the site's Raft secret ``password`` if it has one; None if no answer came (a port with another secret closes
    the connection unanswered)."""
    try:
        return TcpUtility(password=password, timeout=timeout_s).executeCommand(address, command)
    except (UtilityException, OSError):
        return None


def ask_group(address: str, timeout_s: float = ASK_TIMEOUT_S, password: bytes | None = None) -> GroupView | None:
    """The Raft group as the member at ``address`` sees it; None if it does not answer."""
    status = _utility(address, ["status"], timeout_s, password)
    if not isinstance(status, dict) or "self" not in status:
        return None
    prefix = "partner_node_status_server_"
    self_address = str(status["self"])
    members = {self_address, *(key[len(prefix) :] for key in status if isinstance(key, str) and key.startswith(prefix))}
    leader = status.get("leader")
    return GroupView(self_address, None if leader is None else str(leader), frozenset(members))


def _check_bindable(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), int(port)))
    except OSError as e:
        raise RaftStartError(
            f"cannot listen on Raft address {address}: {e.strerror or e}. It must be an address of this host and a "
            "free port: fix this node's 'raft' address in the topology (or stop the process using the port)"
        ) from None


def join_running_group(
    self_address: str,
    partner_addresses: Iterable[str],
    data_dir: Path,
    timeout_s: float = JOIN_TIMEOUT_S,
    ask_timeout_s: float = ASK_TIMEOUT_S,
    password: bytes | None = None,
) -> list[str]:
    """Before :class:`RaftMetadataStore` starts on a node: if the site's Raft group already runs without this node,
    have its leader add it (pysyncobj's ``addNodeToCluster``, one member at a time) and wait until that is committed.

    Returns the partners to start the replica with: the members the running group reported (this node left out), or
    ``partner_addresses`` (the topology's other nodes) if no member answered or this node ran before. Raises
    :class:`JoinFailed` after ``timeout_s`` without a committed addition, and :class:`RaftStartError` at once if this
    node could not listen on its address (checked before it is added, so that a mistyped address never becomes a
    member that cannot run). ``password``: the site's Raft secret, as :class:`RaftMetadataStore` takes it.
    """
    self_address = _check_raft_address(self_address)
    peers = sorted({_check_raft_address(a) for a in partner_addresses} - {self_address})
    if has_raft_state(data_dir):
        return peers
    deadline = time.monotonic() + timeout_s
    why = "no member answered"
    checked_bind = False
    while True:
        views = [v for v in (ask_group(a, ask_timeout_s, password) for a in peers) if v is not None]
        # The running group's members, not the topology's list: a node listed there but not added yet (the next one
        # to join) must not count in this node's majority. With no answer, the site is forming from the topology.
        known = sorted({m for v in views for m in v.members} if views else set(peers))
        step = join_step(self_address, False, views)
        if step is JoinStep.START:
            if views and any(self_address not in v.members for v in views):
                logger.info(
                    "Raft node %s is a member of the running group now (%s)",
                    self_address,
                    ", ".join(sorted(v.answered_by for v in views if self_address in v.members)),
                )
            return [a for a in known if a != self_address]
        if step is JoinStep.WAIT:
            why = f"members {', '.join(v.answered_by for v in views)} know of no Raft leader"
        else:
            if not checked_bind:
                _check_bindable(self_address)
                checked_bind = True
            leader = next(v.leader for v in views if v.leader is not None)
            logger.info(
                "Raft node %s: the site's running group (%s) does not count it; asking leader %s to add it",
                self_address,
                ", ".join(sorted({m for v in views for m in v.members})),
                leader,
            )
            answer = _utility(leader, ["add", self_address], ask_timeout_s, password)
            if isinstance(answer, str) and answer.startswith("SUCCESS"):
                logger.info("Raft node %s was added to the site's group by %s", self_address, leader)
                return [a for a in known if a != self_address]
            # FAIL: the leader changed, or another change is not committed yet (one at a time): ask again
            why = (
                f"leader {leader} answered {answer!r} to adding it"
                if answer is not None
                else f"leader {leader} did not answer in {ask_timeout_s:g} s"
            )
        if time.monotonic() >= deadline:
            raise JoinFailed(
                f"Raft node {self_address} is not a member of its site's running Raft group and could not be added "
                f"within {timeout_s:g} s ({why}). Check that a majority of the running nodes is up and that their Raft "
                f"ports ({', '.join(peers) or '-'}) and this node's ({self_address}) reach each other and that every "
                "node has the same Raft secret (--raft-secret-file: a member with another one closes the connection "
                "unanswered), then start this node again"
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# -- the Raft secret ------------------------------------------------------------------------------------


class _CheckedEncryptor:
    """pysyncobj's Fernet for a password, saying in the node's log when a message fails its check.

    pysyncobj (0.3.17) closes such a connection without a word, so a node given another site's secret, or a stray
    process on the port, would look like a network fault. Every message goes through :meth:`extract_timestamp`
    first (it checks the HMAC); the first failure is logged at once, later ones at most every
    :data:`REFUSED_LOG_INTERVAL_S` with their count.
    """

    def __init__(self, fernet: Any, self_address: str) -> None:
        self._fernet = fernet
        self._me = self_address
        self._lock = threading.Lock()
        self._refused = 0
        self._logged_at: float | None = None

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        return bytes(self._fernet.encrypt_at_time(data, current_time))

    def decrypt(self, token: bytes) -> bytes:
        return bytes(self._fernet.decrypt(token))

    def extract_timestamp(self, token: bytes) -> int:
        try:
            return int(self._fernet.extract_timestamp(token))
        except InvalidToken:
            self._note_refused()
            raise

    def _note_refused(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._refused += 1
            if self._logged_at is not None and now - self._logged_at < REFUSED_LOG_INTERVAL_S:
                return
            count, self._refused, self._logged_at = self._refused, 0, now
        logger.warning(
            "Raft node %s refused %d message(s) not sealed with this node's Raft secret and closed the connection: "
            "a node of this site started with another --raft-secret-file (every node of a site needs the same "
            "file, made by 'georep certs init'), or a process that is not a node of this site",
            self._me,
            count,
        )


def command_bytes(raw: dict[str, Any]) -> int:
    """The length of the log entry pysyncobj makes of ``apply_command(raw)``: a type byte and the pickle of the
    method's id (a small int) and its arguments."""
    return 1 + len(syncobj_pickle.dumps((0, (raw,))))


# -- the dump file ---------------------------------------------------------------------------------------


def _entry_to_json(entry: tuple[bytes, int, int]) -> list[Any]:
    command, index, term = entry
    return [base64.b64encode(bytes(command)).decode("ascii"), int(index), int(term)]


def _entry_from_json(raw: object) -> tuple[bytes, int, int]:
    if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str)):
        raise ValueError(f"a log entry must be [base64 command, index, term], got {raw!r}")
    command, index, term = raw
    if not (isinstance(index, int) and isinstance(term, int)):
        raise ValueError(f"a log entry's index and term must be integers, got {raw!r}")
    return (base64.b64decode(command, validate=True), index, term)


@dataclass(frozen=True, slots=True)
class _Dump:
    state: SiteState
    last_applied: tuple[bytes, int, int]  # the entry the state is applied through
    previous: tuple[bytes, int, int]  # the entry before it (pysyncobj keeps both at the head of its log)
    cluster: list[str]


def _read_dump(path: Path) -> _Dump:
    """Read and check a dump file; raises :class:`RaftStartError` saying what to do."""
    try:
        doc = json.loads(_checked_dump_text(path.read_bytes()))
        if not isinstance(doc, dict) or doc.get("format") != DUMP_FORMAT:
            raise ValueError(f"not a {DUMP_FORMAT} file")
        if doc.get("version") not in DUMP_FORMAT_VERSIONS_READ:
            raise ValueError(f"dump format version {doc.get('version')!r}, this node reads {DUMP_FORMAT_VERSION}")
        if doc.get("version") == DUMP_FORMAT_VERSION and DUMP_CHECKSUM_KEY not in doc:
            raise ValueError(f"a version {DUMP_FORMAT_VERSION} dump without its checksum")
        raft = doc["raft"]
        cluster = raft["cluster"]
        if not (isinstance(cluster, list) and all(isinstance(a, str) for a in cluster)):
            raise ValueError("'raft.cluster' must be a list of addresses")
        return _Dump(
            SiteState.restore(doc["state"]),
            _entry_from_json(raft["last_applied"]),
            _entry_from_json(raft["previous"]),
            cluster,
        )
    except (OSError, ValueError, KeyError, TypeError, InvalidSnapshot) as e:
        raise RaftStartError(
            f"cannot read the metadata dump {path}: {e}. If the other nodes of the site hold the metadata, stop this "
            f"node, move {path.parent} away and start it again: it will copy the metadata from the Raft leader"
        ) from None


def _checksummed(doc: dict[str, Any]) -> bytes:
    """The dump's bytes: its JSON, then the SHA-256 of that JSON as its last key (:func:`_checked_dump_text`)."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + f',"{DUMP_CHECKSUM_KEY}":"{digest}"}}'.encode()


def _checked_dump_text(data: bytes) -> bytes:
    """The dump's JSON once its checksum matches; a version 1 dump (before the checksum) as it is. A dump torn by a
    crash fails to parse, and one changed on disk fails here: either way the node refuses it rather than serve a
    state the site never had (``_read_dump`` says how to get the leader's)."""
    suffix = len(f',"{DUMP_CHECKSUM_KEY}":"') + 64 + 2
    tail = data[-suffix:]
    if not tail.startswith(f',"{DUMP_CHECKSUM_KEY}":"'.encode()):
        return data  # no checksum: version 1 (refused below if it says version 2)
    body = data[:-suffix] + b"}"
    if hashlib.sha256(body).hexdigest().encode() != tail[-66:-2]:
        raise ValueError("its checksum does not match its contents: the file was changed or damaged on disk")
    return data


def _write_json_fsynced(path: str, doc: dict[str, Any]) -> None:
    # 0600: the state holds ACLs and SCRAM credentials
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as f:
        f.write(_checksummed(doc))
        f.flush()
        os.fsync(f.fileno())


def _fsync_received_dump(path: Path) -> None:
    """Make a dump pysyncobj wrote (a leader's, received; it neither fsyncs nor syncs the rename) durable, before
    pysyncobj clears the journal that it replaces."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(path.parent)


# -- the replicated object ------------------------------------------------------------------------------


class _ClosingSerializer(Serializer):  # type: ignore[misc]  # pysyncobj has no type hints
    """pysyncobj 0.3.17's ``Serializer`` with the files it opens closed.

    To send its dump to a follower too far behind its log, the leader opens the dump file per follower and drops
    the file object without closing it when the transfer ends, is cancelled (the follower disconnected) or is
    superseded by a new dump. Each public method that can drop a transfer is wrapped to close what it dropped, and
    :meth:`close_files` closes the rest when the replica stops.
    """

    # The transfers in flight, {follower: {"file": ..., "transmitted": n}}: a private attribute of Serializer.
    _TRANSFERS = "_Serializer__transmissions"
    _INCOMING = "_Serializer__incomingTransmissionFile"

    def _transfers(self) -> dict[Any, dict[str, Any]]:
        transfers: dict[Any, dict[str, Any]] = self.__dict__[self._TRANSFERS]
        return transfers

    def _closing(self, call: Callable[[], T]) -> T:
        before = dict(self._transfers())
        try:
            return call()
        finally:
            after = self._transfers()
            for key, transfer in before.items():
                if after.get(key) is not transfer and "file" in transfer:
                    transfer["file"].close()

    # pysyncobj's method names (one misspelt), overridden
    def getTransmissionData(self, transmissionID: Any) -> Any:
        if self.__dict__.get(self._WRITING) is not None:
            return None  # as pysyncobj does while it writes a dump: the transfer starts once it is written
        return self._closing(lambda: super(_ClosingSerializer, self).getTransmissionData(transmissionID))

    def cancelTransmisstion(self, id: Any) -> None:
        self._closing(lambda: super(_ClosingSerializer, self).cancelTransmisstion(id))

    # Log compaction in the background. pysyncobj writes a dump made by a custom serializer in its tick thread, where
    # no heartbeat goes out meanwhile: about 2 s at 100,000 partitions, longer than an election timeout, so every
    # compaction of a big site's log would depose its leader. Here the tick thread only captures the state
    # (``_Replica.capture_dump``) and a thread writes it: to a temporary file, fsynced, renamed over the dump and the
    # directory fsynced. pysyncobj drops the journal entries the dump covers only once checkSerializing says
    # SUCCESS, so the journal still holds them while the dump is written. No dump goes to a follower meanwhile, as
    # pysyncobj does while its forked child writes one.
    _CAPTURE = "_capture_dump"  # set by _Replica: raft_data -> the writer of the dump
    _WRITING = "_dump_writing"  # (thread, outcome) of the dump being written
    _CURRENT_ID = "_Serializer__currentID"
    _FILE = "_Serializer__fileName"

    def serialize(self, data: Any, id: Any) -> None:
        if self.__dict__.get(self._WRITING) is not None:
            return
        self.__dict__[self._CURRENT_ID] = id
        write = self.__dict__[self._CAPTURE](data[1:])
        path = str(self.__dict__[self._FILE])
        outcome: dict[str, BaseException | None] = {}

        def run() -> None:
            try:
                tmp = path + ".tmp"
                write(tmp)
                os.replace(tmp, path)
                fsync_directory(Path(path).parent)
                outcome["error"] = None
            except BaseException as e:  # reported by checkSerializing, in the tick thread
                outcome["error"] = e

        thread = threading.Thread(target=run, name="raft-dump", daemon=True)
        self.__dict__[self._WRITING] = (thread, outcome)
        thread.start()

    def checkSerializing(self) -> Any:
        writing = self.__dict__.get(self._WRITING)
        if writing is None:
            return SERIALIZER_STATE.NOT_SERIALIZING, None
        thread, outcome = writing
        current = self.__dict__[self._CURRENT_ID]
        if thread.is_alive():
            return SERIALIZER_STATE.SERIALIZING, current
        self.__dict__[self._WRITING] = None
        error = outcome.get("error")
        if error is not None:
            logger.error("writing the metadata dump failed (the journal keeps every entry): %r", error)
            return SERIALIZER_STATE.FAILED, current
        self._closing(lambda: self.__dict__.__setitem__(self._TRANSFERS, {}))  # the transfers restart with it
        return SERIALIZER_STATE.SUCCESS, current

    def wait_dump_written(self) -> None:
        writing = self.__dict__.get(self._WRITING)
        if writing is not None:
            writing[0].join()

    def close_files(self) -> None:
        for transfer in self._transfers().values():
            if "file" in transfer:
                transfer["file"].close()
        self.__dict__[self._TRANSFERS] = {}
        incoming = self.__dict__.get(self._INCOMING)
        if incoming is not None:
            incoming.close()
            self.__dict__[self._INCOMING] = None


class _Replica(SyncObj):  # type: ignore[misc]  # pysyncobj has no type hints
    """The SyncObj: one ``SiteState`` and the one replicated method that changes it.

    Every attribute is set before ``SyncObj.__init__`` starts the tick thread, which applies log entries at once.
    pysyncobj calls :meth:`apply_command`, :meth:`_write_dump` and :meth:`_read_dump` from its tick thread; readers
    in other threads take ``_state_lock``.
    """

    _SyncObj__raftElectionDeadline: float  # pysyncobj's, which the pre-vote gate moves (on pysyncobj's clock)

    def __init__(
        self,
        self_address: str,
        partners: list[str],
        conf: dict[str, Any],
        dump_path: Path,
        initial: _Dump | None,
        transport_class: Callable[..., Any],
        rejoining: bool = False,
    ) -> None:
        password = conf.get("password")
        # before SyncObj.__init__: it connects to the partners with this (pysyncobj reads :attr:`encryptor`)
        self._checked_encryptor = None if password is None else _CheckedEncryptor(getEncryptor(password), self_address)
        self._state_lock = threading.Lock()
        self._site_state = initial.state if initial is not None else SiteState()
        # The last copy state() handed out, until the state changes: a failover's leads each read the state many
        # times a second, and a copy of 10,000 partitions' table per read was a third of a survivor's CPU.
        self._shared_copy: SiteState | None = None
        self._dumped_index = initial.last_applied[1] if initial is not None else 0
        self._dump_path = dump_path
        self._me = self_address
        self._last_leader: str | None = None  # the Raft address of the leader last followed (elections.py)
        self._first_timeout: bool | None = rejoining  # until the first timeout is drawn: whether this node ran before
        self._pre_vote: PreVoteRound | None = None  # this node's last round of pre-votes (prevote.py)
        # pysyncobj's clock (CLOCK_MONOTONIC_RAW, not time.monotonic) of the last append from a leader
        self._leader_heard_at: float | None = None
        self.leader_since: float | None = None  # time.monotonic() when this replica became the leader; None: it is not
        self.on_change: Callable[[], None] | None = None  # called in the tick thread after each applied command
        syncobj_conf = SyncObjConf(
            serializer=self._write_dump, deserializer=self._read_dump, onStateChanged=self._state_changed, **conf
        )
        super().__init__(self_address, partners, syncobj_conf, transportClass=transport_class)
        # The tick thread sleeps 0.1 s before its first tick, so no transfer can have started yet.
        self._SyncObj__serializer.__class__ = _ClosingSerializer
        self._SyncObj__serializer.__dict__[_ClosingSerializer._CAPTURE] = self.capture_dump

    @property
    def encryptor(self) -> _CheckedEncryptor | None:  # what pysyncobj's transport seals each connection with
        return self._checked_encryptor

    def release_files(self) -> None:
        """Close the files pysyncobj leaves open, once a dump being written is; only once the tick thread has
        stopped."""
        self._SyncObj__serializer.wait_dump_written()
        self._SyncObj__serializer.close_files()

    @replicated  # type: ignore[untyped-decorator]  # pysyncobj has no type hints
    def apply_command(self, raw: dict[str, Any]) -> Result:
        try:
            command = command_from_dict(raw)
        except InvalidCommand as e:
            logger.error("refusing a metadata command this node cannot decode: %s", e)
            return Refused(RefusalCode.INVALID_COMMAND, str(e))
        try:
            with self._state_lock:
                self._shared_copy = None
                result = self._site_state.apply(command)
        except Exception as e:  # a bug in SiteState: refuse (alike on every node) rather than stop the replica
            logger.exception("applying metadata command %r failed", raw)
            return Refused(RefusalCode.INVALID_COMMAND, f"internal error applying {command!r}: {e!r}")
        on_change = self.on_change
        if on_change is not None and isinstance(result, Applied):
            try:
                on_change()
            except Exception:  # the watcher's bug must not stop the replica
                logger.exception("the metadata change callback failed")
        return result

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803  # pysyncobj's name
        """pysyncobj's tick, after a read of what waits on the sockets if the election deadline has passed.

        pysyncobj looks at its deadline *before* it reads its sockets. A tick thread held up longer than the election
        timeout (a journal fsync behind a disk busy with thousands of segment files, the GIL of a busy node) then runs
        for leader with its leader's heartbeats unread in the socket: the term goes up, the leader steps down, and
        every proposal in flight fails, for no failure at all. At 2,000 partitions on a loaded machine that moved the
        Raft leadership a dozen times a minute. Reading first lets those heartbeats reset the deadline; a leader that
        is really gone sent nothing, and the election goes on as before (safety never depends on when one runs)."""
        if (
            self._SyncObj__raftState != _RAFT_LEADER
            and self._SyncObj__raftElectionDeadline < raft_clock()
            and self._SyncObj__transport.ready
        ):
            self._poller.poll(0)
        if self._pre_vote_gate():
            super()._onTick(timeToWait)
            return
        # pysyncobj reads its deadline again after work of its own (a journal's one-second timer, a transport
        # getting ready): a tick held up past the deadline there would run for leader without asking first, as
        # on a loaded machine it did. The deadline is out of its reach for this tick; a message that resets it
        # (an append, a vote) meanwhile is kept, else it comes back, and the next tick's gate asks.
        held, self._SyncObj__raftElectionDeadline = self._SyncObj__raftElectionDeadline, math.inf
        try:
            super()._onTick(timeToWait)
        finally:
            if self._SyncObj__raftElectionDeadline == math.inf:
                self._SyncObj__raftElectionDeadline = held

    def _pre_vote_gate(self) -> bool:
        """Before pysyncobj's tick: a follower whose election timer ran out asks for pre-votes instead of running;
        it runs (the timer is left expired) only once a majority granted them (``georep.raft.prevote``). Whether
        pysyncobj may run an election in this tick."""
        if (
            self._SyncObj__raftState == _RAFT_LEADER
            or self._SyncObj__selfNode is None
            or self._SyncObj__transferInProgress  # the leader asked for this election
        ):
            return True
        if self._SyncObj__raftElectionDeadline >= raft_clock() or not self._SyncObj__connectedToAnyone():
            return False
        term = self.raftCurrentTerm + 1
        if self._pre_vote is not None and self._pre_vote.proposed_term == term and self._pre_vote.won:
            self._pre_vote = None
            return True
        others = list(self._SyncObj__otherNodes)
        self._pre_vote = PreVoteRound(term, len(others) + 1)
        if self._pre_vote.won:  # a group of one
            return True
        self._SyncObj__raftElectionDeadline = raft_clock() + self._SyncObj__generateRaftTimeout()
        heard = self._leader_heard_ago_s()
        logger.info(
            "Raft node %s heard no leader for %s: asks the others whether it may run for leader in term %d",
            self._me,
            "ever" if heard is None else f"{heard:.2f}s",
            term,
        )
        mine = self._log_position()
        for node in others:
            self._SyncObj__transport.send(
                node, {"type": _PRE_VOTE, "term": term, "last_log_index": mine.index, "last_log_term": mine.term}
            )
        return False

    def _log_position(self) -> LogPosition:
        return LogPosition(self._SyncObj__getCurrentLogTerm(), self._SyncObj__getCurrentLogIndex())

    def _leader_heard_ago_s(self) -> float | None:
        return None if self._leader_heard_at is None else raft_clock() - self._leader_heard_at

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # pysyncobj's, overridden
        """pysyncobj's message handling, plus the pre-votes (tick thread) and the time of the leader's last append."""
        kind = message.get("type") if isinstance(message, dict) else None
        if kind in (_PRE_VOTE, _PRE_VOTE_ANSWER):
            try:
                self._on_pre_vote_message(node, message)
            except (KeyError, TypeError, ValueError) as exc:  # a member's bug: no vote, and say so
                logger.warning("Raft node %s: a malformed %s from %s is ignored: %r", self._me, kind, node, exc)
            return
        if kind == "append_entries" and message["term"] >= self.raftCurrentTerm:
            self._leader_heard_at = raft_clock()
        SyncObj._SyncObj__onMessageReceived(self, node, message)

    def _on_pre_vote_message(self, node: Any, message: dict[str, Any]) -> None:
        if message["type"] == _PRE_VOTE:
            self._answer_pre_vote(node, message)
            return
        round_ = self._pre_vote
        if round_ is not None and self._SyncObj__raftState != _RAFT_LEADER:
            was_won = round_.won
            if round_.answer(str(node.address), int(message["term"]), bool(message["granted"])) and not was_won:
                self._SyncObj__raftElectionDeadline = 0.0  # run at this tick

    def _answer_pre_vote(self, node: Any, message: dict[str, Any]) -> None:
        conf = self.conf
        granted = grants_pre_vote(
            self.raftCurrentTerm,
            self._log_position(),
            int(message["term"]),
            LogPosition(int(message["last_log_term"]), int(message["last_log_index"])),
            i_lead=self._SyncObj__raftState == _RAFT_LEADER,
            heard_leader_ago_s=self._leader_heard_ago_s(),
            sticky_s=conf.raftMinTimeout - conf.appendEntriesPeriod,
        )
        self._SyncObj__transport.send(node, {"type": _PRE_VOTE_ANSWER, "term": message["term"], "granted": granted})

    def _SyncObj__generateRaftTimeout(self) -> float:  # pysyncobj's private __generateRaftTimeout, overridden
        """The election timeout pysyncobj draws at each message of the leader, at start and when it runs: ranked
        after the leader's (``georep.raft.elections``) rather than uniform."""
        leader = self._getLeader()
        if leader is not None:
            self._last_leader = str(leader.address)
        conf = self.conf
        members = [str(node.address) for node in self.otherNodes]
        timeout_s = election_timeout_s(
            self._me, self._last_leader, members, conf.raftMinTimeout, conf.raftMaxTimeout, random.random()
        )
        rejoining, self._first_timeout = self._first_timeout, None
        if rejoining is None:
            return timeout_s
        return first_election_timeout_s(timeout_s, rejoining, conf.connectionRetryTime)

    def _state_changed(self, old: int, new: int) -> None:
        """pysyncobj's ``onStateChanged`` (tick thread): every election shows in the node's log, so a site whose Raft
        leadership moves while no node fails (timers too short for the load) can be told from one that is stable."""
        # A candidate's term is raised just after this call; a leader's and a follower's are already set.
        self.leader_since = time.monotonic() if new == _RAFT_LEADER else None
        if new == _RAFT_CANDIDATE:
            logger.info("Raft node %s runs for leader in term %d", self._me, self.raftCurrentTerm + 1)
        elif new == _RAFT_LEADER:
            logger.info("Raft node %s leads the site's Raft group in term %d", self._me, self.raftCurrentTerm)
        elif old == _RAFT_LEADER:
            logger.info("Raft node %s no longer leads the site's Raft group (term %d)", self._me, self.raftCurrentTerm)

    def read(self, fn: Callable[[SiteState], T]) -> T:
        with self._state_lock:
            return fn(self._site_state)

    def copy(self) -> SiteState:
        """A copy of the state, shared by every caller until the next command changes the state."""
        with self._state_lock:
            if self._shared_copy is None:
                self._shared_copy = self._site_state.copy()
            return self._shared_copy

    def dumped_index(self) -> int:
        return self._dumped_index

    def _write_dump(self, path: str, raft_data: tuple[Any, Any, Any]) -> None:
        """pysyncobj's log compaction, in its tick thread (unused: :class:`_ClosingSerializer` calls
        :meth:`capture_dump` instead, and writes in a thread of its own)."""
        self.capture_dump(raft_data)(path)

    def capture_dump(self, raft_data: tuple[Any, Any, Any]) -> Callable[[str], None]:
        """The state as of ``last_applied`` (now, in the tick thread that applies the log), and what writes it to a
        file later, in any thread: a copy of the tables, cheap (16 ms at 100,000 partitions) where encoding and
        writing them is not (about 2 s)."""
        last_applied, previous, cluster = raft_data
        with self._state_lock:
            state = self._site_state.copy()
        raft = {
            "last_applied": _entry_to_json(last_applied),
            "previous": _entry_to_json(previous),
            "cluster": sorted(node.address for node in cluster),
        }

        def write(path: str) -> None:
            doc = {"format": DUMP_FORMAT, "version": DUMP_FORMAT_VERSION, "state": state.snapshot(), "raft": raft}
            _write_json_fsynced(path, doc)
            self._dumped_index = int(last_applied[1])

        return write

    def _read_dump(self, path: str) -> tuple[Any, Any, Any]:
        """pysyncobj loads a dump: at start, or one sent by the leader to a node too far behind its log."""
        _fsync_received_dump(Path(path))
        dump = _read_dump(Path(path))
        with self._state_lock:
            self._site_state = dump.state
            self._shared_copy = None
        self._dumped_index = dump.last_applied[1]
        # pysyncobj compares these entries with its journal's head: they must be (bytes, int, int) tuples. It takes the
        # cluster as the membership (dynamic membership), leaving out its own node by comparing Node objects with
        # what it gets: with plain strings it would keep itself as its own partner, so this node is left out here.
        return (dump.last_applied, dump.previous, [a for a in dump.cluster if a != self._me])


# -- the store --------------------------------------------------------------------------------------------


class _Outcome:
    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Any = None
        self.error: int | None = None

    def done(self, result: Any, error: int) -> None:
        self.result = result
        self.error = error
        self.event.set()


def _open_journal(raft_dir: Path, journal_sync: bool) -> DurableJournal | None:
    if not journal_sync:
        if (raft_dir / JOURNAL_FILE).exists():
            raise RaftStartError(
                f"{raft_dir} holds a fsynced journal ({JOURNAL_FILE}); journal_sync=False would "
                "start from another one: use a fresh data dir"
            )
        return None
    try:
        return DurableJournal(raft_dir)
    except JournalDamaged as e:
        raise RaftStartError(str(e)) from None
    except OSError as e:
        raise RaftStartError(
            f"cannot open the Raft journal in {raft_dir}: {e.strerror or e}; check the data dir's disk and permissions"
        ) from None


class RaftMetadataStore:
    """The site's metadata, replicated by Raft over the site's nodes; see the module docstring.

    ``self_address`` and ``partner_addresses`` are the Raft ``host:port`` of this node and of the others (the same
    set on every node). ``data_dir`` is the node's data dir; the Raft files go under ``data_dir/raft``. Build it in the
    node's main thread, and :meth:`close` it. ``password`` is the site's Raft secret
    (``georep.security.raft_secret``): every message on the Raft port is then sealed and checked with it; the same
    on every node of the site. ``None`` leaves the port plaintext (``--insecure`` nodes and tests only).
    ``port_limits``: what the connections to the Raft port may take (``georep.raft.transport``).

    ``journal_sync=False`` keeps pysyncobj's own journal (``journal.bin``, written through mmap, never fsynced: it
    survives a crash of the process, not of the machine) and sends messages without waiting for it: for benchmarks
    that measure what the fsyncs cost (``bench/metadata.py``), never for a node. A data dir keeps one kind of journal.
    """

    def __init__(
        self,
        self_address: str,
        partner_addresses: Iterable[str],
        data_dir: Path,
        timing: RaftTiming | None = None,
        password: bytes | None = None,
        port_limits: RaftPortLimits | None = None,
        journal_sync: bool = True,
    ) -> None:
        self._timing = timing or RaftTiming()
        self._self_address = _check_raft_address(self_address)
        partners = sorted({_check_raft_address(a) for a in partner_addresses} - {self_address})
        rejoining = has_raft_state(data_dir)
        raft_dir = data_dir / RAFT_DIR
        raft_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        raft_dir.chmod(0o700)  # one made by an older georep too
        dump_path = raft_dir / DUMP_FILE
        initial = _read_dump(dump_path) if dump_path.exists() else None
        raft_log = _open_journal(raft_dir, journal_sync)
        journal.install()
        conf = {
            **self._timing.conf_kwargs(),
            "journalFile": JournalHandle(raft_log) if raft_log is not None else str(raft_dir / PYSYNCOBJ_JOURNAL_FILE),
            "fullDumpFile": str(dump_path),
            # The sizes that bound a member's messages (georep.raft.frames): the Raft port refuses longer frames.
            "appendEntriesBatchSizeBytes": APPEND_BATCH_BYTES,
            "logCompactionBatchSize": DUMP_CHUNK_BYTES,
            "bindAddress": self_address,  # pysyncobj binds 0.0.0.0 otherwise
            "maxBindRetries": 1,  # fail now with a clear error rather than retry in the background forever
            "commandsWaitLeader": False,
            # Members join a running group (``join_running_group``); the membership lives in the log, the journal
            # and the dump, so a restarted node keeps it whatever its topology file lists.
            "dynamicMembershipChange": True,
        }
        if password is not None:
            conf["password"] = password
        with warnings.catch_warnings():
            # pysyncobj 0.3.17 reads the journal's .meta file with open(...).read() and never closes it
            warnings.filterwarnings("ignore", category=ResourceWarning, message=r"unclosed file .*\.meta'>")
            transport = functools.partial(
                GuardedTransport,
                limits=port_limits or RaftPortLimits(),
                journal_sync=raft_log.sync if raft_log is not None else None,
            )
            try:
                replica = _Replica(self_address, partners, conf, dump_path, initial, transport, rejoining)
            except BaseException:
                if raft_log is not None:
                    raft_log._destroy()
                raise
        try:
            replica.waitBinded()
        except SyncObjException:
            replica._doDestroy()  # the tick thread has already stopped: release the socket and the journal here
            _check_bindable(self_address)  # says why: not an address of this host, or the port in use
            raise RaftStartError(
                f"cannot listen on Raft address {self_address}: another process (or another node of this host) "
                "probably uses the port; choose another Raft port or stop that process"
            ) from None
        self._replica = replica
        self._closed = False

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in pysyncobj's thread: it must only hand over, not block) after each command that
        changed the local state, so that a node acts on a new leadership at once rather than at its next look."""
        self._replica.on_change = callback

    # -- reads (local) ----------------------------------------------------------------------------------

    def state(self) -> SiteState:
        """A copy of the local state, consistent at one log index. May be behind the leader; see the module doc.
        Read it only: callers share one copy until the state changes (a later command never shows in it)."""
        return self._replica.copy()

    def read(self, fn: Callable[[SiteState], T]) -> T:
        """``fn(state)`` under the state's lock, without copying it. ``fn`` must not keep the state nor block."""
        return self._replica.read(fn)

    def topics(self) -> dict[str, TopicSpec]:
        return self._replica.read(lambda state: state.topics())

    def topics_version(self) -> int:
        """The state's version: it changes with every command but a heartbeat, so with every topic created."""
        return self._replica.read(lambda state: state.version)

    def entries(self) -> dict[str, TopicEntry]:
        """Every name's entry (``SiteState.entries``): the same dict until the state changes."""
        return self._replica.read(lambda state: state.entries())

    def merge_entries(self, received: Sequence[TopicEntry]) -> list[Merged]:
        """Join each of ``received`` into the site's entries, as one Raft command (``MergeTopicEntry`` each, in a
        batch); what each merge gives against this node's view (its conflicts are this node's to report). A
        refused entry is left out of the change (logged); with one entry, raises :class:`CommandRefused`. Blocks
        up to the write timeout (call it off the event loop); raises :class:`MetadataUnavailable`."""
        held = self.entries()
        merges = [merge(held.get(e.name), e) for e in received]
        # Only what changes this node's view, and what the state machine takes: every command changes the state's
        # version, which starts the next sync round's merges, so proposing the same entries would never stop.
        wanted = [i for i, m in enumerate(merges) if m.changed and not _refused_delete(held.get(m.entry.name), m.entry)]
        for i, m in enumerate(merges):
            if m.changed and i not in wanted:
                logger.debug("topic %r: georep's own topic, never deleted", m.entry.name)
                merges[i] = Merged(held[m.entry.name], False, ())
        if not wanted:
            return merges
        result = self.propose(CommandBatch(tuple(MergeTopicEntry(received[i]) for i in wanted)))
        results = result.results if isinstance(result, Applied) else (result,) * len(wanted)
        for i, outcome in zip(wanted, results, strict=True):
            if isinstance(outcome, Refused):
                if len(received) == 1:
                    raise CommandRefused(outcome)
                logger.warning("topic %r: entry not taken: %s", received[i].name, outcome.reason)
                merges[i] = Merged(held.get(received[i].name) or received[i], False, ())
        return merges

    def get(self, name: str) -> TopicSpec:
        spec, entry = self._replica.read(lambda state: (state.topic(name), state.entries().get(name)))
        if spec is None:
            raise UnknownTopic(name, entry.stamp.site if entry is not None and entry.deleted else "")
        return spec

    def acls(self) -> dict[str, AclRecord]:
        return self._replica.read(lambda state: state.acls())

    # -- writes ----------------------------------------------------------------------------------------

    def put_acl(self, record: AclRecord) -> bool:
        """Raises :class:`MetadataUnavailable`; blocks up to the write timeout (call it off the event loop)."""
        result = self.propose(PutAcl(record))
        if isinstance(result, Refused):
            raise CommandRefused(result)
        return result.changed

    def create_topic(self, spec: TopicSpec) -> None:
        """Raises ``TopicExists``, ``InvalidTopic``, or :class:`MetadataUnavailable`. Committed when it returns."""
        result = self.propose(CreateTopic(spec))
        if isinstance(result, Refused):
            if result.code is RefusalCode.TOPIC_EXISTS:
                raise TopicExists(spec.name)
            raise CommandRefused(result)

    def propose(self, command: Command, timeout_s: float | None = None) -> Result:
        """Commit ``command`` and return what applying it gave; see the module docstring.

        Raises :class:`NoRaftLeader` or :class:`CommitUnconfirmed` once ``timeout_s`` (default
        ``RaftTiming.write_timeout_s``) has passed without a confirmation; never blocks longer.
        :class:`CommandTooLarge` at once for a command whose log entry would be over the bound of the Raft port.
        """
        self._check_open()
        timeout = self._timing.write_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        raw = command.to_dict()
        what = f"{command.KIND} command"
        size = command_bytes(raw)
        if size > COMMAND_BYTES_MAX:
            raise CommandTooLarge(what, size)
        while True:
            # Not to a leader we know is gone: pysyncobj would send the command into the void, and report it only
            # as LEADER_CHANGED (outcome unknown) once a new leader shows up. Wait for one instead.
            if self.leader_address is not None:
                outcome = _Outcome()
                self._replica.apply_command(raw, callback=outcome.done)
                if not outcome.event.wait(max(0.0, deadline - time.monotonic())):
                    raise self._unavailable(what, timeout)
                if outcome.error == FAIL_REASON.SUCCESS:
                    result = outcome.result
                    if not isinstance(result, Applied | Refused):
                        raise CommitUnconfirmed(
                            f"the {what} was committed but gave no result ({result!r}): "
                            "read the state to see its effect"
                        )
                    return result
                if outcome.error not in _NOT_IN_LOG:
                    reachable, unreachable = self._reachability()
                    total = reachable + len(unreachable)
                    if reachable * 2 <= total:  # the leader stepped down for want of a majority
                        raise NoRaftLeader(what, timeout, reachable, total, unreachable)
                    leader = self.leader_address or "none known"
                    raise CommitUnconfirmed(
                        f"the Raft leader changed while the {what} was in flight (pysyncobj error {outcome.error}; "
                        f"leader now: {leader}): it may or may not be applied; read the state after read_barrier() "
                        "and retry if it is not"
                    )
            pause_s = min(self._timing.retry_interval_s, deadline - time.monotonic())
            if pause_s <= 0:
                raise self._unavailable(what, timeout)
            time.sleep(pause_s)

    def read_barrier(self, timeout_s: float | None = None) -> None:
        """Return once the local state holds every command committed before this call (a no-op through the log)."""
        self.propose(ReadBarrier(), timeout_s)

    def _unavailable(self, what: str, timeout_s: float) -> MetadataUnavailable:
        reachable, unreachable = self._reachability()
        total = reachable + len(unreachable)
        leader = self.leader_address
        if reachable * 2 <= total or leader is None:
            return NoRaftLeader(what, timeout_s, reachable, total, unreachable)
        return CommitUnconfirmed(
            f"the {what} was not confirmed within {timeout_s:g} s (Raft leader {leader}, {reachable} of "
            f"{total} metadata nodes reachable): it may still be applied; read the state after "
            "read_barrier() and retry if it is not"
        )

    # -- Raft status ------------------------------------------------------------------------------------

    def _reachability(self) -> tuple[int, list[str]]:
        partners = sorted(self._replica.otherNodes, key=lambda node: node.address)  # a copy: it changes on joins
        unreachable = [node.address for node in partners if not self._replica.isNodeConnected(node)]
        return len(partners) + 1 - len(unreachable), unreachable

    def members(self) -> list[str]:
        """The Raft addresses of the group's members as this node knows them (itself included), sorted. A member
        added or removed counts from the moment its log entry reaches this node, as Raft's membership changes do."""
        return sorted({self._self_address, *(node.address for node in self._replica.otherNodes)})

    @property
    def self_address(self) -> str:
        return self._self_address

    @property
    def is_leader(self) -> bool:
        """This node believes it is the Raft leader. A leader cut off from the majority believes so for up to
        ``leader_step_down_s``: call :meth:`read_barrier` before acting on a decision that must not be stale."""
        return bool(self._replica._isLeader())

    @property
    def led_for_s(self) -> float | None:
        """How long this node's replica has been the Raft leader; None if it is not. A node that acts as the leader
        (the controller) counts from here, not from when it first looked: its own calls may have waited for the
        election, while the other nodes' writes already went through it."""
        since = self._replica.leader_since
        if since is None or not self.is_leader:
            return None
        return max(0.0, time.monotonic() - since)

    @property
    def leader_address(self) -> str | None:
        """The Raft address of the leader as this node last heard of it; None if none is known or it is unreachable
        from here (pysyncobj keeps pointing at a dead leader until a new one is elected)."""
        leader = self._replica._getLeader()
        if leader is None:
            return None
        if leader.address != self._self_address and not self._replica.isNodeConnected(leader):
            return None
        return str(leader.address)

    def status(self) -> RaftStatus:
        reachable, unreachable = self._reachability()
        return RaftStatus(
            self._self_address,
            self.leader_address,
            self.is_leader,
            reachable,
            reachable + len(unreachable),
            int(self._replica.raftLastApplied),
            int(self._replica.raftCommitIndex),
            int(self._replica.raftCurrentTerm),
        )

    # -- lifecycle -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the metadata store of Raft node {self._self_address} is closed")

    def close(self, snapshot: bool = True) -> None:
        """Stop this node's Raft replica and release its port and files. Idempotent.

        With ``snapshot`` (the default) the applied state is dumped first, so that the node restarts with all of it
        even before it reaches a majority (the journal alone gives only what the commit index recorded up to a
        second before the stop). ``snapshot=False`` stops as a crash would.
        """
        if self._closed:
            return
        self._closed = True
        if snapshot:
            self._dump_before_close()
        self._replica.destroy_synchronous()
        self._replica.release_files()

    def _dump_before_close(self) -> None:
        target = int(self._replica.raftLastApplied)
        if self._replica.dumped_index() >= target:
            return
        self._replica.forceLogCompaction()
        deadline = time.monotonic() + self._timing.close_snapshot_timeout_s
        while self._replica.dumped_index() < target:
            if time.monotonic() >= deadline:
                logger.warning(
                    "Raft node %s: no dump of the metadata within %g s before closing; the journal has it",
                    self._self_address,
                    self._timing.close_snapshot_timeout_s,
                )
                return
            time.sleep(0.01)

    def __enter__(self) -> RaftMetadataStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
