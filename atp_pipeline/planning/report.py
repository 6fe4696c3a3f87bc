"""The plan report: a console table, ``plan.json``, ``plan.png`` and a one-row summary.

``summary.json`` is the run's headline in flat form; the multirun callback
(:mod:`atp_pipeline.sweep`) collects these into the sweep's summary table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from rich.console import Console
from rich.table import Table

from atp_pipeline.planning.gradsync import GradSyncReport, print_gradsync
from atp_pipeline.planning.search import Plan


def _gbps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def plan_table(plan: Plan) -> Table:
    topo = plan.topology
    title = (f"ATP plan: topology '{topo.name}' ({topo.world_size} devices), model "
             f"'{plan.model.name}' (h={plan.model.hidden}, L={plan.model.layers}, "
             f"b={plan.model.batch_size}, s={plan.model.seq_len}, {plan.model.dtype}), "
             f"mesh={plan.strategy.value}")
    table = Table(title=title, title_justify="left")
    for col in ("", "d1 x d2", "B1' GB/s", "B2' GB/s", "B1 GB/s", "B2 GB/s", "T_comm", "vs (N,1)",
                "source"):
        table.add_column(col, justify="right" if col not in ("", "source") else "left")
    mt = plan.megatron.t_comm_s
    for c in plan.candidates:
        mark = "*" if c.mesh == plan.selected else ""
        source = c.source + ("" if c.infeasible is None else ", infeasible")
        table.add_row(mark, f"{c.mesh[0]} x {c.mesh[1]}", _gbps(c.dim1.B_prime_GBps),
                      _gbps(c.dim2.B_prime_GBps), _gbps(c.dim1.B_GBps), _gbps(c.dim2.B_GBps),
                      _seconds(c.t_comm_s), f"{c.t_comm_s / mt:.3f}" if mt > 0 else "-", source,
                      style="bold green" if mark else None)
    return table


def _seconds(t: float) -> str:
    if t == 0:
        return "0"
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.3f} us"


def print_plan(plan: Plan, console: Optional[Console] = None,
               gradsync: Optional[GradSyncReport] = None) -> None:
    console = console or Console(width=160)
    console.print(plan_table(plan))
    sel = plan.candidate(plan.selected)
    console.print(f"selected DeviceMesh{plan.selected}: T_comm {_seconds(sel.t_comm_s)} per step, "
                  f"{sel.t_comm_s / plan.megatron.t_comm_s:.3f}x Megatron-LM's (N,1)"
                  if plan.megatron.t_comm_s > 0 else f"selected DeviceMesh{plan.selected}")
    for label, dim in (("dim 1", sel.dim1), ("dim 2", sel.dim2)):
        if dim.size > 1:
            crossed = "; ".join(
                f"level '{c.level}': {c.units_per_group} units per group, {c.groups_sharing} "
                f"group(s) share a unit, {c.GBps:.4g} GB/s (limited by {c.limited_by})"
                for c in dim.crossings)
            console.print(f"  {label} (size {dim.size}, {dim.source}): {crossed}")
    for note in plan.notes:
        console.print(f"note: {note}")
    for c in plan.candidates:
        if c.infeasible:
            console.print(f"infeasible {c.mesh[0]}x{c.mesh[1]}: {c.infeasible}")
    if gradsync is not None:
        print_gradsync(gradsync, console)


def gradsync_for_config(cfg: Any, plan: Any) -> Optional[GradSyncReport]:
    """The data-parallel gradient sync of a planned step under every aggregation mode
    (:mod:`atp_pipeline.planning.gradsync`), for the ATP plan of ``mesh=auto``/fixed/
    megatron (one bucket: ``dp`` replicas of each of the ``d1·d2`` shards on the devices the
    run occupies) and for an SBP plan (``mesh=sbp``: one bucket per layer whose weight is
    replicated over its data-parallel role, §4.4.1). ``None`` if it cannot be estimated."""
    from atp_pipeline.planning import gradsync
    from atp_pipeline.planning.memory import per_device_memory
    from atp_pipeline.topology.model import Topology
    from atp_pipeline.training import resolve_dp

    agg = cfg.aggregation
    mode = getattr(agg.mode, "value", agg.mode)
    k = int(agg.get("payload_k", 62)) if hasattr(agg, "get") else 62
    if hasattr(plan, "problem") and hasattr(plan, "result"):  # SBPReport (mesh=sbp)
        problem, assign = plan.problem, plan.result.assignment
        breakdown = problem.breakdown(assign)
        tp_s = sum(v["seconds"] for c, v in breakdown.items() if c != "all_reduce")
        return gradsync.estimate(plan.topology, gradsync.sbp_buckets(problem, assign),
                                 plan.model.bytes_per_element, configured=mode, payload_k=k,
                                 tp_comm_s=tp_s)
    topo = Topology.from_config(cfg.topology)
    devices = cfg.trainer.devices or topo.world_size
    dp = resolve_dp(cfg, devices)
    d1, d2 = plan.selected
    if dp < 1 or dp * d1 * d2 != devices:
        return None
    params = per_device_memory(plan.model, (d1, d2), dp).params
    return gradsync.estimate(topo.restrict(devices), [gradsync.dp_bucket(params, dp, d1 * d2)],
                             plan.model.bytes_per_element, configured=mode, payload_k=k,
                             tp_comm_s=plan.candidate(plan.selected).t_comm_s)


def report_plan(cfg: Any, plan: Any, out_dir: Path, extra_summary: Optional[Dict[str, Any]] = None
                ) -> Dict[str, Any]:
    """Print and write a planned step — the tensor-parallel plan (ATP's mesh, or the SBP
    plan of ``mesh=sbp``) and, beside it, the data-parallel gradient sync under every
    aggregation mode; the summary row. Used by ``stage=plan`` and ``stage=fit`` alike."""
    gs = gradsync_for_config(cfg, plan)
    extra = {**(gradsync_summary(gs) if gs else {}), **(extra_summary or {})}
    if hasattr(plan, "problem") and hasattr(plan, "result"):  # SBPReport (mesh=sbp)
        plan.print()
        if gs is not None:
            print_gradsync(gs, Console(width=180))
        paths = plan.write(out_dir, extra_summary=extra)
        if gs is not None:
            data = json.loads(paths["plan"].read_text())
            data["gradient_sync"] = gs.to_dict()
            paths["plan"].write_text(json.dumps(data, indent=2) + "\n")
        row = {**plan.summary_row(), **extra}
    else:
        print_plan(plan, gradsync=gs)
        paths = write_plan(plan, out_dir, plot=cfg.planner.plot, extra_summary=extra_summary, gradsync=gs)
        row = {**summary_row(plan), **extra}
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return row


def summary_row(plan: Plan) -> Dict[str, Any]:
    sel = plan.candidate(plan.selected)
    mt = plan.megatron.t_comm_s
    return {
        "topology": plan.topology.name,
        "model": plan.model.name,
        "world_size": plan.world_size,
        "strategy": plan.strategy.value,
        "selected": f"{plan.selected[0]}x{plan.selected[1]}",
        "t_comm_s": sel.t_comm_s,
        "megatron_t_comm_s": mt,
        "ratio_to_megatron": sel.t_comm_s / mt if mt > 0 else None,
        "B1_GBps": sel.dim1.B_GBps,
        "B2_GBps": sel.dim2.B_GBps,
        "source": sel.source,
    }


def gradsync_summary(gs: GradSyncReport) -> Dict[str, Any]:
    """Flat summary columns of a gradient-sync estimate (seconds per mode, the fastest)."""
    return {**{f"gradsync_{m.mode}_s": m.seconds for m in gs.modes},
            "gradsync_best": gs.best if gs.synchronizes else None}


def write_plan(plan: Plan, out_dir: Path, plot: bool = True,
               extra_summary: Optional[Dict[str, Any]] = None,
               gradsync: Optional[GradSyncReport] = None) -> Dict[str, Path]:
    """Write plan.json, summary.json and (if ``plot``) plan.png into ``out_dir``; with
    ``gradsync``, plan.json gets ``gradient_sync`` and the summary its per-mode seconds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"plan": out_dir / "plan.json", "summary": out_dir / "summary.json"}
    data = plan.to_dict()
    if gradsync is not None:
        data["gradient_sync"] = gradsync.to_dict()
    paths["plan"].write_text(json.dumps(data, indent=2) + "\n")
    summary = summary_row(plan)
    if gradsync is not None:
        summary.update(gradsync_summary(gradsync))
    summary.update(extra_summary or {})
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    if plot:
        paths["plot"] = out_dir / "plan.png"
        plot_plan(plan, paths["plot"])
    return paths


def plot_plan(plan: Plan, path: Path) -> None:
    """Bar chart of every candidate's T_comm; the selection and (N,1) are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(labels) + 2), 3.6))
    bars = ax.bar(labels, times, color=colors)
    for bar, c in zip(bars, plan.candidates):
        if c.source == "calibrated":
            bar.set_hatch("//")
    ax.set_xlabel("DeviceMesh(d1, d2)")
    ax.set_ylabel("T_comm per step (ms, Eq. 2)")
    ax.set_title(f"{plan.topology.name}, {plan.model.name}: selected "
                 f"{plan.selected[0]}x{plan.selected[1]} (green), (N,1) orange, hatched = calibrated",
                 fontsize=9)
    if len(times) > 1 and min(t for t in times if t > 0) * 50 < max(times):
        ax.set_yscale("log")
    if len(labels) > 8:
        ax.tick_params(axis="x", labelrotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
