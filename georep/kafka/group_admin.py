"""The Kafka gateway's group deletes: DeleteGroups (42) and OffsetDelete (47), over ``GroupService.delete``.

Kept apart from ``gateway.py`` (the handler table names them) so the gateway's class stays within its size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kafka.protocol import admin as kadmin
from kafka.protocol import consumer as kconsumer

from georep.auth.acl import Operation
from georep.auth.acl import group as acl_group
from georep.kafka import errors as k
from georep.kafka.protocol import Request

if TYPE_CHECKING:
    from georep.kafka.gateway import Client, KafkaGateway


async def delete_groups(gw: KafkaGateway, req: Request, peer: Client) -> Any:
    """DeleteGroups: every committed position of each group, with tombstone commits that replicate to every
    site (``GroupService.delete``); NON_EMPTY_GROUP while a group has members, GROUP_ID_NOT_FOUND for one
    this site has no position of."""
    r = kadmin.DeleteGroupsResponse
    results = []
    for name in req.body.groups_names:
        code = 0
        try:
            gw._allow(peer, Operation.COMMIT, [acl_group(name)])
            await gw.groups.delete(name, None)
        except Exception as exc:
            code = gw._code(exc)
        results.append(r.DeletableGroupResult(group_id=name, error_code=code))
    return r(results=results)


async def offset_delete(gw: KafkaGateway, req: Request, peer: Client) -> Any:
    """OffsetDelete: the group's positions of the partitions named, as DeleteGroups does; a partition of a
    topic that an active member subscribes to gets GROUP_SUBSCRIBED_TO_TOPIC, as in Kafka, and the others
    are deleted even while the group has members."""
    r = kconsumer.OffsetDeleteResponse
    rt, rp = r.OffsetDeleteResponseTopic, r.OffsetDeleteResponseTopic.OffsetDeleteResponsePartition
    b = req.body
    try:
        gw._allow(peer, Operation.COMMIT, [acl_group(b.group_id)])
        await gw.groups.sync()
        subscribed = gw.groups.subscribed(b.group_id)
        wanted = [(t.name, p.partition_index) for t in b.topics for p in t.partitions]
        await gw.groups.delete(b.group_id, [tp for tp in wanted if tp[0] not in subscribed], members_ok=True)
    except Exception as exc:
        return r(error_code=gw._code(exc), topics=[])
    return r(
        topics=[
            rt(
                name=t.name,
                partitions=[
                    rp(
                        partition_index=p.partition_index,
                        error_code=k.GROUP_SUBSCRIBED_TO_TOPIC if t.name in subscribed else 0,
                    )
                    for p in t.partitions
                ],
            )
            for t in b.topics
        ]
    )
