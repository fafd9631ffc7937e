"""The ``georep`` command against a real node, as a user runs it."""

from __future__ import annotations

import json

import pytest

from georep.client import key_partition
from georep.server.process import NodeProcess
from tests.support.cli import georep, ok


def test_topic_create_list_describe(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    assert "created topic 'orders' with 3 partitions" in ok(
        georep("topic", "create", "orders", "--partitions", "3", "--config", "retention_ms=3600000", *b)
    )
    listing = ok(georep("topic", "list", *b))
    assert listing.splitlines()[0].split() == ["TOPIC", "PARTITIONS", "RECORDS"]
    assert listing.splitlines()[1].split() == ["orders", "3", "0"]
    described = ok(georep("topic", "describe", "orders", *b))
    assert "Partitions: 3" in described and "retention_ms=3600000" in described
    as_json = json.loads(ok(georep("topic", "describe", "orders", "--json", *b)))
    assert as_json["name"] == "orders" and as_json["partitions"] == 3
    assert [p["partition"] for p in as_json["partition_states"]] == [0, 1, 2]
    # the environment variable is the default bootstrap
    assert "orders" in ok(georep("topic", "list", env={"GEOREP_BOOTSTRAP": node.address}))


def test_produce_with_key_separator_then_consume_json(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    ok(georep("topic", "create", "events", "--partitions", "2", *b))
    lines = b"k1:v1\nk2:v:2\nno-key-line\n:empty-key\nk3:\xff\xfe\n"
    result = georep("produce", "events", "--key-separator", ":", "--compression", "zstd", *b, stdin=lines)
    ok(result)
    assert "produced 5 records" in result.stderr.decode()
    out = ok(georep("consume", "events", "--from-beginning", "--json", "--max", "5", "--timeout", "5", *b))
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 5
    for r in records:
        assert set(r) == {"topic", "key", "value", "partition", "offset", "origin", "origin_seq", "timestamp"}
        assert r["topic"] == "events"
        assert r["origin"].startswith("a@")
        if r["key"] is not None:
            assert r["partition"] == key_partition(r["key"].encode(), 2)
    pairs = sorted((r["key"] or "", r["value"]) for r in records)
    assert pairs == sorted(
        [("k1", "v1"), ("k2", "v:2"), ("", "no-key-line"), ("", "empty-key"), ("k3", "\ufffd\ufffd")]
    )
    assert sum(1 for r in records if r["key"] is None) == 1  # "no-key-line" has no separator: null key

    raw_by_key = {"k1": b"v1", "k2": b"v:2", None: b"no-key-line", "": b"empty-key", "k3": b"\xff\xfe"}
    raw = georep("consume", "events", "--from-beginning", "--timeout", "1", "--partition", "0", *b)
    assert raw.returncode == 0, raw.stderr.decode()
    expected = sorted(raw_by_key[r["key"]] for r in records if r["partition"] == 0)
    assert sorted(raw.stdout.splitlines()) == expected


@pytest.mark.slow  # consumes that wait out their --timeout (7 s)
def test_consume_offset_vector_and_timeout(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    ok(georep("topic", "create", "one", "--partitions", "1", *b))
    ok(
        georep(
            "produce",
            "one",
            "--linger-ms",
            "0",
            "--batch-size",
            "64",
            *b,
            stdin=b"".join(b"line-%d\n" % i for i in range(10)),
        )
    )
    out = ok(georep("consume", "one", "--offset", "4", "--partition", "0", "--timeout", "1", *b))
    assert out.splitlines() == [f"line-{i}" for i in range(4, 10)]
    first = json.loads(ok(georep("consume", "one", "--from-beginning", "--json", "--max", "1", *b)))
    vector = f"{first['origin']}:7"
    out = ok(georep("consume", "one", "--vector", vector, "--timeout", "1", *b))
    assert out.splitlines() == ["line-7", "line-8", "line-9"]
    # without --from-beginning the console consumer starts at the end
    assert ok(georep("consume", "one", "--timeout", "1", *b)) == ""
    offsets = ok(georep("offsets", "one", *b))
    assert offsets.splitlines()[1].split()[:2] == ["0", "10"]
    assert ok(georep("health", *b)).startswith("SERVING site=a")


def test_dead_address_prints_one_clear_line() -> None:
    for args in (("topic", "list"), ("produce", "t"), ("consume", "t"), ("health",)):
        result = georep(*args, "--bootstrap", "127.0.0.1:1")
        err = result.stderr.decode()
        assert result.returncode == 1
        assert "Traceback" not in err
        assert err.strip().splitlines() == [
            "georep: error: cannot reach georep node at 127.0.0.1:1 (connection refused): "
            "is it running? check --bootstrap"
        ]


def test_unknown_topic(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    for args in (("consume", "missing", "--timeout", "1"), ("topic", "describe", "missing")):
        result = georep(*args, *b)
        err = result.stderr.decode()
        assert result.returncode == 1 and "Traceback" not in err
        assert err.startswith("georep: error:") and "missing" in err and len(err.strip().splitlines()) == 1
    result = georep("produce", "missing", *b, stdin=b"x\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr.decode()
    assert "missing" in result.stderr.decode()


def test_bad_arguments_are_usage_errors() -> None:
    result = georep("consume", "t", "--vector", "nonsense", "--bootstrap", "127.0.0.1:1")
    assert result.returncode == 1 and "invalid vector offset" in result.stderr.decode()
    result = georep("produce", "t", "--acks", "some", "--bootstrap", "127.0.0.1:1")
    assert result.returncode == 1 and "invalid acks" in result.stderr.decode()


def test_a_line_over_the_topics_limit_fails_at_once_with_the_limit_named(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    ok(georep("topic", "create", "small", "--partitions", "1", "--config", "max_batch_bytes=1024", *b))
    # the limit is checked before sending: no wait for the delivery timeout, no "unreachable"
    result = georep("produce", "small", *b, stdin=b"fits\n" + b"x" * 5000 + b"\n", timeout=20)
    assert result.returncode == 1
    err = result.stderr.decode()
    assert "max_batch_bytes=1024 of topic 'small'; nothing was sent" in err and "unreachable" not in err
    assert "1 of 2 records" in err
