"""What a whole step takes beyond the step-time terms' sum, fitted over the probe models' own steps:
:class:`StepResidual` (two factors per process and chunk count) and :class:`CpuStep` (the step from
a rank's CPU per mesh and chunk count)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Tuple

from atp_pipeline.errors import ConfigError

Mesh = Tuple[int, int]


def _nearest(values: Mapping[int, Any], key: int) -> Any:
    """``values`` at the calibrated key nearest ``key`` (ties: the larger key's)."""
    return values[min(values, key=lambda n: (abs(n - key), -n))]




def cell_key(mesh: Mesh, chunks: int) -> str:
    """A (mesh, chunk count) cell's name in :class:`CpuStep` and its YAML: ``"2x1/c2"``."""
    return f"{mesh[0]}x{mesh[1]}/c{chunks}"


@dataclass(frozen=True)
class CpuStep:
    """The step as a multiple of one rank's CPU: on a host whose processes share its cores, a step
    is every rank's CPU work plus waits that keep a share of it per (mesh, chunk count) cell, which
    the step-time terms' timeline does not reproduce (the waits depend on which rank's work the
    others wait for). So the step is ``ratio[P][cell] × (a·CPU + b) + wait[P][cell]``: ``CPU`` the
    model's predicted CPU of a rank (:attr:`~atp_pipeline.planning.steptime.StepEstimate.cpu_s`: its
    compute and its collectives' backend CPU); ``a, b`` per process count and cell what the probes'
    measured rank CPU was against that prediction; ``ratio`` and ``wait`` per cell the probes'
    measured step against their measured rank CPU, ``T = ratio·U + wait`` (both relative
    non-negative least squares over the probe models' own steps). A cell not calibrated takes the
    medians over its process count's cells of its chunk count (else of all its cells); a process
    count not calibrated the nearest one's (ties: the larger)."""

    ratio: Mapping[int, Mapping[str, float]]  # processes -> cell_key -> step / rank CPU
    cpu: Mapping[int, Mapping[str, Tuple[float, float]]]  # processes -> cell_key -> (a, b seconds)
    wait: Mapping[int, Mapping[str, float]] = field(default_factory=dict)  # processes -> cell_key -> seconds

    def _count(self, processes: int) -> int:
        return min(self.ratio, key=lambda n: (abs(n - processes), -n))

    def _cells(self, cells: Mapping[str, Any], processes: int, mesh: Mesh, chunks: int) -> List[str]:
        """The cells of ``cells`` (one count's) a cell is priced from: itself where calibrated on
        ``processes`` itself, else its count's cells of its chunk count (else all its cells)."""
        key = cell_key(mesh, chunks)
        if self._count(processes) == processes and key in cells:
            return [key]
        return [k for k in cells if k.endswith(f"/c{chunks}")] or list(cells)

    def step(self, processes: int, mesh: Mesh, chunks: int, cpu_s: float) -> float:
        """The step of a rank whose predicted CPU is ``cpu_s`` on ``mesh`` at ``chunks`` among ``processes``."""
        p = self._count(processes)
        cells, waits = self.ratio[p], self.wait.get(p, {})
        same = self._cells(cells, processes, mesh, chunks)
        g, w = statistics.median(cells[k] for k in same), statistics.median(waits.get(k, 0.0) for k in same)
        a, b = self.line(processes, mesh, chunks)
        return g * (a * cpu_s + b) + w

    def line(self, processes: int, mesh: Mesh, chunks: int) -> Tuple[float, float]:
        """The rank CPU's line ``(a, b)`` for ``mesh`` at ``chunks`` among ``processes``: its cell's,
        else the medians over the nearest calibrated count's cells of its chunk count (else of all its cells)."""
        p = self._count(processes)
        lines = self.cpu.get(p) or _nearest(self.cpu, p)
        same = self._cells(lines, processes, mesh, chunks)
        return statistics.median(lines[k][0] for k in same), statistics.median(lines[k][1] for k in same)

    def at_speed(self, overhead: float) -> "CpuStep":
        """The same with the CPU offsets ``b`` and the waits at the host's per-call speed now (:class:`HostSpeed`)."""
        return CpuStep(self.ratio,
                       {p: {c: (a, b * overhead) for c, (a, b) in per.items()} for p, per in self.cpu.items()},
                       {p: {k: w * overhead for k, w in cells.items()} for p, cells in self.wait.items()})

    def describe(self) -> str:
        def one(p: int) -> str:
            cpu = ", ".join(f"x{a:.3f} + {b * 1e3:.2f} ms ({c})" for c, (a, b) in sorted(self.cpu.get(p, {}).items()))
            waits = self.wait.get(p, {})
            cells = ", ".join(f"{k} x{v:.2f}" + (f" + {waits[k] * 1e3:.2f} ms" if waits.get(k) else "")
                              for k, v in sorted(self.ratio[p].items()))
            return f"{p} processes: rank CPU {cpu}; step / rank CPU {cells}"
        return "the step from a rank's CPU (" + "; ".join(one(p) for p in sorted(self.ratio)) + ")"


@dataclass(frozen=True)
class StepResidual:
    """What a whole step takes beyond the terms' sum, per process count ``P`` and chunk count
    ``c`` (§4.1), as two factors: the step is ``compute[P][c] × compute + exposed[P][c] × exposed``
    (the terms' compute — on an oversubscribed host the host-bound CPU — and their exposed
    communication, :class:`~atp_pipeline.planning.steptime.StepEstimate`). Fitted (relative
    non-negative least squares) over the probe models' own training steps (forward, backward,
    optimizer, each between barriers as the validation times a step; their collectives run) against
    the profile's prediction of them: what no term has or what the terms misprice alike for every
    model — the closing barrier and the run queue (shares of the step whatever its size, so factors
    rather than seconds), a rank's CPU the calibration's kernels price short, the exposed
    collectives' time where a step makes many calls. Only probe models (never a model, batch or
    sequence length the validation runs) enter it. At a process or chunk count not calibrated, the
    nearest calibrated count's factors (ties: the larger count's). Where the probe models left out
    of the fit in turn chose it (``form == "cpu"``), :class:`CpuStep` gives the step instead."""

    compute: Mapping[int, Mapping[int, float]]
    exposed: Mapping[int, Mapping[int, float]]
    # how many probe steps each process count's factors are fitted over
    steps: Mapping[int, int] = field(default_factory=dict)
    #: the step from a rank's CPU, fitted over the same probe steps; where set and
    #: ``form == "cpu"`` it gives the step instead of the two factors
    anchored: Optional[CpuStep] = None
    form: str = "terms"
    #: each form's error on the probe models left out of its fit in turn (median, worst), the
    #: choice of ``form`` (leave-one-probe-model-out at calibration)
    cv: Mapping[str, Tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.form not in RESIDUAL_FORMS or (self.form == "cpu" and self.anchored is None):
            raise ConfigError(f"step residual: form '{self.form}' (one of {', '.join(RESIDUAL_FORMS)}; "
                              f"'cpu' with its fit)")

    def at(self, processes: int, chunks: int = 1) -> Tuple[float, float]:
        """``(compute, exposed)`` factors at ``processes`` and ``chunks``."""
        if not self.compute:
            return 1.0, 1.0
        p = min(self.compute, key=lambda n: (abs(n - processes), -n))
        comp = _nearest(self.compute[p], chunks)
        return comp, _nearest(self.exposed.get(p) or self.compute[p], chunks)

    def describe(self, processes: Optional[int] = None, chunks: Optional[int] = None, source: bool = True) -> str:
        """What the residual is (``source``: and that the probes' steps fitted it)."""
        def per_chunks(p: int) -> str:
            return ", ".join(f"compute x{c:.3f}, exposed x{_nearest(self.exposed.get(p) or self.compute[p], k):.3f}"
                             + (f" (chunks {k})" if len(self.compute[p]) > 1 else "")
                             for k, c in sorted(self.compute[p].items()))
        counts = "; ".join(f"{per_chunks(p)} at {p} processes"
                           + (f" ({self.steps[p]} probe steps)" if p in self.steps else "")
                           for p in sorted(self.compute))
        at = ""
        if processes is not None and (processes not in self.compute
                                      or (chunks is not None and len(self.compute[processes]) > 1
                                          and chunks not in self.compute[processes])):
            a, b = self.at(processes, chunks or 1)
            at = (f"; {processes} processes{f', chunks {chunks}' if chunks else ''} not calibrated: "
                  f"the nearest count's (x{a:.3f}, x{b:.3f})")
        fitted = " (fitted over the probes' own steps)" if source else ""
        head = f"step residual {counts}{fitted}{at}"
        cv = "; ".join(f"{f} {m:.1%} / {w:.1%}" for f, (m, w) in sorted(self.cv.items()))
        if self.form == "cpu" and self.anchored is not None:
            head = f"step residual: {self.anchored.describe()} [{head}]"
        return head + (f"; form '{self.form}' chosen on the probe models left out in turn (median / worst: {cv})"
                       if cv else "")

    def cpu_step(self, processes: int, mesh: Mesh, chunks: int, cpu_s: float) -> Optional[float]:
        """The step from a rank's CPU where that form is chosen (:class:`CpuStep`), else None."""
        return self.anchored.step(processes, mesh, chunks, cpu_s) if self.form == "cpu" and self.anchored else None


RESIDUAL_FORMS = ("terms", "cpu")
