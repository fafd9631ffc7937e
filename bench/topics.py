"""Topics at scale: creating many topics at one site, the time until every site has them, and ``topic list``.

Two parts. ``create`` runs against a running topology (``georep up --topology T --data-dir D``), from the
repository root::

    .venv/bin/python bench/topics.py create --data-dir D --bootstrap 127.0.0.1:7101 \
        --sites 127.0.0.1:7201,127.0.0.1:7301 --topics 1000 --partitions 10 --batch 100

``listing`` needs no node: it builds one node's broker and ``NodeService`` in this process, over in-memory
partition logs (no file handle per partition, so 10,000 topics fit any fd limit), and times ``ListTopics``::

    .venv/bin/python bench/topics.py listing --topics 10000 --partitions 1

``create`` measures, in one process through the Python admin client (``georep.client.admin.Admin``):

* ``create``: ``--topics`` topics of ``--partitions`` partitions each at the ``--bootstrap`` site: one
  ``CreateTopic`` call per topic (``--batch 1``), or ``CreateTopics`` calls of ``--batch`` topics each;
* ``reach``: from the first create until every ``--sites`` site lists every one of them (polled with the
  paged ``ListTopics``, definitions only);
* ``list``: one full ``topic list`` (every page, the summary view) at the ``--bootstrap`` site.

``first-use`` runs ``bench/first_use.py`` with the arguments that follow (issue 25: topics created on first
use at a, on a chain a -> b -> c of interest links, and a wildcard subscription at c)::

    .venv/bin/python bench/topics.py first-use --topics 100000 --records 1000000 --parts chain

``listing`` measures, per call, the median of ``--repeats``:

* ``unpaged full``: ``ListTopicsRequest()`` (every topic with every partition's state): what ``topic list`` and
  every topic sync asked before issue 22;
* ``summary, paged``: every page of ``topic list``'s listing (1,000 topics a page), together;
* ``sync, unchanged``: a topic sync's call when nothing changed (``changed_since`` the current token).
"""

from __future__ import annotations

import argparse
import asyncio
import runpy
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from georep.client.admin import Admin, NewTopic
from georep.metadata.store import SiteIdentity
from georep.proto import georep_pb2 as pb
from georep.security.tls import TlsConfig
from georep.server.broker import Broker
from georep.server.metrics import NodeMetrics
from georep.server.service import NodeService
from georep.storage.api import LogConfig
from georep.storage.memory_log import MemoryLog
from topology.ids import SiteId

WAIT_S = 300.0


async def create(admin: Admin, names: list[str], partitions: int, batch: int) -> None:
    if batch <= 1:
        for name in names:
            await admin.create_topic(name, partitions)
        return
    for i in range(0, len(names), batch):
        results = await admin.create_topics([NewTopic(name, partitions) for name in names[i : i + batch]])
        refused = [r for r in results if r.error is not None]
        if refused:
            sys.exit(f"{len(refused)} topics refused, the first: {refused[0].error}")


async def missing_at(admin: Admin, names: set[str]) -> int:
    have = {t.name for t in await admin.list_topics(view="definition")}
    return len(names - have)


async def run(args: argparse.Namespace) -> None:
    tls = TlsConfig.from_dir(args.data_dir / "certs") if not args.insecure else None
    names = [f"{args.prefix}/t{i:05d}" for i in range(args.topics)]
    others = [a for a in args.sites.split(",") if a]
    async with Admin(args.bootstrap, tls=tls) as admin:
        admins = [await Admin(a, tls=tls).start() for a in others]
        try:
            started = time.perf_counter()
            await create(admin, names, args.partitions, args.batch)
            created_s = time.perf_counter() - started
            print(f"create: {args.topics} topics x {args.partitions} partitions in {created_s:.2f} s", flush=True)
            wanted = set(names)
            deadline = started + WAIT_S
            while True:
                left = [await missing_at(a, wanted) for a in admins]
                if not any(left):
                    break
                if time.perf_counter() > deadline:
                    sys.exit(f"after {WAIT_S:.0f} s the other sites still miss {left} topics")
                await asyncio.sleep(0.1)
            print(f"reach: every site has them {time.perf_counter() - started:.2f} s after the first create")
            started = time.perf_counter()
            topics = await admin.list_topics()
            print(f"list: {len(topics)} topics (summary view, every page) in {time.perf_counter() - started:.2f} s")
        finally:
            for a in admins:
                await a.close()


def memory_log(directory: Path, config: LogConfig, now_ms: int) -> MemoryLog:
    return MemoryLog(config)


async def timed(call: Callable[[], Awaitable[Any]], repeats: int) -> float:
    """The median seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def listing(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        broker = Broker(Path(tmp), SiteIdentity(SiteId("a"), 1), open_log=memory_log)
        started = time.perf_counter()
        outcomes = broker.create_topics([(f"t{i:05d}", args.partitions, {}) for i in range(args.topics)])
        assert all(not isinstance(o, Exception) for o in outcomes), next(
            o for o in outcomes if isinstance(o, Exception)
        )
        took = time.perf_counter() - started
        print(f"created {args.topics} topics x {args.partitions} partitions in memory in one call: {took:.2f} s")
        service = NodeService(broker, NodeMetrics(broker))

        async def call(request: pb.ListTopicsRequest) -> pb.ListTopicsResponse:
            return await service.list_topics(request.SerializeToString(), None)  # type: ignore[arg-type]

        async def every_page() -> None:
            token = ""
            while True:
                page = await call(pb.ListTopicsRequest(page_size=1000, page_token=token, view=pb.TOPIC_VIEW_SUMMARY))
                token = page.next_page_token
                if not token:
                    return

        now = (await call(pb.ListTopicsRequest(changed_since="", view=pb.TOPIC_VIEW_DEFINITION))).catalog_token
        unchanged = pb.ListTopicsRequest(changed_since=now, view=pb.TOPIC_VIEW_DEFINITION, page_size=1000)
        full = await timed(lambda: call(pb.ListTopicsRequest()), args.repeats)
        paged = await timed(every_page, args.repeats)
        sync = await timed(lambda: call(unchanged), args.repeats * 10)
        size = len((await call(pb.ListTopicsRequest())).SerializeToString())
        print(f"unpaged full listing (before): {full * 1000:8.1f} ms per call, {size / 1e6:.1f} MB")
        print(f"summary, every page:           {paged * 1000:8.1f} ms")
        answer = len((await call(unchanged)).SerializeToString())
        print(f"sync, nothing changed:         {sync * 1000:8.3f} ms per call, {answer} bytes")
        for p in broker.partitions.values():
            p.log.close()


def main() -> None:
    if sys.argv[1:2] == ["first-use"]:  # issue 25's benchmark: topics created on first use, interest links
        sys.argv = [str(Path(__file__).with_name("first_use.py")), *sys.argv[2:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    create = parts.add_parser("create", help="create topics at a running site; time until every site has them")
    create.add_argument("--bootstrap", required=True, help="a node of the site that creates the topics")
    create.add_argument("--sites", default="", help="a node of each other site, comma-separated")
    create.add_argument("--data-dir", type=Path, default=Path(".georep"), help="the data dir of 'georep up'")
    create.add_argument("--insecure", action="store_true")
    create.add_argument("--topics", type=int, default=1000)
    create.add_argument("--partitions", type=int, default=10)
    create.add_argument("--batch", type=int, default=1, help="topics per CreateTopics call (1: CreateTopic each)")
    create.add_argument("--prefix", default="bench")
    lists = parts.add_parser("listing", help="ListTopics of one node in this process, over in-memory logs")
    lists.add_argument("--topics", type=int, default=10_000)
    lists.add_argument("--partitions", type=int, default=1)
    lists.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args) if args.part == "create" else listing(args))


if __name__ == "__main__":
    main()
