"""The step a user pays: compute + exposed communication per candidate plan (issue 15).

Eq. 2–4 rank meshes by communication alone; this model predicts the whole training step
of one tensor-parallel replica on ``DeviceMesh(d1, d2)`` and what it adds up to:

* **Compute**: every local kernel of the step at its *local* shape — the GEMMs of the
  column-/row-first linears (forward, input gradient, weight gradient), the attention core
  on ``heads/(d1·d2)`` heads, the norms and the elementwise kernels between them, the
  optimizer — each timed by a :class:`ComputeProfile`: a measured time where the
  calibration measured that very shape, else the kind's fitted ``t = α + work·γ`` (work =
  FLOPs for GEMM and attention, elements otherwise). A profile is calibrated on the device
  (``python -m atp_pipeline.run.calibrate_compute``, under the concurrency of training) or
  derived from the device's spec (``peak_TFLOPs`` with an efficiency curve, stated as such).
* **Communication**: exactly the collectives of the runtime cost model
  (:func:`atp_pipeline.planning.cost.comm_terms` with ``cost_model=runtime``), each placed
  where the runtime sends it — the schedule is built *from* those terms, and every term is
  placed once (a test sums the schedule by kind and dimension against the cost model).
  A collective's duration is the topology's fitted α-β for its kind and level
  (AutoDDL §3.2) where it has one, else Eq. 3–4's bandwidths (:func:`collective_seconds`).
  Collectives on one mesh dimension run one after another (one group, one link), as in
  the runtime's :class:`~atp_pipeline.parallel.comm.Comm`.
* **Overlap as the runtime does it**: the forward pass of a block runs ``chunks`` pieces
  of the batch as a wavefront over its stages (§4.1, Figure 8): a stage launches its
  collective and the chunk waits for it only when it starts its next stage, so one
  chunk's collective is hidden behind the next chunk's compute. In the backward pass
  (reverse order of the forward's kernels, as autograd runs them) each linear's
  input-gradient all-reduce runs while its weight-gradient GEMM computes (§4.2), and the
  chunks' backwards take turns the same way at every collective (each chunk's graph is its
  own, :mod:`~atp_pipeline.parallel.overlap`). Then the optimizer step and, with ``dp > 1``, the
  data-parallel gradient sync under the configured aggregation mode
  (:mod:`atp_pipeline.planning.gradsync`, not overlapped).

* **What the runtime pays beyond kernels and α-β** — three calibrated terms of the profile,
  each measured in the compute calibration's own run and named in every prediction
  (:meth:`ComputeProfile.describe`): :class:`Dispatch`, the framework cost around each
  kernel (per layout: ``seconds·(1 + kernel_factor) + per_kernel_s``; from the runtime's own
  forward and backward with its collectives skipped); :class:`SyncFit`, what a collective
  costs in a step when processes share the cores (``alpha + per_compute × compute since the
  rank's previous collective``, from compute-then-collective loops) and the share ``hidden``
  of a collective's overlap with compute that compute really hides (from
  collective-during-compute loops; on CPU the transfer takes cycles from compute); and the
  optimizer kernel timed as training runs it (foreach AdamW over DTensor parameters).

The step is simulated on one rank's timeline (:func:`simulate`): compute advances the
clock, a wait moves it to the collective's end. ``exposed = step - compute`` is the
communication the user pays; ``total_comm`` is what Eq. 2-style sums would charge.
Tokens/s and model FLOPs utilization (MFU: the model's FLOPs of §5, ``shape.flops_per_step``,
over step time × devices × the profile's peak) follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from atp_pipeline.config.schema import CostModel
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.bandwidth import dimension_bandwidth
from atp_pipeline.planning.cost import CommTerm, collective_seconds, comm_terms
from atp_pipeline.planning.sbp.alphabeta import AlphaBeta, Collective
from atp_pipeline.planning.shape import KV_GATHERED, KV_PICK, KV_SCATTER, ModelShape, kv_placement
from atp_pipeline.topology.model import Topology

Mesh = Tuple[int, int]

# ----------------------------------------------------------------------------- kernels
GEMM, ATTN_FWD, ATTN_BWD, NORM_FWD, NORM_BWD, POINTWISE, OPTIMIZER = (
    "gemm", "attention_fwd", "attention_bwd", "norm_fwd", "norm_bwd", "pointwise", "optimizer")
KINDS = (GEMM, ATTN_FWD, ATTN_BWD, NORM_FWD, NORM_BWD, POINTWISE, OPTIMIZER)


@dataclass(frozen=True)
class Kernel:
    """One local kernel: ``gemm`` dims ``(M, K, N)`` (``[M,K] @ [K,N]``); attention
    ``(batch, heads, seq, head_dim)``; norms, pointwise ``(elements,)``; optimizer
    ``(tensors, elements)``."""

    kind: str
    dims: Tuple[int, ...]

    @property
    def work(self) -> float:
        """FLOPs (GEMM: ``2MKN``; attention forward ``4·b·a·s²·d``, backward twice that),
        else elements."""
        if self.kind == GEMM:
            m, k, n = self.dims
            return 2.0 * m * k * n
        if self.kind in (ATTN_FWD, ATTN_BWD):
            b, a, s, d = self.dims
            return (4.0 if self.kind == ATTN_FWD else 8.0) * b * a * s * s * d
        return float(self.dims[-1])

    @property
    def flops(self) -> float:
        return self.work if self.kind in (GEMM, ATTN_FWD, ATTN_BWD) else 0.0


@dataclass(frozen=True)
class KindFit:
    """``t = alpha_s + work * per_unit_s`` (plus ``per_tensor_s`` per tensor for the optimizer)."""

    alpha_s: float
    per_unit_s: float
    per_tensor_s: float = 0.0


RUNTIME = "styles"  # the layout key of the runtime's framework cost: one runtime lays out every model


def dispatch_key(layout: str, mesh: Mesh) -> str:
    """The profile's key of a layout's framework cost calibrated on one mesh: ``layout@d1xd2``."""
    return f"{layout}@{mesh[0]}x{mesh[1]}"


@dataclass(frozen=True)
class Dispatch:
    """What the runtime pays around its kernels, per layout key (:data:`RUNTIME`):
    ``per_kernel_s`` for every kernel of the program (Python, autograd ``Function``s, DTensor
    ``to_local``, views, module calls, ``Comm`` bookkeeping) and ``kernel_factor``, the extra
    fraction of the kernels' own time they take in the step (cache, allocator; negative where
    the kernels run faster in the step's sequence than each timed alone with every rank at it). A kernel's
    time in the step is ``seconds·(1 + kernel_factor) + per_kernel_s``. Calibrated from the
    runtime's own forward and backward with its collectives skipped."""

    per_kernel_s: float
    kernel_factor: float = 0.0


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
class ComputeProfile:
    """How long a device's kernels take: fitted per kind, and measured points by exact shape.

    ``name``/``source`` say which calibration a prediction used; ``processes`` how many
    processes shared the host while it was measured (training's concurrency); ``peak_flops``
    is the per-device FLOP/s MFU is quoted against."""

    name: str
    source: str
    fits: Mapping[str, KindFit]
    points: Mapping[Tuple[str, Tuple[int, ...]], float] = field(default_factory=dict)
    processes: int = 1
    peak_flops: float = 0.0
    dispatch: Mapping[str, Dispatch] = field(default_factory=dict)  # by dispatch_key(layout[, mesh])
    sync: Optional[SyncFit] = None
    optimizer: str = ""  # how the optimizer kernel was run (the runtime's)

    def dispatch_of(self, layout: str, mesh: Optional[Mesh] = None) -> Tuple[str, Optional[Dispatch]]:
        """The framework cost of ``layout`` on ``mesh``: the one calibrated on that mesh where
        there is one (the runtime's work around a kernel differs by mesh: a d2 > 1 mesh splits
        and gathers activations over d2), else the layout's fit over every mesh."""
        for key in ((dispatch_key(layout, mesh),) if mesh is not None else ()) + (layout,):
            if key in self.dispatch:
                return key, self.dispatch[key]
        return layout, None

    def step_kernel_seconds(self, k: Kernel, layout: str, mesh: Optional[Mesh] = None) -> float:
        """A kernel's time in a step of a model laid out ``layout`` on ``mesh``: the kernel's
        time with the runtime's framework cost around it (:class:`Dispatch`; the optimizer is
        calibrated as the runtime runs it, whole)."""
        t = self.seconds(k)
        d = self.dispatch_of(layout, mesh)[1]
        if d is None or k.kind == OPTIMIZER:
            return t
        return t * (1.0 + d.kernel_factor) + d.per_kernel_s

    def sync_seconds(self, compute_since: float) -> float:
        return 0.0 if self.sync is None else self.sync.seconds(compute_since)

    @property
    def hidden(self) -> float:
        """Share of the time a collective in flight overlaps compute that the compute really
        hides (1: all; on CPU the transfer takes cycles from the ranks' compute)."""
        return 1.0 if self.sync is None else self.sync.hidden

    def describe(self, layout: str, mesh: Optional[Mesh] = None) -> str:
        """Which calibrations a prediction for ``layout`` (on ``mesh``) uses, in one line."""
        parts = [f"kernels '{self.name}'"]
        key, d = self.dispatch_of(layout, mesh)
        if d is not None:
            parts.append(f"dispatch[{key}] {d.per_kernel_s * 1e6:.1f} us/kernel + {d.kernel_factor:.1%}")
        if self.sync is not None:
            parts.append(f"sync {self.sync.alpha_s * 1e6:.0f} us + {self.sync.per_compute:.3f} x compute "
                         f"per collective, {self.sync.hidden:.0%} of overlap hidden")
        if self.optimizer:
            parts.append(f"optimizer {self.optimizer}")
        return "; ".join(parts)

    def seconds(self, k: Kernel) -> float:
        hit = self.points.get((k.kind, tuple(k.dims)))
        if hit is not None:
            return hit
        fit = self.fits.get(k.kind)
        if fit is None:
            raise ConfigError(f"compute profile '{self.name}' has no fit for kernel kind '{k.kind}'")
        if k.kind == OPTIMIZER:
            return fit.alpha_s + k.dims[0] * fit.per_tensor_s + k.work * fit.per_unit_s
        return fit.alpha_s + k.work * fit.per_unit_s

    # ------------------------------------------------------------------ topology yaml
    @classmethod
    def from_config(cls, data: Mapping[str, Any], where: str = "device.compute") -> "ComputeProfile":
        """From a topology's ``device.compute`` (written by the compute calibration)."""
        try:
            fits = {}
            for kind, f in dict(data["fits"]).items():
                if kind not in KINDS:
                    raise ConfigError(f"{where}.fits: unknown kernel kind '{kind}' (one of {', '.join(KINDS)})")
                fit = KindFit(float(f["alpha_us"]) * 1e-6, float(f["ns_per_unit"]) * 1e-9,
                              float(f.get("per_tensor_us", 0.0)) * 1e-6)
                if min(fit.alpha_s, fit.per_unit_s, fit.per_tensor_s) < 0 or not all(
                        math.isfinite(x) for x in (fit.alpha_s, fit.per_unit_s, fit.per_tensor_s)):
                    raise ConfigError(f"{where}.fits.{kind}: alpha_us, ns_per_unit, per_tensor_us must be finite >= 0")
                fits[kind] = fit
            missing = [k for k in KINDS if k not in fits]
            if missing:
                raise ConfigError(f"{where}.fits: missing kernel kinds {', '.join(missing)}")
            points = {}
            for p in data.get("points") or []:
                kind, dims, us = p[0], tuple(int(x) for x in p[1]), float(p[2])
                if kind not in KINDS or not us > 0:
                    raise ConfigError(f"{where}.points: bad point {p!r} (kind, dims, microseconds > 0)")
                points[(str(kind), dims)] = us * 1e-6
            dispatch = {}
            for layout, d in dict(data.get("dispatch") or {}).items():
                dd = Dispatch(float(d["per_kernel_us"]) * 1e-6, float(d.get("kernel_factor", 0.0)))
                if not (dd.per_kernel_s >= 0 and dd.kernel_factor > -1 and math.isfinite(dd.per_kernel_s)
                        and math.isfinite(dd.kernel_factor)):
                    raise ConfigError(f"{where}.dispatch.{layout}: per_kernel_us, kernel_factor must be finite "
                                      f"(per_kernel_us >= 0, kernel_factor > -1)")
                dispatch[str(layout)] = dd
            sync = None
            if data.get("sync"):
                sd = data["sync"]
                sync = SyncFit(float(sd["alpha_us"]) * 1e-6, float(sd.get("per_compute", 0.0)),
                               float(sd.get("hidden", 1.0)))
                if not (sync.alpha_s >= 0 and sync.per_compute >= 0 and math.isfinite(sync.alpha_s)
                        and math.isfinite(sync.per_compute) and 0 <= sync.hidden <= 1):
                    raise ConfigError(f"{where}.sync: alpha_us, per_compute must be finite >= 0, hidden in [0, 1]")
            return cls(name=str(data["name"]), source=str(data.get("source", "")), fits=fits, points=points,
                       processes=int(data.get("processes", 1)), peak_flops=float(data.get("peak_GFLOPs", 0)) * 1e9,
                       dispatch=dispatch, sync=sync, optimizer=str(data.get("optimizer", "")))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"{where}: not a compute profile ({type(exc).__name__}: {exc})") from None

    def to_config(self) -> Dict[str, Any]:
        g = lambda x: float(f"{x:.6g}")  # noqa: E731
        return {"name": self.name, "source": self.source, "processes": self.processes,
                "peak_GFLOPs": g(self.peak_flops / 1e9),
                "fits": {k: {"alpha_us": g(f.alpha_s * 1e6), "ns_per_unit": g(f.per_unit_s * 1e9),
                             **({"per_tensor_us": g(f.per_tensor_s * 1e6)} if f.per_tensor_s else {})}
                         for k, f in self.fits.items()},
                **({"optimizer": self.optimizer} if self.optimizer else {}),
                **({"dispatch": {k: {"per_kernel_us": g(d.per_kernel_s * 1e6), "kernel_factor": g(d.kernel_factor)}
                                 for k, d in sorted(self.dispatch.items())}} if self.dispatch else {}),
                **({"sync": {"alpha_us": g(self.sync.alpha_s * 1e6), "per_compute": g(self.sync.per_compute),
                             "hidden": g(self.sync.hidden)}}
                   if self.sync is not None else {}),
                "points": [[k, list(d), g(s * 1e6)] for (k, d), s in sorted(self.points.items())]}

    @classmethod
    def from_spec(cls, device: Mapping[str, Any]) -> Optional["ComputeProfile"]:
        """From a device's datasheet: GEMM and attention at ``peak_TFLOPs`` times an
        efficiency curve ``e(F) = 0.7·F/(F + 2 GFLOP)`` (large GEMMs reach 70 % of peak,
        a 2-GFLOP GEMM half of that; an assumption, not a measurement), memory-bound kernels
        at ``memory_GBps`` (default 2000) over 3 accesses of 2 bytes, 5 µs per launch."""
        peak = device.get("peak_TFLOPs")
        if not peak:
            return None
        peak_flops = float(peak) * 1e12
        mem = float(device.get("memory_GBps") or 2000.0) * 1e9
        launch = 5e-6
        # e(F) folded into alpha: F/(0.7 peak F/(F+F0)) = (F + F0)/(0.7 peak) = F0/(0.7 peak) + F/(0.7 peak)
        f0 = 2e9
        gemm = KindFit(launch + f0 / (0.7 * peak_flops), 1 / (0.7 * peak_flops))
        elem = KindFit(launch, 6.0 / mem)
        fits = {GEMM: gemm, ATTN_FWD: gemm, ATTN_BWD: gemm, NORM_FWD: elem, NORM_BWD: elem,
                POINTWISE: elem, OPTIMIZER: KindFit(0.0, 16.0 / mem, launch)}
        return cls(name=f"spec:{device.get('name', 'device')}",
                   source=f"datasheet {peak:g} TFLOP/s x efficiency curve 0.7*F/(F+2 GFLOP) (assumed, not measured)",
                   fits=fits, processes=1, peak_flops=peak_flops)


def profile_of(topo: Topology) -> Optional[ComputeProfile]:
    """The topology's compute profile: its calibrated ``device.compute``, else its spec."""
    compute = topo.device.get("compute")
    if compute:
        return ComputeProfile.from_config(compute, f"topology '{topo.name}': device.compute")
    return ComputeProfile.from_spec(topo.device)


# ----------------------------------------------------------------------------- schedule
# An item of one rank's program: ("k", Kernel) computes; ("sync", Coll) blocks on a
# collective; ("async", Coll) launches one the chunk waits for at its next stage;
# ("linear", Coll) launches one the program waits for at the next ("join",) (§4.2).
Item = Tuple[Any, ...]


@dataclass(frozen=True)
class Coll:
    """A placed collective: ``share`` of a cost-model term, for ``tokens`` tokens."""

    term: CommTerm
    share: Fraction
    tokens: int

    @property
    def elements(self) -> Fraction:
        return self.term.elements_per_token * self.tokens * self.share


class Terms:
    """The cost model's terms, handed out by ``(op, phase)`` in order; every share of every
    term must be placed exactly once per block and chunk (:meth:`check_done`)."""

    def __init__(self, terms: Sequence[CommTerm]) -> None:
        self.terms = list(terms)
        self.placed: Dict[int, Fraction] = {i: Fraction(0) for i in range(len(self.terms))}

    def take(self, op: str, phase: str, tokens: int, share: Fraction = Fraction(1), nth: int = 0,
             count: Fraction = Fraction(1)) -> Optional[Coll]:
        """The ``nth`` term ``(op, phase)`` (None where the mesh has none: a size-1 dimension);
        ``count`` is the weight of this placement towards the term's total (1 per block
        placement; ``1/chunks`` per chunk)."""
        hits = [i for i, t in enumerate(self.terms) if t.op == op and t.phase == phase]
        if nth >= len(hits):
            return None
        i = hits[nth]
        self.placed[i] += share * count
        return Coll(self.terms[i], share, tokens)

    def check_done(self) -> None:
        wrong = [f"{t.op}/{t.phase}/d{t.dim} ({self.placed[i]} placed)" for i, t in enumerate(self.terms)
                 if self.placed[i] != 1]
        if wrong:
            raise ValueError(f"step model: cost-model terms not placed exactly once: {', '.join(wrong)}")


def _k(kind: str, *dims: int) -> Item:
    return ("k", Kernel(kind, tuple(int(d) for d in dims)))


def _c(mode: str, coll: Optional[Coll]) -> List[Item]:
    return [] if coll is None else [(mode, coll)]


def _linear_bwd(m: int, k: int, n: int, coll: Optional[Coll]) -> List[Item]:
    """A linear's backward (``mappings.LinearAllReduce``): input-gradient GEMM, its all-reduce
    launched, weight-gradient GEMM while it runs, then wait (§4.2)."""
    if coll is None:
        return [_k(GEMM, m, n, k), _k(GEMM, n, m, k)]
    return [_k(GEMM, m, n, k), ("linear", coll), _k(GEMM, n, m, k), ("join",)]


def _fan_in_bwd(m: int, k: int, widths: Sequence[int], coll: Optional[Coll]) -> List[Item]:
    """The backward of column-first linears reading one input (``k`` features, outputs of
    ``widths``, run in reverse): each adds its partial input gradient to the others', and the
    last to run all-reduces the sum while its weight gradient computes (§4.2; ``mappings.FanIn``)."""
    *first, last = list(reversed(widths))
    out: List[Item] = []
    for n in first:
        out += _linear_bwd(m, k, n, None)
    return out + [_k(POINTWISE, m * k)] * len(first) + _linear_bwd(m, k, last, coll)


@dataclass
class Program:
    """One rank's step: each block's items per chunk (run as the wavefront, :func:`_stages`),
    the rest in order."""

    pre: List[Item]  # embeddings, before the blocks
    blocks_fwd: List[List[List[Item]]]  # [layer][chunk] -> forward items
    blocks_bwd: List[List[List[Item]]]  # [layer][chunk] -> backward items, in execution order (layers run reversed)
    post_fwd: List[Item]  # final norm, head, loss
    post_bwd: List[Item]  # their backward, in execution order
    pre_bwd: List[Item]  # embeddings' backward
    tail: List[Item]  # optimizer
    chunks: int


def _stages(items: List[Item]) -> List[List[Item]]:
    """A chunk's items cut where it yields (the wavefront of :mod:`~atp_pipeline.parallel.overlap`):
    after a blocking collective's launch, and after a linear's weight-gradient GEMM with its
    input-gradient all-reduce in flight (§4.2); the chunk waits for what it launched when its
    next stage starts, while the other chunks compute."""
    out: List[List[Item]] = [[]]
    for item in items:
        if item[0] in ("sync", "linear"):
            out[-1].append(("async", item[1]))
            if item[0] == "sync":
                out.append([])
        elif item[0] == "join":
            out.append([])
        else:
            out[-1].append(item)
    return out


def _layer(shape: ModelShape, mesh: Mesh, T: int, batch: int, terms: Terms,
           count: Fraction) -> Tuple[List[Item], List[Item]]:
    """One block of one chunk (``T`` tokens, ``batch`` sequences) as the style plan lays it
    out: forward items in order, backward items in execution order (reverse of the forward's
    pieces, as autograd runs them). ``count`` weighs each placement towards its term."""
    d1, d2 = mesh
    h, f, s, hd = shape.hidden, shape.ffn, shape.seq_len, shape.head_dim
    q, kv = shape.q_width, shape.kv_width
    hs = h // d2
    heads_local = shape.heads // (d1 * d2)
    up = shape.ffn_matrices - 1
    layout = kv_placement(shape, d1, d2)
    rot = 2 if shape.position == "rotary" else 0

    def tk(op: str, phase: str, share: Fraction = Fraction(1), nth: int = 0) -> Optional[Coll]:
        return terms.take(op, phase, T, share=share, nth=nth, count=count)
    pieces: List[Tuple[List[Item], List[Item]]] = []

    def norm() -> None:
        g, gb = tk("norm", "fwd", Fraction(1, 2)), tk("norm", "bwd", Fraction(1, 2))
        if shape.norm_layout == "stats":  # sums over the split hidden all-reduced, then normalized
            pieces.append(([_k(NORM_FWD, T * hs), *_c("sync", g)], [_k(NORM_BWD, T * hs), *_c("sync", gb)]))
        else:  # gathered: the model's own norm on the whole hidden, sliced back
            pieces.append(([*_c("sync", g), _k(NORM_FWD, T * h), _k(POINTWISE, T * hs)],
                           [*_c("sync", gb), _k(NORM_BWD, T * h), _k(POINTWISE, T * hs)]))
    norm()
    widths = [q + 2 * kv] if shape.qkv_fused else [q, kv, kv]
    pieces.append(([x for w in widths for x in (_k(GEMM, T, hs, w // d1),
                                                *_c("sync", tk("f1", "fwd", Fraction(w, q + 2 * kv))),
                                                _k(POINTWISE, T * w // d1))],
                   _fan_in_bwd(T, hs, [w // d1 for w in widths], tk("f1", "bwd"))))
    kvf = tk("kv", "fwd") if layout == KV_GATHERED else None
    kv_pick = [tk("pick", "bwd", nth=i) for i in range(2)] if layout in (KV_PICK, KV_GATHERED) else []
    kv_scatter = tk("scatter", "bwd", nth=1) if layout == KV_SCATTER else None
    scq, gaf = tk("scatter", "bwd"), tk("gather", "fwd")
    pieces.append(([*([_k(POINTWISE, T * (q + kv) // d1)] * rot), *_c("sync", kvf),
                    _k(ATTN_FWD, batch, heads_local, s, hd), *_c("sync", gaf)],
                   [_k(ATTN_BWD, batch, heads_local, s, hd), *_c("sync", scq), *_c("sync", kv_scatter),
                    *[x for c in kv_pick for x in _c("sync", c)], *([_k(POINTWISE, T * (q + kv) // d1)] * rot)]))
    f2f, f2b = tk("f2", "fwd"), tk("f2", "bwd")
    pieces.append(([_k(GEMM, T, q // d1, hs), *_c("sync", f2f), _k(POINTWISE, T * hs)],
                   [*_linear_bwd(T, q // d1, hs, f2b), _k(POINTWISE, T * hs)]))
    norm()
    pieces.append(([x for _ in range(up) for x in (_k(GEMM, T, hs, f // d1),
                                                   *_c("sync", tk("f3", "fwd", Fraction(1, up))))],
                   _fan_in_bwd(T, hs, [f // d1] * up, tk("f3", "bwd"))))
    pieces.append(([_k(POINTWISE, T * f // d1)] * up, [_k(POINTWISE, T * f // d1)] * up))
    f4f, f4b = tk("f4", "fwd"), tk("f4", "bwd")
    pieces.append(([_k(GEMM, T, f // d1, hs), *_c("sync", f4f), _k(POINTWISE, T * hs)],
                   [*_linear_bwd(T, f // d1, hs, f4b), _k(POINTWISE, T * hs)]))
    fw = [x for a, _ in pieces for x in a]
    bw = [x for _, b in reversed(pieces) for x in b]
    return fw, bw


def _program(shape: ModelShape, mesh: Mesh, tokens: int, batch: int, chunks: int, terms: Terms) -> Program:
    """One rank's step of ``shape`` laid out by its style plan (the runtime's one layout for
    every family): each block's forward as ``chunks`` wavefront chunks cut at their
    collectives (§4.1), the backward with §4.2's overlap; embeddings before, the final norm,
    head and loss after."""
    d1, d2 = mesh
    h, V = shape.hidden, shape.vocab_size
    T, hs = tokens, h // d2
    L = shape.layers
    blocks_fwd, blocks_bwd = [], []
    for _ in range(L):
        per_chunk = [_layer(shape, mesh, T // chunks, batch // chunks, terms, Fraction(1, L * chunks))
                     for _ in range(chunks)]
        blocks_fwd.append([fw for fw, _ in per_chunk])
        blocks_bwd.append([bw for _, bw in per_chunk])
    one = Fraction(1)

    def tm(op: str, phase: str, nth: int = 0) -> Optional[Coll]:
        return terms.take(op, phase, T, nth=nth, count=one)
    post_fwd: List[Item] = []
    post_bwd_norm: List[Item] = []
    if shape.final_norm:
        g, gb = tm("norm_f", "fwd"), tm("norm_f", "bwd")
        if shape.norm_layout == "stats":
            post_fwd += [_k(NORM_FWD, T * hs), *_c("sync", g)]
            post_bwd_norm = [_k(NORM_BWD, T * hs), *_c("sync", gb)]
        else:
            post_fwd += [*_c("sync", g), _k(NORM_FWD, T * h), _k(POINTWISE, T * hs)]
            post_bwd_norm = [*_c("sync", gb), _k(NORM_BWD, T * h), _k(POINTWISE, T * hs)]
    if shape.head_layout == "tied":
        post_fwd += [_k(GEMM, T, hs, V), *_c("sync", tm("head", "fwd"))]
        head_bwd = [_k(GEMM, T, V, hs), _k(GEMM, V, T, hs)]
        loss_fwd, loss_bwd = [_k(POINTWISE, T * V)] * 3, [_k(POINTWISE, T * V)] * 2
    elif shape.head_layout == "gathered":
        Vl = V // d1
        post_fwd += [_k(GEMM, T, hs, Vl), *_c("sync", tm("head", "fwd", 0)), *_c("sync", tm("head", "fwd", 1))]
        head_bwd = [_k(POINTWISE, T * Vl), *_linear_bwd(T, hs, Vl, tm("head", "bwd"))]
        loss_fwd, loss_bwd = [_k(POINTWISE, T * V)] * 3, [_k(POINTWISE, T * V)] * 2  # the model's own loss
    else:  # vocab_parallel: max and sums of the split logits over d1
        Vl = V // d1
        post_fwd += [_k(GEMM, T, hs, Vl), *_c("sync", tm("head", "fwd"))]
        head_bwd = _linear_bwd(T, hs, Vl, tm("head", "bwd"))
        loss_fwd = [_k(POINTWISE, T * Vl), *_c("sync", tm("loss", "fwd", 0)), _k(POINTWISE, T * Vl),
                    _k(POINTWISE, T * Vl), _k(POINTWISE, T * Vl), *_c("sync", tm("loss", "fwd", 1))]
        loss_bwd = [_k(POINTWISE, T * Vl)] * 3
    post_fwd += loss_fwd
    post_bwd = loss_bwd + head_bwd + post_bwd_norm
    emb = tm("embed", "bwd") if shape.gathered_embeddings else None
    embeds = (2 if shape.position == "learned" else 1)
    pre = [_k(POINTWISE, T * hs)] * (embeds + shape.gathered_embeddings)
    pre_bwd = [_k(POINTWISE, T * hs)] * embeds + _c("sync", emb)
    return Program(pre, blocks_fwd, blocks_bwd, post_fwd, post_bwd, pre_bwd, [], chunks)


def optimizer_kernel(shape: ModelShape, mesh: Mesh) -> Kernel:
    """The optimizer step over this rank's parameter tensors (elements per device of
    :func:`~atp_pipeline.planning.memory.per_device_memory`)."""
    from atp_pipeline.planning.memory import per_device_memory

    params = per_device_memory(shape, mesh).params
    linears = (1 if shape.qkv_fused else 3) + 1 + shape.ffn_matrices
    norm_tensors = 2 if shape.norm == "layernorm" else 1
    per_layer = linears * (2 if shape.bias else 1) + 2 * norm_tensors
    tensors = (shape.layers * per_layer + 1 + (1 if shape.position == "learned" else 0)
               + (norm_tensors if shape.final_norm else 0) + (0 if shape.tied_embeddings else 1))
    return Kernel(OPTIMIZER, (tensors, int(params)))


def build_program(shape: ModelShape, mesh: Mesh, batch: int, chunks: int,
                  terms: Optional[Sequence[CommTerm]] = None) -> Tuple[Program, Terms]:
    """One rank's program for ``batch`` sequences on ``mesh`` in ``chunks`` pieces, its
    collectives placed from the runtime cost model's terms (all of them, exactly once)."""
    if terms is None:
        terms = comm_terms(CostModel.runtime, shape, mesh)
    t = Terms(terms)
    tokens = batch * shape.seq_len
    if batch % chunks:
        raise ConfigError(f"step model: chunks={chunks} does not divide the local batch {batch}")
    prog = _program(shape, mesh, tokens, batch, chunks, t)
    prog.tail = [("k", optimizer_kernel(shape, mesh))]
    t.check_done()
    return prog, t


def placed_elements(prog: Program) -> Dict[Tuple[str, str], int]:
    """Elements per step by ``(collective, "d1"|"d2")`` of the program's collectives (to be
    equal to :func:`~atp_pipeline.planning.cost.predicted_elements` of the same terms)."""
    out: Dict[Tuple[str, str], Fraction] = {}
    for item in _all_items(prog):
        if item[0] in ("sync", "async", "linear"):
            c: Coll = item[1]
            key = (c.term.collective, f"d{c.term.dim}")
            out[key] = out.get(key, Fraction(0)) + c.elements
    return {k: int(v) for k, v in out.items()}


def _all_items(prog: Program) -> Iterable[Item]:
    yield from prog.pre
    for layer in prog.blocks_fwd:
        for chunk in layer:
            yield from chunk
    yield from prog.post_fwd
    yield from prog.post_bwd
    for layer in prog.blocks_bwd:
        for chunk in layer:
            yield from chunk
    yield from prog.pre_bwd
    yield from prog.tail


# ----------------------------------------------------------------------------- timing
class CommClock:
    """Duration of a placed collective on ``mesh``: the topology's fitted α-β per kind and
    level (AutoDDL §3.2) where it has ``alpha_beta``, else Eq. 3–4 (:func:`collective_seconds`).
    ``emulated`` (a topology and a slowdown) adds the emulated interconnect of
    :mod:`atp_pipeline.parallel.emulation`: a collective ends no earlier than its modeled
    time there (:func:`emulated_seconds`)."""

    def __init__(self, topo: Topology, mesh: Mesh, bytes_per_element: int,
                 emulated: Optional[Tuple[Topology, float]] = None) -> None:
        self.mesh, self.q = mesh, bytes_per_element
        self.ab = AlphaBeta.from_topology(topo) if topo.alpha_beta else None
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
            t = self.ab.cost(Collective(collective), size, nbytes, stride)
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


@dataclass
class _Timeline:
    clock: CommClock
    profile: ComputeProfile
    q: int
    layout: str = ""
    mesh: Optional[Mesh] = None
    now: float = 0.0
    compute: float = 0.0
    comm_total: float = 0.0
    dispatch: float = 0.0  # framework cost around the kernels (in ``compute``)
    sync: float = 0.0  # the host's synchronization cost added to collectives (in ``comm_total``)
    optimizer: float = 0.0  # (in ``compute``)
    since: float = 0.0  # compute since this rank's previous collective
    link_free: Dict[int, float] = field(default_factory=dict)

    def launch(self, c: Coll) -> Tuple[float, float, float]:
        """Start a collective now (after the ones in flight on its dimension); ``(start, end,
        end of its real transfer)`` (an emulated link's remaining time is a sleep)."""
        nbytes = float(c.elements) * self.q
        bare = self.clock.seconds(c.term.collective, c.term.dim, nbytes)
        dur = real = bare
        if bare > 0:
            extra = self.profile.sync_seconds(self.since)
            dur = self.clock.seconds(c.term.collective, c.term.dim, nbytes, extra)
            real = (self.clock.unemulated_seconds(c.term.collective, c.term.dim, nbytes) + extra
                    if self.clock.emulated is not None else dur)
            self.sync += dur - bare
            self.since = 0.0
        start = max(self.now, self.link_free.get(c.term.dim, 0.0))
        end = start + dur
        self.link_free[c.term.dim] = end
        self.comm_total += dur
        return start, end, start + real

    def run(self, items: Sequence[Item], pending: List[Tuple[float, float, float]]) -> None:
        joined: List[Tuple[float, float, float]] = []
        for item in items:
            tag = item[0]
            if tag == "k":
                k: Kernel = item[1]
                dt = self.profile.step_kernel_seconds(k, self.layout, self.mesh)
                if k.kind == OPTIMIZER:
                    self.optimizer += dt
                else:
                    self.dispatch += dt - self.profile.seconds(k)
                self.now += dt
                self.compute += dt
                self.since += dt
            elif tag == "sync":
                self.now = max(self.now, self.launch(item[1])[1])
            elif tag == "async":
                pending.append(self.launch(item[1]))
            elif tag == "linear":
                joined.append(self.launch(item[1]))
            elif tag == "join":
                self.wait(joined)
            else:  # pragma: no cover - the builders emit only the tags above
                raise ValueError(f"unknown schedule item {tag!r}")

    def wait(self, pending: List[Tuple[float, float, float]]) -> None:
        """Wait for collectives in flight ``(start, end, end of the real transfer)``: the
        compute that ran during a real transfer is late by the share ``1 - hidden`` of that
        overlap (the transfer took CPU from it); the clock moves to that or the last end."""
        if pending:
            steal = (1.0 - self.profile.hidden) * sum(max(0.0, min(self.now, r) - i) for i, _, r in pending)
            last = max(self.now, *(e for _, e, _ in pending))
            now = max(self.now + steal, last)
            self.sync += now - last
            self.comm_total += now - last
            self.now = now
            pending.clear()


def _round_robin(tl: "_Timeline", stages: List[List[List[Item]]]) -> None:
    """Chunks' stages (``stages[chunk][stage]``) as the runtime's wavefront runs them: chunks
    take turns stage by stage; a chunk waits for its collectives in flight when its turn comes."""
    pending: List[List[Tuple[float, float, float]]] = [[] for _ in stages]
    for st in range(max(len(s) for s in stages)):
        for c, chunk in enumerate(stages):
            if st < len(chunk):
                tl.wait(pending[c])
                tl.run(chunk[st], pending[c])
    for p in pending:
        tl.wait(p)


def simulate(prog: Program, clock: CommClock, profile: ComputeProfile, bytes_per_element: int,
             layout: str = "") -> Tuple[float, float, float]:
    """``(step, compute, total communication)`` seconds of one rank's program: the forward
    of each block as :mod:`~atp_pipeline.parallel.overlap` runs it (chunks take turns stage by
    stage, a stage ending where its chunk launches a collective, which the chunk waits for when
    its turn comes again), each block's backward the same way over the chunks' separate graphs
    (a backward stage also ends after a linear's weight gradient, its input-gradient
    all-reduce in flight, §4.2). ``layout`` picks the profile's framework cost (:class:`Dispatch`)."""
    tl = _run(prog, clock, profile, bytes_per_element, layout)
    return tl.now, tl.compute, tl.comm_total


def _run(prog: Program, clock: CommClock, profile: ComputeProfile, bytes_per_element: int,
         layout: str) -> "_Timeline":
    tl = _Timeline(clock, profile, bytes_per_element, layout, clock.mesh)
    tl.run(prog.pre, [])
    for layer in prog.blocks_fwd:
        _round_robin(tl, [_stages(items) for items in layer])
    tl.run(prog.post_fwd, [])
    tl.run(prog.post_bwd, [])
    for layer in reversed(prog.blocks_bwd):  # each chunk's backward of the block, chunks taking turns too
        _round_robin(tl, [_stages(items) for items in layer])
    tl.run(prog.pre_bwd, [])
    tl.run(prog.tail, [])
    return tl


# ----------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class StepSetting:
    """What the step runs besides the mesh: §4.1 chunks, data-parallel replicas and the
    aggregation mode of their gradient sync."""

    chunks: int = 1
    dp: int = 1
    aggregation: str = "ring"
    world: Optional[Topology] = None  # the topology of all dp replicas (their gradient sync)
    fsdp: bool = False  # parameters, gradients, optimizer state sharded over dp (memory)

    def __post_init__(self) -> None:
        if self.chunks < 1 or self.dp < 1:
            raise ConfigError(f"step model: chunks and dp must be >= 1, got chunks={self.chunks}, dp={self.dp}")


@dataclass(frozen=True)
class StepEstimate:
    """Predicted step of one candidate: ``step_s = compute_s + exposed_comm_s + gradsync_s``."""

    step_s: float
    compute_s: float
    exposed_comm_s: float  # tensor-parallel communication not hidden behind compute
    total_comm_s: float  # every tensor-parallel collective's duration, summed
    gradsync_s: float
    tokens_per_s: float
    mfu: Optional[float]
    profile: str  # which compute calibration
    comm_source: str
    dispatch_s: float = 0.0  # of compute_s: the runtime's framework cost around the kernels
    optimizer_s: float = 0.0  # of compute_s
    sync_s: float = 0.0  # of total_comm_s: the host's synchronization cost of the collectives
    calibration: str = ""  # which calibrated terms the prediction used

    def to_dict(self) -> Dict[str, Any]:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "total_comm_s": self.total_comm_s, "gradsync_s": self.gradsync_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "profile": self.profile,
                "comm_source": self.comm_source, "dispatch_s": self.dispatch_s, "optimizer_s": self.optimizer_s,
                "sync_s": self.sync_s, "calibration": self.calibration}


def estimate_step(topo: Topology, shape: ModelShape, mesh: Mesh, setting: StepSetting,
                  profile: ComputeProfile, emulated: Optional[Tuple[Topology, float]] = None,
                  gradsync_s: float = 0.0) -> StepEstimate:
    """The predicted step of ``shape`` on ``mesh`` of ``topo`` (one replica of ``setting.dp``;
    its local batch is ``batch_size / dp``); ``gradsync_s`` is the data-parallel sync to add."""
    if shape.batch_size % setting.dp:
        raise ConfigError(f"step model: batch {shape.batch_size} does not split over dp={setting.dp}")
    batch = shape.batch_size // setting.dp
    prog, _ = build_program(shape, mesh, batch, setting.chunks)
    clock = CommClock(topo, mesh, shape.bytes_per_element, emulated)
    tl = _run(prog, clock, profile, shape.bytes_per_element, RUNTIME)
    step, compute = tl.now + gradsync_s, tl.compute
    devices = mesh[0] * mesh[1] * setting.dp
    mfu = shape.flops_per_step / (step * devices * profile.peak_flops) if profile.peak_flops > 0 else None
    return StepEstimate(step, compute, step - compute - gradsync_s, tl.comm_total, gradsync_s,
                        shape.tokens_per_step / step, mfu, profile.name, clock.source, tl.dispatch, tl.optimizer,
                        tl.sync, profile.describe(RUNTIME, mesh))
