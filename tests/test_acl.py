"""The ACL core: patterns, decisions, super-users, the replicated records, the RPC table and the replication rules."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.site_state import PutAcl, SiteState, command_from_dict
from georep.auth.acl import (
    RESOURCE_OF,
    AclEntry,
    InvalidAcl,
    Operation,
    acl_entry,
    authorize,
    group,
    is_super_user,
    parse_acl_entry,
    topic,
)
from georep.auth.acl_replication import origin_may_arrive, pull_decision, repair_decision
from georep.auth.acl_sync import AclCache, change, effective, merge
from georep.auth.policy import Policy
from georep.auth.principal import Principal, parse_principal
from georep.metadata.store import AclRecord
from georep.proto import georep_pb2 as pb
from georep.security.acl_rpc import NODE_ACCESS, SEGMENTS_ACCESS, decide
from georep.storage.metadata_file import FileMetadataStore
from tests.support.examples import examples
from tests.support.raft import Site as RaftSite
from tests.support.raft import wait_until as raft_wait
from topology.filters import TopicFilter
from topology.model import Link, Site, Topology

ALICE = parse_principal("client:alice")
BOB = parse_principal("client:bob")


def test_default_deny_names_principal_operation_resource_and_the_fix() -> None:
    decision = authorize([], ALICE, Operation.PRODUCE, topic("orders/eu"), own_site="a")
    assert not decision.allowed
    for part in ("client:alice", "produce", "topic:orders/eu"):
        assert part in decision.message
    assert "georep acl add client:alice produce topic:orders/eu" in decision.message


def test_an_entry_allows_only_its_operation_principal_and_resources() -> None:
    entries = [acl_entry("client:alice", "produce", "topic:orders/**")]
    assert authorize(entries, ALICE, Operation.PRODUCE, topic("orders"), "a").allowed
    assert authorize(entries, ALICE, Operation.PRODUCE, topic("orders/eu/paris"), "a").allowed
    assert not authorize(entries, ALICE, Operation.CONSUME, topic("orders/eu"), "a").allowed
    assert not authorize(entries, BOB, Operation.PRODUCE, topic("orders/eu"), "a").allowed
    assert not authorize(entries, ALICE, Operation.PRODUCE, topic("payments"), "a").allowed


def test_principal_patterns() -> None:
    every_client = acl_entry("client:**", "consume", "topic:**")
    nodes_of_a = acl_entry("node:a/+", "consume", "topic:**")
    assert every_client.allows(ALICE, Operation.CONSUME, topic("x"))
    assert not every_client.allows(parse_principal("site:b"), Operation.CONSUME, topic("x"))  # the kind never widens
    assert nodes_of_a.allows(parse_principal("node:a/3"), Operation.CONSUME, topic("x"))
    assert not nodes_of_a.allows(parse_principal("node:b/3"), Operation.CONSUME, topic("x"))
    with pytest.raises(InvalidAcl, match="client:"):
        acl_entry("*", "consume", "topic:**")
    with pytest.raises(InvalidAcl, match="a pattern such as client:\\*\\*"):
        acl_entry("client:al**", "consume", "topic:**")
    with pytest.raises(InvalidAcl, match="wildcard must be a whole level"):
        acl_entry("node:a/+x/**", "consume", "topic:**")
    with pytest.raises(InvalidAcl, match="site:"):
        acl_entry("user:alice", "consume", "topic:**")


def test_operations_go_with_their_kind_of_resource_and_replicate_comes_from_the_topology() -> None:
    with pytest.raises(InvalidAcl, match="applies to a group"):
        acl_entry("client:alice", "commit", "topic:orders")
    with pytest.raises(InvalidAcl, match="applies to a topic"):
        acl_entry("client:alice", "produce", "group:g")
    with pytest.raises(InvalidAcl, match="link"):
        acl_entry("site:b", "replicate", "cluster")
    with pytest.raises(InvalidAcl, match="unknown operation 'write'"):
        acl_entry("client:alice", "write", "topic:orders")
    with pytest.raises(InvalidAcl, match="'\\+' for exactly one level"):
        acl_entry("client:alice", "produce", "topic:orders*")


def test_every_operation_but_replicate_can_be_granted_on_its_kind_of_resource() -> None:
    """An operation added to the enum without its resource kind (``audit`` once was) could not be granted at all."""
    example = {"topic": "topic:orders/**", "group": "group:g", "cluster": "cluster"}
    for op in Operation:
        if op is not Operation.REPLICATE:
            assert acl_entry("client:alice", op.value, example[RESOURCE_OF[op].value]).operation is op
    assert acl_entry("client:auditor", "audit", "topic:orders/**").operation is Operation.AUDIT
    with pytest.raises(InvalidAcl, match="applies to a topic"):
        acl_entry("client:auditor", "audit", "cluster")


def test_super_users() -> None:
    assert is_super_user(parse_principal("site:a"), "a")
    assert is_super_user(parse_principal("node:a/2"), "a")
    assert not is_super_user(parse_principal("node:b/2"), "a")
    assert is_super_user(parse_principal("client:admin"), "a")
    assert not is_super_user(parse_principal("client:admin"), "a", super_users=[ALICE])
    assert is_super_user(ALICE, "a", super_users=[ALICE])
    assert authorize([], parse_principal("node:a/1"), Operation.ADMIN, group("g"), "a").allowed


names = st.lists(st.sampled_from(["a", "b", "orders", "eu"]), min_size=1, max_size=3).map("/".join)
patterns = st.lists(st.sampled_from(["a", "b", "orders", "+", "**"]), min_size=1, max_size=3).map("/".join)
entries_st = st.builds(
    lambda who, op, pat: acl_entry(who, op, f"topic:{pat}"),
    st.sampled_from(["client:alice", "client:bob", "client:**"]),
    st.sampled_from(["produce", "consume"]),
    patterns,
)


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(entries_st, max_size=6),
    st.lists(entries_st, max_size=3),
    names,
    st.sampled_from([Operation.PRODUCE, Operation.CONSUME]),
    st.sampled_from([ALICE, BOB]),
    st.randoms(),
)
def test_decisions_are_monotone_and_independent_of_order(
    entries: list[AclEntry], more: list[AclEntry], name: str, op: Operation, who: Principal, rnd: random.Random
) -> None:
    before = authorize(entries, who, op, topic(name), "a").allowed
    shuffled = list(entries)
    rnd.shuffle(shuffled)
    assert authorize(shuffled, who, op, topic(name), "a").allowed == before
    if before:
        assert authorize(entries + more, who, op, topic(name), "a").allowed
    # the reference: some entry matches all three parts, with the filter matched by topology/filters.py
    naive = any(
        e.operation is op
        and (str(e.principal) in (str(who), "client:**"))
        and TopicFilter(e.resource.filter).matches(name)
        for e in entries
    )
    assert before == naive


@settings(max_examples=examples(100), deadline=None)
@given(entries_st)
def test_entries_round_trip_through_their_key(entry: AclEntry) -> None:
    assert parse_acl_entry(entry.key()) == entry


# -- replicated records ---------------------------------------------------------------------------------------------

records_st = st.builds(
    AclRecord,
    st.sampled_from(["client:alice produce topic:x", "client:bob consume topic:**"]),
    st.booleans(),
    st.integers(0, 5),
    st.sampled_from(["a", "b", "c"]),
)


def _fold(records: list[AclRecord]) -> dict[str, AclRecord]:
    table: dict[str, AclRecord] = {}
    for r in records:
        for kept in merge(table, [r]):
            table = {**table, kept.entry: kept}
    return table


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(records_st, max_size=10), st.randoms())
def test_records_converge_whatever_the_order_and_repeats(records: list[AclRecord], rnd: random.Random) -> None:
    other = records + rnd.sample(records, k=len(records) // 2)
    rnd.shuffle(other)
    assert _fold(records) == _fold(other)
    # and one merge of everything gives the same as one at a time
    assert {r.entry: r for r in merge({}, records)} == _fold(records)


def test_a_remove_beats_the_add_it_saw_even_with_a_clock_behind() -> None:
    entry = acl_entry("client:alice", "produce", "topic:x")
    add = change(entry, True, None, now_ms=1_000, site="a")
    remove = change(entry, False, add, now_ms=10, site="b")  # b's clock is far behind a's
    assert remove.stamp_ms > add.stamp_ms
    table = _fold([remove, add])
    assert effective(table) == []


def test_cache_parses_once_per_table() -> None:
    table = {"client:alice produce topic:x": AclRecord("client:alice produce topic:x", True, 1, "a")}
    cache = AclCache(lambda: table)
    first = cache()
    assert cache() is first and [str(e) for e in first] == ["client:alice produce topic:x"]
    table = {**table, "client:bob consume topic:y": AclRecord("client:bob consume topic:y", True, 1, "a")}
    assert len(cache()) == 2


def test_site_state_keeps_the_newest_record_and_snapshots_it() -> None:
    state = SiteState()
    old = AclRecord("client:alice produce topic:x", True, 5, "a")
    new = AclRecord("client:alice produce topic:x", False, 6, "b")
    assert state.apply(PutAcl(new)).changed  # type: ignore[union-attr]
    assert not state.apply(PutAcl(old)).changed  # type: ignore[union-attr]
    assert not state.apply(PutAcl(new)).changed  # type: ignore[union-attr]
    assert state.acls() == {new.entry: new}
    assert SiteState.restore(state.snapshot()) == state
    assert SiteState.restore(state.snapshot()).acls() == {new.entry: new}
    assert command_from_dict(PutAcl(new).to_dict()) == PutAcl(new)
    assert "acls" not in SiteState().snapshot()  # snapshots from before ACLs compare equal


def test_file_store_keeps_records_across_restarts(tmp_path: Path) -> None:
    store = FileMetadataStore(tmp_path / "topics.json")
    record = AclRecord("client:alice produce topic:x", True, 5, "a")
    before = store.acls()
    assert store.put_acl(record)
    assert store.acls() is not before  # a new table: caches see the change
    assert not store.put_acl(AclRecord(record.entry, False, 4, "a"))
    assert FileMetadataStore(tmp_path / "topics.json").acls() == {record.entry: record}


# -- replication rules ----------------------------------------------------------------------------------------------


def _topology(links: list[tuple[str, str, str]]) -> Topology:
    sites = tuple(Site(s, (f"127.0.0.1:{7000 + i}",)) for i, s in enumerate("abcd"))  # type: ignore[arg-type]
    return Topology(sites, tuple(Link(s, d, (TopicFilter(f),)) for s, d, f in links))  # type: ignore[arg-type]


def test_only_a_linked_site_pulls_and_only_what_its_link_carries() -> None:
    topo = _topology([("a", "b", "orders/**"), ("b", "a", "**")])
    assert pull_decision(topo, "a", parse_principal("site:b"), ["orders/eu", "__georep_offsets"]).allowed
    assert pull_decision(topo, "a", parse_principal("node:b/2"), ["orders"]).allowed
    refused = pull_decision(topo, "a", parse_principal("site:b"), ["payments"])
    assert not refused.allowed and "payments" in refused.message and "a -> b carries only orders/**" in refused.message
    stranger = pull_decision(topo, "a", parse_principal("site:c"), [])
    assert not stranger.allowed and "no link a -> c" in stranger.message and "site:c" in stranger.message
    assert not pull_decision(topo, "a", ALICE, []).allowed
    assert pull_decision(topo, "a", parse_principal("node:a/3"), ["payments"]).allowed  # its own nodes
    assert repair_decision(topo, "a", parse_principal("site:b"), "orders", "a").allowed
    assert not repair_decision(topo, "a", parse_principal("site:c"), "orders", "a").allowed


link_sets = st.lists(
    st.tuples(st.sampled_from("abcd"), st.sampled_from("abcd"), st.sampled_from(["**", "x", "y"])), max_size=8
).map(lambda ls: list({(s, d): (s, d, f) for s, d, f in ls if s != d}.values()))


@settings(max_examples=examples(100), deadline=None)
@given(link_sets, st.sampled_from(["x", "y"]))
def test_origin_rule_is_exactly_what_honest_sites_can_send(links: list[tuple[str, str, str]], name: str) -> None:
    """The docstring's proof, checked: run honest replication to its fixpoint (every site stamps its own origin and
    pulls everything its links carry); a link then carries an origin exactly when the rule accepts it."""
    topo = _topology(links)
    held = {s: {s} for s in "abcd"}
    for _ in range(len(held) + 1):  # a fixpoint within #sites rounds
        for s, d, f in links:
            if TopicFilter(f).matches(name):
                held[d] |= held[s]
    for s, d, f in links:
        if not TopicFilter(f).matches(name):
            continue
        for origin in "abcd":
            assert origin_may_arrive(topo, s, d, name, origin) == (origin in held[s]), (s, d, origin)


# -- the RPC table --------------------------------------------------------------------------------------------------


def _policy(entries: list[AclEntry], topo: Topology | None = None) -> Policy:
    return Policy("a", lambda: entries, lambda: topo)


def test_every_node_rpc_has_a_rule() -> None:
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Node"].methods}
    assert methods == set(NODE_ACCESS)
    assert {m.name for m in pb.DESCRIPTOR.services_by_name["Segments"].methods} == set(SEGMENTS_ACCESS)


def test_table_decisions() -> None:
    entries = [
        acl_entry("client:alice", "produce", "topic:orders/**"),
        acl_entry("client:alice", "commit", "group:g"),
        acl_entry("client:alice", "consume", "topic:orders/**"),
    ]
    policy = _policy(entries, _topology([("a", "b", "orders/**")]))
    assert decide(NODE_ACCESS, "Produce", pb.ProduceRequest(topic="orders/eu"), ALICE, policy).allowed
    assert not decide(NODE_ACCESS, "Produce", pb.ProduceRequest(topic="orders/eu"), BOB, policy).allowed
    commit = pb.CommitOffsetsRequest(group="g", commits=[pb.PartitionCommit(topic="orders")])
    assert decide(NODE_ACCESS, "CommitOffsets", commit, ALICE, policy).allowed
    other_group = decide(NODE_ACCESS, "CommitOffsets", pb.CommitOffsetsRequest(group="h"), ALICE, policy)
    assert not other_group.allowed and "group:h" in other_group.message
    assert not decide(NODE_ACCESS, "FetchCommitted", pb.FetchCommittedRequest(group="g"), ALICE, policy).allowed
    assert not decide(NODE_ACCESS, "SetLink", pb.SetLinkRequest(), ALICE, policy).allowed
    assert decide(NODE_ACCESS, "SetLink", pb.SetLinkRequest(), parse_principal("client:admin"), policy).allowed
    assert decide(NODE_ACCESS, "Health", pb.HealthRequest(), BOB, policy).allowed
    pull = pb.ReplicateRequest(dst_site="b", wants=[pb.PullWant(topic="orders")])
    assert decide(NODE_ACCESS, "Replicate", pull, parse_principal("site:b"), policy).allowed
    lying = pb.ReplicateRequest(dst_site="c", wants=[pb.PullWant(topic="orders")])
    assert not decide(NODE_ACCESS, "Replicate", lying, parse_principal("site:b"), policy).allowed
    assert not decide(NODE_ACCESS, "Replicate", pull, parse_principal("site:c"), policy).allowed
    read = pb.ReadSegmentRequest()
    assert not decide(SEGMENTS_ACCESS, "ReadSegment", read, parse_principal("site:b"), policy).allowed
    assert decide(SEGMENTS_ACCESS, "ReadSegment", read, parse_principal("node:a/2"), policy).allowed
    assert not decide(NODE_ACCESS, "NoSuchMethod", pb.HealthRequest(), ALICE, policy).allowed


def test_digests_need_audit_on_the_topic_and_a_members_digests_only_the_sites_nodes() -> None:
    auditor = parse_principal("client:auditor")
    entries = [
        acl_entry("client:auditor", "audit", "topic:orders/**"),
        acl_entry("client:alice", "consume", "topic:orders/**"),
    ]
    policy = _policy(entries)
    scan = pb.ScanDigestsRequest(topic="orders/eu")
    assert decide(NODE_ACCESS, "ScanDigests", scan, auditor, policy).allowed
    refused = decide(NODE_ACCESS, "ScanDigests", scan, ALICE, policy)  # consume is not audit
    assert not refused.allowed and "georep acl add client:alice audit topic:orders/eu" in refused.message
    assert not decide(NODE_ACCESS, "ScanDigests", pb.ScanDigestsRequest(topic="payments"), auditor, policy).allowed
    assert not decide(NODE_ACCESS, "Fetch", pb.FetchRequest(topic="orders/eu"), auditor, policy).allowed
    member = pb.ScanSegmentDigestsRequest(segment=pb.SegmentRef(topic="orders/eu"))
    assert not decide(SEGMENTS_ACCESS, "ScanSegmentDigests", member, auditor, policy).allowed
    assert decide(SEGMENTS_ACCESS, "ScanSegmentDigests", member, parse_principal("node:a/2"), policy).allowed


def test_pairs_of_entries_do_not_interact() -> None:
    """Each entry decides alone: for every pair, the pair allows exactly what either allows."""
    pool = [
        acl_entry(*e)
        for e in itertools.product(["client:alice", "client:**"], ["produce", "consume"], ["topic:x", "topic:**"])
    ]
    for first, second in itertools.combinations(pool, 2):
        for op in (Operation.PRODUCE, Operation.CONSUME):
            for name in ("x", "y"):
                both = authorize([first, second], ALICE, op, topic(name), "a").allowed
                either = any(authorize([e], ALICE, op, topic(name), "a").allowed for e in (first, second))
                assert both == either


def test_raft_store_replicates_records_to_every_member_and_keeps_them_across_restarts(tmp_path: Path) -> None:
    """A multi-node site: an ACL record is a Raft command (PutAcl) every member applies; a stale one changes
    nothing, and a restarted member has it back."""
    site = RaftSite(tmp_path)
    site.start()
    try:
        leader = site[site.leader()]
        record = AclRecord("client:alice produce topic:x", True, 5, "a")
        assert leader.put_acl(record)
        assert not leader.put_acl(AclRecord(record.entry, False, 4, "b"))  # older: kept out
        raft_wait(lambda: all(s.acls() == {record.entry: record} for s in site.running()), "every member has it")
        site.stop(0)
        site.start(0)
        raft_wait(lambda: site[0].acls() == {record.entry: record}, "the restarted member has it back")
    finally:
        site.close()


def test_a_kafka_offset_ask_comes_only_from_the_sites_own_nodes() -> None:
    """A group coordinator asks a partition's leader (issue 23) through ``ListOffsets``; the answer sets a Kafka
    client's fetch filter, so a client that may consume the topic may still not ask it."""
    policy = _policy([acl_entry("client:alice", "consume", "topic:orders/**")], _topology([("a", "b", "orders/**")]))
    listed = pb.ListOffsetsRequest(topic="orders/eu", position=pb.START_LATEST)
    assert decide(NODE_ACCESS, "ListOffsets", listed, ALICE, policy).allowed
    ask = pb.ListOffsetsRequest(topic="orders/eu", kafka=pb.KafkaOffsetAsk(client="c@h", commit_offset=3))
    refused = decide(NODE_ACCESS, "ListOffsets", ask, ALICE, policy)
    assert not refused.allowed and "only from a node of site" in refused.message
    assert decide(NODE_ACCESS, "ListOffsets", ask, parse_principal("node:a/2"), policy).allowed


def test_an_auditor_reads_digests_and_fetches_batches_by_coordinate_but_no_records() -> None:
    """The live audit's principal: ScanDigests and FetchBatch (the drill into a batch whose CRC differs) with the
    audit operation on the topic; no Fetch of records; a site still fetches by the topology's reach alone."""
    auditor = parse_principal("client:auditor")
    policy = _policy([acl_entry("client:auditor", "audit", "topic:orders/**")], _topology([("a", "b", "**")]))
    digests = pb.ScanDigestsRequest(topic="orders/eu", partition=0)
    assert decide(NODE_ACCESS, "ScanDigests", digests, auditor, policy).allowed
    batch = pb.FetchBatchRequest(topic="orders/eu", partition=0, origin_site="a", origin_seq=3)
    assert decide(NODE_ACCESS, "FetchBatch", batch, auditor, policy).allowed
    other = decide(NODE_ACCESS, "FetchBatch", pb.FetchBatchRequest(topic="payments", origin_site="a"), auditor, policy)
    assert not other.allowed and "audit" in other.message and "topic:payments" in other.message
    assert not decide(NODE_ACCESS, "Fetch", pb.FetchRequest(topic="orders/eu"), auditor, policy).allowed
    assert not decide(NODE_ACCESS, "FetchBatch", batch, BOB, policy).allowed
    assert decide(NODE_ACCESS, "FetchBatch", batch, parse_principal("site:b"), policy).allowed
