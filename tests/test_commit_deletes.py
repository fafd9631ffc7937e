"""Deleting a group's positions (issue 23: DeleteGroups, OffsetDelete, ``georep group delete``): a delete is a
tombstone commit that wins by its stamp like any commit, so every site drops the position whatever order the
commits reach it in, and a stale commit from another site cannot bring it back."""

from __future__ import annotations

import itertools

from offsets.commits import Commit, CommitTable
from offsets.coordinates import Origin
from offsets.hlc import HlcStamp
from offsets.vector import VectorOffset
from topology.ids import SiteId

A1 = Origin(SiteId("a"), 1)
B1 = Origin(SiteId("b"), 1)


def commit(hlc: int, by: Origin, seq: int, deleted: bool = False) -> Commit:
    vector = VectorOffset() if deleted else VectorOffset({A1: seq})
    return Commit("g", "t", 0, vector, HlcStamp(hlc), by, deleted=deleted)


def test_a_delete_round_trips_as_a_commit_record() -> None:
    tomb = commit(10, A1, 0, deleted=True)
    assert Commit.decode(tomb.value()) == tomb
    assert b'"del":1' in tomb.value()
    assert b'"del"' not in commit(10, A1, 5).value()  # an ordinary commit's record is unchanged


def test_a_delete_hides_the_position_and_a_stale_commit_does_not_bring_it_back() -> None:
    stale, delete, later = commit(5, B1, 40), commit(10, A1, 0, deleted=True), commit(20, B1, 70)
    for order in itertools.permutations([commit(1, A1, 10), stale, delete]):
        table = CommitTable()
        for c in order:
            table.apply(c)
        assert table.get("g", "t", 0) is None, order
        assert list(table.of_group("g")) == [] and table.groups() == []
    table.apply(later)  # a commit made after the delete (a larger stamp) is the position again, as in Kafka
    assert table.get("g", "t", 0) == later
