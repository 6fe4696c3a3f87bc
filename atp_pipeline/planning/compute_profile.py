"""How long a device's kernels take (:class:`ComputeProfile`: fits per kernel kind, measured points,
the runtime's framework and synchronization costs, contention, the probe models a calibration ran),
read from a topology's ``device.compute`` or derived from its spec."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.host_speed import (  # noqa: F401
    STEPS_GROUP,
    HostSpeed,
    parse_step_label,
    step_label,
    step_processes,
    steps_count,
    steps_speed,
)
from atp_pipeline.planning.kernels import (
    ATTN_BWD,
    ATTN_FWD,
    COMPOSED,
    GEMM,
    KINDS,
    NORM_BWD,
    NORM_FWD,
    OPTIMIZER,
    POINTWISE,
    Kernel,
)
from atp_pipeline.planning.profile_parts import (  # noqa: F401 - re-exported: the profile's parts
    CollectiveCPU,
    Framework,
    KindFit,
    Probe,
    SyncFit,
    _by_size,
    grid_seconds,
    shape_key,
)
from atp_pipeline.planning.step_residual import CpuStep, StepResidual, _nearest, cell_key  # noqa: F401
from atp_pipeline.topology.model import Topology

Mesh = Tuple[int, int]


KERNEL_TIMES = ("cpu", "wall")


def _factor(measured: Mapping[int, float], processes: int) -> float:
    """A contention factor at ``processes``: measured where measured, linear between counts,
    proportional beyond the largest, the smallest's below; 1 without a measurement."""
    if not measured:
        return 1.0
    pts = sorted(measured.items())
    if processes in measured:
        return measured[processes]
    if processes < pts[0][0]:
        return pts[0][1]
    if processes > pts[-1][0]:
        return pts[-1][1] * processes / pts[-1][0]
    for (p0, c0), (p1, c1) in zip(pts, pts[1:]):
        if p0 <= processes <= p1:
            return c0 + (c1 - c0) * (processes - p0) / (p1 - p0)
    raise AssertionError("unreachable")
@dataclass(frozen=True)
class Conditions:
    """What a profile's calibrated times are multiplied by for a run of ``processes`` on the host
    (:meth:`ComputeProfile.at_processes`): ``timeline`` the kernels on one rank's timeline,
    ``comm`` the collectives' α-β, ``sync`` the sync term; ``skew`` whether ranks reach a
    collective apart by a share of the compute before it; ``host`` (where ``oversubscribed``)
    the factor of a rank's CPU when every rank computes at once, so the step is no less than it."""

    processes: int
    timeline: float
    comm: float
    sync: float
    skew: bool
    oversubscribed: bool
    host: float


PROFILE_KEYS = frozenset({"name", "source", "date", "processes", "cores", "peak_GFLOPs", "contention", "fits",
                          "kernel_time", "comm_contention", "optimizer", "framework", "sync", "collective_cpu",
                          "probes", "points", "reference", "step_residual"})


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
    collective_cpu: Optional[CollectiveCPU] = None
    # "cpu": the kernels' points and fits and the framework are a rank's CPU seconds (its
    # ``process_time``), what the work costs a core whatever shares it; "wall": the slowest
    # rank's wall seconds with ``processes`` computing at once (an older calibration's)
    kernel_time: str = "wall"
    # the collectives' own factor with ``P`` processes on the host (pairs' all-reduce; absent:
    # the kernels' ``contention``)
    comm_contention: Mapping[int, float] = field(default_factory=dict)
    # the host's speed at calibration: the probes' whole steps, STEPS_GROUP -> step_label -> wall seconds
    reference: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # set by :meth:`at_speed`: the prices are this calibration's scaled to the host's speed now
    speed: Optional[HostSpeed] = None
    # the step beyond the terms' sum per process count (:class:`StepResidual`; absent: factor 1)
    step_residual: Optional[StepResidual] = None

    def residual_factors(self, processes: int, chunks: int = 1) -> Tuple[float, float]:
        """The ``(compute, exposed)`` factors of the terms' step at ``processes`` and ``chunks``
        (:class:`StepResidual`; 1 and 1 without one)."""
        return (1.0, 1.0) if self.step_residual is None else self.step_residual.at(processes, chunks)

    def cpu_step(self, processes: int, mesh: Mesh, chunks: int, cpu_s: float) -> Optional[float]:
        """The step from a rank's CPU ``cpu_s`` where the residual's chosen form is that
        (:class:`CpuStep`), else None (the terms' step with :meth:`residual_factors`)."""
        return None if self.step_residual is None else self.step_residual.cpu_step(processes, mesh, chunks, cpu_s)

    def at_speed(self, speed: HostSpeed) -> "ComputeProfile":
        """This profile at the host's speed now (:class:`HostSpeed`, timed again where it predicts):
        every kernel price (measured points, fits; the peak throughput inversely) x ``speed.compute``;
        the framework's per-kernel and per-collective prices, the collectives' backend CPU and the
        sync term's per-collective extra x ``speed.overhead``. Ratios (contention factors, the
        framework's ``kernel_factor``, the overlap's hidden share) and the topology's α-β stay."""
        if self.speed is not None:
            raise ConfigError(f"compute profile '{self.name}' is already at a re-timed speed ({self.speed.describe()})")
        c, o = speed.compute, speed.overhead
        fits = {k: replace(f, alpha_s=f.alpha_s * c, per_unit_s=f.per_unit_s * c, per_tensor_s=f.per_tensor_s * c)
                for k, f in self.fits.items()}
        fw = self.framework
        if fw is not None:
            fw = Framework(fw.per_kernel_s * o, fw.kernel_factor, fw.per_collective_s * o, fw.per_collective_byte_s * o,
                           fw.per_read_s * o)
        sync = None if self.sync is None else SyncFit(self.sync.alpha_s * o, self.sync.per_compute, self.sync.hidden)
        cc = self.collective_cpu
        if cc is not None:
            cc = CollectiveCPU(dict(cc.busy), {k: v * o for k, v in cc.per_call.items()},
                               {k: v * o for k, v in cc.per_byte.items()})
        sr = self.step_residual
        if sr is not None and sr.anchored is not None:
            sr = replace(sr, anchored=sr.anchored.at_speed(o))
        return replace(self, fits=fits, points={k: t * c for k, t in self.points.items()},
                       peak_flops=self.peak_flops / c, framework=fw, sync=sync, collective_cpu=cc, speed=speed,
                       step_residual=sr)

    def __post_init__(self) -> None:
        if self.kernel_time not in KERNEL_TIMES:
            raise ConfigError(f"compute profile '{self.name}': kernel_time '{self.kernel_time}' "
                              f"(one of {', '.join(KERNEL_TIMES)})")

    def at_processes(self, processes: int) -> Conditions:
        """Every factor the step model prices a run of ``processes`` on the host with, at once."""
        return Conditions(processes, self.timeline_factor(processes), self.comm_factor(processes),
                          self.sync_factor(processes), self.skewed(processes), self.oversubscribed(processes),
                          self.host_factor(processes))

    def residual_seconds(self, processes: int, mesh: Mesh, chunks: int, step: float, compute: float,
                         cpu: float) -> float:
        """What a whole step takes beyond the terms' ``step`` (of which ``compute``; ``cpu`` the
        rank's predicted CPU): the step from a rank's CPU less ``step`` where the residual's chosen
        form is that (:class:`CpuStep`), else the two factors' share of the compute and the exposed
        communication (:class:`StepResidual`; none without one)."""
        anchored = self.cpu_step(processes, mesh, chunks, cpu)
        if anchored is not None:
            return anchored - step
        fc, fe = self.residual_factors(processes, chunks)
        return compute * (fc - 1.0) + (step - compute) * (fe - 1.0)

    def timeline_factor(self, processes: int) -> float:
        """The factor of calibrated kernel times on one rank's timeline with ``processes`` on the
        host: a CPU-priced profile's times are already what a kernel takes on a core (1); a
        wall-priced one's, the contention factor of a rank with a core to itself
        (:meth:`alone_factor`)."""
        return 1.0 if self.kernel_time == "cpu" else self.alone_factor(processes)

    def host_factor(self, processes: int) -> float:
        """How much longer than on the rank's timeline its compute takes when every rank computes
        at once: with more processes than cores, ``processes / cores`` (CPU-priced: the ranks
        share the cores evenly); wall-priced, the contention factor at ``processes`` over the
        one at a core's. 1 where every rank has a core."""
        if not self.oversubscribed(processes):
            return 1.0
        if self.kernel_time == "cpu":
            return processes / self.cores
        return self.contention_factor(processes) / self.alone_factor(processes)

    def sync_factor(self, processes: int) -> float:
        """The factor of the sync term (a collective's extra, measured at the calibration's
        processes) with ``processes`` on the host: the collectives' (:meth:`comm_factor`) for a
        CPU-priced profile, the timeline's for a wall-priced one."""
        return self.comm_factor(processes) if self.kernel_time == "cpu" else self.alone_factor(processes)

    def skewed(self, processes: int) -> bool:
        """Whether ranks reach a collective apart by a share of the compute before it (the sync
        term's ``per_compute``): where they share cores (more processes than cores), as the
        calibration's loops measured it; with a core each (a CPU-priced profile), they run the
        same compute in step and only the sync term's ``alpha`` stays. A wall-priced profile:
        always (as it was calibrated)."""
        return self.kernel_time != "cpu" or self.oversubscribed(processes)

    def comm_factor(self, processes: int) -> float:
        """The factor of the calibrated collectives' times (α-β, measured with the calibration's
        processes on the host) with ``processes`` on it: the collectives' own measured factor
        where the profile has it, else the kernels' (:meth:`contention_factor`)."""
        return _factor(self.comm_contention, processes) if self.comm_contention else self.contention_factor(processes)

    def oversubscribed(self, processes: int) -> bool:
        """More processes than the host's cores (known from the calibration)."""
        return 0 < self.cores < processes

    def alone_factor(self, processes: int) -> float:
        """The factor of calibrated times for a rank that has a core to itself while
        ``processes`` run on the host: the contention factor at ``min(processes, cores)``
        (where the cores are not known: at ``processes``)."""
        return self.contention_factor(min(processes, self.cores) if self.cores else processes)

    def collective_busy(self, size: int) -> float:
        """Share of a core a rank keeps busy while waiting in a ``size``-rank collective (0 uncalibrated)."""
        return 0.0 if self.collective_cpu is None else self.collective_cpu.share(size)

    def contention_factor(self, processes: int) -> float:
        """The factor of calibrated times with ``processes`` on the host: measured where the
        calibration measured that count, linear between counts, proportional beyond the
        largest (every process wants a core), the smallest's below; 1 without a measurement."""
        return _factor(self.contention, processes)

    def step_kernel_seconds(self, k: Kernel) -> float:
        """A kernel's time in a step: the kernel's time with the runtime's framework cost
        around it (:class:`Framework`; the optimizer is calibrated as the runtime runs it, whole)."""
        t = self.seconds(k)
        if self.framework is None or k.kind == OPTIMIZER:
            return t
        return t * (1.0 + self.framework.kernel_factor) + self.framework.per_kernel_s

    def read_seconds(self, reads: int) -> float:
        """The runtime's CPU for ``reads`` sharded parameter reads (:class:`Framework`)."""
        return 0.0 if self.framework is None else reads * self.framework.per_read_s

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
        parts = [f"kernels '{self.name}'" + (f" ({self.date})" if self.date else "")
                 + (" at a rank's CPU time" if self.kernel_time == "cpu" else "")]
        if self.speed is not None:
            parts.append(self.speed.describe())
        fw = self.framework
        if fw is not None:
            parts.append(f"framework {fw.per_kernel_s * 1e6:.1f} us/kernel + {fw.kernel_factor:.1%}, "
                         f"{fw.per_collective_s * 1e6:.1f} us + "
                         f"{fw.per_collective_byte_s * 1e9:.3f} ns/B per collective"
                         + (f", {fw.per_read_s * 1e6:.1f} us per parameter read" if fw.per_read_s else ""))
        if self.sync is not None:
            parts.append(f"sync {self.sync.alpha_s * 1e6:.0f} us + {self.sync.per_compute:.3f} x compute "
                         f"per collective, {self.sync.hidden:.0%} of overlap hidden")
        if self.optimizer:
            parts.append(f"optimizer {self.optimizer}")
        if self.collective_cpu is not None:
            cc = self.collective_cpu
            parts.append("; ".join(x for x in (
                ("waiting in a collective keeps " + ", ".join(
                    f"{v:.0%} of a core busy ({k} ranks)" for k, v in sorted(cc.busy.items()))) if cc.busy else "",
                ("a collective's backend CPU per call " + ", ".join(
                    f"{cc.per_call.get(k, 0.0) * 1e6:.0f} us"
                    + (f" + {cc.per_byte[k] * 1e9:.3f} ns/B" if k in cc.per_byte else "") + f" ({k} ranks)"
                    for k in sorted(set(cc.per_call) | set(cc.per_byte)))) if cc.per_call or cc.per_byte else "")
                if x) or "collectives' backend CPU 0")
        if self.step_residual is not None:
            parts.append(self.step_residual.describe(processes))
        if processes is not None and self.contention:
            parts.append(f"contention x{self.contention_factor(processes):.3f} at {processes} processes "
                         f"(calibrated at {self.processes})"
                         + (f", collectives x{self.comm_factor(processes):.3f}" if self.comm_contention else ""))
            if self.oversubscribed(processes) and self.kernel_time == "cpu":
                parts.append(f"{processes} processes on {self.cores} cores: a rank's kernels at their CPU time, "
                             f"the step no less than every rank's CPU over the cores")
            elif self.oversubscribed(processes):
                parts.append(f"{processes} processes on {self.cores} cores: a rank alone on a core "
                             f"x{self.alone_factor(processes):.3f}, "
                             f"the step no less than every rank's CPU over the cores")
        return "; ".join(parts)

    def seconds(self, k: Kernel) -> float:
        """A kernel's time: the measured point of its shape; else an attention core on the
        calibration's full grid of cores (:func:`grid_seconds`, :attr:`Kernel.grid`); else, between
        measured points of its kind, interpolated in log(size)-log(time) from the nearest below and
        above (a sweep of shapes, not the plans' own; :attr:`Kernel.size`: the work, an attention
        core's score elements); else the kind's fit ``α + units·γ`` (:meth:`KindFit.units`).
        Memoized per shape (a search prices the same kernels in many layouts)."""
        key = (k.kind, tuple(k.dims))
        hit = self.points.get(key)
        if hit is not None:
            return hit
        memo = self.__dict__.get("_seconds_memo")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_seconds_memo", memo)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = self._priced(k)
        return hit

    def _priced(self, k: Kernel) -> float:
        fit = self.fits.get(k.kind)
        if fit is None:
            raise ConfigError(f"compute profile '{self.name}' has no fit for kernel kind '{k.kind}'")
        if k.kind == OPTIMIZER:
            return fit.alpha_s + k.dims[0] * fit.per_tensor_s + fit.units(k) * fit.per_unit_s
        grid = self.kernel_grids().get(k.kind)
        if grid is not None and k.grid is not None:
            return grid_seconds(*grid, k.grid)
        curve = self._curves().get(k.kind)
        size = k.size
        if curve and size > 0 and curve[0][0] <= size <= curve[-1][0]:
            w = math.log(size)
            for (w0, t0), (w1, t1) in zip(curve, curve[1:]):
                if w0 <= size <= w1:
                    if w1 == w0:
                        return t0
                    a = (w - math.log(w0)) / (math.log(w1) - math.log(w0))
                    return math.exp(math.log(t0) + a * (math.log(t1) - math.log(t0)))
        return fit.alpha_s + fit.units(k) * fit.per_unit_s

    def kernel_grids(self) -> Dict[str, Tuple[Tuple[Tuple[int, ...], ...], Dict[Tuple[int, ...], float]]]:
        """Per kind with grid coordinates (:attr:`Kernel.grid`: the attention cores), the measured
        points as a full grid of at least three values on every axis: the axes' values and
        ``coordinates -> seconds`` (equal coordinates: the median). A kind whose points leave a cell
        empty or an axis at two values (where the head size's effect can run both ways) is priced
        by its size curve."""
        cached = self.__dict__.get("_grid_cache")
        if cached is None:
            by: Dict[str, Dict[Tuple[int, ...], List[float]]] = {}
            for (kind, dims), t in self.points.items():
                g = Kernel(kind, dims).grid
                if g is not None:
                    by.setdefault(kind, {}).setdefault(g, []).append(t)
            cached = {}
            for kind, d in by.items():
                values = {g: sorted(ts)[len(ts) // 2] for g, ts in d.items()}
                axes = tuple(tuple(sorted({g[i] for g in values})) for i in range(len(next(iter(values)))))
                if math.prod(len(a) for a in axes) == len(values) and min(len(a) for a in axes) >= 3:
                    cached[kind] = (axes, values)
            object.__setattr__(self, "_grid_cache", cached)
        return cached

    def _curves(self) -> Dict[str, List[Tuple[float, float]]]:
        """Per kind, the measured ``(size, seconds)`` points sorted by :attr:`Kernel.size` (equal size: the median)."""
        cached = self.__dict__.get("_curve_cache")
        if cached is None:
            by: Dict[str, Dict[float, List[float]]] = {}
            for (kind, dims), t in self.points.items():
                if kind != OPTIMIZER:
                    w = Kernel(kind, dims).size
                    if w > 0:
                        by.setdefault(kind, {}).setdefault(w, []).append(t)
            cached = {kind: [(w, sorted(ts)[len(ts) // 2]) for w, ts in sorted(d.items())] for kind, d in by.items()}
            object.__setattr__(self, "_curve_cache", cached)
        return cached

    # ------------------------------------------------------------------ topology yaml
    @classmethod
    def from_config(cls, data: Mapping[str, Any], where: str = "device.compute") -> "ComputeProfile":
        """From a topology's ``device.compute`` as ``stage=calibrate`` writes it
        (:class:`~atp_pipeline.config.schema.ComputeProfileConfig`). A profile of an older
        format is refused in one line that says to calibrate again."""
        unknown = sorted(set(data) - PROFILE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} (a profile of an older schema? "
                              f"calibrate again: python train.py stage=calibrate)")
        older = older_format(data)
        if older:
            raise ConfigError(f"{where}: a compute profile of an older format ({older}) {AGAIN}")
        try:
            return cls(name=str(data["name"]), source=str(data.get("source") or ""), fits=_fits(data, where),
                       points=_points(data, where), processes=int(data.get("processes") or 1),
                       peak_flops=float(data.get("peak_GFLOPs") or 0) * 1e9, framework=_framework(data, where),
                       sync=_sync(data, where), optimizer=str(data.get("optimizer") or ""),
                       contention=_factors(data, "contention", 1, where), date=str(data.get("date") or ""),
                       probes=tuple(Probe(str(p["name"]), str(p["key"]), (int(p["mesh"][0]), int(p["mesh"][1])),
                                          int(p["batch"]), int(p["seq_len"]), int(p.get("processes") or 0))
                                    for p in data.get("probes") or []),
                       cores=int(data.get("cores") or 0), collective_cpu=_collective_cpu(data, where),
                       kernel_time=str(data.get("kernel_time") or "wall"),
                       comm_contention=_factors(data, "comm_contention", 2, where),
                       reference=_reference(data, where), step_residual=_step_residual(data, where))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"{where}: not a compute profile ({type(exc).__name__}: {exc})") from None

    def to_config(self) -> Dict[str, Any]:
        if self.speed is not None:  # its prices are not the calibration's: it would be read back re-timed twice
            raise ConfigError(f"compute profile '{self.name}' is re-timed ({self.speed.describe()}): "
                              f"write the calibration's own profile")
        g = lambda x: float(f"{x:.6g}")  # noqa: E731
        fw = self.framework
        return {"name": self.name, "source": self.source, **({"date": self.date} if self.date else {}),
                "processes": self.processes, **({"cores": self.cores} if self.cores else {}),
                **({"kernel_time": self.kernel_time} if self.kernel_time != "wall" else {}),
                "peak_GFLOPs": g(self.peak_flops / 1e9),
                **({"contention": {int(p): g(c) for p, c in sorted(self.contention.items())}}
                   if self.contention else {}),
                **({"comm_contention": {int(p): g(c) for p, c in sorted(self.comm_contention.items())}}
                   if self.comm_contention else {}),
                "fits": {k: {"alpha_us": g(f.alpha_s * 1e6), "ns_per_unit": g(f.per_unit_s * 1e9),
                             **({"per_tensor_us": g(f.per_tensor_s * 1e6)} if f.per_tensor_s else {}),
                             **({"per_size": True} if f.per_size else {})}
                         for k, f in self.fits.items()},
                **({"optimizer": self.optimizer} if self.optimizer else {}),
                **({"framework": {"per_kernel_us": g(fw.per_kernel_s * 1e6), "kernel_factor": g(fw.kernel_factor),
                                  "per_collective_us": g(fw.per_collective_s * 1e6),
                                  "per_collective_ns_per_byte": g(fw.per_collective_byte_s * 1e9),
                                  **({"per_read_us": g(fw.per_read_s * 1e6)} if fw.per_read_s else {})}}
                   if fw is not None else {}),
                **({"sync": {"alpha_us": g(self.sync.alpha_s * 1e6), "per_compute": g(self.sync.per_compute),
                             "hidden": g(self.sync.hidden)}}
                   if self.sync is not None else {}),
                **({"collective_cpu": {
                    **({"busy": {int(k): g(v) for k, v in sorted(self.collective_cpu.busy.items())}}
                       if self.collective_cpu.busy else {}),
                    **({"per_call_us": {int(k): g(v * 1e6) for k, v in sorted(self.collective_cpu.per_call.items())}}
                       if self.collective_cpu.per_call else {}),
                    **({"per_byte_ns": {int(k): g(v * 1e9) for k, v in sorted(self.collective_cpu.per_byte.items())}}
                       if self.collective_cpu.per_byte else {})}}
                   if self.collective_cpu is not None else {}),
                **({"probes": [p.to_config() for p in self.probes]} if self.probes else {}),
                **({"reference": {grp: {k: g(v * 1e6) for k, v in sorted(vals.items())}
                                  for grp, vals in self.reference.items()}} if self.reference else {}),
                **({"step_residual": {part: {int(p): {int(c): g(f) for c, f in sorted(fs.items())}
                                             for p, fs in sorted(getattr(self.step_residual, part).items())}
                                      for part in ("compute", "exposed")} | {
                                      **({"probe_steps": {int(p): int(n)
                                                          for p, n in sorted(self.step_residual.steps.items())}}
                                         if self.step_residual.steps else {}),
                                      **self._anchored_config(g)}}
                   if self.step_residual is not None else {}),
                "points": [[k, list(d), g(s * 1e6)] for (k, d), s in sorted(self.points.items())]}

    def _anchored_config(self, g: Any) -> Dict[str, Any]:
        """The residual's form, its CPU-anchored fit and their left-out errors, as YAML."""
        sr = self.step_residual
        if sr is None:
            return {}
        out: Dict[str, Any] = {"form": sr.form} if sr.form != "terms" else {}
        if sr.anchored is not None:
            out["cpu_ratio"] = {int(p): {k: g(v) for k, v in sorted(cells.items())}
                                for p, cells in sorted(sr.anchored.ratio.items())}
            out["cpu_fit"] = {int(p): {c: [g(a), g(b * 1e6)]
                                       for c, (a, b) in sorted(per.items(), key=lambda kv: str(kv[0]))}
                              for p, per in sorted(sr.anchored.cpu.items())}
            if sr.anchored.wait:
                out["cpu_wait"] = {int(p): {k: g(w * 1e6) for k, w in sorted(cells.items())}
                                   for p, cells in sorted(sr.anchored.wait.items())}
        if sr.cv:
            out["cv"] = {f: [g(m), g(w)] for f, (m, w) in sorted(sr.cv.items())}
        return out

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
                POINTWISE: elem, OPTIMIZER: KindFit(0.0, 16.0 / mem, launch),
                **{k: KindFit(launch, passes * elem.per_unit_s) for k, (_, passes) in COMPOSED.items()}}
        return cls(name=f"spec:{device.get('name', 'device')}",
                   source=f"datasheet {peak:g} TFLOP/s x efficiency curve 0.7*F/(F+2 GFLOP) (assumed, not measured)",
                   fits=fits, processes=1, peak_flops=peak_flops)


AGAIN = "(calibrate again: python train.py stage=calibrate)"


def older_format(data: Mapping[str, Any]) -> str:
    """Why ``data`` is a compute profile of an older format than this code reads ('' if it is not)."""
    fits = dict(data.get("fits") or {})
    missing = [k for k in KINDS if k not in fits]
    if missing:
        return f"no fit for kernel kind(s) {', '.join(missing)}"
    reference = dict(data.get("reference") or {})
    if reference and STEPS_GROUP not in reference:
        return "reference without the probes' steps"
    others = sorted(str(g) for g in reference if g != STEPS_GROUP)
    if others:
        return f"reference with group(s) {', '.join(others)} beside the probes' steps"
    rd = dict(data.get("step_residual") or {})
    if "factor" in rd or not all(isinstance(v, Mapping) for v in dict(rd.get("compute") or {}).values()):
        return "step_residual without factors per chunk count"
    if any("/" not in str(c) for per in dict(rd.get("cpu_fit") or {}).values() for c in dict(per)):
        return "step_residual.cpu_fit per chunk count, not per cell"
    return ""


def _finite(values: Any, low: float = 0.0) -> bool:
    return all(math.isfinite(v) and v >= low for v in values)


def _fits(data: Mapping[str, Any], where: str) -> Dict[str, KindFit]:
    fits = {}
    for kind, f in dict(data["fits"]).items():
        if kind not in KINDS:
            raise ConfigError(f"{where}.fits: unknown kernel kind '{kind}' (one of {', '.join(KINDS)})")
        fit = KindFit(float(f["alpha_us"]) * 1e-6, float(f["ns_per_unit"]) * 1e-9,
                      float(f.get("per_tensor_us") or 0.0) * 1e-6, bool(f.get("per_size") or False))
        if not _finite((fit.alpha_s, fit.per_unit_s, fit.per_tensor_s)):
            raise ConfigError(f"{where}.fits.{kind}: alpha_us, ns_per_unit, per_tensor_us must be finite >= 0")
        fits[str(kind)] = fit
    return fits


def _points(data: Mapping[str, Any], where: str) -> Dict[Tuple[str, Tuple[int, ...]], float]:
    points = {}
    for p in data.get("points") or []:
        kind, dims, us = p[0], tuple(int(x) for x in p[1]), float(p[2])
        if kind not in KINDS or not us > 0:
            raise ConfigError(f"{where}.points: bad point {p!r} (kind, dims, microseconds > 0)")
        points[(str(kind), dims)] = us * 1e-6
    return points


def _framework(data: Mapping[str, Any], where: str) -> Optional[Framework]:
    fd = data.get("framework")
    if not fd:
        return None
    fw = Framework(float(fd["per_kernel_us"]) * 1e-6, float(fd.get("kernel_factor") or 0.0),
                   float(fd.get("per_collective_us") or 0.0) * 1e-6,
                   float(fd.get("per_collective_ns_per_byte") or 0.0) * 1e-9,
                   float(fd.get("per_read_us") or 0.0) * 1e-6)
    if not (_finite((fw.per_kernel_s, fw.per_collective_s, fw.per_collective_byte_s, fw.per_read_s))
            and fw.kernel_factor > -1 and math.isfinite(fw.kernel_factor)):
        raise ConfigError(f"{where}.framework: per_kernel_us, per_collective_us, "
                          f"per_collective_ns_per_byte, per_read_us must be finite >= 0, kernel_factor > -1")
    return fw


def _sync(data: Mapping[str, Any], where: str) -> Optional[SyncFit]:
    sd = data.get("sync")
    if not sd:
        return None
    sync = SyncFit(float(sd["alpha_us"]) * 1e-6, float(sd.get("per_compute") or 0.0),
                   float(sd["hidden"]) if sd.get("hidden") is not None else 1.0)
    if not (_finite((sync.alpha_s, sync.per_compute)) and 0 <= sync.hidden <= 1):
        raise ConfigError(f"{where}.sync: alpha_us, per_compute must be finite >= 0, hidden in [0, 1]")
    return sync


def _known_keys(section: Mapping[str, Any], known: set, where: str) -> None:
    """Refuse a section holding keys this format does not write (a profile of another format)."""
    extra = sorted(set(section) - known)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, extra))} {AGAIN}")


def _collective_cpu(data: Mapping[str, Any], where: str) -> Optional[CollectiveCPU]:
    cd = data.get("collective_cpu")
    if not cd:
        return None
    _known_keys(cd, {"busy", "per_call_us", "per_byte_ns"}, f"{where}.collective_cpu")
    busy = {int(k): float(v) for k, v in dict(cd.get("busy") or {}).items()}
    if not all(k >= 2 and 0 <= v <= 1 for k, v in busy.items()):
        raise ConfigError(f"{where}.collective_cpu.busy: group size >= 2 -> share of a core in [0, 1], got {busy}")
    per_call = {int(k): float(v) * 1e-6 for k, v in dict(cd.get("per_call_us") or {}).items()}
    per_byte = {int(k): float(v) * 1e-9 for k, v in dict(cd.get("per_byte_ns") or {}).items()}
    for key, vals, unit in (("per_call_us", per_call, "us"), ("per_byte_ns", per_byte, "ns")):
        if not (all(k >= 2 for k in vals) and _finite(vals.values())):
            raise ConfigError(f"{where}.collective_cpu.{key}: group size >= 2 -> finite {unit} >= 0, got {vals}")
    return CollectiveCPU(busy, per_call, per_byte)


def _factors(data: Mapping[str, Any], key: str, least: int, where: str) -> Dict[int, float]:
    got = {int(p): float(c) for p, c in dict(data.get(key) or {}).items()}
    if any(p < least or not (c > 0 and math.isfinite(c)) for p, c in got.items()):
        raise ConfigError(f"{where}.{key}: processes >= {least} -> finite factor > 0, got {got}")
    return got


def _reference(data: Mapping[str, Any], where: str) -> Dict[str, Dict[str, float]]:
    reference = {str(g): {str(k): float(v) * 1e-6 for k, v in dict(vals or {}).items()}
                 for g, vals in dict(data.get("reference") or {}).items()}
    if any(g != STEPS_GROUP for g in reference) or not all(
            v > 0 and math.isfinite(v) for vals in reference.values() for v in vals.values()):
        raise ConfigError(f"{where}.reference: group ({STEPS_GROUP}) -> label -> microseconds > 0, "
                          f"got {sorted(reference)}")
    return reference


def _step_residual(data: Mapping[str, Any], where: str) -> Optional[StepResidual]:
    rd = data.get("step_residual")
    if not rd:
        return None
    _known_keys(rd, {"compute", "exposed", "probe_steps", "form", "cpu_ratio", "cpu_fit", "cpu_wait", "cv"},
                f"{where}.step_residual")
    comp = {int(k): {int(c): float(x) for c, x in dict(v).items()} for k, v in dict(rd["compute"]).items()}
    expo = {int(k): {int(c): float(x) for c, x in dict(v).items()} for k, v in dict(rd["exposed"]).items()}
    if not comp or set(comp) != set(expo) or any(set(comp[k]) != set(expo[k]) for k in comp) or not all(
            k >= 1 and c >= 1 and v >= 0 and math.isfinite(v)
            for d in (comp, expo) for k, vs in d.items() for c, v in vs.items()):
        raise ConfigError(f"{where}.step_residual: compute and exposed: the same processes >= 1 -> "
                          f"chunks >= 1 -> finite factor >= 0, got {comp}, {expo}")
    cv = {str(f): (float(mw[0]), float(mw[1])) for f, mw in dict(rd.get("cv") or {}).items()}
    return StepResidual(comp, expo, {int(k): int(v) for k, v in dict(rd.get("probe_steps") or {}).items()},
                        _cpu_step(rd, where), str(rd.get("form") or "terms"), cv)


def _cpu_step(rd: Mapping[str, Any], where: str) -> Optional[CpuStep]:
    if not rd.get("cpu_ratio"):
        return None
    ratio = {int(p): {str(k): float(v) for k, v in dict(cells).items()} for p, cells in dict(rd["cpu_ratio"]).items()}
    fit = {int(p): {str(c): (float(ab[0]), float(ab[1]) * 1e-6) for c, ab in dict(per).items()}
           for p, per in dict(rd.get("cpu_fit") or {}).items()}
    wait = {int(p): {str(k): float(v) * 1e-6 for k, v in dict(cells).items()}
            for p, cells in dict(rd.get("cpu_wait") or {}).items()}
    if not fit or not all(v > 0 and math.isfinite(v) for cells in ratio.values() for v in cells.values()) \
            or not all(_finite(ab) for per in fit.values() for ab in per.values()) \
            or not all(p in ratio and k in ratio[p] and v >= 0 and math.isfinite(v)
                       for p, cells in wait.items() for k, v in cells.items()):
        raise ConfigError(f"{where}.step_residual: cpu_ratio: processes -> 'd1xd2/cC' -> finite factor "
                          f"> 0, cpu_fit: processes -> 'd1xd2/cC' -> [factor >= 0, microseconds >= 0] and "
                          f"cpu_wait: cpu_ratio's cells -> microseconds >= 0, got {ratio}, {fit}, {wait}")
    return CpuStep(ratio, fit, wait)


def profile_of(topo: Topology) -> Optional[ComputeProfile]:
    """The topology's compute profile: its calibrated ``device.compute``, else its spec."""
    compute = topo.device.get("compute")
    if compute:
        prof = ComputeProfile.from_config(compute, f"topology '{topo.name}': device.compute")
        speed = topo.device.get("host_speed")  # the host's speed re-timed (run.calibration.with_calibration)
        if speed:
            prof = prof.at_speed(HostSpeed.from_dict(speed))
        return prof
    return ComputeProfile.from_spec(topo.device)
