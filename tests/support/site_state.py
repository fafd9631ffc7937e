"""Applying metadata commands to a ``SiteState`` in tests: what must be applied, and what must be refused."""

from __future__ import annotations

from cluster.site_state import Applied, Command, RefusalCode, Refused, SiteState


def applied(state: SiteState, command: Command) -> Applied:
    result = state.apply(command)
    assert isinstance(result, Applied), result
    return result


def refused(state: SiteState, command: Command, code: RefusalCode) -> Refused:
    """``command`` is refused with ``code``, and leaves the state as it was."""
    before = state.snapshot()
    result = state.apply(command)
    assert isinstance(result, Refused), result
    assert result.code is code, result
    assert state.snapshot() == before, "a refused command changed the state"
    return result
