"""A held report costs what changed, not the held table's size (issue 22): a site that heard of 3 sites x 10,000
partitions looked at all 30,000 entries for every report, even when one partition had moved."""

from __future__ import annotations

from georep.broker.acks import AckTable, HeldChanged
from offsets.coordinates import Origin
from offsets.held import HeldReporter, HeldTable
from offsets.vector import VectorOffset
from topology.ids import SiteId

A1 = Origin(SiteId("a"), 1)
B1 = Origin(SiteId("b"), 1)
PARTITIONS = 2_000


class Looked(int):
    """A version number that counts how often a reader compares it (one comparison: one entry looked at)."""

    looks = 0

    def __gt__(self, other: int) -> bool:
        Looked.looks += 1
        return int(self) > int(other)


def test_a_report_after_one_change_looks_at_that_entry_not_the_whole_table() -> None:
    table = HeldTable()
    for site in ("b", "c"):
        for p in range(PARTITIONS):
            table.update(site, "t", p, VectorOffset({A1: 1}))
    reporter = HeldReporter("a")
    assert len(reporter.next_report(table) or []) == 2 * PARTITIONS  # the first report tells everything
    reporter.acked()
    table.versions = {key: Looked(v) for key, v in table.versions.items()}  # count from here on
    Looked.looks = 0

    assert table.update("c", "t", 7, VectorOffset({A1: 2}))
    report = reporter.next_report(table)
    assert report == [(("c", "t", 7), VectorOffset({A1: 2}))]
    assert Looked.looks <= 2  # the changed entry, and the first unchanged one before it
    reporter.acked()
    assert reporter.next_report(table) is None  # nothing new: nothing sent


def test_partitions_that_hold_nothing_are_not_reported() -> None:
    """A create of 10,000 partitions in a 3-site cycle sent every upstream reports of 20,000 empty entries (each
    site's own, and those its downstream reported, passed on), again at every stream reopen: an empty vector covers
    no record, so reports leave it out (the node's and the simulator's alike)."""
    acks = AckTable("b", B1)
    for p in range(PARTITIONS):
        acks.open_partition(("t", p), True, 0, VectorOffset())
    reporter = HeldReporter("a")
    assert reporter.next_report(acks.held) is None
    acks.held_reported([("c", "t", p, VectorOffset()) for p in range(PARTITIONS)])  # an older node's report
    assert reporter.next_report(acks.held) is None

    assert acks.held_reported([("c", "t", 3, VectorOffset({A1: 1}))]) == [HeldChanged()]  # what it holds goes on
    assert reporter.next_report(acks.held) == [(("c", "t", 3), VectorOffset({A1: 1}))]
