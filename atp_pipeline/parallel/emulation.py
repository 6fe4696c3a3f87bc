"""Emulated interconnect: each collective takes the time the topology model predicts.

:class:`TopologyEmulator` gives :class:`~atp_pipeline.parallel.comm.Comm` the modeled
duration of a collective from its kind, mesh dimension and size — Eq. 3-4 bandwidths of
the mesh on a topology (:mod:`atp_pipeline.planning.bandwidth`) and the planner's
per-collective time (:func:`atp_pipeline.planning.cost.collective_seconds`), so the
emulated step and the planner's prediction are one model. The real transfer still happens
(results stay exact); the wait just ends no earlier than launch + modeled time, by
sleeping, so on one host topology effects and overlap become measurable. ``slowdown``
scales the modeled times (a tiny CPU model moves kilobytes, which a datasheet link carries
in microseconds). Everything measured this way is labelled emulated by its producers.
"""

from __future__ import annotations

from typing import Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.bandwidth import dimension_bandwidth
from atp_pipeline.planning.cost import collective_seconds
from atp_pipeline.topology.model import Topology


class TopologyEmulator:
    def __init__(self, topology: Topology, mesh: Tuple[int, int], slowdown: float = 1.0) -> None:
        d1, d2 = mesh
        if d1 * d2 != topology.world_size:
            raise ConfigError(f"emulating mesh {d1}x{d2} needs a topology of {d1 * d2} devices; "
                              f"'{topology.name}' has {topology.world_size}")
        if not slowdown > 0:
            raise ConfigError(f"emulation slowdown must be > 0, got {slowdown}")
        self.topology, self.mesh, self.slowdown = topology, mesh, slowdown
        self.dims = {"d1": dimension_bandwidth(topology, mesh, 1),
                     "d2": dimension_bandwidth(topology, mesh, 2)}

    def seconds(self, kind: str, axis: str, nbytes: int) -> float:
        dim = self.dims.get(axis)
        if dim is None or dim.size == 1:
            return 0.0
        return self.slowdown * collective_seconds(kind, dim.size, nbytes, dim.B_GBps, dim.B_prime_GBps)

    def describe(self) -> dict:
        return {"emulated": True, "topology": self.topology.name, "mesh": list(self.mesh),
                "slowdown": self.slowdown,
                "B_GBps": {k: v.B_GBps for k, v in self.dims.items()},
                "B_prime_GBps": {k: v.B_prime_GBps for k, v in self.dims.items()}}
