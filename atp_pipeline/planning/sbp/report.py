"""``planner=sbp``: plan a decoder-only transformer with the SBP search.

:func:`plan_sbp` turns a :class:`~atp_pipeline.planning.shape.ModelShape` (any family:
fused or separate q/k/v with GQA widths, gated or two-matrix MLP) and a topology into the
model's matmul chain (:func:`~atp_pipeline.planning.sbp.chain.model_chain`, blocks tied,
§4.5.1), costs it as the executor runs it (the row layout between matmuls,
``io="rows"``) with the topology's alpha-beta model (calibrated α/β where the topology
has them, else Eq. 3's B′ and ``planner.sbp.alpha_us``), limits memory to the topology's
device memory (§4.5.2), runs the configured search (§4.6) and checks that the result can be
executed (:func:`~atp_pipeline.planning.sbp.chain.sbp_infeasibility`,
:func:`~atp_pipeline.planning.sbp.layout.check_chain_layout`) — all before
any process starts; every failure is one :class:`~atp_pipeline.errors.ConfigError` line.

:class:`SBPPlan` is the SBP planner's
:class:`~atp_pipeline.planning.interface.PlanResult` (``kind = "sbp"``): a console table
with each layer's distribution (strategy, SBP of X/W/Y per mesh role, the DTensor
placements on the plan's device mesh) and its predicted communication per collective;
``plan.json`` (``to_dict``), the summary row, a per-layer chart (``plot``) and the
executor's :class:`~atp_pipeline.planning.sbp.layout.SBPLayout` (``layout``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.table import Table

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import AlphaBeta
from atp_pipeline.planning.fmt import fmt_seconds
from atp_pipeline.planning.sbp.chain import model_chain, sbp_infeasibility
from atp_pipeline.planning.sbp.layout import SBPLayout, check_chain_layout, placement_names, plan_mesh_shape
from atp_pipeline.planning.sbp.search import SearchResult, search
from atp_pipeline.planning.sbp.space import COLLECTIVES, MemoryModel, Problem, compile_problem
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.topology.model import Topology

SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}


def memory_model(shape: ModelShape, topo: Topology) -> MemoryModel:
    """Bytes per parameter as :mod:`atp_pipeline.planning.memory` counts them (weights and
    gradients in the model's dtype, Adam's two fp32 states, an fp32 master copy for 16-bit
    types), activations in the dtype, the limit from the topology's device memory."""
    q = shape.bytes_per_element
    capacity = topo.device.get("memory_GB")
    return MemoryModel(param_bytes=2 * q + 8 + (4 if q == 2 else 0), act_bytes=q,
                       limit=float(capacity) * 1e9 if capacity else None)


@dataclass(frozen=True)
class SBPPlan:
    """A searched SBP plan with everything its report shows. A
    :class:`~atp_pipeline.planning.interface.PlanResult`."""

    topology: Topology
    model: ModelShape
    problem: Problem
    result: SearchResult
    budget_s: float
    device_mesh: Tuple[int, ...]
    notes: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def world_size(self) -> int:
        return self.problem.p

    @property
    def cost_s(self) -> float:
        return self.result.cost

    @property
    def layout(self) -> SBPLayout:
        """The executor's view: devices and one strategy per layer key."""
        return SBPLayout.from_search(self.problem, self.result)

    @property
    def tp_comm_s(self) -> float:
        """Predicted seconds per step of the collectives other than the weight-gradient
        all-reduces (activations: reduce-scatter, all-gather, all-to-all)."""
        breakdown = self.problem.breakdown(self.result.assignment)
        return sum(v["seconds"] for c, v in breakdown.items() if c != "all_reduce")

    def grad_buckets(self, dp: int = 1) -> List[Any]:
        """The weight-gradient buckets (§4.4.1: one per layer whose weight is replicated over
        its ``b`` role) for :func:`~atp_pipeline.planning.gradsync.estimate`; ``dp`` is
        ignored: the plan's data parallelism is inside its strategies."""
        from atp_pipeline.planning import gradsync

        return gradsync.sbp_buckets(self.problem, self.result.assignment)

    # -------------------------------------------------------- PlanResult interface
    kind = "sbp"

    @property
    def whole_layout(self) -> Any:
        """One replica over every device: the plan's data parallelism is inside its strategies."""
        from atp_pipeline.planning.mesh_plan import Layout

        return Layout(1, (self.world_size, 1), False, 1, "ring")

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        return self.device_mesh

    @property
    def label(self) -> str:
        return self.layout.label()

    @property
    def predicted_comm_s(self) -> float:
        return self.cost_s

    def with_notes(self, notes: Sequence[str]) -> "SBPPlan":
        return replace(self, notes=tuple(notes))

    def layer_rows(self) -> List[Dict[str, Any]]:
        """Per tie group: strategy, SBP placements (§4.2.2, per role and on the plan's mesh)
        and the predicted seconds/bytes per collective of its instances."""
        rows = []
        for v, s in zip(self.problem.vars, self.result.assignment):
            strat = v.strategies[s]
            lay = placement_names(strat, self.mesh_shape)
            rows.append({
                "tie": v.name, "instances": v.count,
                "shape": {"b": v.layer.b, "n": v.layer.n, "m": v.layer.m},
                "strategy": strat.to_dict(),
                "device_mesh_placements": {t: list(lay[t]) for t in ("X", "W", "Y", "split")},
                "communication": {c: {"seconds": float(v.cost[c][s]), "bytes_per_device": float(v.volume[c][s])}
                                  for c in COLLECTIVES},
                "memory_bytes_per_device": float(v.memory[s]),
            })
        return rows

    def to_dict(self) -> dict:
        body = self.result.plan(self.problem)
        body["layers"] = self.layer_rows()
        return {
            "planner": "sbp", "strategy": "sbp", "topology": self.topology.to_dict(),
            "world_size": self.world_size,
            "model": self.model.to_dict(), "device_mesh": list(self.mesh_shape),
            "search": {"method": self.result.method, "budget_s": self.budget_s,
                       "evaluations": self.result.evaluations, "seconds": self.result.seconds,
                       "complete": self.result.complete},
            **{k: body[k] for k in ("cost_s", "communication", "memory_bytes_per_device", "memory_limit",
                                     "layers")},
            "execution_plan": self.layout.to_dict(), "notes": list(self.notes),
        }

    def summary_row(self) -> Dict[str, Any]:
        comm = self.problem.breakdown(self.result.assignment)
        return {"topology": self.topology.name, "model": self.model.name, "world_size": self.world_size,
                "strategy": "sbp", "selected": self.label, "t_comm_s": self.cost_s,
                **{f"t_{c}_s": comm[c]["seconds"] for c in COLLECTIVES},
                "method": self.result.method, "search_s": self.result.seconds}

    def _layer_comm(self) -> List[Dict[str, Any]]:
        """Per tie group: predicted seconds per collective, the communication between
        layers (pair tables) charged to the consumer."""
        assign = self.result.assignment
        pair: Dict[int, Dict[str, float]] = {}
        for pr in self.problem.pairs:
            mine = pair.setdefault(pr.b, {})
            for c, (cost, _) in (pr.by or {"all_to_all": (pr.cost, pr.volume)}).items():
                mine[c] = mine.get(c, 0.0) + float(cost[assign[pr.a], assign[pr.b]])
        out = []
        for i, (v, s) in enumerate(zip(self.problem.vars, assign)):
            comm = {c: float(v.cost[c][s]) + pair.get(i, {}).get(c, 0.0) for c in COLLECTIVES}
            out.append({"tie": v.name, "comm": comm})
        return out

    def table(self) -> Table:
        m = self.model
        table = Table(title=f"SBP plan: topology '{self.topology.name}' ({self.world_size} devices), model "
                            f"'{m.name}' (h={m.hidden}, L={m.layers}, b={m.batch_size}, s={m.seq_len}, "
                            f"{m.dtype}), planner=sbp, device mesh {self.mesh_shape}", title_justify="left")
        for col in ("layer", "x", "b x n -> m", "strategy", "X", "W", "Y", *(SHORT[c] for c in COLLECTIVES)):
            table.add_column(col, justify="left" if col in ("layer", "strategy", "X", "W", "Y") else "right")
        for row, per in zip(self.layer_rows(), self._layer_comm()):
            st, sh, pl = row["strategy"], row["shape"], row["strategy"]["placements"]
            roles = st["mesh"]
            comm = per["comm"]
            table.add_row(row["tie"], str(row["instances"]), f"{sh['b']} x {sh['n']} -> {sh['m']}",
                          f"{st['label']}", _sbp(pl["X"], roles), _sbp(pl["W"], roles), _sbp(pl["Y"], roles),
                          *(fmt_seconds(comm[c]) for c in COLLECTIVES))
        return table

    def print(self, console: Any = None) -> None:
        console = console or Console(width=180)
        console.print(self.table())
        comm = self.problem.breakdown(self.result.assignment)
        console.print("predicted communication per step: " + ", ".join(
            f"{c} {fmt_seconds(comm[c]['seconds'])} ({comm[c]['bytes_per_device'] / 1e6:.4g} MB/device)"
            for c in COLLECTIVES) + f"; total {fmt_seconds(self.cost_s)}")
        limit = self.problem.memory_limit
        mem = self.problem.memory(self.result.assignment)
        console.print(f"memory {mem / 1e9:.4g} GB/device" + (f" (limit {limit / 1e9:.4g} GB)" if limit else "")
                      + f"; {self.result.method} search: {self.result.evaluations} evaluations in "
                        f"{self.result.seconds * 1e3:.1f} ms" + ("" if self.result.complete else " (budget hit)"))
        console.print(f"execution: DTensor placements on DeviceMesh{self.mesh_shape} (plan.json: "
                      f"device_mesh_placements); X/W/Y in the paper's notation, roles in mesh order")
        for note in self.notes:
            console.print(f"note: {note}")

    def plot(self, path: Path) -> bool:
        """``plan.png``: predicted communication per layer (tie group), stacked by collective
        (communication between layers charged to the consumer, as in the table)."""
        from atp_pipeline.figures import axes

        per = self._layer_comm()
        names = [row["tie"] for row in per]
        with axes(path, (max(4.0, 0.8 * len(names) + 2), 3.6)) as ax:
            bottom = [0.0] * len(names)
            for c in COLLECTIVES:
                vals = [row["comm"][c] * 1e3 for row in per]
                ax.bar(names, vals, bottom=bottom, label=SHORT[c])
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xlabel("layer (tie group)")
            ax.set_ylabel("predicted communication per step (ms)")
            ax.set_title(f"{self.topology.name}, {self.model.name}: SBP plan on DeviceMesh{self.mesh_shape}, "
                         f"total {fmt_seconds(self.cost_s)}", fontsize=9)
            ax.legend(fontsize=8)
        return True

    def write(self, out_dir: Path, extra_summary: Optional[Dict[str, Any]] = None) -> Dict[str, Path]:
        """plan.json, plan.txt (the printed report) and summary.json into ``out_dir``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"plan": out_dir / "plan.json", "text": out_dir / "plan.txt", "summary": out_dir / "summary.json"}
        paths["plan"].write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        console = Console(record=True, width=180, file=open("/dev/null", "w"))
        self.print(console)
        paths["text"].write_text(console.export_text())
        paths["summary"].write_text(json.dumps({**self.summary_row(), **(extra_summary or {})}, indent=2) + "\n")
        return paths


def _sbp(placements: List[str], sizes: List[int]) -> str:
    """The paper's notation, e.g. ``(S0:2, B:2)``; roles of size 1 are left out."""
    short = {"Shard(0)": "S0", "Shard(1)": "S1", "Replicate()": "B", "Partial()": "P"}
    parts = [f"{short.get(p, p)}:{k}" for p, k in zip(placements, sizes) if k > 1]
    return f"({', '.join(parts)})" if parts else "whole"


def plan_sbp(topo: Topology, shape: ModelShape, sbp_cfg: Any, devices: Optional[int] = None) -> SBPPlan:
    """Search the SBP plan of the model ``shape`` on ``topo`` (``sbp_cfg``: a
    :class:`~atp_pipeline.config.schema.SBPConfig` or its DictConfig, ``planner.sbp``) and
    check that it can be executed; one-line :class:`ConfigError` otherwise."""
    p = devices or topo.world_size
    if p != topo.world_size:
        topo = topo.restrict(p)
    method = getattr(sbp_cfg.method, "value", sbp_cfg.method)
    if sbp_cfg.orders not in ("paper", "all"):
        raise ConfigError(f"planner.sbp.orders must be 'paper' or 'all', got '{sbp_cfg.orders}'")
    if not 1 <= sbp_cfg.max_split_dims <= 3:
        raise ConfigError(f"planner.sbp.max_split_dims must be 1, 2 or 3, got {sbp_cfg.max_split_dims}")
    if sbp_cfg.alpha_us < 0:
        raise ConfigError(f"planner.sbp.alpha_us must be >= 0, got {sbp_cfg.alpha_us}")
    why = sbp_infeasibility(shape, p)
    if why:
        raise ConfigError(f"planner=sbp: model '{shape.name}' on {p} devices: {why}")
    alpha = float(sbp_cfg.alpha_us) * 1e-6
    ab = AlphaBeta.from_topology(topo, alpha=alpha) if p > 1 else AlphaBeta.uniform(alpha, 0.0)
    try:
        layers = model_chain(shape)
        problem = compile_problem(layers, p, ab, memory_model(shape, topo), sbp_cfg.orders,
                                  int(sbp_cfg.max_split_dims), io="rows")
    except ConfigError as exc:
        raise ConfigError(f"planner=sbp: model '{shape.name}' on {p} devices: {exc}") from None
    result = search(problem, method, float(sbp_cfg.budget_s), int(sbp_cfg.seed))
    if result.cost == float("inf"):
        limit = problem.memory_limit or 0.0
        best = sum(float(var.memory.min()) for var in problem.vars)
        raise ConfigError(f"planner=sbp: no SBP plan of model '{shape.name}' on {p} devices fits the "
                          f"{limit / 1e9:g} GB per device of '{topo.name}' (the leanest needs "
                          f"~{best / 1e9:.1f} GB)")
    plan = SBPPlan(topo, shape, problem, result, float(sbp_cfg.budget_s), (1,))
    layout = plan.layout
    check_chain_layout(layout, layers, what=f"model '{shape.name}'")
    notes = [topo.note] if topo.note else []
    notes.append("between the matmuls (except an MLP's direct edges) activations are whole sequences split over "
                 "row groups of devices (the model's own code runs on them); embeddings, norms, biases, the LM "
                 "head and the loss run there with replicated weights (outside the SBP search space; their "
                 "gradient all-reduces are not in the prediction)")
    return replace(plan, device_mesh=plan_mesh_shape(layout.strategies.values(), p), notes=tuple(notes))
