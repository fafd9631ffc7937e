"""The consumer's parts without a node (aiokafka's split): the subscription state, and what the fetcher hands to
``poll``; and the rule that keeps each part small."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import georep.client
from georep.client.connection import Connection
from georep.client.errors import InvalidData, InvalidRequest
from georep.client.fetched import ConsumerRecord
from georep.client.fetcher import Fetcher, FetchOptions
from georep.client.subscription import Chunk, Start, SubscriptionState
from offsets.coordinates import LocalOffset, Origin, OriginSeq
from offsets.vector import VectorOffset
from topology.ids import SiteId

A = Origin(SiteId("a"), 1)
FUNCTION_LINES_MAX = 80


def record(offset: int, seq: int, partition: int = 0) -> ConsumerRecord:
    return ConsumerRecord("t", partition, LocalOffset(offset), A, OriginSeq(seq), 0, None, b"v", ())


def test_a_seek_before_the_subscription_resolves_applies_to_the_partitions_it_finds() -> None:
    s = SubscriptionState("latest", 4)
    s.subscribe(["t"])
    s.seek_all(None, Start("earliest"))
    assert s.add(("t", 0)).start == Start("earliest")
    s.assign([("u", 1)])
    assert list(s.states) == [("u", 1)] and not s.subscribed


def test_at_another_site_a_partition_goes_on_from_the_vector_of_what_was_consumed() -> None:
    async def main() -> None:
        s = SubscriptionState("earliest", 4)
        state = s.add(("t", 0), Start("vector", -1, VectorOffset({A: 2})))
        state.consumed = {A: 5}
        state.position = 9
        await state.queue.put(Chunk([record(9, 5)], 10))  # fetched, not returned: the other site sends it again
        start = s.vector_start(state)
        assert start == Start("vector", -1, VectorOffset({A: 5}))
        assert state.queue.empty() and state.position is None and state.vector() == VectorOffset({A: 5})
        fresh = s.add(("t", 1), Start("offset", 7))
        assert s.vector_start(fresh) == Start("earliest"), "a local offset means nothing at another site"

    asyncio.run(main())


def test_poll_gets_the_records_before_an_error_then_the_error() -> None:
    async def main() -> None:
        s = SubscriptionState("earliest", 4)
        state = s.add(("t", 0), Start("offset", 0))
        fetcher = Fetcher(s, Connection("127.0.0.1:1"), FetchOptions())
        await fetcher.put(state, Chunk([record(0, 0), record(1, 1)], 2))
        await fetcher.put(state, Chunk([], 2, InvalidData("bad batch at 2")))
        assert [r.offset for r in fetcher.take(10)] == [0, 1]
        assert state.position == 2 and state.vector() == VectorOffset({A: 2})
        with pytest.raises(InvalidData, match="bad batch"):  # the next poll: not lost between two polls
            fetcher.take(10)
        assert fetcher.take(10) == [] and state.current is None
        s.add(("t", 1), Start("none"))
        with pytest.raises(InvalidRequest, match="auto_offset_reset='none'"):
            fetcher.start()

    asyncio.run(main())


def test_no_function_of_the_client_is_longer_than_a_screen() -> None:
    """The consumer's 110-line fetch loop was the reason for the split (issue 21)."""
    long = []
    for path in sorted(Path(georep.client.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert not long, long
