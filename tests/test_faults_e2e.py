"""Process-level faults on the default triangle: a site frozen with SIGSTOP for 30 s under load, and a site
rebuilt from an empty data dir under load. Every acknowledged record ends up at every site exactly once
(I1-I4), and the rebuilt site takes a new epoch and gets back the records its old epoch wrote."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable

import pytest

from georep.proto import georep_pb2 as pb
from tests.support.sites import TRIANGLE, Sites, check_invariants, converged, produce, wait_until

pytestmark = pytest.mark.slow
TOPIC = "events"
FREEZE_S = 30


class Load:
    """A producer writing to one site in a thread until stopped; ``sent`` holds what was acknowledged."""

    def __init__(self, address: str, prefix: str) -> None:
        self.address, self.prefix = address, prefix
        self.sent: set[tuple[bytes, bytes]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        wave = 0
        while not self._stop.is_set():
            self.sent |= asyncio.run(produce(self.address, TOPIC, f"{self.prefix}{wave}", 100))
            wave += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the producer did not finish"


def triangle(make_sites: Callable[..., Sites]) -> Sites:
    sites = make_sites(["a", "b", "c"], TRIANGLE)
    sites.start()
    sites.stub("a").CreateTopic(pb.CreateTopicRequest(name=TOPIC, partitions=3), timeout=5)
    wait_until("every site has the topic", lambda: all(sites.vectors(s, TOPIC) for s in "bc"), 30)
    return sites


def test_a_site_frozen_for_30_s_under_load_catches_up_and_loses_nothing(make_sites: Callable[..., Sites]) -> None:
    sites = triangle(make_sites)
    b = sites.nodes["b"]
    with Load(sites.address("a"), "a") as load_a, Load(sites.address("c"), "c") as load_c:
        time.sleep(1)
        os.kill(b.pid, signal.SIGSTOP)
        try:
            time.sleep(FREEZE_S)  # a and c go on meanwhile, replicating to each other
        finally:
            os.kill(b.pid, signal.SIGCONT)
        time.sleep(2)
    sent = load_a.sent | load_c.sent
    assert len(sent) >= 400
    wait_until("b catches up after the freeze", lambda: converged(sites, ["a", "b", "c"], TOPIC, len(sent)), 90)
    check_invariants(sites, ["a", "b", "c"], TOPIC, sent)
    assert b.alive()


def test_a_site_rebuilt_from_an_empty_dir_under_load_gets_everything_back(make_sites: Callable[..., Sites]) -> None:
    sites = triangle(make_sites)
    b = sites.nodes["b"]
    before_b = asyncio.run(produce(sites.address("b"), TOPIC, "old-b", 300))
    wait_until("b's records reach a and c", lambda: converged(sites, ["a", "b", "c"], TOPIC, 300), 60)
    old_epoch = sites.status("b").epoch
    with Load(sites.address("a"), "a") as load_a:
        time.sleep(1)
        b.kill9()
        shutil.rmtree(b.data_dir)  # the disk is lost
        time.sleep(1.1)  # a new epoch is the creation time in seconds: make it differ
        b.start()
        time.sleep(2)
    assert sites.status("b").epoch != old_epoch  # rebuilt: never re-issues the old epoch's coordinates
    after_b = asyncio.run(produce(sites.address("b"), TOPIC, "new-b", 100))
    sent = before_b | load_a.sent | after_b
    wait_until("the rebuilt b holds everything", lambda: converged(sites, ["a", "b", "c"], TOPIC, len(sent)), 90)
    check_invariants(sites, ["a", "b", "c"], TOPIC, sent)
