"""A delete reaches a multi-node site's members while a write waits for its quorum (georep/server/cluster_member.py):
the write's ack fails naming the delete, the leader stops leading, and every node removes its copies, a node
whose Segments service no longer answers included. Three nodes in one process, as tests/test_cluster_member.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.site_state import CreateTopic, MergeTopicEntry
from georep.broker.errors import NotLeader
from georep.metadata.topic_entry import delete
from georep.metadata.topics import TopicSpec
from georep.record.batch import local_prefix
from georep.server.cluster_member import PartitionLeader
from tests.support.segments import make_batch
from tests.test_cluster_member import KEY, ORIGIN, Node, now_ms, produce, site_of, start_site, wait_for, writing_leader
from topology.ids import NodeId


def copies_left(node: Node) -> list[object]:
    """What ``node`` still holds of topic t: its store's copies and their directories."""
    dirs = [d for d in (node.data_dir / "replicas").iterdir() if d.name.startswith(KEY[0])]
    return [*node.store.partitions(), *dirs]


@pytest.mark.slow
def test_a_delete_fails_a_waiting_ack_naming_it_and_every_member_removes_its_copies(tmp_path: Path) -> None:
    nodes = site_of(3, tmp_path)

    async def run() -> None:
        try:
            await start_site(nodes)
            proposer = nodes[NodeId(1)].member
            assert proposer is not None
            await proposer.propose(CreateTopic(TopicSpec(KEY[0], 1)))
            lead = await wait_for("a leader writing t-0", lambda: writing_leader(nodes))
            assert isinstance(lead, PartitionLeader)
            await produce(lead, 0)  # acked by the quorum: every member holds a copy
            for node in nodes.values():
                await wait_for(f"node {node.me} holds a copy", lambda node=node: node.store.segment_ids(KEY))
            # The other members stop answering segment calls (their Raft goes on): the next write waits for them.
            for node in nodes.values():
                if node.me != lead.member.me and node.server is not None:
                    await node.server.stop(None)
            b = make_batch(ORIGIN, 4, [b"waits"])
            batch = local_prefix(lead.end_offset(), b.header.batch_length, now_ms(), b.header.crc) + b.covered
            _, end = await lead.append(batch)
            waiting = asyncio.create_task(lead.confirmed(end))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            entry = proposer.metadata.state().entries()[KEY[0]]
            await proposer.propose(MergeTopicEntry(delete(entry, KEY[0], now_ms(), "a")))
            with pytest.raises(NotLeader, match="was deleted at site a"):
                await asyncio.wait_for(waiting, 30)
            for node in nodes.values():
                member = node.member
                assert member is not None
                await wait_for(f"node {node.me} leads nothing", lambda member=member: not member.leaders)
                # The store forgets the copies first, then moves their directories out: wait for both.
                await wait_for(f"node {node.me} removed its copies", lambda node=node: not copies_left(node))
        finally:
            for node in nodes.values():
                await node.stop()

    asyncio.run(run())
