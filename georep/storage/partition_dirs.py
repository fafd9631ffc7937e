"""The name of a partition's directory, in a node's ``logs/`` (and in its ``replicas/``, which a multi-node site's
segment copies use): the topic %-quoted (``/`` and every other character a file name may not hold), ``-``, the
partition number, so the last ``-`` separates the two. The node writes these names and the audit reads them.

A topic's incarnation k > 0 (the deletes of its name it has outlived, georep/metadata/topic_entry.py) appends
``@k`` to the topic's part, so the files of two incarnations never mix; ``@`` is always quoted in a topic's part,
so no topic name reads as one. Incarnation 0 keeps the names from before incarnations."""

from __future__ import annotations

import urllib.parse


def topic_file_name(topic: str) -> str:
    """``topic`` as a file name: '/' (and every other character a name may not hold) %-quoted."""
    return urllib.parse.quote(topic, safe="")


def topic_dir_prefix(topic: str, incarnation: int = 0) -> str:
    """The part of the partition directories' names of ``topic``'s ``incarnation`` before ``-N``."""
    quoted = topic_file_name(topic)
    return f"{quoted}@{incarnation}" if incarnation else quoted


def partition_dir_name(topic: str, partition: int, incarnation: int = 0) -> str:
    return f"{topic_dir_prefix(topic, incarnation)}-{partition}"


def parse_partition_dir(name: str) -> tuple[str, int] | None:
    """The topic and partition a directory ``name`` stands for; None for a name no partition has."""
    parsed = parse_incarnation_dir(name)
    return None if parsed is None else (parsed[0], parsed[1])


def parse_incarnation_dir(name: str) -> tuple[str, int, int] | None:
    """The topic, partition and incarnation a directory ``name`` stands for; None for a name no partition has."""
    quoted, sep, number = name.rpartition("-")
    if not sep or not number.isdigit():
        return None
    quoted, at, incarnation = quoted.partition("@")
    if at and not incarnation.isdigit():
        return None
    return urllib.parse.unquote(quoted), int(number), int(incarnation or 0)
