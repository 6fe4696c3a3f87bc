"""The one place through which every collective of the runtime passes.

:class:`Comm` wraps ``torch.distributed`` on the process groups of a (dp, d1, d2) mesh and
counts, per rank, the calls, elements, bytes and time of each collective by kind and
mesh dimension (:class:`CommStats`); the planner's runtime cost model predicts exactly
these counts (:func:`atp_pipeline.planning.cost.runtime_terms`). Elements are the input
size of an all-reduce and the output (gathered) size of an all-gather. A dimension of size
1 has no collective: nothing is sent and nothing is counted.

Optionally an emulator (:class:`~atp_pipeline.parallel.emulation.TopologyEmulator`)
stretches each collective to the time the topology model predicts for its size and
dimension, on top of the real transfer: the caller's wait ends no earlier than the
modeled completion. Collectives on one mesh dimension share its links, so their modeled
transfers run one after another (a collective launched while another is in flight on the
same dimension starts when that one ends); different dimensions are independent, as in
the planner. The wait sleeps, so an emulated link occupies no CPU core and overlaps with
compute like a real one.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class Emulates(Protocol):
    def seconds(self, kind: str, axis: str, nbytes: int) -> float: ...


@dataclass
class Counter:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # time callers were blocked waiting for it
    span_s: float = 0.0  # launch to completion (overlapped compute included)
    emulated_s: float = 0.0  # modeled time imposed by the emulator (0 without)


@dataclass
class CommStats:
    """Totals since the last :meth:`reset`, keyed ``(kind, axis)``."""

    totals: Dict[Tuple[str, str], Counter] = field(default_factory=lambda: defaultdict(Counter))

    def reset(self) -> None:
        self.totals.clear()

    def elements(self) -> Dict[Tuple[str, str], int]:
        return {k: c.elements for k, c in self.totals.items()}

    def by_axis(self) -> Dict[str, Counter]:
        out: Dict[str, Counter] = defaultdict(Counter)
        for (_, axis), c in self.totals.items():
            o = out[axis]
            o.calls += c.calls
            o.elements += c.elements
            o.bytes += c.bytes
            o.wait_s += c.wait_s
            o.span_s += c.span_s
            o.emulated_s += c.emulated_s
        return dict(out)

    def to_dict(self) -> Dict[str, dict]:
        return {f"{kind}/{axis}": dict(c.__dict__) for (kind, axis), c in sorted(self.totals.items())}


class Handle:
    """An in-flight collective; :meth:`wait` blocks until it (and its emulated time) is done."""

    def __init__(self, comm: Optional["Comm"], work: Optional[dist.Work], counter: Optional[Counter],
                 start: float, modeled: float, deadline: float) -> None:
        self._comm, self._work, self._counter = comm, work, counter
        self._start, self._modeled, self._deadline = start, modeled, deadline
        self.done = counter is None

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        remaining = self._deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        end = time.perf_counter()
        assert self._counter is not None
        self._counter.wait_s += end - t0
        self._counter.span_s += end - self._start
        self._counter.emulated_s += self._modeled
        self.done = True


DONE = Handle(None, None, None, 0.0, 0.0, 0.0)


_YIELD = threading.local()


def set_yield_point(fn: Optional[Callable[[], None]]) -> None:
    """In this thread, call ``fn`` between launching a blocking collective and waiting for it
    (None: wait at once). Chunk-based overlap (:mod:`~atp_pipeline.parallel.overlap`) passes
    control to another chunk there, so the collective is in flight while that chunk computes."""
    _YIELD.fn = fn


def wait(h: "Handle") -> None:
    """Wait for ``h``, after the thread's yield point (if any) let other chunks compute."""
    fn = getattr(_YIELD, "fn", None)
    if fn is not None:
        fn()
    h.wait()


class Comm:
    """Counted (and optionally emulated) collectives on the named dimensions of a mesh."""

    def __init__(self, mesh: DeviceMesh, emulator: Optional[Emulates] = None) -> None:
        self.mesh = mesh
        self.emulator = emulator
        self.stats = CommStats()
        names = mesh.mesh_dim_names or ()
        self._groups = {n: mesh.get_group(n) for n in names}
        self._sizes = {n: mesh.size(i) for i, n in enumerate(names)}
        coord = mesh.get_coordinate() or ()
        self._ranks = {n: int(coord[i]) for i, n in enumerate(names)} if coord else {}
        self._link_free: Dict[str, float] = {}  # emulation: when each dimension's link is idle

    def size(self, axis: str) -> int:
        return self._sizes.get(axis, 1)

    def rank(self, axis: str) -> int:
        return self._ranks.get(axis, 0)

    def group(self, axis: str) -> dist.ProcessGroup:
        return self._groups[axis]

    def _launch(self, kind: str, axis: str, elements: int, nbytes: int,
                work_fn) -> Handle:
        c = self.stats.totals[(kind, axis)]
        c.calls += 1
        c.elements += elements
        c.bytes += nbytes
        start = time.perf_counter()
        modeled = deadline = 0.0
        if self.emulator is not None:
            modeled = self.emulator.seconds(kind, axis, nbytes)
            deadline = max(start, self._link_free.get(axis, 0.0)) + modeled
            self._link_free[axis] = deadline
        return Handle(self, work_fn(), c, start, modeled, deadline)

    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False) -> Handle:
        """In-place all-reduce of ``t`` over ``axis`` (``op`` "sum" or "max")."""
        if self.size(axis) == 1:
            return DONE
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        h = self._launch("all_reduce", axis, t.numel(), t.numel() * t.element_size(),
                         lambda: dist.all_reduce(t, op=reduce_op, group=self._groups[axis], async_op=True))
        if not async_op:
            wait(h)
        return h

    def all_gather(self, t: torch.Tensor, axis: str, async_op: bool = False) -> Tuple[torch.Tensor, Handle]:
        """Gather ``t`` from every rank of ``axis`` along a new leading block: the result is
        ``t.shape[0] * size`` rows, rank order."""
        n = self.size(axis)
        if n == 1:
            return t, DONE
        t = t.contiguous()
        out = torch.empty((t.shape[0] * n, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return out, self.all_gather_into(out, t, axis, async_op)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, axis: str, async_op: bool = False) -> Handle:
        """All-gather ``t`` from every rank of ``axis`` into ``out`` (``size`` times ``t``'s
        elements, rank order)."""
        if self.size(axis) == 1:
            out.copy_(t.reshape(out.shape))
            return DONE
        h = self._launch("all_gather", axis, out.numel(), out.numel() * out.element_size(),
                         lambda: _all_gather(out, t, group=self._groups[axis], async_op=True))
        if not async_op:
            wait(h)
        return h

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, axis: str,
                       op: "dist.ReduceOp.RedOpType" = dist.ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Reduce ``t`` over ``axis`` and give each rank its block of the result in ``out``
        (rank order); elements counted: the input's (nccl-tests' convention)."""
        if self.size(axis) == 1:
            out.copy_(t.reshape(out.shape))
            return DONE
        h = self._launch("reduce_scatter", axis, t.numel(), t.numel() * t.element_size(),
                         lambda: _reduce_scatter(out, t, op=op, group=self._groups[axis], async_op=True))
        if not async_op:
            wait(h)
        return h


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REGISTRY: Dict[int, Comm] = {}


def comm_for(mesh: DeviceMesh, emulator: Optional[Emulates] = None) -> Comm:
    """The :class:`Comm` of ``mesh`` (one per mesh, so all layers share its counters)."""
    key = id(mesh)
    comm = _REGISTRY.get(key)
    if comm is None or comm.mesh is not mesh:
        comm = _REGISTRY[key] = Comm(mesh, emulator)
    elif emulator is not None:
        comm.emulator = emulator
    return comm
