"""``georep drill --client kafka``: a site failover drill with unmodified Kafka clients (confluent-kafka).

1. Create a fresh topic ``kdrill-<ms>`` through the victim's Kafka port and wait until the failover site
   has it too.
2. One idempotent ``acks=all`` producer per site (the victim and the failover site), at ``--rate`` records/s;
   each value names its site and sequence, so every record is accounted for.
3. ``--consumers`` consumers in a fresh group at the victim's Kafka port; they commit synchronously every
   ``--commit-interval-ms``. The nodes must run with ``--kafka-commit-acks geo:2`` (``georep up`` does):
   a commit is acknowledged once the failover site holds it too.
4. After ``--warmup`` seconds the victim's node is killed (SIGKILL; its pid from
   ``DATA_DIR/<site>/node.json``, so a local run), and the consumers are abandoned, as a crashed
   application's would be.
5. New consumers in the same group connect to the failover site's Kafka port. Its OffsetFetch turns the
   group's committed vectors into that site's local offsets, and its Fetch leaves out the records those
   vectors cover (docs/kafka.md). ``--after`` seconds later the producers stop; the consumers drain.

It then reads the whole topic at the failover site with a group-less consumer (an independent count) and
reports: the records committed at the victim (what its last commit per partition covered), the records
delivered after the failover, **duplicates relative to the last commit** (delivered after the failover
although that commit covered them) and **lost** (held by the failover site, not covered by the commit,
never delivered after the failover). Both must be zero. Records delivered twice after the failover by the new
group's own rebalance (a member that had not heard of it yet read what the new owner then read from the
group's commit) are counted apart: that is Kafka's at-least-once between commits, not the failover. It
also reports the RPO of ``acks=all`` at the victim (acknowledged there, never reached the failover site:
``acks=all`` promises the site's replicas, not another site) and the time from the kill to the first record
consumed at the failover site.
Unless ``--no-restart``, the victim is started again with the command in its ``node.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from georep.cli.drill import promises_lines
from georep.cli.drill_sites import DrillSitesError, drill_sites
from georep.security.tls import TlsConfig
from georep.storage.private import append_private
from topology.model import Topology

NODE_INFO = "node.json"
POLL_S = 0.05
TOPIC_WAIT_S = 20.0
DRAIN_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0
UNCOMMITTED_S = 0.5  # reading on after the last commit, before the kill


class KafkaDrillError(Exception):
    """What stops the drill before it measures anything; the message says what to do."""


@dataclass
class Deliveries:
    """What one phase's consumers got: (partition, offset) -> value, and every value in delivery order."""

    at: dict[tuple[int, int], str] = field(default_factory=dict)
    values: list[str] = field(default_factory=list)
    first_ms: float | None = None
    committed: dict[int, int] = field(default_factory=dict)  # partition -> highest offset a commit acknowledged
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set before the kill: no commit starts, so the last commit is the last acknowledged one (a commit cut by the
    # kill may or may not have been stored, and the drill could not say what "the last commit" was).
    no_more_commits: threading.Event = field(default_factory=threading.Event)
    committing: threading.Lock = field(default_factory=threading.Lock)


def _info(data_dir: Path, site: str) -> dict[str, Any]:
    path = data_dir / site / NODE_INFO
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KafkaDrillError(
            f"the Kafka drill reads {path} ({exc}): run it on the machine and with the --data-dir of 'georep up'"
        ) from None
    if not info.get("kafka"):
        raise KafkaDrillError(
            f"site {site}'s node serves no Kafka listener: start it with --kafka-listen ('georep up' does)"
        )
    return info


def _producer(
    bootstrap: str,
    site: str,
    rate: float,
    stop: threading.Event,
    acked: list[str],
    failed: list[str],
    topic: str,
    secure: dict[str, str],
) -> None:
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "message.timeout.ms": 10_000,
            "socket.timeout.ms": 3_000,
            "log_level": 0,
            **secure,
        }
    )

    def delivered(err: Any, msg: Any) -> None:
        (failed if err else acked).append(msg.value().decode())

    seq = 0
    started = time.monotonic()
    while not stop.is_set():
        due = started + seq / rate
        wait = due - time.monotonic()
        if wait > 0:
            p.poll(min(POLL_S, wait))  # never negative: librdkafka waits forever on a negative timeout
            continue
        try:
            p.produce(topic, value=f"{site}|{seq}".encode(), on_delivery=delivered)
        except BufferError:
            p.poll(POLL_S)
            continue
        seq += 1
        p.poll(0)
    p.flush(12)


def _consume(consumers: list[Any], got: Deliveries, stop: threading.Event, commit_s: float | None) -> None:
    last_commit = time.monotonic()
    while not stop.is_set():
        for c in consumers:
            m = c.poll(POLL_S)
            if m is None or m.error() is not None:
                continue
            with got.lock:
                if got.first_ms is None:
                    got.first_ms = time.time() * 1000
                value = m.value().decode()
                got.at[(m.partition(), m.offset())] = value
                got.values.append(value)
        if commit_s is not None and time.monotonic() - last_commit >= commit_s:
            last_commit = time.monotonic()
            with got.committing:
                for c in consumers:
                    if got.no_more_commits.is_set():
                        break
                    try:
                        for tp in c.commit(asynchronous=False) or []:
                            if tp.error is None and tp.offset >= 0:
                                with got.lock:
                                    got.committed[tp.partition] = max(got.committed.get(tp.partition, 0), tp.offset)
                    except Exception:  # nothing to commit yet, or a rebalance: the next round commits
                        continue


def _consumers(bootstrap: str, group: str, topic: str, n: int, secure: dict[str, str]) -> list[Any]:
    from confluent_kafka import Consumer

    out = []
    for i in range(n):
        c = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "client.id": f"drill-{i}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 500,
                "log_level": 0,
                **secure,
            }
        )
        c.subscribe([topic])
        out.append(c)
    return out


def _read_all(bootstrap: str, topic: str, partitions: int, secure: dict[str, str]) -> list[str]:
    """Every record of ``topic`` at one site, with no group (the independent count)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False, "log_level": 0, **secure}
    )
    try:
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        got: dict[int, list[str]] = {p: [] for p in range(partitions)}
        positions = dict.fromkeys(range(partitions), 0)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(positions[p] < ends[p] for p in ends) and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error() is not None:
                continue
            part, offset = m.partition(), m.offset()
            if part is None or offset is None:
                continue
            got[part].append((m.value() or b"").decode())
            positions[part] = offset + 1
        return [v for p in sorted(got) for v in got[p]]
    finally:
        c.close()


def _abandon(consumers: list[Any]) -> None:
    """Drop consumers whose site died, as a crashed application would (their close may wait on the dead site)."""
    for c in consumers:
        threading.Thread(target=c.close, daemon=True).start()


def ssl_config(tls: TlsConfig | None) -> dict[str, str]:
    """librdkafka's settings for mutual TLS with georep's certificate files (none for a plaintext site)."""
    if tls is None:
        return {}
    return {
        "security.protocol": "SSL",
        "ssl.ca.location": str(tls.ca),
        "ssl.certificate.location": str(tls.cert),
        "ssl.key.location": str(tls.key),
    }


def kafka_drill(
    args: argparse.Namespace, topology: Topology, out: Callable[[str], None] = print, tls: TlsConfig | None = None
) -> dict[str, Any]:
    try:
        victim, target = drill_sites(topology, args.site, args.failover_to)
    except DrillSitesError as exc:
        raise KafkaDrillError(str(exc)) from None
    infos = {s: _info(args.data_dir, s) for s in (victim, target)}
    secure = ssl_config(tls)
    kafka = {s: str(infos[s]["kafka"]) for s in infos}
    stamp = int(time.time() * 1000)
    topic, group = f"kdrill-{stamp}", f"kdrill-{stamp}"
    out(
        f"drill (Kafka clients): kill site {victim}, the group fails over to {target}; topic {topic}, "
        f"{args.rate:g} records/s per producer at acks=all, commits every {args.commit_interval_ms} ms"
    )
    _create_topic(topic, args.partitions, victim, kafka[victim], target, kafka[target], secure)

    acked: dict[str, list[str]] = {victim: [], target: []}
    failed: dict[str, list[str]] = {victim: [], target: []}
    stops = {s: threading.Event() for s in (victim, target)}
    producers = [
        threading.Thread(
            target=_producer, args=(kafka[s], s, args.rate, stops[s], acked[s], failed[s], topic, secure), daemon=True
        )
        for s in (victim, target)
    ]
    for t in producers:
        t.start()
    before, after = Deliveries(), Deliveries()
    stop_before, stop_after = threading.Event(), threading.Event()
    consumers_a = _consumers(kafka[victim], group, topic, args.consumers, secure)
    reading_a = threading.Thread(
        target=_consume, args=(consumers_a, before, stop_before, args.commit_interval_ms / 1000), daemon=True
    )
    reading_a.start()
    time.sleep(args.warmup)
    killed_ms = _kill_between_commits(before, int(infos[victim]["pid"]))
    stops[victim].set()
    stop_before.set()
    reading_a.join(CLOSE_TIMEOUT_S)
    _abandon(consumers_a)
    out(f"  killed site {victim} (pid {infos[victim]['pid']}); the group reconnects to {target} ({kafka[target]})")
    consumers_b = _consumers(kafka[target], group, topic, args.consumers, secure)
    # No commits here: with the victim down, a commit at geo:2 cannot be acknowledged (the drill measures the
    # failover to the victim's last commit).
    reading_b = threading.Thread(target=_consume, args=(consumers_b, after, stop_after, None), daemon=True)
    reading_b.start()
    time.sleep(args.after)
    stops[target].set()
    for t in producers:
        t.join(20)
    held = _read_all(kafka[target], topic, args.partitions, secure)
    with before.lock:
        committed = {v for (p, o), v in before.at.items() if o < before.committed.get(p, 0)}
    expected = [v for v in held if v not in committed]
    _wait_delivered(after, expected)
    stop_after.set()
    reading_b.join(CLOSE_TIMEOUT_S)
    for c in consumers_b:
        c.close()
    if not args.no_restart:
        _restart(infos[victim], args.data_dir / victim)
    return _report(victim, target, topic, group, acked, held, before, after, committed, expected, killed_ms)


def _create_topic(
    topic: str, partitions: int, victim: str, victim_kafka: str, target: str, target_kafka: str, secure: dict[str, str]
) -> None:
    """Create ``topic`` at the victim, and wait until the link carries it to the target."""
    from confluent_kafka import admin as kafka_admin

    AdminClient, NewTopic = kafka_admin.AdminClient, kafka_admin.NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": victim_kafka, "log_level": 0, **secure})
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(15)
    except Exception as exc:
        raise KafkaDrillError(f"cannot create {topic} at {victim}'s Kafka port {victim_kafka}: {exc}") from None
    target_admin = AdminClient({"bootstrap.servers": target_kafka, "log_level": 0, **secure})
    deadline = time.monotonic() + TOPIC_WAIT_S
    while topic not in target_admin.list_topics(timeout=5).topics:
        if time.monotonic() > deadline:
            raise KafkaDrillError(f"{topic} did not reach site {target} within {TOPIC_WAIT_S:g}s: is there a link?")
        time.sleep(0.2)


def _kill_between_commits(before: Deliveries, pid: int) -> float:
    """SIGKILL the victim's node once a commit was made and none is in flight; when (ms since the epoch)."""
    if not before.committed:
        deadline = time.monotonic() + 20
        while not before.committed and time.monotonic() < deadline:
            time.sleep(0.1)
    # The kill, once no commit is in flight. The consumers at the victim go on reading until it; what they
    # delivered after their last commit may be delivered again (Kafka's at-least-once beyond the commit),
    # nothing before it may.
    before.no_more_commits.set()
    with before.committing:
        pass
    time.sleep(UNCOMMITTED_S)
    os.kill(pid, signal.SIGKILL)
    return time.time() * 1000


def _wait_delivered(after: Deliveries, expected: list[str]) -> None:
    """Wait until the consumers at the target delivered every expected record (or give up after a while)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        with after.lock:
            if set(expected) <= set(after.values):
                return
        time.sleep(0.1)


def _restart(info: dict[str, Any], node_dir: Path) -> None:
    """Start the killed node again the way it was started (its node.json), if it says how."""
    command = info.get("command")
    if command:
        with append_private(node_dir / "node.log") as log:
            subprocess.Popen(
                command,
                cwd=info.get("cwd"),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )


def _report(
    victim: str,
    target: str,
    topic: str,
    group: str,
    acked: dict[str, list[str]],
    held: list[str],
    before: Deliveries,
    after: Deliveries,
    committed: set[str],
    expected: list[str],
    killed_ms: float,
) -> dict[str, Any]:
    held_set = set(held)
    delivered_after = list(after.values)
    duplicates = [v for v in delivered_after if v in committed]
    # Delivered twice after the failover, by the new group's own rebalance (a member that had not yet heard of
    # it read past the group's commit): Kafka's at-least-once between commits, reported but no broken promise.
    seen: set[str] = set()
    repeated = 0
    for v in delivered_after:
        repeated += v in seen
        seen.add(v)
    lost = sorted(set(expected) - set(delivered_after))
    rpo = [v for v in acked[victim] if v not in held_set]
    broken = []
    if duplicates:
        broken.append(f"{len(duplicates)} record(s) the last commit covered were delivered again at {target}")
    if lost:
        broken.append(f"{len(lost)} record(s) held at {target} and not committed were never delivered there")
    if not before.committed:
        broken.append(f"no commit was acknowledged at {victim} before the kill")
    return {
        "client": "kafka",
        "victim": victim,
        "failover_to": target,
        "topic": topic,
        "group": group,
        "acked": {s: len(v) for s, v in acked.items()},
        "held_at_failover_site": len(held),
        "delivered_before": len(before.values),
        "committed_records": len(committed),
        "delivered_after": len(delivered_after),
        "expected_after": len(expected),
        "duplicates_relative_to_commit": len(duplicates),
        "delivered_twice_after": repeated,
        "lost": len(lost),
        "lost_examples": lost[:10],
        "rpo_acks_all_at_victim": len(rpo),
        "rto_ms": None if after.first_ms is None else round(after.first_ms - killed_ms),
        "promises_broken": broken,
        "ok": not broken,
    }


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"drill (Kafka clients, confluent-kafka): site {doc['victim']} killed, group {doc['group']} failed over "
        f"to {doc['failover_to']}",
        f"  acked at acks=all: {', '.join(f'{s} {n}' for s, n in doc['acked'].items())}; held at "
        f"{doc['failover_to']}: {doc['held_at_failover_site']}; acked at {doc['victim']} but never at "
        f"{doc['failover_to']} (acks=all promises the site, not another): {doc['rpo_acks_all_at_victim']}",
        f"  before the kill: delivered {doc['delivered_before']}, covered by the last commit "
        f"{doc['committed_records']}",
        f"  after the failover: delivered {doc['delivered_after']} of {doc['expected_after']} expected; "
        f"duplicates relative to the last commit: {doc['duplicates_relative_to_commit']}; lost: {doc['lost']} "
        f"(delivered twice within the new group's rebalance, past its own commits: {doc['delivered_twice_after']})",
        f"  RTO (kill to the first record consumed at {doc['failover_to']}): {doc['rto_ms']} ms",
    ]
    lines += promises_lines(
        doc["promises_broken"], "every promise kept: zero lost and zero duplicated relative to the last commit"
    )
    return "\n".join(lines)
