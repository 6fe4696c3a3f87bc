"""Builders for common interconnects, as plain topology-config dicts.

They produce exactly what a ``conf/topology/*.yaml`` holds (same schema, same
validation), so a preset can be regenerated and sized from the command line::

    python -m atp_pipeline.topology.builders torus2d --rows 32 --cols 32 --link-GBps 25 \\
        --name torus32 > ~/myconf/topology/torus32.yaml
    python train.py hydra.searchpath=[file://$HOME/myconf] topology=torus32 stage=plan
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

import yaml

TopologyDict = Dict[str, Any]


def ring_matrix(count: int, link_GBps: float) -> List[List[float]]:
    """P2P matrix of ``count`` units on a bidirectional ring of ``link_GBps`` links.

    Neighbours i±1 are joined by one link; on a 2-ring both of a unit's links reach the
    same neighbour, so that pair has twice the link bandwidth.
    """
    m = [[0.0] * count for _ in range(count)]
    if count == 2:
        m[0][1] = m[1][0] = 2.0 * link_GBps
    elif count > 2:
        for i in range(count):
            m[i][(i + 1) % count] = m[i][(i - 1) % count] = float(link_GBps)
    return m


def switched(count: int, GBps: float, name: str = "switch", unit: str = "gpu",
             description: str = "") -> TopologyDict:
    """``count`` devices behind one non-blocking switch: a one-level matrix, P2P = group."""
    return {
        "name": name,
        "description": description or f"{count} devices on a non-blocking {GBps:g} GB/s switch",
        "levels": [{"name": unit, "count": count, "p2p_GBps": GBps, "group_GBps": GBps,
                    "routing": "direct"}],
    }


def torus2d(rows: int, cols: int, link_GBps: float, name: str = "torus2d",
            description: str = "") -> TopologyDict:
    """A ``rows`` x ``cols`` 2D torus as ATP §3.4 / Figure 7(b) describes it.

    The outer level holds ``rows`` rings; two adjacent rings are joined by ``cols`` links
    (one per device), so their P2P bandwidth is ``cols*link`` and a ring's group bandwidth
    (both directions) twice that. The inner level is one ring of ``cols`` devices with
    ``link`` to each neighbour and ``2*link`` group bandwidth. Both levels are routed:
    torus chips forward traffic for each other.
    """
    return {
        "name": name,
        "description": description or f"{rows}x{cols} 2D torus, {link_GBps:g} GB/s per link",
        "levels": [
            {"name": "ring", "count": rows, "p2p_GBps": ring_matrix(rows, cols * link_GBps),
             "group_GBps": 2.0 * cols * link_GBps,
             "routing": "routed"},
            {"name": "chip", "count": cols, "p2p_GBps": ring_matrix(cols, link_GBps),
             "group_GBps": 2.0 * link_GBps, "routing": "routed"},
        ],
    }


def nodes(n_nodes: int, per_node: int, inter_GBps: float, intra_p2p_GBps: float,
          intra_group_GBps: float, name: str = "cluster", description: str = "") -> TopologyDict:
    """``n_nodes`` nodes on a switched network, ``per_node`` fully connected devices each."""
    return {
        "name": name,
        "description": description or f"{n_nodes} nodes x {per_node} devices",
        "levels": [
            {"name": "node", "count": n_nodes, "p2p_GBps": inter_GBps, "group_GBps": inter_GBps,
             "routing": "direct"},
            {"name": "gpu", "count": per_node, "p2p_GBps": intra_p2p_GBps,
             "group_GBps": intra_group_GBps, "routing": "direct"},
        ],
    }


class _FlowRows(list):
    """A matrix row, dumped in flow style so a YAML matrix reads as a matrix."""


def _represent_row(dumper: yaml.SafeDumper, data: _FlowRows) -> Any:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", list(data), flow_style=True)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_FlowRows, _represent_row)


def _numbers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        rows = [_numbers(v) for v in value]
        numeric = rows and all(isinstance(v, (int, float)) for v in rows)
        return _FlowRows(rows) if numeric else rows
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    return value


def to_yaml(topology: TopologyDict, header: Optional[str] = None) -> str:
    """The topology as a ``conf/topology`` YAML file (matrices one row per line)."""
    text = yaml.dump(_numbers(topology), Dumper=_Dumper, sort_keys=False, width=200)
    return (f"# {header}\n" if header else "") + text


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atp_pipeline.topology.builders",
                                     description="Write a topology config (YAML) to stdout.")
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("switched", help="one level: devices on a non-blocking switch")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--GBps", type=float, required=True)
    t = sub.add_parser("torus2d", help="two levels: rings of a 2D torus (Figure 7b)")
    t.add_argument("--rows", type=int, required=True)
    t.add_argument("--cols", type=int, required=True)
    t.add_argument("--link-GBps", type=float, required=True)
    n = sub.add_parser("nodes", help="two levels: switched nodes of fully connected devices")
    n.add_argument("--nodes", type=int, required=True)
    n.add_argument("--per-node", type=int, required=True)
    n.add_argument("--inter-GBps", type=float, required=True)
    n.add_argument("--intra-p2p-GBps", type=float, required=True)
    n.add_argument("--intra-group-GBps", type=float, required=True)
    for sp in (p, t, n):
        sp.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    if args.kind == "switched":
        topo = switched(args.count, args.GBps, name=args.name)
    elif args.kind == "torus2d":
        topo = torus2d(args.rows, args.cols, args.link_GBps, name=args.name)
    else:
        topo = nodes(args.nodes, args.per_node, args.inter_GBps, args.intra_p2p_GBps,
                     args.intra_group_GBps, name=args.name)
    from atp_pipeline.topology.model import Topology  # validate before writing

    Topology.from_config(topo)
    sys.stdout.write(to_yaml(topo, header=f"generated by python -m atp_pipeline.topology.builders "
                                          f"{' '.join(argv if argv is not None else sys.argv[1:])}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
