"""A site behind a live upstream on a group's commits says so instead of handing out a stale position.

Handing out the older commit would make the consumer read again what the group
had already committed: a duplicate relative to the commit, which exact failover
(I5) rules out. The soak showed it under load: after its site was killed, a
group that rejoined at another site started from a commit the new site had not
received yet. Now FetchCommitted answers ``CommitsBehind`` (gRPC ABORTED) and a
group member asks again at its next heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest

from cluster.groups import IllegalGeneration
from georep.broker.errors import CommitsBehind
from georep.client.errors import CommitsBehind as ClientCommitsBehind
from georep.client.errors import GroupRebalanced, Operation, from_status
from georep.proto import georep_pb2 as pb
from georep.server.broker import Broker
from georep.server.groups import GroupService
from georep.server.status import wire_status
from georep.storage.metadata_file import load_or_create_identity
from offsets.commits import OFFSETS_TOPIC, offsets_partition
from offsets.coordinates import Origin
from topology.ids import SiteId


def test_a_site_behind_what_its_upstream_holds_now_refuses_rather_than_answer_stale(tmp_path: Path) -> None:
    async def main() -> None:
        broker = Broker(tmp_path, load_or_create_identity(tmp_path, "b", 1))
        groups = GroupService(broker)
        request = pb.FetchCommittedRequest(group="g", wait_caught_up_ms=50)
        assert list((await groups.fetch_committed(request)).offsets) == []  # no upstream: answers
        asked: list[tuple[tuple[str, int], float]] = []
        upstream = {Origin(SiteId("a"), 1): 3}  # an upstream already holds 3 commit records of origin a@1

        async def upstream_vectors(key: tuple[str, int], timeout_s: float) -> list[Mapping[Origin, int]]:
            asked.append((key, timeout_s))
            return [upstream]

        groups.upstream_vectors = upstream_vectors
        with pytest.raises(CommitsBehind, match="has not caught up") as caught:
            await groups.fetch_committed(request)
        assert asked and asked[0][0] == (OFFSETS_TOPIC, offsets_partition("g"))  # asked afresh, for g's partition
        upstream.clear()  # what the upstream holds, this site holds too
        assert list((await groups.fetch_committed(request)).offsets) == []
        broker.close()
        code, reason = wire_status(caught.value) or (grpc.StatusCode.INTERNAL, "")
        assert code is grpc.StatusCode.ABORTED
        assert isinstance(from_status(Operation.GROUP, code, str(caught.value), reason), ClientCommitsBehind)
        rebalanced = wire_status(IllegalGeneration("generation 3 is not the group's"))
        assert rebalanced is not None and rebalanced[0] is code
        assert isinstance(from_status(Operation.GROUP, code, "", rebalanced[1]), GroupRebalanced)

    asyncio.run(main())
