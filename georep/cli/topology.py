"""Showing a topology: a text summary and a picture (PNG or SVG). A shell.

``summary_text`` is pure. ``draw`` writes a file, with matplotlib imported only
when it is called (matplotlib is in the ``spark`` extra, not a core
dependency). ``main`` is what ``georep topology show [FILE]`` runs: it reads the
file (or takes the embedded default), prints the summary and the warnings,
and writes the picture.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from georep.metadata.topics import InvalidTopic, validate_topic_name
from topology.ids import SiteId
from topology.model import InvalidTopology, Topology, default_topology, parse_topology, warnings
from topology.routing import Router

STATE_STREAMING = "streaming"
STATE_DOWN = "down"
STATE_UNKNOWN = "unknown"  # its destination site did not answer, or no live state was asked for
# Edge colours by the states a destination reports for its inbound links (``SiteStatus``: georep/replication/
# links.py's LinkState, and "stalled" when an origin's records stopped arriving over a streaming link), and unknown.
STATE_COLOURS = {
    STATE_STREAMING: "#2e7d32",
    "connecting": "#1565c0",
    "stalled": "#ef6c00",
    STATE_DOWN: "#c62828",
    STATE_UNKNOWN: "#9e9e9e",
}
_OTHER_COLOUR = "#6a1b9a"  # a state this version does not know (a newer node's)
PICTURE_SUFFIXES = (".png", ".svg")

_LinkKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class LinkStatus:
    """What is known about one link: its state and, if measured, how far dst is behind src."""

    state: str = STATE_UNKNOWN
    lag_records: int | None = None
    lag_ms: int | None = None

    def lag_text(self) -> str:
        parts = []
        if self.lag_records is not None:
            parts.append(f"{self.lag_records} rec")
        if self.lag_ms is not None:
            parts.append(f"{self.lag_ms} ms")
        return " / ".join(parts)


_UNKNOWN = LinkStatus()


def _status(link_state: Mapping[_LinkKey, LinkStatus] | None, key: _LinkKey) -> LinkStatus:
    if link_state is None:
        return _UNKNOWN
    return link_state.get(key, _UNKNOWN)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _router(topology: Topology, link_state: Mapping[_LinkKey, LinkStatus] | None) -> Router:
    router = Router(topology)
    for link in topology.links_sorted():
        if _status(link_state, link.key).state == STATE_DOWN:
            router.set_link_up(link.src, link.dst, False)
    return router


def summary_text(
    topology: Topology, link_state: Mapping[_LinkKey, LinkStatus] | None = None, *, topic: str | None = None
) -> str:
    """Sites, links (filters, cost, state, lag), the preferred upstreams and the warnings.

    The routing table needs a topic when some link has a topic filter, since routes then differ per topic.
    Links whose state is "down" are left out of the routes.
    """
    ids = topology.site_ids()
    lines = [
        f"topology: {len(ids)} site{'s' if len(ids) != 1 else ''}, "
        f"{len(topology.links)} link{'s' if len(topology.links) != 1 else ''}",
        "",
        "sites:",
    ]
    lines += _table([["site", "nodes"]] + [[s, ", ".join(topology.site(s).nodes)] for s in ids])
    lines += ["", "links:"]
    if topology.links:
        rows = [["link", "cost", "state", "lag", "topics"]]
        for link in topology.links_sorted():
            status = _status(link_state, link.key)
            rows.append(
                [
                    link.describe(),
                    str(link.cost),
                    status.state,
                    status.lag_text() or "-",
                    ", ".join(str(f) for f in link.topics),
                ]
            )
        lines += _table(rows)
    else:
        lines.append("  (none)")
    filtered = not all(link.carries_everything for link in topology.links)
    lines.append("")
    if topic is None and filtered:
        lines.append("routes: some links have topic filters, so routes differ per topic; give a topic to see them")
    elif len(ids) > 1:
        router = _router(topology, link_state)
        sample = topic if topic is not None else "any"
        title = f"topic {topic!r}" if topic is not None else "every topic"
        lines.append(f"routes ({title}): the upstream each site pulls each origin's records from")
        rows = [["site \\ origin", *ids]]
        for dst in ids:
            row: list[str] = [dst]
            for origin in ids:
                upstream: SiteId | None = router.preferred_upstream(dst, origin, sample)
                row.append("-" if dst == origin else (upstream or "unreachable"))
            rows.append(row)
        lines += _table(rows)
    found = warnings(topology)
    if found:
        lines += ["", "warnings:"] + [f"  - {w}" for w in found]
    return "\n".join(lines) + "\n"


def _edge_label(topology: Topology, key: _LinkKey, status: LinkStatus) -> str:
    link = topology.link(*key)
    parts = []
    if status.state not in (STATE_STREAMING, STATE_UNKNOWN):  # the colour says these; spell out the rest
        parts.append(status.state)
    lag = status.lag_text()
    if lag:
        parts.append(f"lag {lag}")
    if not link.carries_everything:
        parts.append(", ".join(str(f) for f in link.topics))
    if link.cost != 1:
        parts.append(f"cost {link.cost}")
    return "\n".join(parts)


def draw(topology: Topology, path: Path, link_state: Mapping[_LinkKey, LinkStatus] | None = None) -> None:
    """Write a picture of the topology to ``path``; the format (PNG or SVG) follows its suffix.

    Edges are coloured by link state (green streaming, blue connecting, orange stalled, red down, grey unknown) and
    labelled with the lag when it is known, the topic filters when the link has any, and the cost
    when it is not 1. Opposite links a -> b and b -> a curve apart, so both are visible.
    """
    suffix = path.suffix.lower()
    if suffix not in PICTURE_SUFFIXES:
        raise ValueError(f"cannot draw to {path}: use a file name ending in .png or .svg")
    # Imported here: matplotlib is optional and slow to import. The object API (Figure + Agg canvas)
    # touches no global pyplot state, so drawing is safe from any thread.
    import networkx as nx
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    ids = list(topology.site_ids())
    graph = nx.DiGraph()
    graph.add_nodes_from(ids)
    keys = [link.key for link in topology.links_sorted()]
    graph.add_edges_from(keys)
    pos = nx.circular_layout(ids) if len(ids) > 1 else {ids[0]: (0.0, 0.0)}
    statuses = {key: _status(link_state, key) for key in keys}
    colours = [STATE_COLOURS.get(statuses[key].state, _OTHER_COLOUR) for key in keys]
    styles = ["dashed" if statuses[key].state == STATE_DOWN else "solid" for key in keys]
    node_size = 1800
    curve = "arc3,rad=0.18"

    fig = Figure(figsize=(7.0, 6.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    nx.draw_networkx_nodes(
        graph, pos, nodelist=ids, node_size=node_size, node_color="#e3f2fd", edgecolors="#1565c0", ax=ax
    )
    labels = {}
    for sid in ids:
        count = len(topology.site(sid).nodes)
        labels[sid] = f"{sid}\n{count} node{'s' if count != 1 else ''}"
    nx.draw_networkx_labels(graph, pos, labels=labels, font_size=9, ax=ax)
    if keys:
        nx.draw_networkx_edges(
            graph,
            pos,
            edgelist=keys,
            edge_color=colours,
            style=styles,
            width=2.0,
            arrows=True,
            arrowstyle="-|>",
            arrowsize=18,
            node_size=node_size,
            connectionstyle=curve,
            ax=ax,
        )
        edge_labels = {key: _edge_label(topology, key, statuses[key]) for key in keys}
        edge_labels = {key: text for key, text in edge_labels.items() if text}
        if edge_labels:
            nx.draw_networkx_edge_labels(
                graph,
                pos,
                edge_labels=edge_labels,
                font_size=7,
                rotate=False,
                label_pos=0.35,
                node_size=node_size,
                connectionstyle=curve,
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none"},
                ax=ax,
            )
    legend = [Line2D([0], [0], color=colour, lw=2, label=state) for state, colour in STATE_COLOURS.items()]
    ax.legend(handles=legend, loc="lower right", fontsize=8, title="link state", title_fontsize=8)
    ax.set_title(f"georep topology: {len(ids)} sites, {len(keys)} links")
    ax.margins(0.15)
    ax.set_axis_off()
    fig.savefig(path, format=suffix[1:])


LiveState = Callable[[Topology], Mapping[_LinkKey, LinkStatus]]


def main(
    argv: Sequence[str] | None = None,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    live: LiveState | None = None,
) -> int:
    """``georep topology show [FILE] [--output PICTURE] [--topic TOPIC]``. Returns the exit code."""
    stdout = out if out is not None else sys.stdout
    stderr = err if err is not None else sys.stderr
    parser = argparse.ArgumentParser(
        prog="georep topology show",
        description="Print a summary of a topology file and write a picture of it (PNG or SVG).",
    )
    parser.add_argument(
        "file", nargs="?", type=Path, help="topology TOML file (default: the embedded three-site default)"
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="picture to write, .png or .svg (default: <file name>.png, or topology.png)"
    )
    parser.add_argument("--topic", help="show the routes of this topic (needed when links have topic filters)")
    args = parser.parse_args(argv)
    if args.topic is not None:
        try:
            validate_topic_name(args.topic)
        except InvalidTopic as e:
            print(f"error: --topic: {e}", file=stderr)
            return 2
    output: Path = args.output or Path(f"{args.file.stem if args.file else 'topology'}.png")
    if output.suffix.lower() not in PICTURE_SUFFIXES:
        print(f"error: cannot write {output}: use a file name ending in .png or .svg", file=stderr)
        return 2
    if args.file is None:
        topology = default_topology()
    else:
        try:
            text = args.file.read_text(encoding="utf-8")
        except OSError as e:
            print(f"error: cannot read {args.file}: {e.strerror or e}", file=stderr)
            return 2
        except UnicodeDecodeError:
            print(f"error: {args.file} is not UTF-8 text", file=stderr)
            return 2
        try:
            topology = parse_topology(text)
        except InvalidTopology as e:
            print(f"error: {args.file}: {e}", file=stderr)
            return 2
    # The running sites, when reachable, tell each link's state and lag.
    link_state = live(topology) if live is not None else None
    stdout.write(summary_text(topology, link_state, topic=args.topic))
    try:
        draw(topology, output, link_state)
    except OSError as e:
        print(f"error: cannot write {output}: {e.strerror or e}", file=stderr)
        return 1
    print(f"\nwrote {output}", file=stdout)
    return 0
