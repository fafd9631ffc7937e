"""Kafka's tools' flag spellings work with georep's CLI where they are unambiguous (issue 23): ``--bootstrap-server``
for ``--bootstrap``, ``--topic`` for the topic argument, ``--max-messages`` for ``--max``."""

from __future__ import annotations

import argparse

import pytest

from georep.cli import cluster, group, scrub
from georep.cli.main import parse_args


def test_kafka_spellings_mean_what_georep_spells_otherwise() -> None:
    kafka = parse_args(["consume", "--bootstrap-server", "h:1", "--topic", "t", "--max-messages", "5"])
    georep = parse_args(["consume", "--bootstrap", "h:1", "t", "--max", "5"])
    for key in ("bootstrap", "topic", "max"):
        assert getattr(kafka, key) == getattr(georep, key), key
    assert parse_args(["produce", "--topic", "t"]).topic == "t"
    assert parse_args(["offsets", "--topic", "t", "--time", "earliest"]).topic == "t"
    assert parse_args(["topic", "describe", "--topic", "t"]).name == "t"
    assert parse_args(["topic", "create", "a", "--topic", "b", "--partitions", "3"]).name == ["a", "b"]
    for module, argv in ((group, ["list"]), (cluster, ["status"]), (scrub, ["--now"])):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args([*argv, "--bootstrap-server", "h:2"]).bootstrap in ("h:2", ["h:2"]), module


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["consume", "t", "--topic", "u"], "two topics given (t, u)"),
        (["consume"], "give the topic, as TOPIC or --topic TOPIC"),
        (["topic", "create", "--partitions", "1"], "give at least one topic name"),
    ],
)
def test_a_missing_or_doubled_topic_is_refused_with_what_to_do(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err
    assert parse_args(["consume", "t", "--topic", "t"]).topic == "t"  # the same topic twice is one
