"""Creating many topics at once (``CreateTopics``, and a topic sync that learns many) without holding the node.

A one-node site creates topics on the event loop (its partitions join the broker's tables there), and each
partition costs a directory, files and fsyncs (most of it ``SegmentLog.open``'s recovery point): a thousand topics
in one go would hold the node's links and clients for seconds. So they go in steps of about
:data:`STEP_PARTITIONS` partitions (one write of the topic table each), and what waits on the loop runs between
steps. A multi-node site's are Raft commands, made in a worker thread.

Leaving the loop free for as long as each step took (half the loop for creates) was measured worse, not better:
every step changes the partitions a link may pull, and each change reopens its streams with every partition
(``PullSession._check_wants``), so more steps that the loop notices cost more reopens (bench/topics.py, 1,000
topics of 5 partitions: 89 s to create instead of 14-24 s).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from concurrent.futures import Executor

from georep.metadata.topics import TopicSpec
from georep.server.broker import Broker

STEP_PARTITIONS = 64

TopicRequest = tuple[str, int, dict[str, str]]  # name, partitions, config overrides


async def create_topics(
    broker: Broker, requests: Sequence[TopicRequest], *, internal: bool = False, executor: Executor | None = None
) -> list[TopicSpec | Exception]:
    """What :meth:`Broker.create_topics` answers, for every request, in their order."""
    loop = asyncio.get_running_loop()
    if broker.in_site:
        call = functools.partial(broker.create_topics, list(requests), internal=internal)
        return await loop.run_in_executor(executor, call)
    out: list[TopicSpec | Exception] = []
    step: list[TopicRequest] = []
    partitions = 0
    for request in requests:
        step.append(request)
        partitions += max(request[1], 1)
        if partitions >= STEP_PARTITIONS:
            out += broker.create_topics(step, internal=internal)
            step, partitions = [], 0
            await asyncio.sleep(0)
    if step:
        out += broker.create_topics(step, internal=internal)
    return out
