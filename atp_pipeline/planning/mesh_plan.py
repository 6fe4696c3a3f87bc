"""ATP's mesh plan (§3.5): every candidate ``DeviceMesh(d1, d2)`` costed, one selected.

:class:`MeshPlan` is the ATP planner's :class:`~atp_pipeline.planning.interface.PlanResult`:
its console table (bandwidths per dimension, T_comm, ratio to Megatron's ``(N, 1)``), the
levels each dimension of the selection crosses, ``plan.json`` and the ``plan.png`` bar
chart of every candidate's T_comm.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.table import Table

from atp_pipeline.config.schema import CostModel, MeshStrategy, Objective
from atp_pipeline.planning.bandwidth import DimBandwidth
from atp_pipeline.planning.compute_profile import ComputeProfile
from atp_pipeline.planning.cost import TermCost
from atp_pipeline.planning.fmt import fmt_seconds
from atp_pipeline.planning.gradsync import GradBucket, dp_bucket
from atp_pipeline.planning.memory import per_device_memory
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.planning.steptime import StepEstimate, StepSetting
from atp_pipeline.topology.model import Topology

Mesh = Tuple[int, int]


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    dim1: DimBandwidth
    dim2: DimBandwidth
    t_comm_s: float
    terms: Tuple[TermCost, ...]
    infeasible: Optional[str] = None
    step: Optional[StepEstimate] = None  # the predicted step (planning/steptime.py)

    @property
    def source(self) -> str:
        sources = {d.source for d in (self.dim1, self.dim2)} - {"none"}
        return sources.pop() if len(sources) == 1 else ("model" if not sources else "mixed")

    def to_dict(self, megatron_t: float) -> dict:
        return {
            "mesh": list(self.mesh),
            "B1_prime_GBps": self.dim1.B_prime_GBps,
            "B2_prime_GBps": self.dim2.B_prime_GBps,
            "B1_GBps": self.dim1.B_GBps,
            "B2_GBps": self.dim2.B_GBps,
            "t_comm_s": self.t_comm_s,
            "ratio_to_megatron": self.t_comm_s / megatron_t if megatron_t > 0 else None,
            "source": self.source,
            "feasible": self.infeasible is None,
            "infeasible_reason": self.infeasible,
            "dims": [self.dim1.to_dict(), self.dim2.to_dict()],
            "terms": [t.to_dict() for t in self.terms],
            "step": None if self.step is None else self.step.to_dict(),
        }


@dataclass(frozen=True)
class Layout:
    """One whole layout: ``dp`` replicas of ``DeviceMesh(d1, d2)``, FSDP, chunks, aggregation."""

    dp: int
    mesh: Mesh
    fsdp: bool
    chunks: int
    aggregation: str

    @property
    def devices(self) -> int:
        return self.dp * self.mesh[0] * self.mesh[1]

    @property
    def label(self) -> str:
        sync = ("fsdp" if self.fsdp else self.aggregation) if self.dp > 1 else "-"
        return f"dp{self.dp} x {self.mesh[0]}x{self.mesh[1]}, {sync}, chunks {self.chunks}"

    @property
    def overrides(self) -> str:
        """The command-line fields that fix this layout."""
        return (f"mesh={self.mesh[0]}x{self.mesh[1]} mesh.dp={self.dp} mesh.fsdp={str(self.fsdp).lower()} "
                f"overlap=chunk{self.chunks} aggregation={self.aggregation}")

    def to_dict(self) -> Dict[str, Any]:
        return {"dp": self.dp, "mesh": list(self.mesh), "fsdp": self.fsdp, "chunks": self.chunks,
                "aggregation": self.aggregation}


@dataclass(frozen=True)
class LayoutCandidate:
    """A layout, priced where it can run: ``step`` (None where not priced), ``t_comm_s`` (one
    replica's Eq. 2-4 tensor-parallel communication on its batch), ``sync_s`` (gradient sync or
    FSDP traffic per step), ``memory_bytes`` per device; ``why`` it cannot run (None: it can) and
    ``lost`` (one of :data:`LOST`, ``"chosen"``, or ``""`` before ranking)."""

    layout: Layout
    step: Optional[StepEstimate] = None
    t_comm_s: Optional[float] = None
    sync_s: float = 0.0
    memory_bytes: Optional[float] = None
    why: Optional[str] = None
    lost: str = ""

    @property
    def feasible(self) -> bool:
        return self.why is None

    @property
    def comm_s(self) -> Optional[float]:
        return None if self.t_comm_s is None else self.t_comm_s + self.sync_s

    def to_dict(self) -> Dict[str, Any]:
        st = self.step
        return {**self.layout.to_dict(), "label": self.layout.label, "feasible": self.feasible, "why": self.why,
                "lost": self.lost, "predicted_step_s": None if st is None else st.step_s,
                "predicted_tokens_per_s": None if st is None else st.tokens_per_s,
                "predicted_compute_s": None if st is None else st.compute_s,
                "predicted_exposed_comm_s": None if st is None else st.exposed_comm_s,
                "t_comm_s": self.t_comm_s, "sync_s": self.sync_s, "memory_per_device_bytes": self.memory_bytes}


@dataclass(frozen=True)
class MeshPlan:
    """ATP's mesh search result (§3.5): every candidate ``DeviceMesh(d1, d2)`` with its
    bandwidths and communication time, and the one selected. A
    :class:`~atp_pipeline.planning.interface.PlanResult`."""

    topology: Topology
    model: ModelShape
    strategy: MeshStrategy
    cost_model: CostModel
    candidates: Tuple[Candidate, ...]
    selected: Mesh
    notes: Tuple[str, ...] = field(default_factory=tuple)
    objective: Objective = Objective.comm
    setting: StepSetting = field(default_factory=StepSetting)
    profile: Optional[ComputeProfile] = None
    # the whole-layout search (planning/layout.py): every layout, ranked (the chosen one first),
    # the topology of all replicas, the fields the user fixed, the search's wall time
    layouts: Tuple[LayoutCandidate, ...] = ()
    world: Optional[Topology] = None
    fixed: Tuple[str, ...] = ()
    planning_s: Optional[float] = None
    top: int = 5  # layouts printed (planner.top)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def candidate(self, mesh: Mesh) -> Candidate:
        for c in self.candidates:
            if c.mesh == tuple(mesh):
                return c
        raise KeyError(mesh)

    @property
    def megatron(self) -> Candidate:
        return self.candidate((self.world_size, 1))

    # -------------------------------------------------------- PlanResult interface
    kind = "atp"

    @property
    def mesh_shape(self) -> Mesh:
        return self.selected

    @property
    def label(self) -> str:
        return f"{self.selected[0]}x{self.selected[1]}"

    @property
    def predicted_comm_s(self) -> float:
        return self.candidate(self.selected).t_comm_s

    def with_notes(self, notes: Sequence[str]) -> "MeshPlan":
        return replace(self, notes=tuple(notes))

    def print(self, console: Any = None) -> None:
        print_plan(self, console)

    def plot(self, path: Path) -> bool:
        plot_plan(self, path)
        return True

    @property
    def whole_layout(self) -> Layout:
        """The whole layout this plan runs: its setting's dp, FSDP, chunks and aggregation on the selected mesh."""
        s = self.setting
        return Layout(s.dp, self.selected, bool(s.fsdp), s.chunks, s.aggregation)

    @property
    def tp_comm_s(self) -> float:
        return self.predicted_comm_s

    def grad_buckets(self, dp: int) -> List[GradBucket]:
        """One bucket: ``dp`` replicas of each of the ``d1·d2`` shards (gradsync)."""
        d1, d2 = self.selected
        return [dp_bucket(per_device_memory(self.model, self.selected, dp).params, dp, d1 * d2)]

    def summary_row(self) -> Dict[str, Any]:
        sel = self.candidate(self.selected)
        mt = self.megatron.t_comm_s
        st = sel.step
        return {"topology": self.topology.name, "model": self.model.name, "world_size": self.world_size,
                "strategy": self.strategy.value, "selected": self.label, "t_comm_s": sel.t_comm_s,
                "megatron_t_comm_s": mt, "ratio_to_megatron": sel.t_comm_s / mt if mt > 0 else None,
                "B1_GBps": sel.dim1.B_GBps, "B2_GBps": sel.dim2.B_GBps, "source": sel.source,
                "objective": self.objective.value,
                "predicted_step_s": None if st is None else st.step_s,
                "predicted_compute_s": None if st is None else st.compute_s,
                "predicted_exposed_comm_s": None if st is None else st.exposed_comm_s,
                "predicted_residual_s": None if st is None else st.residual_s,
                "predicted_tokens_per_s": None if st is None else st.tokens_per_s,
                "predicted_mfu": None if st is None else st.mfu,
                "compute_profile": None if self.profile is None else self.profile.name,
                "dp": self.setting.dp, "fsdp": bool(self.setting.fsdp), "chunks": self.setting.chunks,
                "aggregation": self.setting.aggregation, "layout": self.whole_layout.label,
                "layouts_searched": len(self.layouts) or None, "planning_s": self.planning_s}

    def to_dict(self) -> dict:
        mt = self.megatron.t_comm_s
        sel = self.candidate(self.selected)
        return {
            "planner": "atp",
            "topology": self.topology.to_dict(),
            "world_size": self.world_size,
            "model": self.model.to_dict(),
            "strategy": self.strategy.value,
            "cost_model": self.cost_model.value,
            "objective": self.objective.value,
            "step_setting": {"chunks": self.setting.chunks, "dp": self.setting.dp,
                             "aggregation": self.setting.aggregation},
            "compute_profile": None if self.profile is None else {
                "name": self.profile.name, "source": self.profile.source, "processes": self.profile.processes,
                "peak_GFLOPs": self.profile.peak_flops / 1e9},
            "candidates": [c.to_dict(mt) for c in self.candidates],
            "selected": list(self.selected),
            "selected_runnable": sel.infeasible is None,  # False only with planner.require_divisible=false
            "selected_t_comm_s": sel.t_comm_s,
            "megatron_t_comm_s": mt,
            "notes": list(self.notes),
            "layout": self.whole_layout.to_dict(),
            "layout_search": None if not self.layouts else {
                "world": None if self.world is None else self.world.to_dict(),
                "devices": self.whole_layout.devices, "fixed": list(self.fixed), "planning_s": self.planning_s,
                "lost": lost_counts(self.layouts),
                "candidates": [c.to_dict() for c in self.layouts]},
        }


def lost_counts(layouts: Sequence[LayoutCandidate]) -> Dict[str, int]:
    """How many layouts lost for each reason (and the chosen one)."""
    out: Dict[str, int] = {}
    for c in layouts:
        out[c.lost] = out.get(c.lost, 0) + 1
    return out


def residual_origin(profile: Any, st: Any) -> str:
    """Where a prediction's step residual comes from, in words (the residual's form)."""
    sr = getattr(profile, "step_residual", None)
    if sr is not None and sr.form == "cpu":
        return (f"the step from a rank's CPU, {fmt_seconds(st.cpu_s)} predicted, as the calibration's probe steps "
                f"were to theirs: waits, barriers, run queue")
    return "the calibration's probe steps: barriers, run queue"


def _gbps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def plan_table(plan: MeshPlan) -> Table:
    topo = plan.topology
    dp = plan.setting.dp  # the plan's topology is one replica's: the header counts every device the run uses
    devices = f"{dp * topo.world_size} devices" + (f": {dp} replicas of {topo.world_size}" if dp > 1 else "")
    title = (f"ATP plan: topology '{topo.name}' ({devices}), model "
             f"'{plan.model.name}' (h={plan.model.hidden}, L={plan.model.layers}, "
             f"b={plan.model.batch_size}, s={plan.model.seq_len}, {plan.model.dtype}), "
             f"mesh={plan.strategy.value}, objective={plan.objective.value}")
    table = Table(title=title, title_justify="left")
    for col in ("", "d1 x d2", "B1' GB/s", "B2' GB/s", "B1 GB/s", "B2 GB/s", "T_comm", "vs (N,1)",
                "step", "compute", "exposed", "tokens/s", "MFU", "source"):
        table.add_column(col, justify="right" if col not in ("", "source") else "left")
    mt = plan.megatron.t_comm_s
    for c in plan.candidates:
        mark = "*" if c.mesh == plan.selected else ""
        source = c.source + ("" if c.infeasible is None else ", infeasible")
        st = c.step
        step_cols = ["-"] * 5 if st is None else [
            fmt_seconds(st.step_s), fmt_seconds(st.compute_s), fmt_seconds(st.exposed_comm_s),
            f"{st.tokens_per_s:,.0f}", "-" if st.mfu is None else f"{st.mfu:.1%}"]
        table.add_row(mark, f"{c.mesh[0]} x {c.mesh[1]}", _gbps(c.dim1.B_prime_GBps),
                      _gbps(c.dim2.B_prime_GBps), _gbps(c.dim1.B_GBps), _gbps(c.dim2.B_GBps),
                      fmt_seconds(c.t_comm_s), f"{c.t_comm_s / mt:.3f}" if mt > 0 else "-", *step_cols, source,
                      style="bold green" if mark else None)
    return table


def print_plan(plan: MeshPlan, console: Optional[Console] = None) -> None:
    console = console or Console(width=160)
    console.print(plan_table(plan))
    sel = plan.candidate(plan.selected)
    console.print(f"selected DeviceMesh{plan.selected}: T_comm {fmt_seconds(sel.t_comm_s)} per step, "
                  f"{sel.t_comm_s / plan.megatron.t_comm_s:.3f}x Megatron-LM's (N,1)"
                  if plan.megatron.t_comm_s > 0 else f"selected DeviceMesh{plan.selected}")
    for label, dim in (("dim 1", sel.dim1), ("dim 2", sel.dim2)):
        if dim.size > 1:
            crossed = "; ".join(
                f"level '{c.level}': {c.units_per_group} units per group, {c.groups_sharing} "
                f"group(s) share a unit, {c.GBps:.4g} GB/s (limited by {c.limited_by})"
                for c in dim.crossings)
            console.print(f"  {label} (size {dim.size}, {dim.source}): {crossed}")
    if plan.profile is not None and sel.step is not None:
        st = sel.step
        console.print(f"predicted step {fmt_seconds(st.step_s)} = compute {fmt_seconds(st.compute_s)} + exposed "
                      f"communication {fmt_seconds(st.exposed_comm_s)} (of {fmt_seconds(st.total_comm_s)}; §4.1 chunks "
                      f"{plan.setting.chunks}, §4.2 backward overlap)"
                      + (f" + gradient sync {fmt_seconds(st.gradsync_s)} ({plan.setting.aggregation}, "
                         f"dp={plan.setting.dp})" if st.gradsync_s else "")
                      + (f" + step residual {fmt_seconds(st.residual_s)} ({residual_origin(plan.profile, st)})"
                         if st.residual_s else "")
                      + f"; {st.tokens_per_s:,.0f} tokens/s"
                      + ("" if st.mfu is None else f", MFU {st.mfu:.1%}")
                      + (f"; bound by the host: every rank's CPU ({fmt_seconds(st.cpu_s)} each) over its "
                         f"{plan.profile.cores} cores (the rank's own timeline {fmt_seconds(st.timeline_s)})"
                         if st.host_bound else ""))
        console.print(f"  compute profile '{plan.profile.name}': {plan.profile.source}; communication: "
                      f"{st.comm_source}")
    for note in plan.notes:
        console.print(f"note: {note}")
    for c in plan.candidates:
        if c.infeasible:
            console.print(f"infeasible {c.mesh[0]}x{c.mesh[1]}: {c.infeasible}")
    if plan.layouts:
        print_layouts(plan, console)


def _gb(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB" if x >= 1e5 else f"{x / 1e3:.1f} kB"


def layout_table(plan: MeshPlan, top: int) -> Table:
    """The chosen layout and the next fastest feasible ones (``top`` rows in all)."""
    world = plan.world or plan.topology
    fixed = f"; fixed: {' '.join(plan.fixed)}" if plan.fixed else ""
    table = Table(title=f"whole layouts of the {world.world_size} devices of '{world.name}' (dp x d1 x d2, FSDP, "
                        f"chunks, aggregation; global batch {plan.model.batch_size}{fixed}): the top {top} that may "
                        f"be chosen, of {len(plan.layouts)}, objective={plan.objective.value}", title_justify="left")
    for col in ("", "dp", "d1 x d2", "sync", "chunks", "step", "tokens/s", "MFU", "memory/device", "T_comm (replica)",
                "dp traffic"):
        table.add_column(col, justify="left" if col in ("", "sync") else "right")
    shown = [c for c in plan.layouts if c.lost in ("chosen", "slower")][:top]
    for i, c in enumerate(shown):
        lay, st = c.layout, c.step
        table.add_row("*" if c.lost == "chosen" else str(i + 1), str(lay.dp), f"{lay.mesh[0]} x {lay.mesh[1]}",
                      ("fsdp" if lay.fsdp else lay.aggregation) if lay.dp > 1 else "-", str(lay.chunks),
                      "-" if st is None else fmt_seconds(st.step_s), "-" if st is None else f"{st.tokens_per_s:,.0f}",
                      "-" if st is None or st.mfu is None else f"{st.mfu:.1%}", _gb(c.memory_bytes),
                      "-" if c.t_comm_s is None else fmt_seconds(c.t_comm_s), fmt_seconds(c.sync_s),
                      style="bold green" if c.lost == "chosen" else None)
    return table


def lost_lines(plan: MeshPlan) -> List[str]:
    """Why the rest lost, one line per reason, with its fastest (or smallest) example."""
    words = {"memory": "do not fit the device memory", "divisibility": "do not divide (batch, chunks or heads)",
             "limit": "exceed the aggregation backend's workers", "calibration":
             "have only matrix estimates on a calibrated topology", "slower": "run but are predicted slower"}
    out = []
    for reason in ("memory", "divisibility", "limit", "calibration", "slower"):
        group = [c for c in plan.layouts if c.lost == reason]
        if not group:
            continue
        first = group[0]  # ranked: the fastest priced one first
        if reason == "memory":
            first = min(group, key=lambda c: c.memory_bytes or 0.0)
            example = f"least memory: {first.layout.label}, ~{_gb(first.memory_bytes)}; {first.why}"
        elif reason == "slower":
            example = f"fastest: {first.layout.label}" + (
                f", {fmt_seconds(first.step.step_s)}" if first.step is not None else
                f", communication {fmt_seconds(first.comm_s or 0.0)}")
        elif reason == "divisibility":
            kinds: Dict[str, List[LayoutCandidate]] = {}
            for c in group:
                kind = ("the global batch over dp" if (c.why or "").startswith("global batch") else
                        "the local batch into chunks" if (c.why or "").startswith("local batch") else
                        "the heads over d1 x d2" if "heads" in (c.why or "") else "the topology's units")
                kinds.setdefault(kind, []).append(c)
            example = "; ".join(f"{len(v)} {k}, e.g. {min(v, key=lambda c: c.layout.dp).why}"
                                for k, v in kinds.items())
            out.append(f"  {len(group)} do not divide: {example}")
            continue
        elif reason == "calibration":
            example = f"e.g. {first.layout.label}" + (
                f", {fmt_seconds(first.step.step_s)}" if first.step is not None else "") + \
                "; planner.select_uncalibrated=true lets them compete"
        else:
            example = f"e.g. {first.layout.label}: {first.why}"
        out.append(f"  {len(group)} {words[reason]} ({example})")
    return out


def print_layouts(plan: MeshPlan, console: Any) -> None:
    top = plan_top(plan)
    console.print(layout_table(plan, top))
    chosen = next((c for c in plan.layouts if c.lost == "chosen"), None)
    if chosen is not None:
        st = chosen.step
        console.print(f"chosen layout: {chosen.layout.label}"
                      + ("" if st is None else f": predicted step {fmt_seconds(st.step_s)}, "
                                               f"{st.tokens_per_s:,.0f} tokens/s")
                      + f", ~{_gb(chosen.memory_bytes)} per device ({chosen.layout.overrides})")
    console.print(f"why the other {len(plan.layouts) - 1} lost:")
    for line in lost_lines(plan):
        console.print(line)
    if plan.planning_s is not None:
        console.print(f"planned {len(plan.layouts)} layouts in {plan.planning_s:.3f} s")


def plan_top(plan: MeshPlan) -> int:
    return max(1, plan.top)


def plot_layouts(plan: MeshPlan, ax: Any) -> None:
    """Every priced layout's predicted step (or communication) against its memory per device,
    coloured by why it lost; the chosen one a star, the device memory a line."""
    colours = {"chosen": "tab:green", "slower": "tab:blue", "memory": "tab:red", "calibration": "tab:purple",
               "limit": "tab:orange", "divisibility": "lightgray"}
    by_step = any(c.step is not None for c in plan.layouts)
    for reason, colour in colours.items():
        pts = [(c.memory_bytes / 1e9, (c.step.step_s if by_step and c.step else c.comm_s or 0.0) * 1e3)
               for c in plan.layouts if c.lost == reason and c.memory_bytes is not None
               and (c.step is not None if by_step else c.comm_s is not None)]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=120 if reason == "chosen" else 14,
                       marker="*" if reason == "chosen" else "o", color=colour, label=f"{reason} ({len(pts)})",
                       zorder=3 if reason == "chosen" else 2)
    cap = (plan.world or plan.topology).device.get("memory_GB")
    if cap:
        ax.axvline(float(cap), color="tab:red", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("memory per device (GB, estimate)")
    ax.set_ylabel("predicted step (ms)" if by_step else "communication per step (ms)")
    world = plan.world or plan.topology
    ax.set_title(f"{len(plan.layouts)} layouts of {world.world_size} devices: chosen {plan.whole_layout.label}",
                 fontsize=9)
    ax.legend(fontsize=7)


def plot_plan(plan: MeshPlan, path: Path) -> None:
    """Every candidate's T_comm (left) and predicted step time split into compute and exposed
    communication (right, when predicted); the selection and (N,1) are marked."""
    from atp_pipeline.figures import axes

    labels = [f"{c.mesh[0]}x{c.mesh[1]}" for c in plan.candidates]
    times = [c.t_comm_s * 1e3 for c in plan.candidates]
    colors = []
    for c in plan.candidates:
        if c.mesh == plan.selected:
            colors.append("tab:green")
        elif c.infeasible is not None:
            colors.append("lightgray")
        elif c.mesh == plan.megatron.mesh:
            colors.append("tab:orange")
        else:
            colors.append("tab:blue")
    stepped = any(c.step is not None for c in plan.candidates)
    width = max(4.0, 0.7 * len(labels) + 2)
    extra = 1 if plan.layouts else 0
    ncols = (2 if stepped else 1) + extra
    with axes(path, ((2 * width if stepped else width) + 6 * extra, 3.6), ncols=ncols) as ax_all:
        ax_all = list(ax_all) if ncols > 1 else [ax_all]
        if extra:
            plot_layouts(plan, ax_all.pop(0))
        ax = ax_all[0]
        bars = ax.bar(labels, times, color=colors)
        for bar, c in zip(bars, plan.candidates):
            if c.source == "calibrated":
                bar.set_hatch("//")
        ax.set_xlabel("DeviceMesh(d1, d2)")
        ax.set_ylabel("T_comm per step (ms, Eq. 2)")
        key = [f"selected {plan.selected[0]}x{plan.selected[1]} green"]
        if plan.megatron.mesh != plan.selected:
            key.append("(N,1) orange")
        if any(c.source == "calibrated" for c in plan.candidates):
            key.append("hatched = calibrated")
        ax.set_title(f"{plan.topology.name}, {plan.model.name}: {', '.join(key)}", fontsize=9)
        if len(times) > 1 and min((t for t in times if t > 0), default=1) * 50 < max(times):
            ax.set_yscale("log")
        if len(labels) > 8:
            ax.tick_params(axis="x", labelrotation=60)
        if stepped:
            ax2 = ax_all[1]
            comp = [c.step.compute_s * 1e3 if c.step else 0.0 for c in plan.candidates]
            expo = [c.step.exposed_comm_s * 1e3 + c.step.gradsync_s * 1e3 if c.step else 0.0
                    for c in plan.candidates]
            ax2.bar(labels, comp, color="tab:gray")
            ax2.bar(labels, expo, bottom=comp, color=colors)
            for i, c in enumerate(plan.candidates):
                if c.step is not None:
                    txt = (f"{c.step.tokens_per_s:,.0f} tok/s"
                           + ("" if c.step.mfu is None else f"\n{c.step.mfu:.0%} MFU"))
                    ax2.text(i, comp[i] + expo[i], txt, ha="center", va="bottom", fontsize=6)
            ax2.set_xlabel("DeviceMesh(d1, d2)")
            ax2.set_ylabel("predicted step (ms)")
            ax2.set_title(f"predicted step: compute (gray) + exposed communication; objective="
                          f"{plan.objective.value}, chunks {plan.setting.chunks}", fontsize=9)
            from matplotlib.patches import Patch

            ax2.legend(handles=[Patch(color="tab:gray", label="compute"),
                                Patch(facecolor="white", edgecolor="black",
                                      label="exposed communication (the mesh's colour)")], fontsize=7)
            if len(labels) > 8:
                ax2.tick_params(axis="x", labelrotation=60)
