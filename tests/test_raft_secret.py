"""The Raft secret (issue 12, docs/security.md "Raft"): a TLS site's Raft metadata port takes only messages sealed
with the site's secret. Real processes: a 3-node TLS site forms and commits a topic through Raft, while a plaintext
pysyncobj message and a fourth node with another secret are refused, change nothing and show in the logs."""

from __future__ import annotations

import pickle
import socket
import stat
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from georep.auth.principal import node_principal
from georep.cli.topology_arg import load_topology
from georep.cli.up import ensure_certs, site_processes
from georep.proto import georep_pb2 as pb
from georep.proto import georep_pb2_grpc as pbg
from georep.raft.store import ask_group
from georep.security import dev_ca
from georep.security.raft_secret import MIN_CHARS, RaftSecretError, new_secret, read_secret, secret_file_name
from georep.security.tls import TlsConfig, write_secret
from georep.server.process import NodeProcess
from tests.support.channels import open_channel
from tests.support.cluster_site import ClusterSite, site_toml
from tests.support.ports import free_ports
from tests.support.sites import wait_until


def test_certs_init_writes_one_secret_per_multi_node_site_and_keeps_it(tmp_path: Path) -> None:
    dev_ca.init(tmp_path, dev_ca.plan(["a", "b"], {"a": 3}, []))
    path = tmp_path / secret_file_name("a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_secret(path)
    assert len(secret) == 44  # 32 random bytes, URL-safe base64
    assert not (tmp_path / secret_file_name("b")).exists()  # one node: no Raft
    dev_ca.init(tmp_path, dev_ca.plan(["a", "b"], {"a": 3, "b": 2}, []))
    assert read_secret(path) == secret  # kept: every node of the site must have the same
    assert read_secret(tmp_path / secret_file_name("b")) != secret


@pytest.mark.parametrize(
    ("content", "mode", "says"),
    [
        (None, 0o600, "No such file"),
        (b" \n", 0o600, "is empty"),
        (b"x" * (MIN_CHARS - 1), 0o600, f"at least {MIN_CHARS}"),
        (b"x" * MIN_CHARS, 0o644, "chmod 600"),
    ],
)
def test_a_secret_file_that_cannot_serve_is_refused_with_what_to_do(
    tmp_path: Path, content: bytes | None, mode: int, says: str
) -> None:
    path = tmp_path / "raft-a.secret"
    if content is not None:
        write_secret(path, content)
        path.chmod(mode)
    with pytest.raises(RaftSecretError, match="--raft-secret-file") as raised:
        read_secret(path)
    assert says in str(raised.value)


def test_a_long_enough_private_secret_is_read_stripped(tmp_path: Path) -> None:
    path = tmp_path / "s"
    write_secret(path, b"  " + b"k" * MIN_CHARS + b"\n")
    assert read_secret(path) == b"k" * MIN_CHARS


def test_up_gives_each_node_of_a_multi_node_site_its_secret_file(tmp_path: Path) -> None:
    topology_file = tmp_path / "t.toml"
    topology_file.write_text(site_toml("a", [1, 2, 3], [4, 5, 6]) + '[sites.b]\nnodes = ["127.0.0.1:7"]\n')
    topology = load_topology(topology_file)
    procs = site_processes(topology, topology_file, tmp_path / "data", [], ensure_certs(topology, tmp_path / "data"))
    secrets = {
        p.site: p.extra_args[p.extra_args.index("--raft-secret-file") + 1]
        for p in procs
        if "--raft-secret-file" in p.extra_args
    }
    assert sorted(secrets) == ["a"] and len([p for p in procs if p.site == "a"]) == 3
    assert read_secret(Path(secrets["a"])) and Path(secrets["a"]).is_absolute()  # node.json's restart runs anywhere
    assert all("--raft-secret-file" in p.command() for p in procs if p.site == "a")


# -- real processes --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterSite, Path]]:
    root = tmp_path_factory.mktemp("raft-secret")
    certs = root / "certs"
    dev_ca.init(certs, dev_ca.plan(["a"], {"a": 4}, []))  # node 4: the intruder's certificate is a good one
    cluster = ClusterSite(root, count=3, raft_secret=certs / secret_file_name("a"))
    cluster.use_tls(certs)
    with cluster.running():
        yield cluster, certs


def raft_addresses(cluster: ClusterSite) -> list[str]:
    return [f"127.0.0.1:{p}" for p in cluster.raft_ports]


def members_seen(cluster: ClusterSite, secret: bytes | None) -> list[frozenset[str] | None]:
    views = [ask_group(a, 2.0, secret) for a in raft_addresses(cluster)]
    return [None if v is None else v.members for v in views]


def node_log(node: NodeProcess) -> str:
    path = node.data_dir / "node.log"
    return path.read_text(errors="replace") if path.exists() else ""


def create_topic(cluster: ClusterSite, certs: Path, name: str) -> None:
    with open_channel(cluster.address(1), TlsConfig.from_dir(certs)) as channel:
        pbg.NodeStub(channel).CreateTopic(pb.CreateTopicRequest(name=name, partitions=1), timeout=30)


def described_everywhere(cluster: ClusterSite, certs: Path, name: str) -> bool:
    """Every node has the topic in its metadata (each answers from its own copy)."""
    for n in cluster.nodes:
        with open_channel(cluster.address(n), TlsConfig.from_dir(certs)) as channel:
            try:
                d = pbg.NodeStub(channel).DescribeTopic(pb.DescribeTopicRequest(name=name), timeout=10)
            except grpc.RpcError:  # NOT_FOUND: not applied at this node yet
                return False
        if d.name != name:
            return False
    return True


def test_the_site_forms_and_commits_through_its_sealed_raft_port(site: tuple[ClusterSite, Path]) -> None:
    cluster, certs = site
    secret = read_secret(certs / secret_file_name("a"))
    create_topic(cluster, certs, "sealed")
    wait_until("every node has the topic", lambda: described_everywhere(cluster, certs, "sealed"), 10)
    assert members_seen(cluster, secret) == [frozenset(raft_addresses(cluster))] * 3
    assert members_seen(cluster, None) == [None] * 3  # a plaintext 'status' gets no answer
    assert members_seen(cluster, new_secret()) == [None] * 3  # nor one sealed with another secret


def plaintext_message(message: object) -> bytes:
    """A pysyncobj 0.3.17 frame as a port without a password takes it: length, then zlib of the pickle."""
    data = zlib.compress(pickle.dumps(message), 3)
    return struct.pack("i", len(data)) + data


def test_a_plaintext_add_at_a_raft_port_is_dropped_unanswered(site: tuple[ClusterSite, Path]) -> None:
    cluster, certs = site
    secret = read_secret(certs / secret_file_name("a"))
    stranger = f"127.0.0.1:{free_ports(1)[0]}"
    for address in raft_addresses(cluster):  # one of them is the leader, which would add it on a plaintext port
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(plaintext_message(["add", stranger]))
            try:
                answer = conn.recv(1 << 16)
            except ConnectionResetError:
                answer = b""
        assert answer == b"", f"{address} answered a plaintext message: {answer!r}"
    assert members_seen(cluster, secret) == [frozenset(raft_addresses(cluster))] * 3
    wait_until(
        "a member logs the refused message",
        lambda: any("not sealed with this node's Raft secret" in node_log(n) for n in cluster.nodes.values()),
        10,
    )


def test_a_node_with_another_secret_neither_joins_nor_changes_metadata(
    site: tuple[ClusterSite, Path], tmp_path: Path
) -> None:
    cluster, certs = site
    secret = read_secret(certs / secret_file_name("a"))
    wrong = tmp_path / "wrong.secret"
    write_secret(wrong, new_secret())
    grpc_port, raft_port = free_ports(2)
    # The site's three nodes and itself as a fourth: it claims to be a member of site a
    topology = tmp_path / "topology.toml"
    topology.write_text(site_toml("a", [*cluster.grpc_ports, grpc_port], [*cluster.raft_ports, raft_port]))
    intruder = NodeProcess(
        "a",
        tmp_path / "intruder",
        listen=f"127.0.0.1:{grpc_port}",
        extra_args=[
            "--node-id",
            "4",
            "--topology",
            str(topology),
            "--scrub-bytes-per-s",
            "0",
            "--raft-secret-file",
            str(wrong),
        ],
        tls=TlsConfig.from_dir(certs, node_principal("a", 4)),
    )
    intruder.launch()
    try:
        wait_until(
            "the intruder says what to check",
            lambda: "--raft-secret-file" in node_log(intruder) and "no Raft leader" in node_log(intruder),
            30,
        )
        assert intruder.alive()  # waiting for a majority it never gets; it serves nothing meanwhile
        assert not (intruder.data_dir / "node.json").exists()
        log = node_log(intruder)
        assert "added to the site's group" not in log and "is a member of the running group" not in log
        assert members_seen(cluster, secret) == [frozenset(raft_addresses(cluster))] * 3
        wait_until(
            "every member logs the refused messages",
            lambda: all("not sealed with this node's Raft secret" in node_log(n) for n in cluster.nodes.values()),
            10,
        )
        create_topic(cluster, certs, "after")  # the group commits as before
        wait_until("every node has the topic", lambda: described_everywhere(cluster, certs, "after"), 10)
    finally:
        intruder.stop()


def test_a_tls_node_of_a_multi_node_site_without_the_secret_refuses_to_start(
    site: tuple[ClusterSite, Path], tmp_path: Path
) -> None:
    cluster, certs = site
    tls = TlsConfig.from_dir(certs, node_principal("a", 1))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "georep.cli",
            "node",
            "--site",
            "a",
            "--node-id",
            "1",
            "--topology",
            str(cluster.topology),
            "--data-dir",
            str(tmp_path / "d"),
            "--tls-ca",
            str(tls.ca),
            "--tls-cert",
            str(tls.cert),
            "--tls-key",
            str(tls.key),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--raft-secret-file raft-a.secret" in run.stderr and "georep certs init" in run.stderr, run.stderr
