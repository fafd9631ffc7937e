"""Issue 20, item 10: ``georep node`` refuses a flag that cannot apply in the configuration given, with the reason
and what to do (exit 2), instead of ignoring it (``--node-id 2`` without a topology ran a one-node site)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from georep.security import dev_ca
from tests.support.ports import free_ports
from tests.support.sites import topology_toml

ONE_NODE = "one-node"  # a topology listing one node for site a
NONE = "none"  # no --topology

CASES = [
    (
        NONE,
        ["--insecure", "--node-id", "2"],
        "--node-id 2: only a node of a multi-node site uses it, and this node "
        "runs without --topology, so it is the only node of its site: pass --topology with a file that lists the "
        "site's nodes, or drop the flag",
    ),
    (NONE, ["--insecure", "--replication-factor", "2"], "--replication-factor 2: only a node of a multi-node site"),
    (ONE_NODE, ["--insecure", "--replication-factor", "2"], "the topology lists one node for site 'a'"),
    (ONE_NODE, ["--insecure", "--min-insync-replicas", "1"], "--min-insync-replicas 1: only a node of a multi-node"),
    (ONE_NODE, ["--insecure", "--session-timeout-ms", "1500"], "--session-timeout-ms 1500: only a node of a multi"),
    (NONE, ["--insecure", "--repair-delay-ms", "0"], "--repair-delay-ms 0: only a node of a multi-node site"),
    (ONE_NODE, ["--insecure", "--raft-secret-file", "raft-a.secret"], "--raft-secret-file raft-a.secret: only a"),
    (
        NONE,
        ["--insecure", "--stall-ms", "100"],
        "--stall-ms 100: it times the failover between upstreams, and this node runs without --topology",
    ),
    (
        NONE,
        ["--insecure", "--kafka-commit-acks", "geo:2"],
        "--kafka-commit-acks geo:2: it sets up the Kafka listener, "
        "and the node has none: add --kafka-listen HOST:PORT, or drop the flag",
    ),
    (NONE, ["--insecure", "--kafka-sasl", "scram"], "--kafka-sasl scram: it sets up the Kafka listener"),
    (
        NONE,
        ["--insecure", "--super-user", "client:bob"],
        "--super-user: a node started with --insecure authorizes no call",
    ),
    (
        NONE,
        ["--admin-token-file", "token"],
        "--admin-token-file token: a TLS node authorizes admin calls by the caller's principal",
    ),
]


@pytest.mark.parametrize(("topology", "flags", "message"), CASES, ids=[" ".join(c[1][-2:]) for c in CASES])
def test_a_flag_that_cannot_apply_is_refused_with_the_reason(
    tmp_path: Path, topology: str, flags: list[str], message: str
) -> None:
    args = [
        sys.executable,
        "-m",
        "georep.cli",
        "node",
        "--site",
        "a",
        "--data-dir",
        str(tmp_path / "a"),
        "--listen",
        f"127.0.0.1:{free_ports(1)[0]}",
    ]
    if topology == ONE_NODE:
        topology_file = tmp_path / "topology.toml"
        topology_file.write_text(topology_toml({"a": free_ports(1)[0]}, []))
        args += ["--topology", str(topology_file)]
    if "--insecure" not in flags:
        certs = tmp_path / "certs"
        dev_ca.init(certs, dev_ca.plan(["a"], {}, []))
        args += [
            "--tls-ca",
            str(certs / "ca.crt"),
            "--tls-cert",
            str(certs / "site-a.crt"),
            "--tls-key",
            str(certs / "site-a.key"),
        ]
    run = subprocess.run([*args, *flags], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "a" / "node.json").exists()  # refused before it served
