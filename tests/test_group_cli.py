"""``georep consume --group``, ``georep group list|describe`` and geo acks from the CLI, on real nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from georep.proto import georep_pb2 as pb
from georep.server.process import NodeProcess
from tests.support.cli import georep, ok
from tests.support.sites import Sites, converged, wait_until

TOPIC = "t"


def produce(bootstrap: str, values: list[str], *extra: str) -> None:
    ok(
        georep(
            "produce",
            TOPIC,
            "--bootstrap",
            bootstrap,
            "--linger-ms",
            "0",
            "--batch-size",
            "16",
            *extra,
            stdin="".join(v + "\n" for v in values).encode(),
        )
    )


def vectors(bootstrap: str) -> dict[int, str]:
    described = json.loads(ok(georep("topic", "describe", TOPIC, "--json", "--bootstrap", bootstrap)))
    return {p["partition"]: p["vector"] for p in described["partition_states"]}


def describe(bootstrap: str, group: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(georep("group", "describe", group, "--json", "--bootstrap", bootstrap)))  # type: ignore[no-any-return]


@pytest.mark.slow  # two consumers of a group, each waiting out its idle timeout (11 s)
def test_consume_group_twice_continues_where_the_first_left(node: NodeProcess) -> None:
    b = node.address
    ok(georep("topic", "create", TOPIC, "--partitions", "2", "--bootstrap", b))
    values = [f"v{i}" for i in range(10)]
    produce(b, values)
    first = ok(georep("consume", TOPIC, "--group", "g", "--from-beginning", "--max", "4", "--bootstrap", b))
    # --from-beginning only applies where the group has no commit: the second run continues.
    second = ok(georep("consume", TOPIC, "--group", "g", "--from-beginning", "--timeout", "2", "--bootstrap", b))
    assert len(first.splitlines()) == 4
    assert sorted(first.splitlines() + second.splitlines()) == sorted(values), "a record twice, or never"
    assert ok(georep("consume", TOPIC, "--group", "g", "--timeout", "1", "--bootstrap", b)) == ""

    listing = ok(georep("group", "list", "--bootstrap", b)).splitlines()
    assert listing[0].split() == ["GROUP", "MEMBERS", "GENERATION", "ASSIGNOR", "PARTITIONS", "LAG"]
    row = listing[1].split()
    assert row[0] == "g" and row[1] == "0" and row[3:] == ["range", "2", "0"]

    # The committed vectors are what the site holds; new records are the lag, exactly.
    held = vectors(b)
    produce(b, ["n0", "n1", "n2"], "--partition", "0")
    d = describe(b, "g")
    assert d["group"] == "g" and d["members"] == [] and d["site"].startswith("a@")
    by_partition = {c["partition"]: c for c in d["offsets"]}
    assert {p: c["vector"] for p, c in by_partition.items()} == held
    assert {p: c["lag_records"] for p, c in by_partition.items()} == {0: 3, 1: 0}
    assert all(
        c["committed_by"] == d["site"] and c["committed_at"].endswith("Z") and c["hlc"] > 0 for c in d["offsets"]
    )
    listed = json.loads(ok(georep("group", "list", "--json", "--bootstrap", b)))
    assert listed["groups"] == [
        {
            "group": "g",
            "members": 0,
            "generation": listed["groups"][0]["generation"],
            "assignor": "range",
            "committed_partitions": 2,
            "lag_records": 3,
        }
    ]
    text = ok(georep("group", "describe", "g", "--bootstrap", b)).splitlines()
    assert text[0].startswith(f"Group: g  Site: {d['site']}")
    commit_rows = [line.split() for line in text if line.startswith(f"{TOPIC} ")]
    assert [(r[1], r[2], r[-1]) for r in commit_rows] == [("0", held[0], "3"), ("1", held[1], "0")]

    again = ok(georep("consume", TOPIC, "--group", "g", "--timeout", "1", "--bootstrap", b))
    assert again.split() == ["n0", "n1", "n2"]


@pytest.mark.slow
def test_describe_shows_a_running_member_and_its_assignment(node: NodeProcess) -> None:
    b = node.address
    ok(georep("topic", "create", TOPIC, "--partitions", "3", "--bootstrap", b))
    produce(b, ["x", "y"])
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "georep.cli",
            "consume",
            TOPIC,
            "--group",
            "live",
            "--from-beginning",
            "--timeout",
            "20",  # it must still be a member when the describes below run, under a heavy load too
            "--bootstrap",
            b,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as consumer:
        try:
            wait_until("the consumer joins", lambda: _known(b, "live") and describe(b, "live")["members"], 15)
            d = describe(b, "live")
            [member] = d["members"]
            assert member["assignment"] == {TOPIC: [0, 1, 2]}
            assert 0 <= member["last_heartbeat_age_ms"] < 10_000
            row = ok(georep("group", "list", "--bootstrap", b)).splitlines()[1].split()
            assert row[:2] == ["live", "1"] and row[2] != "0"
            text = ok(georep("group", "describe", "live", "--bootstrap", b))
            assert member["member_id"] in text and f"{TOPIC}/0,1,2" in text
            out, err = consumer.communicate(timeout=60)
        finally:
            consumer.kill()
    assert consumer.returncode == 0, err.decode()
    assert sorted(out.split()) == [b"x", b"y"]
    d = describe(b, "live")
    assert d["members"] == [], "a consumer that exits leaves its group"
    assert sum(c["lag_records"] for c in d["offsets"]) == 0 and len(d["offsets"]) == 3


def _known(bootstrap: str, group: str) -> bool:
    return georep("group", "describe", group, "--bootstrap", bootstrap).returncode == 0


def test_group_errors_are_one_line(node: NodeProcess) -> None:
    b = node.address
    assert ok(georep("group", "list", "--bootstrap", b)).startswith("no consumer groups at site a@")
    assert json.loads(ok(georep("group", "list", "--json", "--bootstrap", b)))["groups"] == []
    unknown = georep("group", "describe", "nope", "--bootstrap", b)
    assert unknown.returncode == 1
    assert unknown.stderr.decode().splitlines() == [
        "georep: error: unknown group 'nope' at site a: no members and no commits here "
        "(list groups with 'georep group list')"
    ]
    for action in (("list",), ("describe", "g")):
        dead = georep("group", *action, "--bootstrap", "127.0.0.1:1")
        assert dead.returncode == 1
        assert dead.stderr.decode().splitlines() == [
            "georep: error: cannot reach georep node at 127.0.0.1:1 (connection refused): "
            "is it running? check --bootstrap"
        ]
    malformed = georep("group", "list", "--bootstrap", "nonsense")
    assert malformed.returncode == 2 and "invalid bootstrap address 'nonsense'" in malformed.stderr.decode()
    assert georep("group").returncode == 2
    assert georep("group", "describe").returncode == 2

    ok(georep("topic", "create", TOPIC, "--partitions", "1", "--bootstrap", b))
    for args, message in (
        (("--group", "g", "--partition", "0"), "--group starts at the group's committed vector"),
        (("--commit-acks", "geo:2"), "--commit-acks needs --group"),
        (("--group", "g", "--commit-acks", "most"), "invalid acks 'most'"),
    ):
        result = georep("consume", TOPIC, *args, "--timeout", "1", "--bootstrap", b)
        err = result.stderr.decode()
        assert result.returncode == 1 and err.startswith("georep: error: ") and message in err, err
        assert len(err.splitlines()) == 1


@pytest.mark.slow
def test_geo_commits_resume_at_another_site_and_geo_acks_time_out(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")])
    sites.start()
    a, b = sites.address("a"), sites.address("b")
    ok(georep("topic", "create", TOPIC, "--partitions", "2", "--bootstrap", a))
    values = [f"v{i}" for i in range(12)]
    produce(a, values, "--acks", "geo:2")
    wait_until("b holds every record", lambda: converged(sites, ["a", "b"], TOPIC, 12), 20)

    first = ok(
        georep(
            "consume",
            TOPIC,
            "--group",
            "g",
            "--from-beginning",
            "--max",
            "5",
            "--commit-acks",
            "geo:2",
            "--bootstrap",
            a,
            timeout=60,
        )
    ).splitlines()
    # geo:2: the commit is at b when the command returns.
    at_b = describe(b, "g")
    assert at_b["site"].startswith("b@") and at_b["members"] == []
    assert all(c["committed_by"].startswith("a@") for c in at_b["offsets"])
    assert sum(c["lag_records"] for c in at_b["offsets"]) == 7
    rest = ok(georep("consume", TOPIC, "--group", "g", "--from-beginning", "--timeout", "2", "--bootstrap", b))
    assert sorted(first + rest.splitlines()) == sorted(values), "resuming at another site: a record twice, or never"
    wait_until(
        "b's final commit reaches a", lambda: sum(c["lag_records"] for c in describe(a, "g")["offsets"]) == 0, 20
    )

    sites.stub("b").SetLink(pb.SetLinkRequest(src="a", enabled=False), timeout=5)
    started = time.monotonic()
    result = georep(
        "produce",
        TOPIC,
        "--acks",
        "geo:2",
        "--request-timeout-ms",
        "1500",
        "--partition",
        "0",
        "--bootstrap",
        a,
        stdin=b"stays\n",
    )
    err = result.stderr.decode()
    assert result.returncode == 1 and time.monotonic() - started < 20
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("georep: error: 1 of 1 records to 't' failed: acks=geo:2 not reached within 1500 ms"), err
    assert sum(int(v.rsplit(":", 1)[1]) for v in vectors(a).values()) == 13, "the write stays at the origin"
    sites.stub("b").SetLink(pb.SetLinkRequest(src="a", enabled=True), timeout=5)
    wait_until("it replicates once the link heals", lambda: converged(sites, ["a", "b"], TOPIC, 13), 20)
