"""``georep drill`` creates its topic at a site that may not create topics yet.

A data dir creates topics only once it has listed each upstream's catalog (georep/server/first_sync.py): a create
waits up to ``CREATE_WAIT_S`` for that first sync. Right after the sites start, on a loaded machine, the sync took
longer than the drill's call deadline (``RPC_TIMEOUT_S``): the drill died with DEADLINE_EXCEEDED before its
workload began (test_drill.py's ``[kill]`` case, once, on a fresh-clone CI; here the create at a just-started
triangle took 6.8 s at a load average of 37). The drill now waits for the first sync (georep.cli.drill.create_topic_at).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from georep.cli.drill import RPC_TIMEOUT_S, DrillError, Site, create_topic_at
from georep.proto import georep_pb2 as pb
from tests.support.ports import free_ports
from tests.support.sites import Sites


@pytest.mark.slow  # it waits out a fresh site's first catalog sync with its upstream held down for 6 s
def test_the_drill_creates_its_topic_once_a_fresh_site_has_synced_its_catalog(make_sites: Callable[..., Sites]) -> None:
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")])
    sites.start("a")  # its upstream b is down: a holds creates back until it has listed b's catalog
    site = Site("a", sites.address("a"))

    async def scenario() -> None:
        nobody = Site("z", f"127.0.0.1:{free_ports(1)[0]}")
        with pytest.raises(DrillError, match=r"cannot create topic t at site z \(UNAVAILABLE"):
            await create_topic_at(nobody, pb.CreateTopicRequest(name="t", partitions=1), timeout_s=1)
        create = asyncio.create_task(create_topic_at(site, pb.CreateTopicRequest(name="drill-1", partitions=2)))
        # The scenario, not a wait: the first sync takes longer than one call's deadline.
        await asyncio.sleep(RPC_TIMEOUT_S + 1)
        assert not create.done(), f"the drill gave up before the site could create: {create.exception()!r}"
        await asyncio.to_thread(sites.start, "b")
        await create

    asyncio.run(scenario())
    assert set(sites.vectors("a", "drill-1")) == {0, 1}
