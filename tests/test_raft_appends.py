"""Appends that repeat what a follower holds, and answers that would send a leader back (georep/raft/appends.py)."""

from __future__ import annotations

from typing import Any

from georep.raft.appends import Entry, next_index_after_answer, trim_append


def log_of(*terms: int) -> list[Entry]:
    """A follower's log: entry i+1 has term terms[i]."""
    return [(f"c{i + 1}".encode(), i + 1, term) for i, term in enumerate(terms)]


def append(prev: int, prev_term: int, entries: list[Entry]) -> dict[str, Any]:
    return {
        "type": "append_entries",
        "term": 2,
        "commit_index": 3,
        "prevLogIdx": prev,
        "prevLogTerm": prev_term,
        "entries": entries,
    }


def trim(log: list[Entry], message: dict[str, Any]) -> Any:
    return trim_append(message, lambda i: log[i - 1] if 1 <= i <= len(log) else None, len(log))


def test_a_late_append_whose_entries_the_follower_holds_is_dropped() -> None:
    log = log_of(1, 1, 2, 2, 2, 2)
    assert trim(log, append(2, 1, log[2:4])) is None  # pysyncobj would cut entries 3..6 and add back 3 and 4


def test_held_entries_are_left_out_and_only_the_rest_is_added() -> None:
    log = log_of(1, 1, 2, 2)
    leader = log_of(1, 1, 2, 2, 2, 2)
    assert trim(log, append(2, 1, leader[2:6])) == append(4, 2, leader[4:6])


def test_an_append_that_repeats_the_end_of_the_log_becomes_a_heartbeat_at_its_end() -> None:
    log = log_of(1, 1, 2)
    assert trim(log, append(1, 1, log[1:3])) == append(3, 2, [])


def test_a_conflict_is_cut_from_its_first_entry_on() -> None:
    log = log_of(1, 1, 1, 1)  # entries 3 and 4 of an old leader
    leader = log_of(1, 1, 2)
    assert trim(log, append(1, 1, leader[1:3])) == append(2, 1, leader[2:3])  # pysyncobj then cuts 3 and 4


def test_other_messages_pass_unchanged() -> None:
    log = log_of(1, 1)
    for message in (
        append(5, 1, log_of(1, 1, 1, 1, 1, 1)[5:]),  # beyond the log: pysyncobj asks for earlier ones
        append(1, 9, log[1:]),  # the previous entry conflicts
        append(2, 1, []),  # a heartbeat
        {**append(1, 1, log[1:]), "transmission": "start", "data": b""},
        {"type": "request_vote", "term": 3},
    ):
        assert trim(log, message) is message


def test_a_successful_answer_never_sends_the_next_index_back() -> None:
    answer = {"type": "next_node_idx", "next_node_idx": 4, "success": True, "reset": False}
    assert next_index_after_answer(answer, before=9, after=4) == 9
    assert next_index_after_answer(answer, before=2, after=4) == 4
    assert next_index_after_answer({**answer, "success": False, "reset": True}, before=9, after=4) == 4
    assert next_index_after_answer({"type": "append_entries"}, before=9, after=3) == 3
