"""The consumer group calls of the ``georep.v1.Node`` service, parsed and handed to the ``GroupService``."""

from __future__ import annotations

from georep.proto import georep_pb2 as pb
from georep.server.groups import GroupService
from georep.server.rpc import Context, parse


class GroupCalls:
    """Group calls on a multi-node site go to the group's coordinator, the leader of its __georep_offsets
    partition; another node answers NotCoordinator with its address (georep/server/groups.py)."""

    def __init__(self, groups: GroupService) -> None:
        self.groups = groups

    async def group_heartbeat(self, data: bytes, context: Context) -> pb.GroupHeartbeatResponse:
        return await self.groups.heartbeat(parse(pb.GroupHeartbeatRequest, data))

    async def leave_group(self, data: bytes, context: Context) -> pb.LeaveGroupResponse:
        return await self.groups.leave(parse(pb.LeaveGroupRequest, data))

    async def commit_offsets(self, data: bytes, context: Context) -> pb.CommitOffsetsResponse:
        return await self.groups.commit(parse(pb.CommitOffsetsRequest, data))

    async def fetch_committed(self, data: bytes, context: Context) -> pb.FetchCommittedResponse:
        return await self.groups.fetch_committed(parse(pb.FetchCommittedRequest, data))

    async def list_groups(self, data: bytes, context: Context) -> pb.ListGroupsResponse:
        parse(pb.ListGroupsRequest, data)
        return await self.groups.list_groups()

    async def describe_group(self, data: bytes, context: Context) -> pb.GroupDescription:
        return await self.groups.describe(parse(pb.DescribeGroupRequest, data))
