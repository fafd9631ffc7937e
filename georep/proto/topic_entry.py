"""A topic's replicated entry (georep/metadata/topic_entry.py) on the wire: ``TopicDescription.entry``."""

from __future__ import annotations

from collections.abc import Mapping

from georep.metadata.topic_entry import Setting, Stamp, TopicEntry
from georep.metadata.topic_entry_codec import legacy_entry
from georep.metadata.topics import parse_topic_config, validate_partitions, validate_topic_name
from georep.proto import georep_pb2 as pb


def entry_to_pb(entry: TopicEntry) -> pb.TopicEntryState:
    out = pb.TopicEntryState(
        incarnation=entry.incarnation,
        deleted=entry.deleted,
        stamp_ms=entry.stamp.ms,
        stamp_site=entry.stamp.site,
    )
    for key, s in entry.settings:
        setting = pb.TopicSettingState(key=key, stamp_ms=s.stamp.ms, stamp_site=s.stamp.site, seen=dict(s.seen))
        if s.value is not None:
            setting.value = s.value
        out.settings.append(setting)
    return out


def entry_from_pb(description: pb.TopicDescription, known_keys: Mapping[str, str]) -> TopicEntry:
    """The entry a listed topic carries; from a node before entries, its definition as incarnation 0 with no
    stamps (its effective config, as a create from it took before). Keys this node does not know are left out.
    Raises ``InvalidTopic`` (a ``ValueError``) for a name, count or value a create would refuse."""
    validate_topic_name(description.name)
    if not description.HasField("entry"):
        config = {k: int(v) for k, v in description.config.items() if k in known_keys}
        return legacy_entry(description.name, description.partitions, config)
    e = description.entry
    settings = tuple(
        sorted(
            (
                s.key,
                Setting(
                    s.value if s.HasField("value") else None,
                    Stamp(s.stamp_ms, s.stamp_site),
                    tuple(sorted(s.seen.items())),
                ),
            )
            for s in e.settings
            if s.key in known_keys
        )
    )
    partitions = 0 if e.deleted else validate_partitions(description.partitions)
    parse_topic_config({k: str(s.value) for k, s in settings if s.value is not None})  # in bounds, as a create's
    return TopicEntry(description.name, e.incarnation, e.deleted, partitions, settings, Stamp(e.stamp_ms, e.stamp_site))
