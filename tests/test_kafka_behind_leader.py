"""A node of a multi-node site whose log of a partition ends below a Kafka client's offset (a deposed leader not
detached yet, or a coordinator's stale view of who leads) must not answer for it: it would store a commit lower than
the one the client was told succeeded, or resume a commit below its hint, and the group would read again records
that commit covered. It refuses a commit, retriably (the coordinator asks the leader again), and answers a hint of
its own site as is. A one-node site's log is the partition, so there a commit past its end still stops at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.kafka import errors as k
from georep.kafka.cluster import OneNode
from georep.kafka.gateway import LeaderUnreachable
from georep.server.broker import Broker
from offsets.vector import VectorOffset
from tests.test_kafka_gateway_core import CLIENT, TOPIC, asking, batch, commit, gateway

END = 8  # the log holds offsets 0..7


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    from georep.storage.metadata_file import load_or_create_identity

    b = Broker(tmp_path, load_or_create_identity(tmp_path, "a", 1))
    b.create_topic(TOPIC, 1, {})
    for i in range(4):
        b.append(TOPIC, 0, batch(2, 1_000 * (i + 1)))
    yield b
    b.close()


def behind(broker: Broker) -> tuple[object, object]:
    """(a coordinator that does not lead the partition, the behind node it asks as its leader)."""
    stale = gateway(broker)
    stale.view_of = lambda keys: OneNode("127.0.0.1", 9092)  # a multi-node site's gateway has a view
    return asking(broker, stale), stale


def test_a_node_behind_the_clients_offset_refuses_its_commit_rather_than_storing_less(broker: Broker) -> None:
    coordinator, _ = behind(broker)
    with pytest.raises(LeaderUnreachable, match="past the end") as refused:
        asyncio.run(coordinator._commit_vector(CLIENT, TOPIC, 0, END + 10))  # type: ignore[attr-defined]
    assert coordinator._code(refused.value) == k.COORDINATOR_LOAD_IN_PROGRESS  # type: ignore[attr-defined]
    offset, _vector = asyncio.run(coordinator._commit_vector(CLIENT, TOPIC, 0, END))  # type: ignore[attr-defined]
    assert offset == END


def test_a_node_behind_a_commits_hint_resumes_it_at_the_hint_not_below(broker: Broker) -> None:
    coordinator, stale = behind(broker)
    ahead = commit(broker.origin, VectorOffset({broker.origin: END + 10}), END + 10)
    assert asyncio.run(coordinator._resume_offset(CLIENT, ahead)) == END + 10  # type: ignore[attr-defined]
    assert not stale.filters._filters  # type: ignore[attr-defined]


def test_a_one_node_site_still_stops_a_commit_past_its_end_at_the_end(broker: Broker) -> None:
    offset, _vector = gateway(broker).commit_vector(CLIENT, TOPIC, 0, END + 10)
    assert offset == END
