"""The name of a partition's directory, in a node's ``logs/`` (and in its ``replicas/``, which a multi-node site's
segment copies use): the topic %-quoted (``/`` and every other character a file name may not hold), ``-``, the
partition number, so the last ``-`` separates the two. The node writes these names and the audit reads them."""

from __future__ import annotations

import urllib.parse


def topic_file_name(topic: str) -> str:
    """``topic`` as a file name: '/' (and every other character a name may not hold) %-quoted."""
    return urllib.parse.quote(topic, safe="")


def partition_dir_name(topic: str, partition: int) -> str:
    return f"{topic_file_name(topic)}-{partition}"


def parse_partition_dir(name: str) -> tuple[str, int] | None:
    """The topic and partition a directory ``name`` stands for; None for a name no partition has."""
    quoted, sep, number = name.rpartition("-")
    if not sep or not number.isdigit():
        return None
    return urllib.parse.unquote(quoted), int(number)
