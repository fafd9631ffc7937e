"""Deleting and resetting a group's positions (issue 23): ``georep group reset-offsets|delete``, and Kafka's
DeleteGroups and OffsetDelete, on a one-node site with its Kafka listener. Both front ends resume from a reset
position: georep's own consumer and confluent-kafka's."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from georep.proto import georep_pb2 as pb
from georep.server.process import NodeProcess
from offsets.commits import OFFSETS_TOPIC
from tests.support.cli import georep, ok
from tests.support.kafka_nodes import KAFKA_ARGS, group_reads, kafka_address, read_frame
from tests.support.sites import Sites, converged, wait_until

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka = pytest.importorskip("kafka")

from confluent_kafka.admin import AdminClient  # noqa: E402

pytestmark = pytest.mark.slow  # a node process, a Kafka client and CLI processes: about a minute

TOPIC = "resets"
NON_EMPTY_GROUP = 68
GROUP_ID_NOT_FOUND = 69
GROUP_SUBSCRIBED_TO_TOPIC = 86


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    started = NodeProcess(site="a", data_dir=Path(tmp_path_factory.mktemp("gadmin")) / "node", extra_args=KAFKA_ARGS)
    started.start()
    ok(georep("topic", "create", TOPIC, "--partitions", "1", "--bootstrap", started.address))
    yield started
    started.kill9()


def produce(node: NodeProcess, values: list[str]) -> None:
    stdin = "".join(v + "\n" for v in values).encode()
    ok(georep("produce", TOPIC, "--bootstrap", node.address, "--linger-ms", "0", stdin=stdin))


def georep_reads(node: NodeProcess, group: str) -> list[str]:
    out = ok(
        georep("consume", TOPIC, "--group", group, "--from-beginning", "--timeout", "2", "--bootstrap", node.address)
    )
    return out.splitlines()


def kafka_reads(node: NodeProcess, group: str, n: int) -> list[str]:
    return group_reads(kafka_address(node), TOPIC, group, n, wait_s=30, idle_s=6)


def reset(node: NodeProcess, group: str, *to: str) -> str:
    return ok(georep("group", "reset-offsets", group, "--topic", TOPIC, *to, "--bootstrap", node.address))


def test_reset_offsets_moves_both_front_ends_and_dry_run_changes_nothing(node: NodeProcess) -> None:
    early = [f"e{i}" for i in range(6)]
    produce(node, early)
    between = datetime.now(UTC).isoformat()  # after every early record's timestamp: the produce returned
    late = [f"l{i}" for i in range(4)]
    produce(node, late)
    assert georep_reads(node, "g1") == early + late

    plan = reset(node, "g1", "--to-earliest", "--dry-run")
    assert "PARTITION  OLD-POSITION  NEW-POSITION" in plan and "dry run" in plan
    assert georep_reads(node, "g1") == [], "a dry run changed the position"

    reset(node, "g1", "--to-earliest", "--execute")
    assert georep_reads(node, "g1") == early + late, "georep's consumer did not resume from the reset position"

    reset(node, "g1", "--to-datetime", between)
    assert kafka_reads(node, "g1", len(late)) == late, "a Kafka consumer did not resume from the reset position"

    vector = reset(node, "g1", "--to-earliest", "--dry-run").splitlines()[2].split()[1]  # the old position: the end
    reset(node, "g1", "--to-earliest")
    reset(node, "g1", "--to-vector", f'"{vector}"')
    assert georep_reads(node, "g1") == []
    reset(node, "g1", "--to-earliest")
    reset(node, "g1", "--to-latest")
    assert kafka_reads(node, "g1", 0) == []


def test_resets_and_deletes_are_refused_while_the_group_has_members(node: NodeProcess) -> None:
    produce(node, ["x"])
    consumer = confluent_kafka.Consumer({"bootstrap.servers": kafka_address(node), "group.id": "busy"})
    consumer.subscribe([TOPIC])
    admin = AdminClient({"bootstrap.servers": kafka_address(node)})
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.2)
        consumer.commit(offsets=[confluent_kafka.TopicPartition(TOPIC, 0, 0)], asynchronous=False)
        for action in (["reset-offsets", "busy", "--topic", TOPIC, "--to-earliest"], ["delete", "busy"]):
            result = georep("group", *action, "--bootstrap", node.address)
            err = result.stderr.decode()
            assert result.returncode == 1 and "active member" in err and "stop its consumers" in err, err
        with pytest.raises(confluent_kafka.KafkaException) as refused:
            admin.delete_consumer_groups(["busy"])["busy"].result(15)
        assert refused.value.args[0].code() == NON_EMPTY_GROUP
        offset_delete = kafka.protocol.consumer.OffsetDeleteRequest(
            version=0, group_id="busy", topics=[(TOPIC, [(0,)])]
        )
        answer = exchange(kafka_address(node), offset_delete, kafka.protocol.consumer.OffsetDeleteResponse)
        assert answer.topics[0].partitions[0].error_code == GROUP_SUBSCRIBED_TO_TOPIC
    finally:
        consumer.close()


def test_delete_groups_and_offset_delete_forget_the_position(node: NodeProcess) -> None:
    produce(node, ["y"])
    admin = AdminClient({"bootstrap.servers": kafka_address(node)})
    for group in ("gone", "gone2", "gone3"):
        reset(node, group, "--to-latest")
    admin.delete_consumer_groups(["gone"])["gone"].result(15)
    unknown = georep("group", "describe", "gone", "--bootstrap", node.address)
    assert unknown.returncode == 1 and "unknown group" in unknown.stderr.decode()
    with pytest.raises(confluent_kafka.KafkaException) as missing:
        admin.delete_consumer_groups(["gone"])["gone"].result(15)
    assert missing.value.args[0].code() == GROUP_ID_NOT_FOUND

    offset_delete = kafka.protocol.consumer.OffsetDeleteRequest(version=0, group_id="gone2", topics=[(TOPIC, [(0,)])])
    answer = exchange(kafka_address(node), offset_delete, kafka.protocol.consumer.OffsetDeleteResponse)
    assert (answer.error_code, answer.topics[0].partitions[0].error_code) == (0, 0)
    assert "unknown group" in georep("group", "describe", "gone2", "--bootstrap", node.address).stderr.decode()

    assert "deleted group 'gone3'" in ok(georep("group", "delete", "gone3", "--bootstrap", node.address))
    assert "y" in georep_reads(node, "gone3"), "after a delete the group starts afresh (from the beginning)"


def exchange(address: str, request: object, response_cls: object) -> object:
    import socket

    request.with_header(correlation_id=1, client_id="raw")  # type: ignore[attr-defined]
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(bytes(request.encode(header=True, framed=True)))  # type: ignore[attr-defined]
        return response_cls.decode(read_frame(sock), version=request.API_VERSION, header=True)  # type: ignore[attr-defined]


def test_a_delete_reaches_every_site_and_an_older_commit_from_another_site_does_not_undo_it(
    make_sites: Callable[..., Sites],
) -> None:
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")])
    sites.start()
    a, b = sites.address("a"), sites.address("b")
    ok(georep("topic", "create", "t", "--partitions", "1", "--bootstrap", a))
    ok(georep("produce", "t", "--bootstrap", a, "--acks", "geo:2", stdin=b"r0\nr1\nr2\n"))
    ok(georep("group", "reset-offsets", "g", "--topic", "t", "--to-latest", "--bootstrap", a))
    wait_until("a's commit reaches b", lambda: known(b, "g"), 20)

    # b commits while a does not hear from it; a's delete comes later, with a larger stamp. When b's older
    # commit reaches a afterwards, it must not bring the position back, at a or at b.
    sites.stub("a").SetLink(pb.SetLinkRequest(src="b", enabled=False), timeout=5)
    ok(georep("group", "reset-offsets", "g", "--topic", "t", "--to-earliest", "--bootstrap", b))
    ok(georep("group", "delete", "g", "--bootstrap", a))
    assert not known(a, "g")
    wait_until("the delete reaches b", lambda: not known(b, "g"), 20)
    sites.stub("a").SetLink(pb.SetLinkRequest(src="b", enabled=True), timeout=5)
    wait_until("b's older commit reaches a", lambda: converged(sites, ["a", "b"], OFFSETS_TOPIC), 20)
    assert not known(a, "g") and not known(b, "g"), "an older commit brought a deleted position back"


def known(bootstrap: str, group: str) -> bool:
    result = georep("group", "describe", group, "--bootstrap", bootstrap)
    assert result.returncode == 0 or "unknown group" in result.stderr.decode(), result.stderr.decode()
    return result.returncode == 0
