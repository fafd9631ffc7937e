"""Issue 20's damage campaign in ``make test``: seeded damage to one site's files, 10 seeds per group of sites.

Each seed damages one file of one of three running sites, restarts it, scrubs it and waits; afterwards every
site must hold every record exactly once, or the site must have refused to start with a message that names the
file and says what to do (``tests/support/damage.py``). ``bench/damage.py --seeds N`` runs longer campaigns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.damage import Campaign

pytestmark = pytest.mark.slow

SEEDS_PER_GROUP = 10


@pytest.fixture
def campaign(tmp_path: Path) -> Iterator[Campaign]:
    running = Campaign(tmp_path).start()
    try:
        yield running
    finally:
        running.close()


@pytest.mark.parametrize("group", range(3))
def test_damage_to_one_site_never_loses_duplicates_or_hides_a_record(campaign: Campaign, group: int) -> None:
    for seed in range(group * SEEDS_PER_GROUP, (group + 1) * SEEDS_PER_GROUP):
        campaign.run_seed(seed)
