"""``georep status`` at scale: its text follows the topics and the trouble, not the partition count."""

from __future__ import annotations

from georep.cli.status import render
from georep.proto import georep_pb2 as pb


def site_status(site: str, partitions: int, lagging: int = -1, damaged: int = -1) -> pb.SiteStatusResponse:
    out = pb.SiteStatusResponse(site=site, epoch=1)
    for i in range(partitions):
        p = out.partitions.add(topic="wide", partition=i, log_end_offset=2)
        p.vector.entries.add(site="a", epoch=1, next_seq=2)
        if i == lagging:
            p.lags.add(origin="b@1", upstream="b", lag_records=7)
        if i == damaged:
            p.damaged.add(origin="a@1", base_offset=0, next_offset=1, reason="crc")
    out.links.add(src="b", dst=site, state="streaming", streams_opened=1)
    return out


def test_a_site_of_thousands_of_partitions_prints_a_line_per_topic_and_only_the_partitions_in_trouble() -> None:
    statuses: dict[str, pb.SiteStatusResponse | str] = {
        "a": site_status("a", 5_000, lagging=17, damaged=4_000),
        "c": site_status("c", 5_000),
    }
    text = render(statuses)
    lines = text.splitlines()
    assert len(lines) < 20, text
    assert "  topic wide: 5000 partitions, 10000 records, 1 lagging (7 records behind), 1 damaged" in lines
    assert any(line.startswith("  wide/17 ") for line in lines) and any(
        line.startswith("  wide/4000 ") for line in lines
    )
    assert "converged partitions: 4999/5000" in lines and "  differs: wide/4000" in lines  # damage is not held
    every = render(statuses, partitions=True).splitlines()
    assert sum(1 for line in every if line.startswith("  wide/")) == 10_000


def test_many_differing_partitions_are_named_up_to_a_bound() -> None:
    a, c = site_status("a", 300), site_status("c", 300)
    for p in c.partitions:
        p.vector.entries[0].next_seq = 1
    lines = render({"a": a, "c": c}).splitlines()
    assert "converged partitions: 0/300" in lines
    assert sum(1 for line in lines if line.startswith("  differs: ")) == 20 and "  ... and 280 differ" in lines
