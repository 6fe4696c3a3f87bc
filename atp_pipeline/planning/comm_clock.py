"""How long a placed collective takes: fitted α-β or Eq. 3–4 (:class:`CommClock`), and the emulated
interconnect's modeled time (:class:`EmulatedLinks`)."""

from __future__ import annotations

from typing import Optional, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import AlphaBeta, Collective
from atp_pipeline.planning.bandwidth import dimension_bandwidth
from atp_pipeline.planning.cost import collective_seconds
from atp_pipeline.topology.model import Topology

Mesh = Tuple[int, int]


# ----------------------------------------------------------------------------- timing
class CommClock:
    """Duration of a placed collective on ``mesh``: the topology's fitted α-β per kind and
    level (AutoDDL §3.2) where it has ``alpha_beta``, else Eq. 3–4 (:func:`collective_seconds`).
    ``emulated`` (a topology and a slowdown) adds the emulated interconnect of
    :mod:`atp_pipeline.parallel.emulation`: a collective ends no earlier than its modeled
    time there (:func:`emulated_seconds`). ``scale``: the compute profile's contention factor
    for the run's processes (gloo's transfers on a shared host take CPU like compute)."""

    def __init__(self, topo: Topology, mesh: Mesh, bytes_per_element: int,
                 emulated: Optional[Tuple[Topology, float]] = None, scale: float = 1.0) -> None:
        self.mesh, self.q, self.scale = mesh, bytes_per_element, scale
        # a single device (a 1x1 mesh's group) has no collectives to time, fitted or not
        self.ab = AlphaBeta.from_topology(topo) if topo.alpha_beta and topo.world_size > 1 else None
        self.dims = {1: dimension_bandwidth(topo, mesh, 1), 2: dimension_bandwidth(topo, mesh, 2)}
        self.emulated = None if emulated is None else EmulatedLinks(emulated[0], mesh, emulated[1])
        self.source = "alpha-beta (fitted)" if self.ab is not None else "Eq. 3-4 bandwidths"

    def seconds(self, collective: str, dim: int, nbytes: float, extra: float = 0.0) -> float:
        """The collective's time; ``extra`` (the host's synchronization cost, :class:`SyncFit`)
        adds to the real transfer, which the emulated link's time bounds from below."""
        t = self.unemulated_seconds(collective, dim, nbytes)
        if t == 0.0:
            return 0.0
        t += extra
        if self.emulated is not None:
            t = max(t, self.emulated.seconds(collective, f"d{dim}", nbytes))
        return t

    def unemulated_seconds(self, collective: str, dim: int, nbytes: float) -> float:
        """The real transfer's time (α-β or Eq. 3–4), 0 on a size-1 dimension."""
        d1, d2 = self.mesh
        size, stride = (d1, d2) if dim == 1 else (d2, 1)
        if size == 1:
            return 0.0
        if self.ab is not None:
            t = self.scale * self.ab.cost(Collective(collective), size, nbytes, stride)
        else:
            bw = self.dims[dim]
            t = collective_seconds(collective, size, nbytes, bw.B_GBps, bw.B_prime_GBps)
        return t


class EmulatedLinks:
    """The emulated interconnect's modeled time of a collective (Eq. 3–4 bandwidths of the
    mesh on ``topology``, :func:`collective_seconds`, times ``slowdown``): one formula for
    the emulator (:class:`~atp_pipeline.parallel.emulation.TopologyEmulator`) and the
    step model."""

    def __init__(self, topology: Topology, mesh: Mesh, slowdown: float = 1.0) -> None:
        d1, d2 = mesh
        if d1 * d2 != topology.world_size:
            raise ConfigError(f"emulating mesh {d1}x{d2} needs a topology of {d1 * d2} devices; "
                              f"'{topology.name}' has {topology.world_size}")
        if not slowdown > 0:
            raise ConfigError(f"emulation slowdown must be > 0, got {slowdown}")
        self.topology, self.mesh, self.slowdown = topology, mesh, slowdown
        self.dims = {"d1": dimension_bandwidth(topology, mesh, 1), "d2": dimension_bandwidth(topology, mesh, 2)}

    def seconds(self, kind: str, axis: str, nbytes: float) -> float:
        dim = self.dims.get(axis)
        if dim is None or dim.size == 1:
            return 0.0
        return self.slowdown * collective_seconds(kind, dim.size, nbytes, dim.B_GBps, dim.B_prime_GBps)
