"""The file-backed metadata of a one-node site: ``topics.json`` (topics, ACLs, SASL users) and ``site.json``
(the site's identity), behind the ``MetadataStore`` port of ``georep/metadata/store.py``.

Both files are JSON replaced atomically (write, fsync, rename, fsync the directory), with a checksum member
(``georep/storage/checked_json.py``): a changed digit still parses, and these files are not derived from
anything, so damage is refused with what to do rather than believed. Files of format version 1 (before the
checksum) are read as they are; the next write replaces them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from georep.metadata.store import AclRecord, DataDirMismatch, SiteIdentity, TopicExists, UnknownTopic, acl_newer
from georep.metadata.topics import TopicSpec
from georep.storage.api import StorageError
from georep.storage.checked_json import DamagedStateFile, dumps_checked, loads_checked
from topology.ids import InvalidSiteId, site_id

log = logging.getLogger(__name__)


class MetadataFileDamaged(StorageError):
    """``topics.json`` or ``site.json`` does not hold what its checksum vouches for: the node refuses to start."""


def write_json_atomic(path: Path, data: object, *, checked: bool = False) -> None:
    """Write, fsync, rename over, fsync the directory: all or nothing. ``checked``: with a checksum member
    (``georep/storage/checked_json.py``), so that damage is refused rather than believed."""
    tmp = path.with_name(path.name + ".tmp")
    # 0600 whatever the umask (open keeps the mode of the file it truncates): topics.json holds users' SCRAM keys
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
    with open(tmp, "w") as f:
        if checked:
            assert isinstance(data, dict)
            f.write(dumps_checked(data).decode("ascii"))
        else:
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
        self._acls: dict[str, AclRecord] = {}
        self._topics_version = 0  # one more per change of the topic table (MetadataStore.topics_version)
        if not path.exists():
            return
        try:
            raw = loads_checked(path.read_bytes(), unchecked_formats=(1,), format_key="version")
            for name, t in raw["topics"].items():
                self._topics[name] = TopicSpec(name, int(t["partitions"]), {k: int(v) for k, v in t["config"].items()})
            for entry in raw.get("acls", ()):  # absent in tables written before ACLs
                record = AclRecord.from_dict(entry)
                self._acls[record.entry] = record
        except (DamagedStateFile, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MetadataFileDamaged(
                f"{path} is damaged ({exc}): it holds this site's topic definitions, ACLs and SASL users. Restore "
                "it from a backup; or move it away and start the node: it takes the topics, ACLs and users of its "
                "linked sites back through topic and ACL sync, and serves the partitions on disk again as their "
                "topics come back (a site with no links must create its topics again with the same partitions)"
            ) from None

    def topics(self) -> dict[str, TopicSpec]:
        return dict(self._topics)

    def topics_version(self) -> int:
        return self._topics_version

    def get(self, name: str) -> TopicSpec:
        try:
            return self._topics[name]
        except KeyError:
            raise UnknownTopic(name) from None

    def create_topic(self, spec: TopicSpec) -> None:
        self.create_topics([spec])

    def create_topics(self, specs: list[TopicSpec]) -> None:
        """Add every one of ``specs`` with one write of the table, or none of them. Raises ``TopicExists`` (for
        the first name taken, or given twice)."""
        topics = dict(self._topics)
        for spec in specs:
            if spec.name in topics:
                raise TopicExists(spec.name)
            topics[spec.name] = spec
        self._write(topics, self._acls)
        self._topics = topics
        self._topics_version += 1

    def acls(self) -> dict[str, AclRecord]:
        return self._acls

    def put_acl(self, record: AclRecord) -> bool:
        if not acl_newer(record, self._acls.get(record.entry)):
            return False
        acls = {**self._acls, record.entry: record}
        self._write(self._topics, acls)
        self._acls = acls
        return True

    def _write(self, topics: dict[str, TopicSpec], acls: dict[str, AclRecord]) -> None:
        table = {t.name: {"partitions": t.partitions, "config": t.config} for t in topics.values()}
        out: dict[str, Any] = {"version": 2, "topics": table}  # 2: with a checksum
        if acls:
            out["acls"] = [acls[k].to_dict() for k in sorted(acls)]
        write_json_atomic(self._path, out, checked=True)


def load_or_create_identity(data_dir: Path, site: str, now_s: int) -> SiteIdentity:
    """The site's epoch is fixed when its data dir is created (docs/design.md, Identity)."""
    path = data_dir / "site.json"
    if path.exists():
        try:
            raw = loads_checked(path.read_bytes(), unchecked_formats=(1,), format_key="version")
            site_id(raw["site"])
            int(raw["epoch"])
        except (DamagedStateFile, ValueError, KeyError, TypeError, InvalidSiteId) as exc:
            raise MetadataFileDamaged(
                f"{path} is damaged ({exc}): it holds this site's epoch. Restore it from a backup; or move it away "
                "and start the node: the site starts under a new epoch, which never reuses a coordinate, and the "
                "records of the old epoch stay and keep replicating"
            ) from None
        if raw["site"] != site:
            raise DataDirMismatch(
                f"data dir {data_dir} belongs to site {raw['site']!r}, not {site!r}: "
                "pass the right --site or another --data-dir"
            )
        return SiteIdentity(site_id(raw["site"]), int(raw["epoch"]))
    identity = SiteIdentity(site_id(site), now_s)
    if any((data_dir / "logs").glob("*")):
        log.warning(
            "data dir %s holds partition logs but no site.json: site %s starts under a new epoch %d (no "
            "coordinate of an earlier epoch is reused; its records stay and keep replicating)",
            data_dir,
            site,
            now_s,
        )
    write_json_atomic(path, {"version": 2, "site": identity.site, "epoch": identity.epoch}, checked=True)
    return identity
