"""Creating many topics at once (``CreateTopics``, and a topic sync that learns many) without holding the node.

A one-node site's topic costs a directory, files and fsyncs per partition (most of it ``SegmentLog.open``'s
recovery point): a thousand topics made on the event loop held a node for seconds, and a site that learnt them
all in one topic sync stopped answering (``DEADLINE_EXCEEDED`` on ``georep topic list``) and its links went down
("no message from b for 5000 ms"). So they are made in steps of about :data:`STEP_PARTITIONS` partitions: each
step's files are made in a worker thread (``Broker.open_new_topics``: no table of the broker's is touched there,
and the names are reserved meanwhile), and the step is then served and written to the topic table at once, on the
loop (``Broker.serve_new_topics``: one write of the table per step). A multi-node site's are Raft commands, made in
a worker thread.

Leaving the loop to the rest of the node for as long as each step took, with the files made on the loop, was
measured worse: every step changes the partitions a link may pull, and each change reopens its streams with every
partition (``PullSession._check_wants``), so more steps cost more reopens (bench/topics.py, 1,000 topics of 5
partitions: 89 s to create instead of 14-24 s).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from concurrent.futures import Executor

from georep.metadata.topics import TopicSpec
from georep.server.broker import Broker, NewTopics

STEP_PARTITIONS = 256

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
    for i, request in enumerate(requests):
        step.append(request)
        partitions += max(request[1], 1)
        if partitions >= STEP_PARTITIONS or i == len(requests) - 1:
            out += await _create_step(broker, step, internal, executor)
            step, partitions = [], 0
    return out


async def _create_step(
    broker: Broker, requests: list[TopicRequest], internal: bool, executor: Executor | None
) -> list[TopicSpec | Exception]:
    outcomes, specs = broker.check_new_topics(requests, internal=internal)
    broker.creating.update(s.name for s in specs)  # another create of these names is refused meanwhile
    made = asyncio.get_running_loop().run_in_executor(executor, broker.open_new_topics, specs)
    try:
        new = await asyncio.shield(made)
    except asyncio.CancelledError:  # the caller left: the files are made all the same, so finish the creates
        made.add_done_callback(functools.partial(_finish_late, broker, specs))
        raise
    except BaseException:
        broker.creating.difference_update(s.name for s in specs)
        raise
    failed = broker.serve_new_topics(new)
    return [failed.get(o.name, o) if isinstance(o, TopicSpec) else o for o in outcomes]


def _finish_late(broker: Broker, specs: list[TopicSpec], made: asyncio.Future[NewTopics]) -> None:
    if made.cancelled() or made.exception() is not None:
        broker.creating.difference_update(s.name for s in specs)
    else:
        broker.serve_new_topics(made.result())
