"""The layers of georep, read from the imports of every module (``ast``: nothing is imported).

What a developer relies on: a folder's name says its layer. A module in a pure folder takes events and ``now_ms``
and returns effects; it reads no clock, opens no file or socket and starts no thread, so the simulator can drive
it exactly as the node does (docs/design.md, "Modules"). And a module never imports one of a layer above its own,
so a shell can be replaced, and the pure core tested, without the rest.

The layers, bottom to top (docs/design.md, "Layers", says why each is where it is). A module may import its own
unit and any unit below it. Pure units come first, so a pure module can import only pure code; the CLI comes
last, so no shell imports it. Every import counts: at the top of a module, inside a function, or under
``TYPE_CHECKING`` (a type a module names is a dependency too). Imports by name at run time
(``importlib.import_module``: the CLI's command table, ``topology``'s lazy names) are not seen, and need not
be: both load from their own unit or from above.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every package the project ships (pyproject.toml), so that a new one is checked too.
_FIND = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
PACKAGES = tuple(pattern.removesuffix("*") for pattern in _FIND["include"])

# Bottom to top. A unit is a folder, or one module that is a layer of its own inside a shell folder (a port).
PURE_LAYERS = (
    "georep/__init__.py",  # the version
    "topology",  # sites, links, ids, filters, routing, reach; a topology file's text
    "offsets",  # origins, coordinates, vector offsets, commits, the held table
    "georep/metadata",  # topics and their configs; the site's metadata port, its identity, ACL records
    "dedup",  # the idempotent producer's table; which replicated batches extend a vector
    "georep/record",  # the batch layout, compression, validation
    "georep/storage/api.py",  # the PartitionLog port
    "georep/broker",  # one site's decisions: append, fetch, acks, commits, repair
    "georep/replication",  # links, pull sessions, sources and sinks
    "georep/auth",  # principals, ACLs and their sync and replication rules, credentials, SASL SCRAM
    "cluster",  # a multi-node site: its metadata state machine, leadership, quorum, recovery, repair; groups
)
SHELL_LAYERS = (
    "georep/faultproxy",  # a tool of tests and benchmarks; imports nothing of georep
    "georep/storage",  # segment files, replica copies, data dirs
    "georep/raft",  # the site's metadata over Raft
    "georep/proto",  # protobuf messages, gRPC stubs, their conversion
    "georep/security",  # TLS, the dev CA, the Raft secret, the ACL pull, the RPC table of authorization
    "georep/client",  # the producer, consumer and admin clients
    "georep/server",  # a node's services: broker, gRPC handlers, replicator, segment cluster
    "georep/kafka",  # the Kafka front end over the server's broker and groups
    "georep/sim",  # the simulator: a second driver of the pure core
    "spark_jobs",  # the Spark audit and delay analytics over segment files
    "georep/node",  # one node process: wires the services, the Kafka listener and /metrics
    "georep/cli",  # the georep command
)
LAYERS = PURE_LAYERS + SHELL_LAYERS
RANK = {unit: rank for rank, unit in enumerate(LAYERS)}
PURE = frozenset(PURE_LAYERS)

# What a pure module may not import from the standard library: I/O, clocks, threads, processes, randomness, logs.
IMPURE_STDLIB = frozenset(
    {
        "asyncio",
        "concurrent",
        "datetime",
        "fcntl",
        "glob",
        "http",
        "io",
        "logging",
        "mmap",
        "multiprocessing",
        "os",
        "pathlib",
        "random",
        "sched",
        "secrets",
        "select",
        "selectors",
        "shutil",
        "signal",
        "socket",
        "socketserver",
        "sqlite3",
        "ssl",
        "subprocess",
        "sys",
        "tempfile",
        "threading",
        "time",
        "urllib.request",
        "uuid",
    }
)
# Third-party libraries a pure module may use: computations on bytes and graphs, no I/O.
PURE_THIRD_PARTY = frozenset({"cramjam", "crc32c", "lz4", "networkx", "zstandard"})
# A pure module's use of an impure standard module, and why it stays pure.
PURE_ALLOWED = {
    ("georep/record/compression.py", "threading"): "threading.local: one zstd context per thread (a context may "
    "not be shared between threads); it starts no thread and its results do not depend on the thread"
}

# Imports that run back up, each with the move that will remove it. Empty: keep it so.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # the importing file, relative to the root: "georep/server/broker.py"
    module: str  # the imported module: "georep.storage.api", "asyncio"
    line: int


def source_files(root: Path = ROOT) -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((root / package).rglob("*.py"))


def imports_of(importer: str, source: str, is_module: Mapping[str, bool]) -> Iterator[Import]:
    """Every import in ``source``; ``from X import Y`` is of ``X.Y`` when that is a module of ours, else of X."""
    for node in ast.walk(ast.parse(source, importer)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"{importer}:{node.lineno}: use absolute imports"
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                yield Import(importer, name if is_module.get(name) else node.module, node.lineno)


def module_name(relative: str) -> str:
    parts = relative.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(relative: str) -> str | None:
    """The layer unit of a file of ours (``georep/server/broker.py`` -> ``georep/server``); None if it has none."""
    if relative in RANK:
        return relative
    parts = relative.split("/")
    for depth in (2, 1):
        unit = "/".join(parts[:depth])
        if len(parts) > depth and unit in RANK:
            return unit
    return None


def violations(sources: Mapping[str, str]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> what is wrong, for every import of ``sources`` (relative path -> text)."""
    files = {module_name(relative): relative for relative in sources}
    is_module = dict.fromkeys(files, True)
    found: dict[tuple[str, str], str] = {}
    for relative, source in sorted(sources.items()):
        unit = unit_of(relative)
        if unit is None:
            found[(relative, "")] = "in no layer: add its folder to LAYERS (and to docs/design.md, 'Layers')"
            continue
        for imp in imports_of(relative, source, is_module):
            problem = _problem(unit, imp, files)
            if problem:
                found.setdefault((relative, imp.module), f"line {imp.line}: {problem}")
    return found


def _problem(unit: str, imp: Import, files: Mapping[str, str]) -> str:
    top = imp.module.split(".")[0]
    if top in PACKAGES:
        target = files.get(imp.module)
        target_unit = unit_of(target) if target else None
        if target_unit is None:
            return f"{imp.module} is no module of ours"
        if RANK[target_unit] > RANK[unit]:
            return f"{unit} imports {target_unit}, a layer above it"
        return ""
    if unit not in PURE or (imp.importer, top) in PURE_ALLOWED:
        return ""
    if top in sys.stdlib_module_names:
        impure = top in IMPURE_STDLIB or imp.module in IMPURE_STDLIB
        return f"pure {unit} imports {imp.module} (I/O, clocks, threads or randomness)" if impure else ""
    return "" if top in PURE_THIRD_PARTY else f"pure {unit} imports {imp.module}, not a pure library"


def read_sources(root: Path = ROOT) -> dict[str, str]:
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8") for path in source_files(root)}


def describe(found: Iterable[tuple[tuple[str, str], str]]) -> str:
    return "\n".join(f"  {importer} -> {module}: {why}" for (importer, module), why in sorted(found))


def test_no_import_runs_back_up_a_layer_and_pure_folders_stay_pure() -> None:
    found = violations(read_sources())
    new = {key: why for key, why in found.items() if key not in KNOWN_VIOLATIONS}
    fixed = sorted(key for key in KNOWN_VIOLATIONS if key not in found)
    assert not new, "imports that break the layering (docs/design.md, 'Layers'):\n" + describe(new.items())
    assert not fixed, f"fixed, so remove them from KNOWN_VIOLATIONS: {fixed}"


def test_every_pure_allowance_is_still_used() -> None:
    sources = read_sources()
    for importer, module in PURE_ALLOWED:
        imported = {imp.module.split(".")[0] for imp in imports_of(importer, sources[importer], {})}
        assert module in imported, f"{importer} no longer imports {module}: remove it from PURE_ALLOWED"


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        ("topology/model.py", "from georep.cli.main import main", "topology imports georep/cli, a layer above it"),
        ("georep/server/x.py", "def f():\n    from georep.kafka import server", "imports georep/kafka, a layer above"),
        ("georep/broker/x.py", "import asyncio", "pure georep/broker imports asyncio"),
        ("dedup/x.py", "from os import path", "pure dedup imports os"),
        ("cluster/x.py", "import grpc", "pure cluster imports grpc, not a pure library"),
        ("georep/record/x.py", "if TYPE_CHECKING:\n    from georep.server import broker", "imports georep/server, a"),
        ("newfolder/x.py", "", "in no layer"),
    ],
)
def test_the_checker_names_what_runs_back_up(importer: str, source: str, expected: str) -> None:
    known = {
        "georep/cli/main.py": "",
        "georep/kafka/__init__.py": "",
        "georep/kafka/server.py": "",
        "georep/server/__init__.py": "",
        "georep/server/broker.py": "",
    }
    found = violations({**known, importer: source})
    assert any(expected in why for why in found.values()), found
    assert not violations({**known, "georep/cli/x.py": "import asyncio\nfrom georep.server import broker"})
