"""Every node of a multi-node site stamps as one origin: the site's epoch is agreed in its Raft metadata
(``InitSite``), the first proposal wins, and it survives snapshots."""

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
