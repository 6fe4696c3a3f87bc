"""The step a user pays: compute + exposed communication per candidate plan (issue 15).

Eq. 2–4 rank meshes by communication alone; this model predicts the whole training step
of one tensor-parallel replica on ``DeviceMesh(d1, d2)`` and what it adds up to:

* **Compute**: every local kernel of the step at its *local* shape — the GEMMs of the
  column-/row-first linears (forward, input gradient, weight gradient), the attention core
  on ``heads/(d1·d2)`` heads, the norms and the elementwise kernels between them, the
  optimizer — each timed by a :class:`ComputeProfile`: interpolated over a calibrated sweep
  of shapes of its kind (log work vs log time between the nearest measured points), else
  the kind's fitted ``t = α + work·γ`` (work = FLOPs for GEMM and attention, elements
  otherwise). A profile is calibrated on the device (``python train.py stage=calibrate``,
  under the concurrency of training; none of it is a plan of the models it predicts) or
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

* **What the runtime pays beyond kernels and α-β** — calibrated terms of the profile,
  each measured in the compute calibration's own run and named in every prediction
  (:meth:`ComputeProfile.describe`): :class:`Framework`, the runtime's CPU work around each
  kernel (``seconds·(1 + kernel_factor) + per_kernel_s``) and each collective call
  (``per_collective_s + bytes·per_collective_byte_s``), one set for every model, fitted
  from *probe* models' forward and backward with their collectives skipped;
  :class:`SyncFit`, what a collective costs in a step when processes share the cores
  (``alpha + per_compute × compute since the rank's previous collective``, from
  compute-then-collective loops) and the share ``hidden`` of a collective's overlap with
  compute that compute really hides (from collective-during-compute loops; on CPU the
  transfer takes cycles from compute); the optimizer timed as training runs it (foreach
  AdamW over DTensor parameters); and the *contention* factor: every calibrated time
  (kernels, framework, sync, fitted α-β) scaled by the measured slowdown with the run's
  processes on the host against the calibration's (a 2-process run on a 4-process
  calibration of a 2-core host runs about twice as fast per kernel).

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
    is the α-β). A kernel costs ``t·(1 + kernel_factor) + per_kernel_s`` in a step.
    Calibrated from probe models' forward and backward with their collectives skipped
    (:mod:`atp_pipeline.run.calibrate_compute`)."""

    per_kernel_s: float
    kernel_factor: float = 0.0
    per_collective_s: float = 0.0
    per_collective_byte_s: float = 0.0

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

    def to_config(self) -> Dict[str, Any]:
        return {"name": self.name, "key": self.key, "mesh": list(self.mesh), "batch": self.batch,
                "seq_len": self.seq_len}


def shape_key(shape: ModelShape) -> str:
    """A model's identity for in-sample checks: every layout-relevant field of its shape but
    batch and sequence length (those are checked apart)."""
    return (f"h{shape.hidden}/a{shape.heads}/kv{shape.kv_heads}/f{shape.ffn}/L{shape.layers}/V{shape.vocab_size}/"
            f"{shape.norm}:{shape.norm_layout}/{shape.position}/{shape.head_layout}/"
            f"{'gated' if shape.gated else 'plain'}/{'fused' if shape.qkv_fused else 'split'}/"
            f"{'bias' if shape.bias else 'nobias'}/{'tied' if shape.tied_embeddings else 'untied'}")


PROFILE_KEYS = frozenset({"name", "source", "date", "processes", "cores", "peak_GFLOPs", "contention", "fits",
                          "optimizer", "framework", "sync", "probes", "points"})


@dataclass(frozen=True)
class ComputeProfile:
    """How long a device's kernels take: fitted per kind, and measured points by shape.

    ``name``/``source``/``date`` say which calibration a prediction used; ``processes`` how
    many processes shared the host while it was measured; ``contention`` the measured factor
    of every calibrated time with ``P`` processes on the host instead (1 at ``processes``:
    CPU ranks share the cores; absent, 1); ``peak_flops`` is the per-device FLOP/s MFU is
    quoted against; ``probes`` the models the calibration ran whole (:class:`Probe`)."""

    name: str
    source: str
    fits: Mapping[str, KindFit]
    points: Mapping[Tuple[str, Tuple[int, ...]], float] = field(default_factory=dict)
    processes: int = 1
    peak_flops: float = 0.0
    framework: Optional[Framework] = None
    sync: Optional[SyncFit] = None
    optimizer: str = ""  # how the optimizer kernel was run (the runtime's)
    contention: Mapping[int, float] = field(default_factory=dict)
    date: str = ""
    probes: Tuple[Probe, ...] = ()
    cores: int = 0  # the host's cores when calibrated (how many the ``processes`` shared)

    def contention_factor(self, processes: int) -> float:
        """The factor of calibrated times with ``processes`` on the host: measured where the
        calibration measured that count, linear between counts, proportional beyond the
        largest (every process wants a core), the smallest's below; 1 without a measurement."""
        if not self.contention:
            return 1.0
        pts = sorted(self.contention.items())
        if processes in self.contention:
            return self.contention[processes]
        if processes < pts[0][0]:
            return pts[0][1]
        if processes > pts[-1][0]:
            return pts[-1][1] * processes / pts[-1][0]
        for (p0, c0), (p1, c1) in zip(pts, pts[1:]):
            if p0 <= processes <= p1:
                return c0 + (c1 - c0) * (processes - p0) / (p1 - p0)
        raise AssertionError("unreachable")

    def step_kernel_seconds(self, k: Kernel) -> float:
        """A kernel's time in a step: the kernel's time with the runtime's framework cost
        around it (:class:`Framework`; the optimizer is calibrated as the runtime runs it, whole)."""
        t = self.seconds(k)
        if self.framework is None or k.kind == OPTIMIZER:
            return t
        return t * (1.0 + self.framework.kernel_factor) + self.framework.per_kernel_s

    def collective_framework_seconds(self, nbytes: float) -> float:
        """The runtime's own CPU work around one collective call moving ``nbytes``."""
        return 0.0 if self.framework is None else self.framework.collective_seconds(nbytes)

    def sync_seconds(self, compute_since: float) -> float:
        return 0.0 if self.sync is None else self.sync.seconds(compute_since)

    @property
    def hidden(self) -> float:
        """Share of the time a collective in flight overlaps compute that the compute really
        hides (1: all; on CPU the transfer takes cycles from the ranks' compute)."""
        return 1.0 if self.sync is None else self.sync.hidden

    def describe(self, processes: Optional[int] = None) -> str:
        """Which calibrations a prediction uses, in one line."""
        parts = [f"kernels '{self.name}'" + (f" ({self.date})" if self.date else "")]
        fw = self.framework
        if fw is not None:
            parts.append(f"framework {fw.per_kernel_s * 1e6:.1f} us/kernel + {fw.kernel_factor:.1%}, "
                         f"{fw.per_collective_s * 1e6:.1f} us + {fw.per_collective_byte_s * 1e9:.3f} ns/B per collective")
        if self.sync is not None:
            parts.append(f"sync {self.sync.alpha_s * 1e6:.0f} us + {self.sync.per_compute:.3f} x compute "
                         f"per collective, {self.sync.hidden:.0%} of overlap hidden")
        if self.optimizer:
            parts.append(f"optimizer {self.optimizer}")
        if processes is not None and self.contention:
            parts.append(f"contention x{self.contention_factor(processes):.3f} at {processes} processes "
                         f"(calibrated at {self.processes})")
        return "; ".join(parts)

    def seconds(self, k: Kernel) -> float:
        """A kernel's time: the measured point of its shape; else, between measured points of
        its kind, interpolated in log(work)-log(time) from the nearest below and above (a
        sweep of shapes, not the plans' own); else the kind's fit ``α + work·γ``."""
        hit = self.points.get((k.kind, tuple(k.dims)))
        if hit is not None:
            return hit
        fit = self.fits.get(k.kind)
        if fit is None:
            raise ConfigError(f"compute profile '{self.name}' has no fit for kernel kind '{k.kind}'")
        if k.kind == OPTIMIZER:
            return fit.alpha_s + k.dims[0] * fit.per_tensor_s + k.work * fit.per_unit_s
        curve = self._curves().get(k.kind)
        if curve and k.work > 0 and curve[0][0] <= k.work <= curve[-1][0]:
            w = math.log(k.work)
            for (w0, t0), (w1, t1) in zip(curve, curve[1:]):
                if w0 <= k.work <= w1:
                    if w1 == w0:
                        return t0
                    a = (w - math.log(w0)) / (math.log(w1) - math.log(w0))
                    return math.exp(math.log(t0) + a * (math.log(t1) - math.log(t0)))
        return fit.alpha_s + k.work * fit.per_unit_s

    def _curves(self) -> Dict[str, List[Tuple[float, float]]]:
        """Per kind, the measured ``(work, seconds)`` points sorted by work (equal work: the median)."""
        cached = self.__dict__.get("_curve_cache")
        if cached is None:
            by: Dict[str, Dict[float, List[float]]] = {}
            for (kind, dims), t in self.points.items():
                if kind != OPTIMIZER:
                    w = Kernel(kind, dims).work
                    if w > 0:
                        by.setdefault(kind, {}).setdefault(w, []).append(t)
            cached = {kind: [(w, sorted(ts)[len(ts) // 2]) for w, ts in sorted(d.items())] for kind, d in by.items()}
            object.__setattr__(self, "_curve_cache", cached)
        return cached

    # ------------------------------------------------------------------ topology yaml
    @classmethod
    def from_config(cls, data: Mapping[str, Any], where: str = "device.compute") -> "ComputeProfile":
        """From a topology's ``device.compute`` (written by the compute calibration)."""
        unknown = sorted(set(data) - PROFILE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} (a profile of an older schema? "
                              f"calibrate again: python train.py stage=calibrate)")
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
            framework = None
            if data.get("framework"):
                fd = data["framework"]
                framework = Framework(float(fd["per_kernel_us"]) * 1e-6, float(fd.get("kernel_factor", 0.0)),
                                      float(fd.get("per_collective_us", 0.0)) * 1e-6,
                                      float(fd.get("per_collective_ns_per_byte", 0.0)) * 1e-9)
                vals = (framework.per_kernel_s, framework.per_collective_s, framework.per_collective_byte_s)
                if not (min(vals) >= 0 and framework.kernel_factor > -1
                        and all(math.isfinite(x) for x in (*vals, framework.kernel_factor))):
                    raise ConfigError(f"{where}.framework: per_kernel_us, per_collective_us, "
                                      f"per_collective_ns_per_byte must be finite >= 0, kernel_factor > -1")
            sync = None
            if data.get("sync"):
                sd = data["sync"]
                sync = SyncFit(float(sd["alpha_us"]) * 1e-6, float(sd.get("per_compute", 0.0)),
                               float(sd.get("hidden", 1.0)))
                if not (sync.alpha_s >= 0 and sync.per_compute >= 0 and math.isfinite(sync.alpha_s)
                        and math.isfinite(sync.per_compute) and 0 <= sync.hidden <= 1):
                    raise ConfigError(f"{where}.sync: alpha_us, per_compute must be finite >= 0, hidden in [0, 1]")
            contention = {int(p): float(c) for p, c in dict(data.get("contention") or {}).items()}
            if any(p < 1 or not (c > 0 and math.isfinite(c)) for p, c in contention.items()):
                raise ConfigError(f"{where}.contention: processes >= 1 -> finite factor > 0, got {contention}")
            probes = tuple(Probe(str(p["name"]), str(p["key"]), (int(p["mesh"][0]), int(p["mesh"][1])),
                                 int(p["batch"]), int(p["seq_len"])) for p in data.get("probes") or [])
            return cls(name=str(data["name"]), source=str(data.get("source", "")), fits=fits, points=points,
                       processes=int(data.get("processes", 1)), peak_flops=float(data.get("peak_GFLOPs", 0)) * 1e9,
                       framework=framework, sync=sync, optimizer=str(data.get("optimizer", "")),
                       contention=contention, date=str(data.get("date", "")), probes=probes,
                       cores=int(data.get("cores", 0)))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"{where}: not a compute profile ({type(exc).__name__}: {exc})") from None

    def to_config(self) -> Dict[str, Any]:
        g = lambda x: float(f"{x:.6g}")  # noqa: E731
        fw = self.framework
        return {"name": self.name, "source": self.source, **({"date": self.date} if self.date else {}),
                "processes": self.processes, **({"cores": self.cores} if self.cores else {}),
                "peak_GFLOPs": g(self.peak_flops / 1e9),
                **({"contention": {int(p): g(c) for p, c in sorted(self.contention.items())}}
                   if self.contention else {}),
                "fits": {k: {"alpha_us": g(f.alpha_s * 1e6), "ns_per_unit": g(f.per_unit_s * 1e9),
                             **({"per_tensor_us": g(f.per_tensor_s * 1e6)} if f.per_tensor_s else {})}
                         for k, f in self.fits.items()},
                **({"optimizer": self.optimizer} if self.optimizer else {}),
                **({"framework": {"per_kernel_us": g(fw.per_kernel_s * 1e6), "kernel_factor": g(fw.kernel_factor),
                                  "per_collective_us": g(fw.per_collective_s * 1e6),
                                  "per_collective_ns_per_byte": g(fw.per_collective_byte_s * 1e9)}}
                   if fw is not None else {}),
                **({"sync": {"alpha_us": g(self.sync.alpha_s * 1e6), "per_compute": g(self.sync.per_compute),
                             "hidden": g(self.sync.hidden)}}
                   if self.sync is not None else {}),
                **({"probes": [p.to_config() for p in self.probes]} if self.probes else {}),
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
    time there (:func:`emulated_seconds`). ``scale``: the compute profile's contention factor
    for the run's processes (gloo's transfers on a shared host take CPU like compute)."""

    def __init__(self, topo: Topology, mesh: Mesh, bytes_per_element: int,
                 emulated: Optional[Tuple[Topology, float]] = None, scale: float = 1.0) -> None:
        self.mesh, self.q, self.scale = mesh, bytes_per_element, scale
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


@dataclass
class _Timeline:
    clock: CommClock
    profile: ComputeProfile
    q: int
    scale: float = 1.0  # the profile's contention factor for the run's processes on the host
    now: float = 0.0
    compute: float = 0.0
    comm_total: float = 0.0
    dispatch: float = 0.0  # framework cost around the kernels and collectives (in ``compute``)
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
            fw = self.scale * self.profile.collective_framework_seconds(nbytes)  # the rank's CPU, before launch
            self.now += fw
            self.compute += fw
            self.dispatch += fw
            self.since += fw
            extra = self.scale * self.profile.sync_seconds(self.since)
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
                dt = self.scale * self.profile.step_kernel_seconds(k)
                if k.kind == OPTIMIZER:
                    self.optimizer += dt
                else:
                    self.dispatch += dt - self.scale * self.profile.seconds(k)
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
             scale: float = 1.0) -> Tuple[float, float, float]:
    """``(step, compute, total communication)`` seconds of one rank's program: the forward
    of each block as :mod:`~atp_pipeline.parallel.overlap` runs it (chunks take turns stage by
    stage, a stage ending where its chunk launches a collective, which the chunk waits for when
    its turn comes again), each block's backward the same way over the chunks' separate graphs
    (a backward stage also ends after a linear's weight gradient, its input-gradient
    all-reduce in flight, §4.2). ``scale``: the profile's contention factor (every calibrated time)."""
    tl = _run(prog, clock, profile, bytes_per_element, scale)
    return tl.now, tl.compute, tl.comm_total


def _run(prog: Program, clock: CommClock, profile: ComputeProfile, bytes_per_element: int,
         scale: float = 1.0) -> "_Timeline":
    tl = _Timeline(clock, profile, bytes_per_element, scale)
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
    processes = mesh[0] * mesh[1] * setting.dp  # on one host: what the contention factor is for
    scale = profile.contention_factor(processes)
    clock = CommClock(topo, mesh, shape.bytes_per_element, emulated, scale)
    tl = _run(prog, clock, profile, shape.bytes_per_element, scale)
    step, compute = tl.now + gradsync_s, tl.compute
    devices = mesh[0] * mesh[1] * setting.dp
    mfu = shape.flops_per_step / (step * devices * profile.peak_flops) if profile.peak_flops > 0 else None
    return StepEstimate(step, compute, step - compute - gradsync_s, tl.comm_total, gradsync_s,
                        shape.tokens_per_step / step, mfu, profile.name, clock.source, tl.dispatch, tl.optimizer,
                        tl.sync, profile.describe(processes))
