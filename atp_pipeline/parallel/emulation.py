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

from atp_pipeline.planning.comm_clock import EmulatedLinks
from atp_pipeline.topology.model import Topology


class TopologyEmulator(EmulatedLinks):
    """The modeled time of each collective (:class:`~atp_pipeline.planning.comm_clock.EmulatedLinks`,
    the formula the step-time model predicts emulated steps with), for :class:`~.comm.Comm`."""

    def __init__(self, topology: Topology, mesh: Tuple[int, int], slowdown: float = 1.0) -> None:
        super().__init__(topology, mesh, slowdown)

    def describe(self) -> dict:
        return {"emulated": True, "topology": self.topology.name, "mesh": list(self.mesh),
                "slowdown": self.slowdown,
                "B_GBps": {k: v.B_GBps for k, v in self.dims.items()},
                "B_prime_GBps": {k: v.B_prime_GBps for k, v in self.dims.items()}}
