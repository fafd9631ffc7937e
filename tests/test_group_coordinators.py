"""The rules that tie a multi-node site's group coordinators to the leaders of ``__georep_offsets``
(``cluster.groups.lead_step``, ``forget_groups``) and the fold they restart (``CommitLog.reset``)."""

from __future__ import annotations

from cluster.groups import GroupCoordinator, LeadStep, forget_groups, lead_step, takeover_hold_until
from dedup.producer import ProducerStateTable
from georep.broker.append import append_as_origin
from georep.broker.commits import CommitEntry, CommitLog, commit_batch
from georep.storage.api import PartitionLog
from georep.storage.memory_log import MemoryLog
from offsets.commits import offsets_partition
from offsets.coordinates import Origin
from offsets.vector import VectorOffset
from topology.ids import SiteId


def test_a_partition_lost_or_led_at_a_new_epoch_drops_its_members_and_its_fold() -> None:
    before = {0: (3, 10), 1: (3, 11), 2: (5, 12)}
    now = {0: (3, 10), 1: (4, 13), 3: (2, 14)}  # 0 unchanged, 1 at a new epoch, 2 lost, 3 gained
    assert lead_step(before, now) == LeadStep(forget_members=(1, 2), refold=(1, 2, 3), taken_over=(1, 3))


def test_leading_a_partition_at_its_first_epoch_takes_nothing_over() -> None:
    # The offsets partition made on a group's first use: no coordinator came before this one, so a group that
    # commits and rejoins at once is not held for a session (a restarted node never leads an epoch granted before
    # its restart). Counting it as a takeover had the first join after a reset on a 3-node site wait 10 s.
    assert lead_step({}, {0: (1, 0)}) == LeadStep(forget_members=(), refold=(0,), taken_over=())
    assert lead_step({0: (1, 0)}, {0: (2, 1)}).taken_over == (0,)  # a second leader takes over


def test_a_roll_under_the_same_epoch_keeps_the_members_but_folds_again() -> None:
    # A roll's seal may cut a commit the leader appended and never confirmed: the table is rebuilt from the log,
    # while the coordinator, and so the membership, stays.
    assert lead_step({0: (3, 10)}, {0: (3, 11)}) == LeadStep(forget_members=(), refold=(0,))
    assert lead_step({0: (3, 10)}, {0: (3, 10)}) == LeadStep(forget_members=(), refold=())


def test_forgetting_a_partition_drops_only_the_groups_it_coordinates() -> None:
    ids = iter(range(100))
    coordinator = GroupCoordinator(lambda topic: 4, lambda client: f"{client}-{next(ids)}")
    names = [f"g{i}" for i in range(12)]
    for name in names:
        coordinator.heartbeat(name, "", ["t"], 10_000, "range", 0, "c")
    lost = offsets_partition(names[0])
    gone = forget_groups(coordinator, [lost], offsets_partition)
    assert gone == sorted(n for n in names if offsets_partition(n) == lost)
    assert sorted(coordinator.groups) == sorted(n for n in names if offsets_partition(n) != lost)


def test_a_reset_partition_is_folded_again_from_its_start_and_keeps_other_partitions() -> None:
    origin = Origin(SiteId("a"), 1)
    g, other = "g0", next(f"g{i}" for i in range(1, 50) if offsets_partition(f"g{i}") != offsets_partition("g0"))
    logs: dict[int, PartitionLog] = {}
    commits = CommitLog()
    for name in (g, other):
        index = offsets_partition(name)
        log = logs[index] = MemoryLog()
        made = commits.new_commits(
            name, [CommitEntry("t", 0, VectorOffset({origin: 5}))], commits.stamp(1_000, 0, "a"), origin, now_ms=1_000
        )
        append_as_origin(
            log,
            ProducerStateTable(),
            origin,
            commit_batch(made, 1_000),
            topic="__georep_offsets",
            max_batch_bytes=1 << 20,
            now_ms=1_000,
        )
    commits.catch_up(logs)
    # A commit the table holds that the log does not (appended, never confirmed, cut by a seal) ...
    ghost = commits.new_commits(
        g, [CommitEntry("t", 0, VectorOffset({origin: 9}))], commits.stamp(2_000, 0, "a"), origin, now_ms=2_000
    )
    commits.record(ghost)
    assert commits.table.get(g, "t", 0).vector.get(origin) == 9  # type: ignore[union-attr]
    # ... is gone once the partition is folded again; the other partition's groups are untouched.
    commits.reset(offsets_partition(g), offsets_partition)
    assert commits.table.get(g, "t", 0) is None and commits.table.get(other, "t", 0) is not None
    commits.catch_up(logs)
    assert commits.table.get(g, "t", 0).vector.get(origin) == 5  # type: ignore[union-attr]


def test_a_new_coordinator_holds_a_group_with_commits_for_a_session_then_assigns() -> None:
    """Members of the previous coordinator may still read their partitions for up to a session: nobody gets a
    partition before then, and everybody who joined meanwhile gets one at the release."""
    ids = iter(range(100))
    coordinator = GroupCoordinator(lambda topic: 4, lambda client: f"{client}-{next(ids)}")
    hold = takeover_hold_until(10_000, 3_000, has_commits=True)
    assert hold == 13_000
    assert takeover_hold_until(10_000, 3_000, has_commits=False) == 0  # nothing committed: nothing to protect
    assert takeover_hold_until(None, 3_000, has_commits=True) == 0  # a one-node site never takes over
    first = coordinator.heartbeat("g", "", ["t"], 3_000, "range", 10_500, "a", hold_until_ms=hold)
    second = coordinator.heartbeat("g", "", ["t"], 3_000, "range", 11_000, "b", hold_until_ms=hold)
    assert first.assignment == () and second.assignment == ()
    assert coordinator.heartbeat("g", first.member_id, ["t"], 3_000, "range", 12_900, "a").assignment == ()
    coordinator.expire(13_000)  # the node's tick releases the hold
    after = [
        coordinator.heartbeat("g", m, ["t"], 3_000, "range", 13_100, "x") for m in (first.member_id, second.member_id)
    ]
    assert sorted(tp for hb in after for tp in hb.assignment) == [("t", p) for p in range(4)]
    assert after[0].generation > second.generation
