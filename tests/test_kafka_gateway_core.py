"""The Kafka gateway decides nothing the core decides: where a resumed commit starts, what a fetch may hand out and
where offsets by time point are the fetch cursor's (``georep/broker/fetch.py``), as for georep's own RPCs.

The planted-bug tests plant the simulator's bugs of the fetch cursor (``tests/test_sim.py``) and show that the
gateway now meets them: a gateway with its own copy of a decision would not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from georep.broker import fetch
from georep.broker.errors import InternalTopic, NotLeader
from georep.kafka import errors as k
from georep.kafka.cluster import OneNode
from georep.kafka.gateway import Client, KafkaGateway, LeaderRefused, LeaderUnreachable
from georep.kafka.protocol import Request
from georep.proto import georep_pb2 as pb
from georep.proto.convert import vector_to_proto
from georep.record.batch import RecordInput, encode_batch
from georep.server.broker import Broker
from georep.server.groups import GroupService
from georep.server.metrics import NodeMetrics
from georep.server.service import NodeService
from georep.storage.api import PartitionLog, start_offset_for_vector
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId

TOPIC = "t"
CLIENT = "c@127.0.0.1"
PEER = Client("127.0.0.1")
ELSEWHERE = Origin(SiteId("z"), 9)


def batch(n: int, timestamp_ms: int) -> bytes:
    return encode_batch([RecordInput(None, b"v%d" % i, (), timestamp_ms) for i in range(n)])


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A one-node site holding three fsynced batches of two records (offsets 0..5) and, unless a test flushes,
    a fourth batch not yet fsynced (offsets 6..7): its topic fsyncs on an interval."""
    from georep.storage.metadata_file import load_or_create_identity

    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic(TOPIC, 1, {"flush_interval_ms": "60000"})
    for i in range(3):
        b.append(TOPIC, 0, batch(2, 1_000 * (i + 1)))
    b.partition(TOPIC, 0).log.flush()
    b.append(TOPIC, 0, batch(2, 9_000))
    yield b
    b.close()


def gateway(broker: Broker) -> KafkaGateway:
    async def create_topic(name: str, partitions: int, config: dict[str, str]) -> None:
        broker.create_topic(name, partitions, config)

    return KafkaGateway(broker, GroupService(broker), "127.0.0.1", 9092, create_topic)


def log_of(broker: Broker) -> PartitionLog:
    return broker.partition(TOPIC, 0).log


def commit(committed_by: Origin, vector: VectorOffset, hint_offset: int) -> pb.CommittedOffset:
    return pb.CommittedOffset(
        topic=TOPIC,
        partition=0,
        vector=vector_to_proto(vector),
        committed_by=str(committed_by),
        hint_offset=hint_offset,
    )


def check_resume(broker: Broker) -> None:
    """OffsetFetch's answer at this site, for a commit made here and for one made at another site."""
    g, log = gateway(broker), log_of(broker)
    here = broker.origin
    # Made here: the hint is exact in this very log, clamped into it (the tail it pointed into was lost).
    assert g.resume_offset(CLIENT, commit(here, VectorOffset({here: 2}), 2)) == 2
    assert g.resume_offset(CLIENT, commit(here, VectorOffset({here: 8}), 100)) == log.log_end_offset
    # Made at another site: its hint is an offset of another log; the vector alone says where, exactly: record 3
    # is the first it does not cover, inside the batch at 2..3 (the client drops record 2 of the fetched batch).
    vector = VectorOffset({here: 3})
    assert start_offset_for_vector(log, vector.to_dict()) == 2
    assert g.resume_offset(CLIENT, commit(ELSEWHERE, vector, 5)) == 3
    assert not g.filters._filters, "nothing the vector covers lies past 3: a plain reader needs no filter"
    # Covering records this site does not hold yet: they may arrive past the answer, so the client is filtered.
    assert g.resume_offset(CLIENT, commit(ELSEWHERE, VectorOffset({here: 3, ELSEWHERE: 4}), 5)) == 3
    assert g.filters.for_fetch((CLIENT, TOPIC, 0), 3) == VectorOffset({here: 3, ELSEWHERE: 4})


def test_a_resumed_commit_starts_where_a_fetch_cursor_from_it_starts(broker: Broker) -> None:
    check_resume(broker)


def test_a_planted_bug_in_the_fetch_cursors_hint_reaches_the_gateway(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's planted bug (``test_a_planted_bug_in_the_fetch_cursors_hint_is_caught``): a hint used
    whatever log it was taken in."""
    real = fetch.start_position

    def any_hint(log: PartitionLog, start: fetch.FetchStart, own: Origin, exact: bool = False) -> int:
        if isinstance(start, fetch.FromVector) and start.hint_offset >= 0:
            return min(start.hint_offset, log.log_end_offset)
        return real(log, start, own, exact)

    monkeypatch.setattr(fetch, "start_position", any_hint)
    with pytest.raises(AssertionError):
        check_resume(broker)


def fetch_at(g: KafkaGateway, offset: int) -> tuple[int, bytes]:
    """(error code, records) of one partition of a Kafka Fetch at ``offset``."""
    body = SimpleNamespace(
        topics=[
            SimpleNamespace(
                topic=TOPIC, partitions=[SimpleNamespace(partition=0, fetch_offset=offset, partition_max_bytes=1 << 20)]
            )
        ]
    )

    async def once() -> list[object]:  # a read with nothing durable waits for the next fsync: a future of the loop
        return g._fetch_once(body, CLIENT, 1 << 20, PEER)[0]

    topics: list[SimpleNamespace] = asyncio.run(once())  # type: ignore[assignment]
    part = topics[0].partitions[0]
    return part.error_code, bytes(part.records or b"")


def check_fetch(broker: Broker) -> None:
    g = gateway(broker)
    code, records = fetch_at(g, 0)
    assert code == 0 and records, "the durable batches"
    assert fetch_at(g, 6) == (0, b""), "the batch at 6 is not fsynced: a crash may lose it, so it is not served"
    assert fetch_at(g, 9)[0] == k.OFFSET_OUT_OF_RANGE


def test_a_kafka_fetch_hands_out_only_durable_batches_in_range(broker: Broker) -> None:
    check_fetch(broker)


def test_a_planted_bug_in_the_fetch_cursors_durable_rule_reaches_the_gateway(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's planted bug (``test_a_planted_bug_in_the_fetch_cursor_is_caught``): the unflushed tail
    served."""
    monkeypatch.setattr(fetch.FetchCursor, "readable", property(lambda c: c.position < c.log.log_end_offset))
    monkeypatch.setattr(fetch, "durable_part", lambda chunk, next_offset, flushed: (chunk, next_offset))
    with pytest.raises(AssertionError, match="not fsynced"):
        check_fetch(broker)


def test_offsets_by_time_point_only_at_durable_batches_at_both_front_ends(broker: Broker) -> None:
    """One rule (``fetch.offset_for_time``): the batch stamped 9000 is not fsynced, so no durable batch is that
    late. georep's ListOffsets says -1, Kafka's the high watermark (where records that late will be)."""

    async def both(timestamp_ms: int) -> tuple[int, int]:
        service = NodeService(broker, NodeMetrics(broker))
        request = pb.ListOffsetsRequest(topic=TOPIC, partition=0, timestamp_ms=timestamp_ms)
        ours = (await service.list_offsets(request.SerializeToString(), None)).offsets[0].offset  # type: ignore[arg-type]
        body = SimpleNamespace(
            topics=[
                SimpleNamespace(name=TOPIC, partitions=[SimpleNamespace(partition_index=0, timestamp=timestamp_ms)])
            ]
        )
        answer = await gateway(broker)._list_offsets(Request(2, 1, 1, "c", body), PEER)
        return ours, answer.topics[0].partitions[0].offset

    flushed = log_of(broker).flushed_offset
    assert asyncio.run(both(2_000)) == (2, 2)
    assert asyncio.run(both(1_000)) == (0, 0)
    assert asyncio.run(both(9_000)) == (-1, flushed)
    log_of(broker).flush()
    assert asyncio.run(both(9_000)) == (6, 6)


def test_an_offset_by_time_is_the_first_record_stamped_that_late_inside_its_batch(broker: Broker) -> None:
    """Kafka's answer, at both front ends: a batch stamped 20 s, 21 s and 22 s at offsets 8..10 answers 9 for 21 s
    (the batch's base, 8, made a seeking Kafka reader read the record stamped 20 s too)."""
    log = log_of(broker)
    log.flush()
    broker.append(TOPIC, 0, encode_batch([RecordInput(None, b"t%d" % i, (), 20_000 + 1_000 * i) for i in range(3)]))
    log.flush()

    async def both(timestamp_ms: int) -> tuple[int, int]:
        service = NodeService(broker, NodeMetrics(broker))
        request = pb.ListOffsetsRequest(topic=TOPIC, partition=0, timestamp_ms=timestamp_ms)
        ours = (await service.list_offsets(request.SerializeToString(), None)).offsets[0].offset  # type: ignore[arg-type]
        body = SimpleNamespace(
            topics=[
                SimpleNamespace(name=TOPIC, partitions=[SimpleNamespace(partition_index=0, timestamp=timestamp_ms)])
            ]
        )
        answer = await gateway(broker)._list_offsets(Request(2, 1, 1, "c", body), PEER)
        return ours, answer.topics[0].partitions[0].offset

    assert [asyncio.run(both(t)) for t in (20_000, 21_000, 21_500, 22_000)] == [(8, 8), (9, 9), (10, 10), (10, 10)]


def test_earliest_and_latest_are_the_same_offsets_at_both_front_ends(broker: Broker) -> None:
    """One rule (``fetch.listed_offset``): earliest is the log start, latest the high watermark (the flushed
    offset, not the log end: the batch at 6..7 is not fsynced), whichever front end asks."""

    async def both(position: int, kafka_timestamp: int) -> tuple[int, int]:
        service = NodeService(broker, NodeMetrics(broker))
        request = pb.ListOffsetsRequest(topic=TOPIC, partition=0, position=position)  # type: ignore[arg-type]
        ours = (await service.list_offsets(request.SerializeToString(), None)).offsets[0].offset  # type: ignore[arg-type]
        body = SimpleNamespace(
            topics=[
                SimpleNamespace(name=TOPIC, partitions=[SimpleNamespace(partition_index=0, timestamp=kafka_timestamp)])
            ]
        )
        answer = await gateway(broker)._list_offsets(Request(2, 1, 1, "c", body), PEER)
        return ours, answer.topics[0].partitions[0].offset

    log = log_of(broker)
    assert asyncio.run(both(pb.START_EARLIEST, -2)) == (0, 0)
    assert asyncio.run(both(pb.START_LATEST, -1)) == (6, 6) == (log.flushed_offset, log.flushed_offset)
    log.flush()
    assert asyncio.run(both(pb.START_LATEST, -1)) == (8, 8)


def test_neither_front_end_creates_an_internal_topic(broker: Broker) -> None:
    """The rule lives in ``Broker.create_topic`` (as the write rule lives in ``Broker.append``)."""
    body = SimpleNamespace(
        validate_only=False,
        topics=[SimpleNamespace(name="__georep_x", num_partitions=1, replication_factor=-1, configs=[])],
    )
    answer = asyncio.run(gateway(broker)._create_topics(Request(19, 5, 1, "c", body), PEER))
    assert answer.topics[0].error_code == k.INVALID_TOPIC_EXCEPTION and "reserved" in answer.topics[0].error_message

    async def georep_create() -> None:
        request = pb.CreateTopicRequest(name="__georep_x", partitions=1)
        await NodeService(broker, NodeMetrics(broker)).create_topic(request.SerializeToString(), None)  # type: ignore[arg-type]

    with pytest.raises(InternalTopic, match="reserved"):
        asyncio.run(georep_create())
    assert "__georep_x" not in broker.metadata.topics()


@pytest.mark.parametrize(
    ("name", "code"), [("__georep_x", k.INVALID_TOPIC_EXCEPTION), (TOPIC, k.TOPIC_ALREADY_EXISTS), ("ok", 0)]
)
def test_a_validate_only_create_meets_the_same_rules(broker: Broker, name: str, code: int) -> None:
    body = SimpleNamespace(
        validate_only=True, topics=[SimpleNamespace(name=name, num_partitions=1, replication_factor=-1, configs=[])]
    )
    answer = asyncio.run(gateway(broker)._create_topics(Request(19, 5, 1, "c", body), PEER))
    assert answer.topics[0].error_code == code
    assert "ok" not in broker.metadata.topics(), "validate_only creates nothing"


def asking(broker: Broker, leader: KafkaGateway) -> KafkaGateway:
    """A gateway of a multi-node site's node that coordinates groups but leads no partition: it asks ``leader``."""
    coordinator = gateway(broker)

    def not_here(topic: str, index: int) -> object:
        raise NotLeader(topic, index, "another node leads it")

    coordinator.broker = SimpleNamespace(partition=not_here, origin=broker.origin)  # type: ignore[assignment]
    coordinator.view_of = lambda keys: OneNode("127.0.0.1", 9092)

    async def ask(topic: str, index: int, question: pb.KafkaOffsetAsk) -> pb.PartitionOffset:
        return leader.answer_coordinator(topic, index, question)

    coordinator.ask_leader = ask  # type: ignore[method-assign]
    return coordinator


def test_a_coordinator_asks_the_partitions_leader_which_keeps_the_clients_filter(broker: Broker) -> None:
    """A multi-node site (issue 23): the group's coordinator does not lead the partition, so it asks the leader for
    where a commit resumes and for a commit's vector; the leader computes them from its log and keeps the client's
    filter, since the client's fetches go to it."""
    leader = gateway(broker)
    coordinator = asking(broker, leader)
    here = broker.origin
    ahead = VectorOffset({here: 3, ELSEWHERE: 4})  # ELSEWHERE's records are still to come here: filtered

    async def run() -> tuple[int, tuple[int, VectorOffset]]:
        resumed = await coordinator._resume_offset(CLIENT, commit(ELSEWHERE, ahead, 5))
        return resumed, await coordinator._commit_vector(CLIENT, TOPIC, 0, 4)

    resumed, (offset, vector) = asyncio.run(run())
    assert resumed == 3
    assert leader.filters.for_fetch((CLIENT, TOPIC, 0), 3) == ahead and not coordinator.filters._filters
    assert (offset, vector) == (4, VectorOffset({here: 4, ELSEWHERE: 4})), "what the filter skipped stays covered"

    async def unreachable(topic: str, index: int, question: pb.KafkaOffsetAsk) -> pb.PartitionOffset:
        raise ConnectionError("node 2 is down")

    coordinator.ask_leader = unreachable
    with pytest.raises(LeaderUnreachable, match="did not answer") as unreached:  # retriable, never a guessed vector
        asyncio.run(coordinator._commit_vector(CLIENT, TOPIC, 0, 4))
    assert coordinator._code(unreached.value) == k.COORDINATOR_LOAD_IN_PROGRESS

    async def below_start(topic: str, index: int, question: pb.KafkaOffsetAsk) -> pb.PartitionOffset:
        raise LeaderRefused(k.OFFSET_OUT_OF_RANGE, "offset 0 is below the log start 5")

    coordinator.ask_leader = below_start
    with pytest.raises(LeaderRefused) as refused:  # what the client must hear is passed on, not retried
        asyncio.run(coordinator._commit_vector(CLIENT, TOPIC, 0, 0))
    assert coordinator._code(refused.value) == k.OFFSET_OUT_OF_RANGE
