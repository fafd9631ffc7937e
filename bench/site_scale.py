"""A three-node site at many partitions (issue 22): idle cost, Raft metadata size, and leader re-election after a
node's ``kill -9``.

Run from the repository root::

    .venv/bin/python bench/site_scale.py --partitions 2000
    .venv/bin/python bench/site_scale.py --partitions 10000 --replication-factor 2

``bench/scale.py`` calls :func:`measure` (one site, one size) and prints its :class:`SiteScale`. What is measured,
on one site ``a`` of three ``georep node --node-id N`` processes (bench/site_cluster.py's ``Site``):

* ``create_s``: ``CreateTopic`` of one topic of ``--partitions`` partitions (or ``--topics`` topics of as many, in
  ``CreateTopics`` calls of 100), to every partition led by a live node
  (``ClusterStatus``'s ``leaderless_partitions`` is 0: the summary, so the poll stays cheap).
* ``settle_s``: from every partition led to a settled site (:func:`settle`): every partition has an open segment on
  ``--replication-factor`` nodes with nothing under-replicated, and then every node spends under
  :data:`SETTLE_CPU_SHARE` of a core over :data:`SETTLE_WINDOW_S` twice in a row (the segment opens, rolls and
  repairs the create set off are over), or ``--settle-timeout-s`` ran out (``settled`` False). Killing a node of a
  site still busy with the create measured that work, not the re-election (225 s in one run, with the nodes at 60%
  of a core opening segments at the kill).
* idle, for ``--idle-s`` once settled: per node, CPU (utime + stime from ``/proc``, as a share of one core), RSS,
  open fds, and the Raft directory's bytes (journal and dump).
* ``reelect_s``: ``kill -9`` of the node that leads the most partitions (not the Raft leader), to the first
  ``ClusterStatus`` of a survivor
  that shows every partition led by a live node again. It includes the session timeout (``--session-timeout-ms``:
  the time to notice the death), printed beside it; ``raft_entries`` is how many Raft log entries the survivors
  committed meanwhile (the applied index's rise: elections go as batches, so it is far below the partition count).
* ``restart_s``: the killed node started again, to when it serves (it wrote ``node.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from site_cluster import NODES, Site, raft_elections

from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.security.tls import client_channel
from georep.server.process import NodeStartError

TOPIC = "scale"
POLL_S = 0.05
RPC_TIMEOUT_S = 5.0
SUMMARY = pb.ClusterStatusRequest(partitions_limit=0)
TOPICS_PER_CALL = 100
SETTLE_CPU_SHARE = 0.15  # of one core, per node: a site busier than this is still working off the create
SETTLE_WINDOW_S = 2.0


@dataclass
class NodeIdle:
    node: int
    cpu_share: float  # of one core, over the idle window
    rss_mb: int
    fds: int
    raft_kib: int


@dataclass
class SiteScale:
    partitions: int
    replication_factor: int
    session_timeout_ms: int
    create_s: float = float("nan")
    whole: bool = False  # every partition had an open segment on replication_factor nodes before the idle window
    settle_s: float = float("nan")  # from every partition led to a settled site (settle)
    settled: bool = False  # False: the settle timeout ran out first
    idle: list[NodeIdle] = field(default_factory=list)
    victim: int = 0
    victim_led: int = 0  # partitions it led when it was killed
    reelect_s: float = float("nan")
    raft_entries: int = 0
    elections_settle: int = 0  # Raft elections (a node ran for leader, from the nodes' logs) from start to the kill
    elections_reelect: int = 0  # from the kill until every partition was led again
    restart_s: float = float("nan")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def _summary(site: Site, nodes: list[int]) -> pb.ClusterStatusResponse | None:
    for n in nodes:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async with client_channel(site.addresses[n], None) as ch:
                answer: pb.ClusterStatusResponse = await pbg.NodeStub(ch).ClusterStatus(SUMMARY, timeout=RPC_TIMEOUT_S)
                return answer
    return None


async def _until_led(
    site: Site, nodes: list[int], partitions: int, timeout_s: float, dead: int | None = None
) -> pb.ClusterStatusResponse:
    """Until every partition is led by a live node, and by none of node ``dead``: right after its kill, a node still
    counts as live until its session runs out, so "no leaderless partition" alone held at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = await _summary(site, nodes)
        moved = answer is not None and all(n.leader_of == 0 for n in answer.nodes if n.node_id == dead)
        if answer is not None and answer.partition_count == partitions and answer.leaderless_partitions == 0 and moved:
            return answer
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"not every partition led by a live node within {timeout_s:g}s")


async def _whole(site: Site, partitions: int, rf: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = await _summary(site, site.live())
        opened = [n.open_segments for n in answer.nodes] if answer is not None else []
        if answer is not None and sum(opened) >= partitions * rf and answer.under_replicated_count == 0:
            return True
        await asyncio.sleep(1.0)
    return False


async def settle(site: Site, partitions: int, rf: int, timeout_s: float) -> tuple[bool, bool, float]:
    """Wait until the site is whole (every partition's open segment on ``rf`` nodes, nothing under-replicated)
    and then quiet (every node under :data:`SETTLE_CPU_SHARE` of a core over two windows of :data:`SETTLE_WINDOW_S`
    in a row), at most ``timeout_s``: (whole, settled, seconds waited)."""
    started = time.monotonic()
    whole = await _whole(site, partitions, rf, timeout_s)
    deadline = started + timeout_s
    quiet = 0
    while whole and quiet < 2 and time.monotonic() < deadline:
        pids = {n: p.pid for n, p in site.nodes.items() if p.pid is not None and p.alive()}
        before = {n: _cpu_s(pid) for n, pid in pids.items()}
        await asyncio.sleep(SETTLE_WINDOW_S)
        busiest = max(((_cpu_s(pid) - before[n]) / SETTLE_WINDOW_S for n, pid in pids.items()), default=0.0)
        quiet = quiet + 1 if busiest < SETTLE_CPU_SHARE else 0
    return whole, quiet >= 2, time.monotonic() - started


async def measure(
    root: Path,
    partitions: int,
    replication_factor: int = 3,
    session_timeout_ms: int = 3_000,
    idle_s: float = 20.0,
    settle_timeout_s: float = 300.0,
    topics: int = 1,
) -> SiteScale:
    """One site of three nodes under ``root`` (removed first): see the module docstring."""
    shutil.rmtree(root, ignore_errors=True)
    args = [
        *("--replication-factor", str(replication_factor), "--min-insync-replicas", str(min(2, replication_factor))),
        *("--session-timeout-ms", str(session_timeout_ms), "--scrub-bytes-per-s", "0"),
    ]
    out = SiteScale(partitions, replication_factor, session_timeout_ms)
    site = Site(root, args)
    try:
        site.start()
        started_wall = time.time()
        started = time.monotonic()
        async with client_channel(site.addresses[NODES[0]], None) as ch:
            await _create(pbg.NodeStub(ch), partitions, topics)
        partitions *= topics
        out.partitions = partitions
        await _until_led(site, list(NODES), partitions, settle_timeout_s)
        out.create_s = time.monotonic() - started
        out.whole, out.settled, out.settle_s = await settle(site, partitions, replication_factor, settle_timeout_s)
        pids = {n: p.pid for n, p in site.nodes.items() if p.pid is not None}
        before = {n: _cpu_s(pid) for n, pid in pids.items()}
        await asyncio.sleep(idle_s)
        for n, pid in pids.items():
            out.idle.append(
                NodeIdle(
                    n,
                    (_cpu_s(pid) - before[n]) / idle_s,
                    _rss_mb(pid),
                    len(os.listdir(f"/proc/{pid}/fd")),
                    _bytes_under(site.nodes[n].data_dir / "raft") // 1024,
                )
            )
        killed_wall = time.time()
        out.elections_settle = raft_elections(site, started_wall, killed_wall)
        await _reelect(site, out, settle_timeout_s)
        out.elections_reelect = raft_elections(site, killed_wall, killed_wall + out.reelect_s)
    finally:
        site.close()
    return out


async def _create(stub: pbg.NodeStub, partitions: int, topics: int) -> None:
    """One topic of ``partitions``, or ``topics`` topics of ``partitions`` each, in ``CreateTopics`` calls of
    :data:`TOPICS_PER_CALL` (what ``georep topic create`` sends)."""
    if topics == 1:
        await stub.CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=partitions), timeout=120)
        return
    names = [f"{TOPIC}-{i:05d}" for i in range(topics)]
    for at in range(0, topics, TOPICS_PER_CALL):
        request = pb.CreateTopicsRequest(
            topics=[pb.CreateTopicRequest(name=n, partitions=partitions) for n in names[at : at + TOPICS_PER_CALL]]
        )
        answer = await stub.CreateTopics(request, timeout=300)
        failed = [r for r in answer.results if r.HasField("error")]
        if failed:
            raise RuntimeError(f"{len(failed)} topics not created, e.g. {failed[0]}")


async def _reelect(site: Site, out: SiteScale, timeout_s: float) -> None:
    status = await _summary(site, list(NODES))
    raft_leader = site.raft_nodes.get(status.raft.leader_address) if status is not None else None
    led = {n.node_id: n.leader_of for n in status.nodes} if status is not None else {}
    # the node that leads the most partitions, not the controller (whose death also stops the metadata for a while)
    out.victim = max((n for n in NODES if n != raft_leader), key=lambda n: (led.get(n, 0), n))
    out.victim_led = led.get(out.victim, 0)
    survivors = [n for n in NODES if n != out.victim]
    applied = status.raft.applied_index if status is not None else 0
    victim = site.nodes[out.victim]
    assert victim.proc is not None
    killed = time.monotonic()
    victim.proc.kill()
    victim.proc.wait()
    after = await _until_led(site, survivors, out.partitions, timeout_s, dead=out.victim)
    out.reelect_s = time.monotonic() - killed
    out.raft_entries = after.raft.applied_index - applied
    restarted = time.monotonic()
    try:
        await site.restart(out.victim)
    except NodeStartError as exc:  # the re-election above still stands: report the restart as failed
        print(f"  restart of node {out.victim} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return
    out.restart_s = time.monotonic() - restarted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=2_000, help="per topic")
    parser.add_argument("--topics", type=int, default=1, help="topics of --partitions each (CreateTopics of 100)")
    parser.add_argument("--replication-factor", type=int, default=3)
    parser.add_argument("--session-timeout-ms", type=int, default=3_000)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--settle-timeout-s", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", type=Path, help="run under this directory and keep it (the nodes' logs)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="georep-site-scale-")))
        result = asyncio.run(
            measure(
                root,
                args.partitions,
                args.replication_factor,
                args.session_timeout_ms,
                args.idle_s,
                args.settle_timeout_s,
                args.topics,
            )
        )
    if args.json:
        print(json.dumps(asdict(result), indent=1))
        return 0
    print(
        f"{result.partitions} partitions, RF {result.replication_factor}: created and led in {result.create_s:.1f}s"
        f" (whole: {result.whole}); settled {result.settle_s:.1f}s later"
        f"{'' if result.settled else ' (NOT settled: the settle timeout ran out, so the kill meets a busy site)'}"
    )
    for n in result.idle:
        print(
            f"  node {n.node}: idle CPU {100 * n.cpu_share:.1f}% of a core, RSS {n.rss_mb} MB, {n.fds} fds, "
            f"Raft dir {n.raft_kib} KiB"
        )
    print(
        f"  kill -9 node {result.victim} (leading {result.victim_led}): every partition led again in "
        f"{result.reelect_s:.2f}s "
        f"(session timeout {result.session_timeout_ms / 1000:g}s; {result.raft_entries} Raft entries); "
        f"restart {result.restart_s:.1f}s"
    )
    print(f"  Raft elections: {result.elections_settle} before the kill, {result.elections_reelect} during re-election")
    return 0


if __name__ == "__main__":
    sys.exit(main())
