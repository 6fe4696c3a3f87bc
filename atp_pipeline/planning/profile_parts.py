"""The parts of a device's compute profile (:mod:`.compute_profile`): fits per kernel kind, the
runtime's framework and synchronization costs, the collectives' CPU, measured grids and the
probe models a calibration ran."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from atp_pipeline.planning.kernels import (
    Kernel,
)
from atp_pipeline.planning.shape import ModelShape

Mesh = Tuple[int, int]


@dataclass(frozen=True)
class KindFit:
    """``t = alpha_s + work * per_unit_s`` (plus ``per_tensor_s`` per tensor for the optimizer);
    ``per_size``: per unit of :attr:`Kernel.size` instead of work (a calibrated profile's attention
    cores: per score element)."""

    alpha_s: float
    per_unit_s: float
    per_tensor_s: float = 0.0
    per_size: bool = False

    def units(self, k: Kernel) -> float:
        """What ``per_unit_s`` multiplies for ``k``."""
        return k.size if self.per_size else k.work


@dataclass(frozen=True)
class Framework:
    """What the runtime pays around its kernels and collectives beyond their own time (one
    set for every model: the runtime is one program of styles whatever the family):
    ``per_kernel_s`` for every kernel of the program (Python, autograd ``Function``\\ s,
    DTensor ``to_local``, views, module calls) and ``kernel_factor``, the extra fraction of
    the kernels' own time they take in the step (cache, allocator; negative where they run
    faster in the step's sequence than each timed alone); and per collective call
    ``per_collective_s`` plus ``per_collective_byte_s`` per byte it moves — the buffers,
    copies, splits and concatenations around it on the rank's own CPU (the transfer itself
    is the α-β). A kernel costs ``t·(1 + kernel_factor) + per_kernel_s`` in a step; each
    sharded parameter the step reads (:func:`~atp_pipeline.planning.step_program.param_reads`:
    DTensor ``to_local`` and its backward, each chunk's own) ``per_read_s`` besides — a layout
    with biases and split norm statistics reads ~2x the parameters of one without, for about
    as many kernels.
    Calibrated from probe models' forward and backward with their collectives skipped
    (:mod:`atp_pipeline.run.calibrate_compute`)."""

    per_kernel_s: float
    kernel_factor: float = 0.0
    per_collective_s: float = 0.0
    per_collective_byte_s: float = 0.0
    per_read_s: float = 0.0

    def collective_seconds(self, nbytes: float) -> float:
        return self.per_collective_s + nbytes * self.per_collective_byte_s


@dataclass(frozen=True)
class SyncFit:
    """What a collective costs in a step beyond the collective calibration's α-β when the
    processes share the host's cores: ``alpha_s`` per collective plus ``per_compute`` seconds
    per second of compute the rank did since its previous collective (ranks reach a
    collective apart by a share of the compute before it). Calibrated from a
    compute-then-collective loop under training's concurrency."""

    alpha_s: float
    per_compute: float = 0.0
    hidden: float = 1.0  # share of an in-flight collective's overlap with compute that is really hidden

    def seconds(self, compute_since: float) -> float:
        return self.alpha_s + self.per_compute * compute_since


@dataclass(frozen=True)
class CollectiveCPU:
    """The CPU a rank's collectives cost its process beside its compute, per group size
    ``size``: per call ``per_call[size]`` plus per byte moved ``per_byte[size]`` (the backend's
    work: its threads' wake-ups, copies, reductions, the loopback's syscalls), and the share of a
    core ``busy[size]`` kept busy per second waited in one. What bounds a step from below on a
    host with fewer cores than processes: every rank's compute and this CPU must fit on the cores,
    however much of a rank's waiting other ranks' compute fills.

    Calibrated (``stage=calibrate``) from the pure collective loops (the compute-then-collective
    loops with no compute: every rank in the same back-to-back collectives after a barrier, so
    nobody waits for a slower rank): per call and per byte. A rank blocked in a gloo collective
    sleeps (ranks waiting for a late one spend less CPU per call, not more), so time waited costs
    nothing. ``busy`` (a share of a core kept busy per second waited; 0 in a calibration's profile)
    is priced where a profile gives one."""

    busy: Mapping[int, float]
    per_call: Mapping[int, float] = field(default_factory=dict)
    per_byte: Mapping[int, float] = field(default_factory=dict)

    def call_seconds(self, size: int, nbytes: float = 0.0) -> float:
        """The CPU one collective call of a ``size``-rank group moving ``nbytes`` costs its rank's backend."""
        return _by_size(self.per_call, size) + nbytes * _by_size(self.per_byte, size)

    def share(self, size: int) -> float:
        """The busy share in a ``size``-rank group: the calibrated size's, linear in the size
        between calibrated sizes, the nearest one's beyond them."""
        return _by_size(self.busy, size)


def _by_size(values: Mapping[int, float], size: int) -> float:
    """A per-group-size value at ``size``: the calibrated size's, linear in the size between
    calibrated sizes, the nearest one's beyond them (0 for a group of one or none calibrated)."""
    if size <= 1 or not values:
        return 0.0
    pts = sorted(values.items())
    if size <= pts[0][0]:
        return pts[0][1]
    if size >= pts[-1][0]:
        return pts[-1][1]
    return next(c0 + (c1 - c0) * (size - s0) / (s1 - s0)
                for (s0, c0), (s1, c1) in zip(pts, pts[1:]) if s0 <= size <= s1)


def grid_seconds(axes: Sequence[Sequence[int]], values: Mapping[Tuple[int, ...], float], at: Sequence[int]) -> float:
    """A kernel's time from a full grid of measured ones (``values``: coordinates on ``axes`` ->
    seconds): multilinear in log(coordinate)-log(time) between the grid's nearest values on every
    axis, and beyond the grid's ends along its outermost cell (the last measured slopes)."""
    corners: List[List[Tuple[int, float]]] = []
    for axis, x in zip(axes, at):
        if len(axis) == 1:
            corners.append([(axis[0], 1.0)])
            continue
        j = min(max(sum(1 for v in axis if v <= x) - 1, 0), len(axis) - 2)
        lo, hi = axis[j], axis[j + 1]
        a = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
        corners.append([(lo, 1.0 - a), (hi, a)])
    log_t = 0.0
    for combo in itertools.product(*corners):
        w = math.prod(c[1] for c in combo)
        if w:
            log_t += w * math.log(values[tuple(c[0] for c in combo)])
    return math.exp(log_t)



@dataclass(frozen=True)
class Probe:
    """A model the calibration ran whole (forward and backward): its shape's identity
    (:meth:`~atp_pipeline.planning.shape.ModelShape` fields, :func:`shape_key`), mesh, local
    batch and sequence length. Validation refuses to count a point that matches one as out
    of sample."""

    name: str
    key: str
    mesh: Mesh
    batch: int
    seq_len: int
    processes: int = 0  # the process count it ran on (0: the profile's ``processes``)

    def to_config(self) -> Dict[str, Any]:
        return {"name": self.name, "key": self.key, "mesh": list(self.mesh), "batch": self.batch,
                "seq_len": self.seq_len, **({"processes": self.processes} if self.processes else {})}


def shape_key(shape: ModelShape) -> str:
    """A model's identity for in-sample checks: every layout-relevant field of its shape but
    batch and sequence length (those are checked apart)."""
    return (f"h{shape.hidden}/a{shape.heads}/kv{shape.kv_heads}/f{shape.ffn}/L{shape.layers}/V{shape.vocab_size}/"
            f"{shape.norm}:{shape.norm_layout}/{shape.position}/{shape.head_layout}/"
            f"{'gated' if shape.gated else 'plain'}/{'fused' if shape.qkv_fused else 'split'}/"
            f"{'bias' if shape.bias else 'nobias'}/{'tied' if shape.tied_embeddings else 'untied'}")
