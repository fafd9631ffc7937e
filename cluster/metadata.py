"""The site's metadata: which topics exist, and the site's identity.

``MetadataStore`` is the port. ``FileMetadataStore`` keeps the table of one
node in a JSON file replaced atomically, so a crash leaves the old or the new
table, never half of one. The Raft-backed store for multi-node sites sits
behind the same protocol.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cluster.topics import TopicSpec
from topology.ids import SiteId, site_id


class TopicExists(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"topic {name!r} already exists: describe it with 'georep topic describe {name}'")


class UnknownTopic(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"topic {name!r} does not exist: create it with 'georep topic create {name} --partitions N'")


class DataDirMismatch(Exception):
    """The data dir belongs to another site."""


class MetadataStore(Protocol):
    def topics(self) -> dict[str, TopicSpec]: ...

    def get(self, name: str) -> TopicSpec:
        """Raises ``UnknownTopic``."""
        ...

    def create_topic(self, spec: TopicSpec) -> None:
        """Raises ``TopicExists``. Durable when it returns."""
        ...


def write_json_atomic(path: Path, data: object) -> None:
    """Write, fsync, rename over, fsync the directory: all or nothing."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FileMetadataStore:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._topics: dict[str, TopicSpec] = {}
        if path.exists():
            raw = json.loads(path.read_text())
            for name, t in raw["topics"].items():
                self._topics[name] = TopicSpec(name, int(t["partitions"]), {k: int(v) for k, v in t["config"].items()})

    def topics(self) -> dict[str, TopicSpec]:
        return dict(self._topics)

    def get(self, name: str) -> TopicSpec:
        try:
            return self._topics[name]
        except KeyError:
            raise UnknownTopic(name) from None

    def create_topic(self, spec: TopicSpec) -> None:
        if spec.name in self._topics:
            raise TopicExists(spec.name)
        topics = {**self._topics, spec.name: spec}
        table = {t.name: {"partitions": t.partitions, "config": t.config} for t in topics.values()}
        write_json_atomic(self._path, {"version": 1, "topics": table})
        self._topics = topics


@dataclass(frozen=True, slots=True)
class SiteIdentity:
    site: SiteId
    epoch: int


def load_or_create_identity(data_dir: Path, site: str, now_s: int) -> SiteIdentity:
    """The site's epoch is fixed when its data dir is created (docs/design.md, Identity)."""
    path = data_dir / "site.json"
    if path.exists():
        raw = json.loads(path.read_text())
        if raw["site"] != site:
            raise DataDirMismatch(
                f"data dir {data_dir} belongs to site {raw['site']!r}, not {site!r}: "
                "pass the right --site or another --data-dir"
            )
        return SiteIdentity(site_id(raw["site"]), int(raw["epoch"]))
    identity = SiteIdentity(site_id(site), now_s)
    write_json_atomic(path, {"version": 1, "site": identity.site, "epoch": identity.epoch})
    return identity
