"""A node's ACL change token: whether its ACL table changed since a linked site last listed it. Pure.

Every link's ACL sync (``georep/security/acl_pull.py``) asked its upstream for the whole ACL table, credentials
included, every ``TOPIC_SYNC_S``, and merged every record, although the table changes only when an operator
changes it somewhere. ``ListAcls`` now answers a token with the table, and a sync that hands the token back is
told ``unchanged`` with no records while the table is the same, as a topic sync is by the catalog token
(``georep/metadata/catalog.py``).

A token is ``instance:version``: ``version`` counts the changes this tracker saw, in the tracker ``instance``
(one per process, so a restarted node, or another node of a multi-node site, never takes a token for its own and
answers every record). A change is any table that is not equal to the one before; the stores hand out the same
dict until a change (``MetadataStore.acls``), so an unchanged table costs one identity check.
"""

from __future__ import annotations

from collections.abc import Mapping

from georep.metadata.store import AclRecord


class AclChanges:
    """The ACL table of one node as last seen, and its token; see the module docstring."""

    def __init__(self, instance: str) -> None:
        if ":" in instance:
            raise ValueError(f"an ACL token instance id has no ':': {instance!r}")
        self.instance = instance
        self._table: Mapping[str, AclRecord] = {}
        self._version = 0

    @property
    def token(self) -> str:
        """The token of the table as last refreshed."""
        return f"{self.instance}:{self._version}"

    def refresh(self, table: Mapping[str, AclRecord]) -> None:
        """Take the node's ACL table as it is now; a table unequal to the last one is a new version."""
        if table is self._table:
            return
        if table != self._table:
            self._version += 1
        self._table = table

    def unchanged_since(self, token: str) -> bool:
        """Whether ``token`` is this tracker's token of the table as last refreshed (so nothing changed since)."""
        return token == self.token
