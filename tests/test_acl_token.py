"""The ACL sync follows a change token (issue 22): an idle link gets no ACL records each round, and a change
upstream still arrives (an add, a remove, after a failed write, from a restarted upstream)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from georep.metadata.acl_token import AclChanges
from georep.metadata.store import AclRecord
from georep.proto import georep_pb2 as pb
from georep.security.acl_pull import AclPull, pull_acls
from georep.server.acl_calls import AclCalls
from georep.storage.metadata_file import FileMetadataStore

ALICE = "client:alice produce topic:orders"
BOB = "client:bob consume topic:orders"


class Upstream:
    """Site ``a``'s ListAcls, as a link's stub calls it; counts the records it sent."""

    def __init__(self, path: Path) -> None:
        self.metadata = FileMetadataStore(path)
        self.calls = AclCalls(cast(Any, SimpleNamespace(metadata=self.metadata)), cast(Any, None))
        self.records_sent = 0

    async def ListAcls(self, request: pb.ListAclsRequest, timeout: float) -> pb.ListAclsResponse:
        resp = await self.calls.list_acls(cast(Any, request), cast(Any, None))
        self.records_sent += len(resp.records)
        return resp

    def restart(self) -> None:
        self.calls = AclCalls(cast(Any, SimpleNamespace(metadata=self.metadata)), cast(Any, None))


class FlakyStore(FileMetadataStore):
    """Site ``b``'s table, whose next ``fail`` writes fail as a full disk would."""

    fail = 0

    def put_acl(self, record: AclRecord) -> bool:
        if self.fail:
            self.fail -= 1
            raise OSError("no space left on device")
        return super().put_acl(record)


def sync(up: Upstream, down: FileMetadataStore, since: str) -> AclPull:
    return asyncio.run(pull_acls(cast(Any, up), down, False, "a", 5.0, since))


def test_an_idle_link_gets_no_records_and_a_change_upstream_still_arrives(tmp_path: Path) -> None:
    up, down = Upstream(tmp_path / "a.json"), FileMetadataStore(tmp_path / "b.json")
    up.metadata.put_acl(AclRecord(ALICE, True, 1_000, "a"))
    first = sync(up, down, "")
    assert [r.entry for r in first.kept] == [ALICE] and ALICE in down.acls()
    token, sent = first.token, up.records_sent
    table = down.acls()
    for _ in range(5):  # idle rounds: nothing listed, nothing merged or written
        again = sync(up, down, token)
        assert again.kept == [] and again.token == token
    assert up.records_sent == sent
    assert down.acls() is table
    up.metadata.put_acl(AclRecord(BOB, True, 2_000, "a"))  # an add upstream
    assert [r.entry for r in sync(up, down, token).kept] == [BOB]
    assert down.acls()[BOB].present
    token = sync(up, down, "").token
    up.metadata.put_acl(AclRecord(ALICE, False, 3_000, "a"))  # a remove upstream
    removed = sync(up, down, token)
    assert [(r.entry, r.present) for r in removed.kept] == [(ALICE, False)]
    assert not down.acls()[ALICE].present


def test_a_failed_write_lists_every_record_again(tmp_path: Path) -> None:
    up, down = Upstream(tmp_path / "a.json"), FlakyStore(tmp_path / "b.json")
    up.metadata.put_acl(AclRecord(ALICE, True, 1_000, "a"))
    down.fail = 1
    failed = sync(up, down, "")
    assert failed.token == "" and ALICE not in down.acls()
    assert [r.entry for r in sync(up, down, failed.token).kept] == [ALICE]


def test_a_restarted_upstream_answers_every_record(tmp_path: Path) -> None:
    up, down = Upstream(tmp_path / "a.json"), FileMetadataStore(tmp_path / "b.json")
    up.metadata.put_acl(AclRecord(ALICE, True, 1_000, "a"))
    token = sync(up, down, "").token
    up.restart()  # another process (or another node of the site): its tokens are not the old ones
    down_lost = FileMetadataStore(tmp_path / "b2.json")  # a site that lacks the record, with the old token
    assert [r.entry for r in sync(up, down_lost, token).kept] == [ALICE]


def test_the_token_moves_with_every_change_and_only_then() -> None:
    changes = AclChanges("n1")
    table = {ALICE: AclRecord(ALICE, True, 1, "a")}
    changes.refresh(table)
    token = changes.token
    changes.refresh(dict(table))  # a new dict, equal: the same table
    assert changes.unchanged_since(token)
    changes.refresh({ALICE: AclRecord(ALICE, False, 2, "a")})
    assert not changes.unchanged_since(token)
    assert not AclChanges("n2").unchanged_since(AclChanges("n1").token)
    with pytest.raises(ValueError, match="no ':'"):
        AclChanges("a:b")
