"""One planner interface: ATP's mesh search and AutoDDL's SBP search behind the same calls.

A planner turns a topology and a :class:`~atp_pipeline.planning.shape.ModelShape` into a
:class:`PlanResult`; everything after planning (the report, the gradient-sync estimate,
the run's summary, the executor chosen by the strategy) reads only this interface, and the
executor is picked from the result's type (``kind``), never from ``if sbp`` branches
scattered over the run.

=====================  =====================================================================
``kind``               ``"atp"`` (:class:`~atp_pipeline.planning.search.MeshPlan`) or ``"sbp"``
                       (:class:`~atp_pipeline.planning.sbp.report.SBPPlan`)
``topology``/``model`` what was planned: the (sub-)topology and the model shape
``world_size``         devices the plan spans (one data-parallel replica for ATP with dp > 1)
``mesh_shape``         the device mesh the executor builds: ``(d1, d2)``, or SBP's N-D mesh
``label``              the selection in one word (``2x2``; SBP: strategies per layer)
``predicted_comm_s``   the planner's communication time per step (seconds)
``whole_layout``       the decided :class:`~atp_pipeline.planning.mesh_plan.Layout`: dp, mesh, FSDP,
                       chunks, aggregation (what resolve writes back into the run's config)
``notes``              lines the report prints under the table
``with_notes``         a copy with other notes
``to_dict``            ``plan.json``
``summary_row``        the flat headline of ``summary.json`` and the sweep table
``print(console)``     the console table
``plot(path)``         ``plan.png``; returns False when the planner draws nothing
=====================  =====================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

from atp_pipeline.config.schema import PlannerKind
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.topology.model import Topology


@runtime_checkable
class PlanResult(Protocol):
    kind: str
    topology: Topology
    model: ModelShape
    notes: Tuple[str, ...]

    @property
    def world_size(self) -> int: ...

    @property
    def mesh_shape(self) -> Tuple[int, ...]: ...

    @property
    def label(self) -> str: ...

    @property
    def predicted_comm_s(self) -> float: ...

    @property
    def whole_layout(self) -> Any: ...

    def with_notes(self, notes: Sequence[str]) -> "PlanResult": ...

    def to_dict(self) -> Dict[str, Any]: ...

    def summary_row(self) -> Dict[str, Any]: ...

    def print(self, console: Any = None) -> None: ...

    def plot(self, path: Path) -> bool: ...


def plan(topology: Topology, shape: ModelShape, planner: Any, mesh: Any, setting: Any = None) -> PlanResult:
    """Run the planner ``planner.name`` (``atp`` | ``sbp``) for ``shape`` on ``topology``: one
    replica's mesh under one ``setting`` (:func:`plan_layout` searches the whole layout).

    ``planner``: a :class:`~atp_pipeline.config.schema.PlannerConfig` (or its DictConfig);
    ``mesh``: a :class:`~atp_pipeline.config.schema.MeshConfig` — ATP searches or fixes the
    2D mesh by it; SBP decides its own mesh and accepts only ``mesh=auto``. ``setting``: the
    step's :class:`~atp_pipeline.planning.steptime.StepSetting` (chunks, dp, aggregation),
    which ATP's step-time objective predicts.
    """
    kind = PlannerKind(getattr(planner.name, "value", planner.name))
    if kind == PlannerKind.atp:
        from atp_pipeline.planning.search import make_plan

        return make_plan(topology, shape, mesh, planner, setting)
    strategy = getattr(mesh.strategy, "value", mesh.strategy)
    if strategy != "auto" or mesh.d1 is not None or mesh.d2 is not None:
        raise ConfigError(f"planner=sbp decides the device mesh per layer itself: it needs mesh=auto, got "
                          f"mesh={strategy}" + (f" ({mesh.d1}x{mesh.d2})" if mesh.d1 else ""))
    from atp_pipeline.planning.sbp.report import plan_sbp

    return plan_sbp(topology, shape, planner.sbp)


def plan_layout(world: Topology, shape: ModelShape, planner: Any, space: Any) -> PlanResult:
    """The whole layout of ``shape`` on the devices of ``world``: ATP's search over dp x d1 x d2,
    FSDP, chunks and aggregation within what ``space`` (a :class:`~atp_pipeline.planning.layout.Space`:
    the fields the user fixed) leaves open (:func:`atp_pipeline.planning.layout.search`); SBP plans
    one replica over every device, so it accepts only ``mesh=auto`` and no dp, FSDP or chunks."""
    kind = PlannerKind(getattr(planner.name, "value", planner.name))
    if kind == PlannerKind.atp:
        from atp_pipeline.planning.layout import search

        return search(world, shape, planner, space)
    strategy = getattr(space.strategy, "value", space.strategy)
    if strategy != "auto":
        mesh = f" ({space.mesh[0]}x{space.mesh[1]})" if space.mesh else ""
        raise ConfigError(f"planner=sbp decides the device mesh per layer itself: it needs mesh=auto, got "
                          f"mesh={strategy}{mesh}")
    from atp_pipeline.planning.sbp.report import plan_sbp

    return plan_sbp(world, shape, planner.sbp)


def describe(result: Optional[PlanResult]) -> str:
    """``"atp 2x2"`` / ``"sbp qkv=b2xm2xn1, ..."``: a plan in one line, for logs."""
    return "no plan" if result is None else f"{result.kind} {result.label}"
