"""The site metadata rules a multi-node site's nodes run on: one origin per site (``InitSite``: the first
proposal wins, and it survives snapshots), and a new controller that replaces no leader before a session."""

from __future__ import annotations

from cluster.site_state import Applied, InitSite, Refused, SiteState, command_from_dict


def test_the_first_proposed_epoch_is_the_sites_and_later_ones_change_nothing() -> None:
    state = SiteState()
    assert state.site() is None
    assert state.apply(InitSite("a", 1_700_000_000)) == Applied()
    assert state.apply(InitSite("a", 1_700_000_009)) == Applied(changed=False)
    assert state.site() == ("a", 1_700_000_000)


def test_a_node_of_another_site_is_refused() -> None:
    state = SiteState()
    state.apply(InitSite("a", 5))
    refused = state.apply(InitSite("b", 6))
    assert isinstance(refused, Refused) and "site 'a', not 'b'" in refused.reason
    assert state.site() == ("a", 5)


def test_the_site_survives_a_snapshot_and_the_command_its_log_encoding() -> None:
    state = SiteState()
    state.apply(InitSite("us-east", 42))
    assert SiteState.restore(state.snapshot()).site() == ("us-east", 42)
    assert command_from_dict(InitSite("us-east", 42).to_dict()) == InitSite("us-east", 42)
    assert SiteState.restore(SiteState().snapshot()).site() is None


def test_a_new_controller_replaces_no_leader_before_a_session_has_passed() -> None:
    """Heartbeats commit through the Raft log: right after the log had no leader, every node looks expired. A
    controller that has led for less than a session timeout keeps the leaders (and still elects where none is)."""
    from cluster.site_state import CreateTopic, ElectLeader, NodeHeartbeat, RegisterNode, plan_leadership
    from georep.metadata.topics import TopicSpec
    from topology.ids import NodeId

    state = SiteState()
    for n in (1, 2):
        state.apply(RegisterNode(NodeId(n), f"127.0.0.1:{7100 + n}"))
        state.apply(NodeHeartbeat(NodeId(n), 1_000, 1 << 30, 0))
    state.apply(CreateTopic(TopicSpec("t", 2)))
    state.apply(ElectLeader("t", 0, NodeId(1), 0))
    # The log stalled for 5 s; node 2 heartbeats first through the new controller.
    state.apply(NodeHeartbeat(NodeId(2), 6_000, 1 << 30, 0))
    assert [e.partition for e in plan_leadership(state, 6_000, 2_000, controller_since_ms=5_900, settle_ms=300)] == [1]
    later = plan_leadership(state, 7_950, 2_000, controller_since_ms=5_900)
    assert [(e.partition, e.node) for e in later] == [(0, NodeId(2)), (1, NodeId(2))]


def test_a_new_controller_replaces_at_once_a_leader_that_stayed_silent_after_it_took_over() -> None:
    """The partition's leader died with the old Raft leader: it never heartbeats through the new controller, so
    after a few ticks (``settle_ms``) it is replaced, without waiting a whole session."""
    from cluster.site_state import CreateTopic, ElectLeader, NodeHeartbeat, RegisterNode, plan_leadership
    from georep.metadata.topics import TopicSpec
    from topology.ids import NodeId

    state = SiteState()
    for n in (1, 2):
        state.apply(RegisterNode(NodeId(n), f"127.0.0.1:{7100 + n}"))
        state.apply(NodeHeartbeat(NodeId(n), 1_000, 1 << 30, 0))
    state.apply(CreateTopic(TopicSpec("t", 1)))
    state.apply(ElectLeader("t", 0, NodeId(1), 0))
    state.apply(NodeHeartbeat(NodeId(2), 4_100, 1 << 30, 0))  # node 2 heartbeats through the new controller
    assert plan_leadership(state, 4_100, 2_000, controller_since_ms=4_000, settle_ms=300) == []  # too soon
    elect = plan_leadership(state, 4_350, 2_000, controller_since_ms=4_000, settle_ms=300)
    assert [(e.partition, e.node) for e in elect] == [(0, NodeId(2))]
    state.apply(NodeHeartbeat(NodeId(1), 4_200, 1 << 30, 0))  # had it heartbeated, it would stay
    assert plan_leadership(state, 4_350, 2_000, controller_since_ms=4_000, settle_ms=300) == []
