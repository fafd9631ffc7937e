"""Deterministic multi-site simulation of georep's replication (STYLE.md §2).

``python -m georep.sim --seed N --topology NAME`` replays one run;
``python -m georep.sim --seeds A..B`` runs a swarm. See ``simulator.py``;
``--cluster`` runs one site's segment cluster (``cluster.py``), and
``--geo-cluster`` the multi-site simulator with a multi-node site
(``geo_cluster.py``).
"""

from georep.sim.checker import InvariantChecker, InvariantViolation
from georep.sim.faults import FaultCounts, Faults
from georep.sim.simulator import SimConfig, SimResult, SimulationFailure, Simulator, replay_command, run_seed
from georep.sim.topologies import DEFAULT_TOPICS, TOPOLOGY_NAMES, build_topology

__all__ = [
    "DEFAULT_TOPICS",
    "TOPOLOGY_NAMES",
    "FaultCounts",
    "Faults",
    "InvariantChecker",
    "InvariantViolation",
    "SimConfig",
    "SimResult",
    "SimulationFailure",
    "Simulator",
    "build_topology",
    "replay_command",
    "run_seed",
]
