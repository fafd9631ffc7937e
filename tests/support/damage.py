"""The damage campaign of issue 20: one site of a running topology has one of its files damaged at random.

Each seed, on three sites in a triangle (``tests/support/sites.py``) that keep running between seeds:

1. records are produced at a site the seed picks (every site is an origin: multi-master), and the sites converge;
2. one site is stopped cleanly, and one of its files is damaged: a segment's ``.log``, ``.index`` or ``.oindex``,
   ``damaged.json``, the recovery point, ``topics.json`` or its journal, ``site.json`` or ``node.json``; by
   flipping bytes, truncating it, zeroing a page of it, or deleting it;
3. the site is started again. Either it refuses to start, and then its log names the damaged file and says what
   to do (the campaign then puts the file back as a backup would, and starts it); or it starts;
4. it is scrubbed, and the campaign waits until every site holds the same records with nothing quarantined;
5. every site must hold every record exactly once, in origin order, with the same bytes (I1-I4), read back with
   ``Fetch``: a silent loss, a duplicate, or "converged" over a missing record fails the seed.

All randomness comes from ``random.Random(seed)``, so a failing seed replays (its damage is in the failure).
``bench/damage.py --seeds N`` runs long campaigns; ``tests/test_damage_campaign.py`` runs some in ``make test``.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from georep.client.producer import Producer
from georep.proto import georep_pb2 as pb
from georep.server.process import NodeStartError
from tests.support.sites import TRIANGLE, Sites, check_invariants, wait_until

TOPIC = "t"
SITES = ["a", "b", "c"]
NODE_ARGS = ["--segment-bytes-max", "4096", "--scrub-bytes-per-s", "0"]  # the campaign scrubs when it chooses
RECORDS_PER_SEED = 60
SETTLE_S = 60.0

# What a refusal must say beyond naming the file: an action the operator can take.
ACTIONS = ("Restore", "restore", "move", "Move")


@dataclass(frozen=True)
class Damage:
    site: str
    path: Path
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.path.name} at site {self.site} ({self.detail})"


def categories(data_dir: Path) -> dict[str, list[Path]]:
    """The site's files a disk could damage, by kind; logs, locks and certificates are not the site's state."""
    out: dict[str, list[Path]] = {}
    for path in sorted(p for p in data_dir.rglob("*") if p.is_file()):
        name = path.name
        kind = next((k for k, test in _KINDS if test(name)), None)
        if kind is not None:
            out.setdefault(kind, []).append(path)
    return out


_KINDS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("segment log", lambda n: n.endswith(".log") and n != "node.log"),
    ("sparse index", lambda n: n.endswith(".index")),
    ("origin index", lambda n: n.endswith(".oindex")),
    ("quarantine list", lambda n: n == "damaged.json"),
    # A node's recovery points: its checkpoint of every partition, or a log's own file (an older data dir)
    ("recovery point", lambda n: n in ("recovery-point", "recovery-point-checkpoint")),
    ("log start", lambda n: n == "log-start"),
    ("topics", lambda n: n == "topics.json"),
    ("topics journal", lambda n: n.startswith("topics.") and n.endswith(".journal")),
    ("site identity", lambda n: n == "site.json"),
    ("node info", lambda n: n == "node.json"),
)


# How often each kind of file is picked: mostly the user topic's segment files, which hold the records.
WEIGHTS = {
    "segment log": 6,
    "origin index": 3,
    "sparse index": 2,
    "quarantine list": 1,
    "recovery point": 2,
    "log start": 1,
    "topics": 1,
    "topics journal": 1,
    "site identity": 1,
    "node info": 1,
}


def damage_one_file(rng: random.Random, site: str, data_dir: Path) -> Damage:
    files = categories(data_dir)
    kinds = sorted(files)
    kind_of_file = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
    candidates = files[kind_of_file]
    ours = [p for p in candidates if p.parent.name.startswith(f"{TOPIC}-")]  # not the internal topics' files
    path = rng.choice(ours if ours and rng.random() < 0.9 else candidates)
    data = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "truncate", "zero", "delete"] if data else ["delete"])
    if kind == "flip":
        spots = sorted({rng.randrange(len(data)) for _ in range(rng.randint(1, 4))})
        for at in spots:
            data[at] ^= rng.randint(1, 255)
        path.write_bytes(bytes(data))
        detail = f"bytes {spots}"
    elif kind == "truncate":
        size = rng.randrange(len(data))
        path.write_bytes(bytes(data[:size]))
        detail = f"to {size} of {len(data)} bytes"
    elif kind == "zero":
        page = rng.randrange(0, len(data), 4096) if len(data) > 4096 else 0
        end = min(len(data), page + 4096)
        data[page:end] = bytes(end - page)
        path.write_bytes(bytes(data))
        detail = f"bytes {page}..{end - 1}"
    else:
        path.unlink()
        detail = f"{len(data)} bytes"
    return Damage(site, path, kind, detail)


async def produce_small_batches(address: str, prefix: str) -> set[tuple[bytes, bytes]]:
    """``RECORDS_PER_SEED`` keyed records in batches of a few records, so that segments hold many batches."""
    sent = set()
    async with Producer(address, linger_ms=1, batch_size=400) as producer:
        futures = []
        for i in range(RECORDS_PER_SEED):
            key, value = f"{prefix}-k{i}".encode(), f"{prefix}-value-{i}".encode().ljust(48, b".")
            futures.append(producer.send(TOPIC, value, key=key))
            sent.add((key, value))
        await asyncio.gather(*futures)
    return sent


class Campaign:
    """Three running sites and every record produced so far."""

    def __init__(self, root: Path) -> None:
        self.sites = Sites(root, SITES, TRIANGLE, stall_ms=500, extra_args=NODE_ARGS)
        self.expected: set[tuple[bytes, bytes]] = set()
        self.refusals = 0

    def start(self) -> Campaign:
        self.sites.start()
        self.sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=2), timeout=10)
        wait_until("every site knows the topic", lambda: all(self.sites.vectors(s, TOPIC) for s in SITES), 30)
        return self

    def close(self) -> None:
        self.sites.close()

    def run_seed(self, seed: int) -> Damage:
        """One seed of the campaign; raises AssertionError (naming the seed and the damage) when it fails."""
        rng = random.Random(seed)
        origin = rng.choice(SITES)
        self.expected |= asyncio.run(produce_small_batches(self.sites.address(origin), f"s{seed}"))
        self.settle(f"seed {seed}: before the damage")
        victim = rng.choice(SITES)
        node = self.sites.nodes[victim]
        node.stop()
        backup = node.data_dir.parent / f"backup-{victim}"
        shutil.rmtree(backup, ignore_errors=True)
        shutil.copytree(node.data_dir, backup)
        damage = damage_one_file(rng, victim, node.data_dir)
        try:
            self.restart(damage, backup)
            self.scrub(victim)
            self.settle(f"seed {seed}: {damage}")
            check_invariants(self.sites, SITES, TOPIC, self.expected)
        except Exception as exc:  # a read refused (DATA_LOSS, OUT_OF_RANGE) fails the seed as much as an assert
            raise AssertionError(f"seed {seed} failed after {damage}: {type(exc).__name__}: {exc}") from exc
        return damage

    def restart(self, damage: Damage, backup: Path) -> None:
        node = self.sites.nodes[damage.site]
        try:
            node.start()
            return
        except NodeStartError as exc:
            said = str(exc)
        stem = damage.path.name.split(".")[0]
        assert damage.path.name in said or stem in said, f"the refusal does not name {damage.path.name}: {said}"
        assert any(a in said for a in ACTIONS), f"the refusal does not say what to do: {said}"
        self.refusals += 1
        shutil.copy2(backup / damage.path.relative_to(node.data_dir), damage.path)  # the operator restores it
        node.start()

    def scrub(self, site: str) -> None:
        for progress in self.sites.stub(site).Scrub(pb.ScrubRequest(), timeout=60):
            if progress.done:
                return

    def settle(self, what: str) -> None:
        wait_until(
            f"{what}: every site holds all {len(self.expected)} records with nothing quarantined",
            self.settled,
            SETTLE_S,
        )

    def settled(self) -> bool:
        vectors = []
        for site in SITES:
            try:
                desc = self.sites.stub(site).DescribeTopic(pb.DescribeTopicRequest(name=TOPIC), timeout=5)
            except grpc.RpcError:
                return False
            if any(ps.damaged for ps in desc.partition_states):
                return False
            vectors.append(
                {
                    ps.partition: {(e.site, e.epoch): e.next_seq for e in ps.vector.entries}
                    for ps in desc.partition_states
                }
            )
        total = sum(sum(v.values()) for v in vectors[0].values())
        return all(v == vectors[0] for v in vectors) and total == len(self.expected)
