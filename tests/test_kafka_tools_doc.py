"""docs/kafka.md's "Kafka tools" section: its AdminClient block runs, as written, against a one-node site's Kafka
listener, so the documentation cannot drift from what the gateway serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from georep.server.process import NodeProcess
from tests.support.cli import georep, ok
from tests.support.kafka_nodes import KAFKA_ARGS, kafka_address

pytest.importorskip("confluent_kafka")

DOC = Path(__file__).resolve().parent.parent / "docs" / "kafka.md"


def tools_section() -> str:
    text = DOC.read_text()
    section = text[text.index("## Kafka tools") :]
    return section[: section.index("\n## ", 1)]


def tools_blocks() -> list[str]:
    section = tools_section()
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_its_admin_client_block() -> None:
    assert len(tools_blocks()) == 1


@pytest.mark.slow
def test_the_admin_client_block_runs_against_a_node(tmp_path: Path) -> None:
    node = NodeProcess(site="a", data_dir=tmp_path / "node", extra_args=KAFKA_ARGS)
    node.start()
    try:
        for block in tools_blocks():
            exec(compile(block, str(DOC), "exec"), {"bootstrap": kafka_address(node)})
    finally:
        node.kill9()


def cli_commands() -> list[list[str]]:
    """The georep commands of the section's table, in its order."""
    rows = [line for line in tools_section().splitlines() if line.startswith("| ") and "`georep " in line]
    return [re.search(r"`georep ([^`]*)`", row).group(1).split() for row in rows]  # type: ignore[union-attr]


@pytest.mark.slow
def test_the_tables_georep_commands_run_in_order(tmp_path: Path) -> None:
    assert len(cli_commands()) == 11
    node = NodeProcess(site="a", data_dir=tmp_path / "node")
    node.start()
    try:
        for command in cli_commands():
            ok(georep(*command, "--bootstrap", node.address))
    finally:
        node.kill9()
