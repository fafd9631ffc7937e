from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from georep.server.process import NodeProcess


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[object]:
    """Factory: ``start_node(site="a", **kw)`` starts a real ``georep node`` process.

    Every process started here is killed at teardown.
    """
    started: list[NodeProcess] = []

    def factory(site: str = "a", data_dir: Path | None = None, extra_args: list[str] | None = None) -> NodeProcess:
        node = NodeProcess(site=site, data_dir=data_dir or tmp_path / f"node-{site}-{len(started)}",
                           extra_args=list(extra_args or []))
        started.append(node)
        return node.start()

    yield factory
    for node in started:
        node.kill9()


@pytest.fixture
def node(start_node) -> NodeProcess:  # type: ignore[no-untyped-def]
    """One running node of site ``a`` with default settings."""
    return start_node()  # type: ignore[no-any-return]
