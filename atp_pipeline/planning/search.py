"""ATP's mesh search (§3.5): cost every 2D mesh of the world size, select the cheapest.

The search space is every ``DeviceMesh(d1, d2)`` with ``d1*d2 = N`` (``n+1`` meshes for
``N = 2^n``), which contains Megatron-LM's ``(N, 1)`` (§3.2.1). Each candidate gets its
bandwidths from Eq. 3-4 (:mod:`.bandwidth`) or the topology's calibration, and its
communication time from Eq. 2 (:mod:`.cost`).

A candidate is *feasible* when the runtime can execute it: the attention heads split
evenly over all ``d1*d2`` devices (QKV is column-first over d1, then scattered over d2 for
the attention core). With ``planner.require_divisible`` (default) only feasible candidates
may be selected; ties go to the larger ``d1`` (closer to Megatron-LM).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from atp_pipeline.config.schema import CostModel, MeshStrategy, Objective
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.bandwidth import dimension_bandwidth
from atp_pipeline.planning.compute_profile import ComputeProfile, profile_of
from atp_pipeline.planning.cost import comm_terms, step_comm_time
from atp_pipeline.planning.memory import memory_infeasibility, per_device_memory
from atp_pipeline.planning.mesh_plan import Candidate, Mesh, MeshPlan
from atp_pipeline.planning.shape import ModelShape, layout_infeasibility
from atp_pipeline.planning.steptime import StepEstimate, StepSetting, estimate_step
from atp_pipeline.topology.model import Topology


def divisors(n: int) -> List[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def candidate_meshes(n: int) -> List[Mesh]:
    """Every 2D mesh of ``n`` devices, Megatron-LM's ``(n, 1)`` first."""
    return [(n // d2, d2) for d2 in divisors(n)]


def mesh_infeasibility(model: ModelShape, mesh: Mesh, topo: Optional[Topology] = None,
                       setting: Optional[StepSetting] = None) -> Optional[str]:
    """Why the runtime cannot run ``model`` on ``mesh`` (None if it can): ATP's layout must
    split it (:func:`~atp_pipeline.planning.shape.layout_infeasibility`), and with ``topo``'s
    device memory known, the per-device estimate of ``setting``'s dp replicas (sharded by FSDP
    when it says so) must fit it."""
    why = layout_infeasibility(model, *mesh)
    if why or topo is None:
        return why
    s = setting or StepSetting()
    return memory_infeasibility(model, mesh, s.dp, s.fsdp, topo.device.get("memory_GB"),
                                f"'{topo.name}' devices")


def step_estimate(topo: Topology, model: ModelShape, mesh: Mesh, setting: StepSetting,
                  profile: Optional[ComputeProfile]) -> Optional[StepEstimate]:
    """The predicted step of one feasible mesh (None without a compute profile), with the
    data-parallel gradient sync of ``setting.dp`` replicas under its aggregation mode added
    (:mod:`.gradsync`, on ``setting.world``, the topology of all replicas)."""
    if profile is None or mesh_infeasibility(model, mesh) is not None:
        return None
    local = model.batch_size // setting.dp
    if model.batch_size % setting.dp or local % setting.chunks:
        return None  # a step the runtime does not run (the run's checks name why)
    sync = 0.0
    if setting.dp > 1 and setting.world is not None:
        from atp_pipeline.planning.gradsync import dp_bucket, estimate
        from atp_pipeline.planning.memory import per_device_memory

        bucket = dp_bucket(per_device_memory(model, mesh, setting.dp).params, setting.dp, mesh[0] * mesh[1])
        mode = setting.aggregation if setting.aggregation in ("ring", "ps", "atp", "switchml") else "ring"
        sync = estimate(setting.world, [bucket], model.bytes_per_element, configured=mode).mode(mode).seconds
    return estimate_step(topo, model, mesh, setting, profile, gradsync_s=sync)


def replica_batch(model: ModelShape, dp: int) -> float:
    """The batch one of ``dp`` data-parallel replicas runs (the global ``model.batch_size`` over
    ``dp``): what a replica's tensor-parallel communication is priced on."""
    return model.batch_size // dp if model.batch_size % dp == 0 else model.batch_size / dp


def evaluate(topo: Topology, model: ModelShape, mesh: Mesh,
             cost_model: CostModel = CostModel.eq2, setting: Optional[StepSetting] = None,
             profile: Optional[ComputeProfile] = None) -> Candidate:
    """Bandwidths (Eq. 3-4) and communication time (Eq. 2) of one mesh, for the batch of one of
    ``setting.dp`` replicas (:func:`replica_batch`), and its predicted step (:mod:`.steptime`)
    when a compute ``profile`` is given."""
    dim1 = dimension_bandwidth(topo, mesh, 1)
    dim2 = dimension_bandwidth(topo, mesh, 2)
    terms = comm_terms(cost_model, model, mesh)
    t, costs = step_comm_time(terms, model.layers, replica_batch(model, (setting or StepSetting()).dp), model.seq_len,
                              model.bytes_per_element, sizes={1: mesh[0], 2: mesh[1]},
                              B={1: dim1.B_GBps, 2: dim2.B_GBps},
                              B_prime={1: dim1.B_prime_GBps, 2: dim2.B_prime_GBps})
    return Candidate(mesh=mesh, dim1=dim1, dim2=dim2, t_comm_s=t, terms=tuple(costs),
                     infeasible=mesh_infeasibility(model, mesh, topo, setting),
                     step=step_estimate(topo, model, mesh, setting or StepSetting(), profile))


def _mesh_cfg(mesh: Any) -> Tuple[MeshStrategy, Optional[int], Optional[int]]:
    return MeshStrategy(mesh.strategy), mesh.d1, mesh.d2


def plan_notes(topo: Topology, model: ModelShape) -> List[str]:
    """What a plan of ``model`` on ``topo`` says beside its table, whatever is selected."""
    notes: List[str] = []
    if topo.note:
        notes.append(topo.note)
    if model.unmodelled:
        notes.append(f"the communication estimate of model '{model.name}' omits its {model.unmodelled} "
                     f"(the runtime sends more than predicted)")
    if model.whole_note:
        notes.append(f"model '{model.name}' runs modules whole, replicated on every tensor-parallel rank on the "
                     f"hidden gathered over d2 ({model.whole_params} parameters not split; their compute, on every "
                     f"rank, is not in the step-time model): {model.whole_note}")
    return notes


def check_mesh(topo: Topology, strategy: MeshStrategy, fd1: Optional[int], fd2: Optional[int]) -> None:
    """A fixed mesh fits ``topo`` exactly; d1/d2 go with ``fixed`` only."""
    n = topo.world_size
    if strategy == MeshStrategy.fixed:
        if fd1 is None or fd2 is None or fd1 < 1 or fd2 < 1:
            raise ConfigError(f"mesh.strategy=fixed needs positive mesh.d1 and mesh.d2, got "
                              f"{fd1} and {fd2}")
        if fd1 * fd2 != n:
            raise ConfigError(f"mesh {fd1}x{fd2} needs {fd1 * fd2} devices but topology "
                              f"'{topo.name}' has {n}")
    elif fd1 is not None or fd2 is not None:
        raise ConfigError(f"mesh.d1/mesh.d2 apply to strategy 'fixed' only, not '{strategy.value}'")


def select(topo: Topology, model: ModelShape, candidates: Sequence[Candidate], strategy: MeshStrategy,
           fixed: Optional[Mesh], planner: Any, objective: Objective, setting: StepSetting,
           notes: List[str]) -> Tuple[Optional[Mesh], Optional[str]]:
    """The mesh ``strategy`` selects among ``candidates`` (one replica's meshes under ``setting``),
    or ``(None, why)`` where none may be selected; notes about the selection are appended to
    ``notes``. By predicted step (``objective=step``, where every eligible candidate has one) or
    by Eq. 2-4's communication; ties go to the larger d1."""
    n = topo.world_size
    if strategy == MeshStrategy.fixed:
        selected: Mesh = fixed  # type: ignore[assignment]
    elif strategy == MeshStrategy.megatron:
        selected = (n, 1)
    else:
        eligible = list(candidates)
        if planner.require_divisible:
            eligible = [c for c in eligible if c.infeasible is None]
            if not eligible:
                if all(layout_infeasibility(model, *c.mesh) for c in candidates):
                    return None, (f"no 2D mesh of {n} devices splits the {model.heads} heads of "
                                  f"model '{model.name}' evenly (need heads % (d1*d2) == 0)")
                fits = [c for c in candidates if not layout_infeasibility(model, *c.mesh)]  # memory-bound
                least = min(fits, key=lambda c: per_device_memory(model, c.mesh, setting.dp, setting.fsdp).total_bytes)
                return None, (f"no 2D mesh of {n} devices can run model '{model.name}'; the least memory: "
                              f"{least.infeasible}")
        if topo.calibrated and not planner.select_uncalibrated:
            calibrated = [c for c in eligible if c.source == "calibrated"]
            skipped = [f"{c.mesh[0]}x{c.mesh[1]}" for c in eligible if c.source != "calibrated"]
            if calibrated:
                if skipped:
                    notes.append(
                        f"topology '{topo.name}' is calibrated (§5.3); meshes {', '.join(skipped)} "
                        f"have only matrix estimates and are listed but not selected "
                        f"(planner.select_uncalibrated=true to allow)")
                eligible = calibrated
        timed = [c for c in eligible if c.step is not None]
        if objective == Objective.step and timed:
            best = min(timed, key=lambda c: (c.step.step_s, -c.mesh[0]))  # type: ignore[union-attr]
        else:
            best = min(eligible, key=lambda c: (c.t_comm_s, -c.mesh[0]))
        selected = best.mesh
    chosen = next(c for c in candidates if c.mesh == selected)
    if chosen.infeasible and planner.require_divisible:
        return None, f"mesh {selected[0]}x{selected[1]}: {chosen.infeasible}"
    return selected, None


def objective_of(planner: Any, topo: Topology, profile: Optional[ComputeProfile], notes: List[str]) -> Objective:
    """``planner.objective``, or ``comm`` (with a note) where ``step`` has no compute profile."""
    objective = Objective(getattr(planner, "objective", Objective.step))
    if objective == Objective.step and profile is None:
        notes.append(f"planner.objective=step: topology '{topo.name}' has no compute profile (device.compute) and "
                     f"its device no peak_TFLOPs, so no step time is predicted; selected by communication (Eq. 2-4). "
                     f"Calibrate this host once: python train.py stage=calibrate topology={topo.name}")
        objective = Objective.comm
    return objective


def make_plan(topo: Topology, model: ModelShape, mesh: Any, planner: Any,
              setting: Optional[StepSetting] = None) -> MeshPlan:
    """Evaluate every candidate mesh and select one according to ``mesh.strategy``
    (``mesh``: a :class:`~atp_pipeline.config.schema.MeshConfig`, ``planner`` a
    :class:`~atp_pipeline.config.schema.PlannerConfig`, or their DictConfigs): by predicted
    step time (``planner.objective=step``, :mod:`.steptime`) or by Eq. 2-4's communication
    time (``comm``). ``setting``: the step's chunks, dp and aggregation (default: 1, 1, ring).
    One replica's mesh under one setting; :mod:`.layout` searches the whole layout."""
    strategy, fd1, fd2 = _mesh_cfg(mesh)
    cost_model = CostModel(planner.cost_model)
    setting = setting or StepSetting()
    notes = plan_notes(topo, model)
    profile = profile_of(topo)
    check_mesh(topo, strategy, fd1, fd2)
    candidates = tuple(evaluate(topo, model, m, cost_model, setting, profile)
                       for m in candidate_meshes(topo.world_size))
    objective = objective_of(planner, topo, profile, notes)
    fixed = (fd1, fd2) if strategy == MeshStrategy.fixed else None
    selected, why = select(topo, model, candidates, strategy, fixed, planner, objective, setting, notes)
    if selected is None:
        raise ConfigError(why or "no mesh selected")
    return MeshPlan(topology=topo, model=model, strategy=strategy, cost_model=cost_model,
                    candidates=candidates, selected=selected, notes=tuple(notes), objective=objective,
                    setting=setting, profile=profile)
