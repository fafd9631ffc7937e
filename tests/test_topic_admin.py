"""Topics by the thousand (issue 22): many created in one call, each created or refused on its own; listings a
page at a time, without the partitions' states, from the admin client and the CLI."""

from __future__ import annotations

import asyncio
import json

from georep.client import Admin, NewTopic, TopicExists
from georep.client.errors import InvalidRequest
from georep.proto import georep_pb2 as pb
from georep.server.process import NodeProcess
from tests.support.cli import georep, ok
from tests.support.node_api import stub_for


def test_create_topics_creates_each_topic_or_says_why_not(node: NodeProcess) -> None:
    async def scenario() -> None:
        async with Admin(node.address) as admin:
            await admin.create_topic("taken", 1)
            asked = [
                NewTopic("ok/one", 2),
                NewTopic("bad name", 1),
                NewTopic("taken", 1),
                NewTopic("ok/two", 3, {"retention_ms": "60000"}),
                NewTopic("ok/one", 2),  # twice in one call
                NewTopic("no-partitions", 0),
            ]
            results = await admin.create_topics(asked)
            assert [r.name for r in results] == [t.name for t in asked]
            assert [type(r.error).__name__ if r.error else None for r in results] == [
                None,
                "InvalidRequest",
                "TopicExists",
                None,
                "TopicExists",
                "InvalidRequest",
            ]
            assert isinstance(results[2].error, TopicExists) and isinstance(results[1].error, InvalidRequest)
            two = await admin.describe_topic("ok/two")
            assert two.partitions == 3 and two.config["retention_ms"] == "60000"
            names = {t.name for t in await admin.list_topics()}
            assert {"ok/one", "ok/two", "taken"} <= names and not names & {"bad name", "no-partitions"}

    asyncio.run(scenario())


def test_topic_list_pages_and_fetches_no_partition_state(node: NodeProcess) -> None:
    b = ("--bootstrap", node.address)
    names = [f"t{i:02d}" for i in range(25)]
    created = ok(georep("topic", "create", *names, "--partitions", "2", *b))
    assert "created 25 of 25 topics" in created
    ok(georep("produce", "t03", *b, stdin=b"x\ny\nz\n"))
    listed: list[str] = []
    token: list[str] = []
    for _ in range(5):
        result = georep("topic", "list", "--limit", "10", "--page-size", "4", *token, *b)
        rows = ok(result).splitlines()[1:]
        assert len(rows) <= 10
        listed += [row.split()[0] for row in rows]
        hint = result.stderr.decode()
        if "--page-token" not in hint:
            break
        token = ["--page-token", hint.split("--page-token ", 1)[1].split("'")[0]]
    assert listed == names, "every topic once, by name, over pages of at most 10"
    as_json = json.loads(ok(georep("topic", "list", "--json", *b)))
    t03 = next(t for t in as_json if t["name"] == "t03")
    assert t03["records"] == 3 and t03["partitions"] == 2 and "partition_states" not in t03
    channel, stub = stub_for(node)
    try:
        page = stub.ListTopics(pb.ListTopicsRequest(page_size=10, view=pb.TOPIC_VIEW_SUMMARY))
        assert len(page.topics) == 10 and page.next_page_token and page.total_size == 26  # and __georep_offsets
        assert not any(t.partition_states for t in page.topics)
        # without paging, as before: every topic with every partition's state
        everything = stub.ListTopics(pb.ListTopicsRequest())
        assert len(everything.topics) == 26 and all(t.partition_states for t in everything.topics)
    finally:
        channel.close()
    refused = georep("topic", "list", "--limit", "0", *b)
    assert refused.returncode != 0 and "--limit 0" in refused.stderr.decode()
