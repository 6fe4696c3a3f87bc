"""The whole-layout search: data-parallel size, FSDP, the 2D mesh, chunks and aggregation together.

A *layout* is ``dp x d1 x d2`` over the devices with FSDP on or off, ``overlap.chunks`` and
the aggregation mode of the gradient sync (:class:`Layout`). :func:`search` enumerates every
layout the user's fixed fields (:class:`Space`) leave open:

* ``dp`` over every divisor of the devices, ``(d1, d2)`` over every factorization of the
  ``devices / dp`` devices of one replica (ATP §3.5: :func:`~atp_pipeline.planning.search.candidate_meshes`);
* FSDP off and on (on only with ``dp > 1``, and only with ``ring``: FSDP reduce-scatters);
* ``chunks`` in :data:`CHUNKS`;
* the aggregation modes the topology supports (:attr:`~atp_pipeline.topology.model.Topology.aggregation_modes`:
  ``ring``, and ``atp``/``ps``/``switchml`` where a level declares aggregating switches); a layout
  with one replica synchronizes nothing and is listed once, as ``ring``.

The global batch is kept: a replica runs ``batch / dp`` sequences, in ``chunks`` pieces. A
layout whose ``dp`` does not divide the batch, whose local batch the chunks do not divide, or
whose mesh does not split the heads is infeasible and says so; every other one is priced by the
step-time model (:func:`~atp_pipeline.planning.steptime.estimate_step`: compute and exposed
tensor-parallel communication of one replica on its batch) plus, with ``dp > 1``, the gradient
sync of its mode (:mod:`.gradsync`) or, with FSDP, FSDP's traffic: two all-gathers of the
replica's parameter shard (forward and backward) and one reduce-scatter of its gradients over
the ``dp`` replicas (:func:`fsdp_seconds`), none overlapped. Each is checked against the device
memory (:func:`~atp_pipeline.planning.memory.memory_infeasibility`, the run's own check).

Within one setting (dp, FSDP, chunks, aggregation) the mesh is selected exactly as ATP's
search selects it (:func:`~atp_pipeline.planning.search.select`: feasible meshes, calibrated
ones first on a calibrated topology); across settings the least predicted step (``objective=step``)
or the least communication, tensor-parallel plus gradient sync (``comm``) wins, ties going to
fewer chunks, no FSDP, ``ring`` and fewer replicas. The result is the chosen setting's
:class:`~atp_pipeline.planning.mesh_plan.MeshPlan` carrying every layout (``layouts``), each
with why it lost: ``memory``, ``divisibility`` (batch, chunks or heads), ``limit`` (the
aggregation backend's worker count), ``calibration`` (an uncalibrated mesh on a calibrated
topology) or ``slower``.

Cost: the pricing of one replica's step depends on ``(dp, mesh, chunks)`` only and is computed
once for all FSDP and aggregation variants; layouts that cannot run are not priced.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from atp_pipeline.config.schema import CostModel, MeshStrategy, Objective
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.compute_profile import ComputeProfile, profile_of
from atp_pipeline.planning.memory import memory_infeasibility, per_device_memory
from atp_pipeline.planning.mesh_plan import Candidate, Layout, LayoutCandidate, Mesh, MeshPlan
from atp_pipeline.planning.search import (
    candidate_meshes,
    check_mesh,
    divisors,
    evaluate,
    objective_of,
    plan_notes,
    select,
)
from atp_pipeline.planning.shape import ModelShape, layout_infeasibility
from atp_pipeline.planning.steptime import StepEstimate, StepSetting, estimate_step
from atp_pipeline.topology.model import Topology

#: the chunk counts searched (§4.1) where ``overlap.chunks`` is not fixed
CHUNKS = (1, 2, 4)
#: the order ties are broken in (and modes are listed in)
MODE_ORDER = ("ring", "atp", "switchml", "ps")
#: why a layout lost, in the order the report lists them
LOST = ("memory", "divisibility", "limit", "calibration", "slower")


@dataclass(frozen=True)
class Space:
    """What the search may choose: a field ``None`` is searched, a value fixes it. ``modes``:
    the aggregation modes searched where ``aggregation`` is not fixed; ``limit(mode, dp)``: why
    the mode's backend cannot synchronize ``dp`` workers (None: it can)."""

    dp: Optional[int] = None
    strategy: MeshStrategy = MeshStrategy.auto
    mesh: Optional[Mesh] = None
    fsdp: Optional[bool] = None
    chunks: Optional[int] = None
    aggregation: Optional[str] = None
    modes: Tuple[str, ...] = ("ring",)
    limit: Optional[Callable[[str, int], Optional[str]]] = None

    def fixed(self) -> List[str]:
        """The fixed fields as the user wrote them."""
        out = []
        if self.strategy == MeshStrategy.fixed and self.mesh:
            out.append(f"mesh={self.mesh[0]}x{self.mesh[1]}")
        elif self.strategy == MeshStrategy.megatron:
            out.append("mesh=megatron")
        if self.dp is not None:
            out.append(f"mesh.dp={self.dp}")
        if self.fsdp is not None:
            out.append(f"mesh.fsdp={str(self.fsdp).lower()}")
        if self.chunks is not None:
            out.append(f"overlap.chunks={self.chunks}")
        if self.aggregation is not None:
            out.append(f"aggregation={self.aggregation}")
        return out

    def check(self, devices: int, name: str = "") -> None:
        """Fixed fields that contradict each other or the devices: one line each."""
        if self.dp is not None and (self.dp < 1 or devices % self.dp):
            raise ConfigError(f"mesh.dp={self.dp} does not divide trainer.devices={devices}")
        if self.strategy == MeshStrategy.fixed and self.mesh:
            d1, d2 = self.mesh
            if self.dp is not None and self.dp * d1 * d2 != devices:
                raise ConfigError(f"mesh {d1}x{d2} with mesh.dp={self.dp} needs {self.dp * d1 * d2} devices, "
                                  f"not {devices}")
            if devices % (d1 * d2):
                raise ConfigError(f"mesh {d1}x{d2} needs {d1 * d2} devices but topology '{name}' has {devices}"
                                  if d1 * d2 > devices else
                                  f"mesh {d1}x{d2} ({d1 * d2} devices a replica) does not divide the {devices} devices "
                                  f"(mesh.dp x d1 x d2 must equal them)")
        if self.fsdp and self.dp == 1:
            raise ConfigError("mesh.fsdp=true shards over data-parallel replicas, but mesh.dp=1: set mesh.dp > 1 "
                              "(the world is dp x d1 x d2)")
        if self.aggregation not in (None, "ring"):
            fixed_mesh = self.strategy == MeshStrategy.fixed and self.mesh
            dp = self.dp if self.dp is not None else (devices // (self.mesh[0] * self.mesh[1]) if fixed_mesh
                                                      else (1 if devices == 1 else None))
            if dp == 1:
                why = "mesh.dp=1" if self.dp is not None else (
                    f"mesh {self.mesh[0]}x{self.mesh[1]} uses all {devices} devices (dp=1)" if fixed_mesh
                    else "the run has one device")
                raise nothing_to_aggregate(self.aggregation, why)
        if self.fsdp and self.aggregation not in (None, "ring"):
            raise ConfigError(f"mesh.fsdp=true reduce-scatters gradients with torch.distributed; "
                              f"aggregation={self.aggregation} all-reduces whole buckets in the network and has no "
                              f"reduce-scatter: use aggregation=ring with mesh.fsdp=true")
        if self.fsdp and self.strategy == MeshStrategy.fixed and self.mesh and self.dp is None \
                and devices == self.mesh[0] * self.mesh[1]:
            raise ConfigError(f"mesh.fsdp=true shards over data-parallel replicas, but mesh "
                              f"{self.mesh[0]}x{self.mesh[1]} uses all {devices} devices (dp=1)")


def nothing_to_aggregate(mode: str, why: str) -> ConfigError:
    """An in-network aggregation mode asked for where there is one replica (``why``)."""
    return ConfigError(f"aggregation={mode} aggregates the gradients of data-parallel replicas, but {why}: there is "
                       f"nothing to aggregate; set mesh.dp > 1 or aggregation=auto")


def fsdp_seconds(world: Topology, params: float, dp: int, tp: int, bytes_per_element: int,
                 alpha_s: Optional[float] = None) -> float:
    """FSDP's traffic per step of a replica's ``params`` elements per device over ``dp`` replicas
    ``tp`` ranks apart: the parameters all-gathered for the forward and again for the backward,
    the gradients reduce-scattered, each a ring moving ``(dp-1)/dp`` of the whole over the group's
    B′ with ``dp-1`` latency steps (:func:`~atp_pipeline.planning.gradsync.link_params`)."""
    if dp <= 1 or params <= 0:
        return 0.0
    from atp_pipeline.planning.gradsync import link_params

    a, bw = link_params(world, dp, tp, alpha_s)
    one = a * (dp - 1) + (dp - 1) / dp * params * bytes_per_element / (bw * 1e9)
    return 3 * one


def sync_seconds(world: Topology, model: ModelShape, mesh: Mesh, dp: int, fsdp: bool, mode: str) -> float:
    """The data-parallel part of a step: FSDP's traffic, or the gradient sync under ``mode``."""
    if dp <= 1:
        return 0.0
    tp = mesh[0] * mesh[1]
    params = per_device_memory(model, mesh, dp).params  # a replica's shard, before FSDP splits it
    if fsdp:
        return fsdp_seconds(world, params, dp, tp, model.bytes_per_element)
    from atp_pipeline.planning.gradsync import dp_bucket, estimate

    return estimate(world, [dp_bucket(params, dp, tp)], model.bytes_per_element, configured=mode).mode(mode).seconds


def _sync(memo: Dict[Tuple[Any, ...], float], world: Topology, model: ModelShape, mesh: Mesh, dp: int, fsdp: bool,
          mode: str) -> float:
    key = (mesh, dp, fsdp, mode)
    if key not in memo:
        memo[key] = sync_seconds(world, model, mesh, dp, fsdp, mode)
    return memo[key]


def with_sync(est: StepEstimate, sync: float, model: ModelShape, devices: int,
              profile: ComputeProfile) -> StepEstimate:
    """``est`` (a replica's step without data-parallel traffic) with ``sync`` seconds added."""
    step = est.step_s + sync
    mfu = model.flops_per_step / (step * devices * profile.peak_flops) if profile.peak_flops > 0 else None
    return replace(est, step_s=step, gradsync_s=est.gradsync_s + sync, tokens_per_s=model.tokens_per_step / step,
                   mfu=mfu)


def _settings(space: Space, dp: int) -> List[Tuple[int, bool, str]]:
    """``(chunks, fsdp, mode)`` of one ``dp`` the space leaves open."""
    chunks = [space.chunks] if space.chunks is not None else list(CHUNKS)
    if dp == 1:
        fsdps = [False] if not space.fsdp else []
        modes = [space.aggregation or "ring"]
    else:
        fsdps = [space.fsdp] if space.fsdp is not None else [False, True]
        modes = [space.aggregation] if space.aggregation else [m for m in MODE_ORDER if m in space.modes]
    out = []
    for c in chunks:
        for f in fsdps:
            for m in (["ring"] if f and not space.aggregation else modes):
                out.append((c, f, m))
    return out


def _tie(layout: Layout) -> Tuple[int, int, int, int]:
    return (layout.chunks, int(layout.fsdp), MODE_ORDER.index(layout.aggregation)
            if layout.aggregation in MODE_ORDER else 9, layout.dp)


def search(world: Topology, model: ModelShape, planner: Any, space: Space) -> MeshPlan:
    """Every layout of ``world``'s devices that ``space`` leaves open, priced and ranked; the
    chosen one's :class:`MeshPlan` (its replica's meshes under its setting) with ``layouts``."""
    t0 = time.perf_counter()
    n = world.world_size
    space.check(n, world.name)
    cost_model = CostModel(planner.cost_model)
    capacity = world.device.get("memory_GB")
    live_fixed = space.aggregation not in (None, "ring")
    dps = [space.dp] if space.dp is not None else divisors(n)
    if space.strategy == MeshStrategy.fixed and space.mesh:
        dps = [n // (space.mesh[0] * space.mesh[1])]
    elif space.dp is None and (space.fsdp or live_fixed):
        dps = [d for d in dps if d > 1] or dps  # FSDP, a gradient-sync backend: replicas to shard, to sync
    layouts: List[LayoutCandidate] = []
    # per setting: (replica, candidates, selected mesh or None, why none, notes, profile, objective)
    per_setting: Dict[Tuple[int, int, bool, str], Tuple[Topology, Tuple[Candidate, ...], Optional[Mesh],
                                                        Optional[str], List[str], Any, Objective]] = {}
    objective_all: Optional[Objective] = None
    replicas: Dict[int, Topology] = {}
    for dp in dps:
        tp = n // dp
        settings = _settings(space, dp)
        if space.strategy == MeshStrategy.fixed and space.mesh:
            meshes: List[Mesh] = [space.mesh]
        elif space.strategy == MeshStrategy.megatron:
            meshes = [(tp, 1)]
        else:
            meshes = candidate_meshes(tp)
        if model.batch_size % dp:
            why = f"global batch {model.batch_size} does not split over dp={dp}"
            layouts += [LayoutCandidate(Layout(dp, m, f, c, a), why=why, lost="divisibility")
                        for m in meshes for c, f, a in settings]
            continue
        local = model.batch_size // dp
        try:
            replica = world.restrict(tp)
        except ConfigError as exc:  # the replica does not fill whole units of a level
            layouts += [LayoutCandidate(Layout(dp, m, f, c, a), why=str(exc), lost="divisibility")
                        for m in meshes for c, f, a in settings]
            continue
        replicas[dp] = replica
        if space.strategy == MeshStrategy.fixed and space.mesh:
            check_mesh(replica, space.strategy, *space.mesh)
        profile = profile_of(replica)
        notes0: List[str] = []
        objective = objective_of(planner, replica, profile, notes0)
        objective_all = objective if objective_all is None else objective_all
        base: Dict[Mesh, Candidate] = {}  # bandwidths and T_comm, per mesh (the replica's batch)
        steps: Dict[Tuple[Mesh, int], Optional[StepEstimate]] = {}
        syncs: Dict[Tuple[Any, ...], float] = {}
        for m in meshes:  # a mesh that cannot split the heads is costed only if its setting is chosen
            base[m] = (_placeholder(m) if planner.require_divisible and layout_infeasibility(model, *m) else
                       evaluate(replica, model, m, cost_model, StepSetting(dp=dp)))
        for c, f, a in settings:
            key = (dp, c, f, a)
            chunk_why = None if local % c == 0 else f"local batch {local} (global {model.batch_size} / dp={dp}) " \
                                                      f"does not split into {c} chunks"
            limit = space.limit(a, dp) if (space.limit and dp > 1 and not f) else None
            setting = StepSetting(chunks=c, dp=dp, aggregation=a, world=world, fsdp=f)
            cands = []
            for m in meshes:
                b = base[m]
                structural = layout_infeasibility(model, *m)
                mem = per_device_memory(model, m, dp, f)
                why_mem = memory_infeasibility(model, m, dp, f, capacity, f"'{world.name}' devices")
                st = None
                sync = 0.0
                if profile is not None and not structural and not chunk_why:
                    if (m, c) not in steps:
                        steps[(m, c)] = estimate_step(replica, model, m, StepSetting(chunks=c, dp=dp), profile)
                    sync = _sync(syncs, world, model, m, dp, f, a)
                    st = with_sync(steps[(m, c)], sync, model, n, profile)
                elif not structural and not chunk_why:
                    sync = _sync(syncs, world, model, m, dp, f, a)
                cands.append(replace(b, infeasible=structural or why_mem, step=st))
                why = structural or chunk_why or limit or why_mem
                lost = ("divisibility" if structural or chunk_why else "limit" if limit else
                        "memory" if why_mem else "")
                layouts.append(LayoutCandidate(Layout(dp, m, f, c, a), st, None if b.dim1 is None else b.t_comm_s,
                                               sync, mem.total_bytes, why, lost))
            if chunk_why or limit:
                per_setting[key] = (replica, tuple(cands), None, chunk_why or limit, [], profile, objective)
                continue
            notes = list(notes0)
            fixed = space.mesh if space.strategy == MeshStrategy.fixed else None
            strategy = space.strategy if space.strategy != MeshStrategy.megatron else MeshStrategy.megatron
            selected, why_none = select(replica, model, cands, strategy, fixed, planner, objective, setting, notes)
            per_setting[key] = (replica, tuple(cands), selected, why_none, notes, profile, objective)
    objective = objective_all or Objective(getattr(planner, "objective", Objective.step))
    best, ranked = _pick(world, planner, objective, per_setting, layouts)
    ranked.sort(key=lambda x: _order(x, objective))
    if best is None:
        raise ConfigError(no_layout(world, model, ranked, space, capacity))
    _, (dp, c, f, a), selected = best
    replica, cands, _, _, notes, profile, obj = per_setting[(dp, c, f, a)]
    cands = tuple(replace(evaluate(replica, model, x.mesh, cost_model, StepSetting(dp=dp)), infeasible=x.infeasible,
                          step=x.step) if x.dim1 is None else x for x in cands)
    chosen_setting = StepSetting(chunks=c, dp=dp, aggregation=a, world=world, fsdp=f)
    if space.strategy != MeshStrategy.auto:  # a fixed or Megatron mesh: its table lists every mesh beside it
        given = {x.mesh: x for x in cands}
        cands = tuple(given.get(m) or evaluate(replica, model, m, cost_model, chosen_setting, profile)
                      for m in candidate_meshes(replica.world_size))
    notes = plan_notes(replica, model) + notes
    strategy = space.strategy
    plan = MeshPlan(topology=replica, model=model, strategy=strategy, cost_model=cost_model, candidates=cands,
                    selected=selected, notes=tuple(notes), objective=obj,
                    setting=chosen_setting, profile=profile,
                    layouts=tuple(ranked), world=world, fixed=tuple(space.fixed()))
    return replace(plan, planning_s=time.perf_counter() - t0)


def _pick(world: Topology, planner: Any, objective: Objective, per_setting: Dict[Tuple[int, int, bool, str], Any],
          layouts: List[LayoutCandidate]) -> Tuple[Optional[Tuple[Tuple[Any, ...], Tuple[int, int, bool, str], Mesh]],
                                                   List[LayoutCandidate]]:
    """The winner among the settings' selected meshes (``(rank, setting key, mesh)``, None if no
    setting selected one) and every layout marked with why it lost (``chosen`` for the winner)."""
    calibrated_only = bool(world.calibrated) and not planner.select_uncalibrated
    # the winner of each setting competes; the rest of its meshes lost within it
    best: Optional[Tuple[Tuple[Any, ...], Tuple[int, int, bool, str], Mesh]] = None
    by_layout = {(x.layout.dp, x.layout.mesh, x.layout.fsdp, x.layout.chunks, x.layout.aggregation): i
                 for i, x in enumerate(layouts)}
    for key, (replica, cands, selected, _, _, _, obj) in per_setting.items():
        if selected is None:
            continue
        dp, c, f, a = key
        lc = layouts[by_layout[(dp, selected, f, c, a)]]
        if not lc.feasible and planner.require_divisible:
            continue
        if calibrated_only and (selected not in world.calibrated or replica is not world):
            continue  # §5.3: the matrix estimate is not trusted where the topology is calibrated
        value = (lc.step.step_s if (objective == Objective.step and lc.step is not None) else (lc.comm_s or math.inf))
        rank = (value, -selected[0], *_tie(lc.layout))
        if best is None or rank < best[0]:
            best = (rank, key, selected)
    ranked = []
    for x in layouts:
        k = (x.layout.dp, x.layout.mesh, x.layout.fsdp, x.layout.chunks, x.layout.aggregation)
        lost = x.lost
        if not lost:
            lost = "slower"
            if (best is not None and k == (best[1][0], best[2], best[1][2], best[1][1], best[1][3])):
                lost = "chosen"
            elif _uncalibrated(world, planner, x):
                lost = "calibration"
        ranked.append(replace(x, lost=lost))
    return best, ranked


def _placeholder(mesh: Mesh) -> Candidate:
    """A mesh not costed (yet): it cannot split the heads, so it is never selected."""
    return Candidate(mesh=mesh, dim1=None, dim2=None, t_comm_s=math.nan, terms=())  # type: ignore[arg-type]


def _uncalibrated(world: Topology, planner: Any, x: LayoutCandidate) -> bool:
    """A layout a calibrated topology's selection passes over: not one replica on a calibrated mesh."""
    return (bool(world.calibrated) and not planner.select_uncalibrated
            and (x.layout.dp != 1 or x.layout.mesh not in world.calibrated))


def _order(x: LayoutCandidate, objective: Objective) -> Tuple[Any, ...]:
    """Chosen first, then feasible layouts fastest first, then the priced infeasible, then the rest."""
    value = (x.step.step_s if objective == Objective.step and x.step is not None else
             x.comm_s if x.comm_s is not None and x.lost != "divisibility" else math.inf)
    group = (0 if x.lost == "chosen" else 1 if x.lost == "slower" else 2 if x.feasible else
             3 if value < math.inf else 4)
    return (group, value, -x.layout.mesh[0], *_tie(x.layout))


def no_layout(world: Topology, model: ModelShape, ranked: Sequence[LayoutCandidate], space: Space,
              capacity: Optional[float]) -> str:
    """Why no layout of ``world`` can run ``model``, in one line: the smallest device memory that
    would fit and the closest candidate where memory is what stops every runnable one; else the
    global batch that would let the smallest data-parallel size run."""
    n = world.world_size
    fixed = f" with {' '.join(space.fixed())}" if space.fixed() else ""
    mem_only = [x for x in ranked if x.lost == "memory" and x.memory_bytes is not None]
    head = f"no layout of the {n} devices of '{world.name}'{fixed} can run model '{model.name}'"
    if mem_only:
        close = min(mem_only, key=lambda x: x.memory_bytes)  # type: ignore[arg-type,return-value]
        return (f"{head}: every runnable one needs more memory than the {capacity:g} GB per device; the smallest "
                f"device memory that fits is {close.memory_bytes / 1e9:.1f} GB ({close.layout.label}: "
                f"{close.layout.overrides})")
    if ranked and all("heads" in (x.why or "") for x in ranked):
        if space.strategy == MeshStrategy.fixed and space.mesh:
            return f"mesh {space.mesh[0]}x{space.mesh[1]}: {ranked[0].why}"
        sizes = sorted({n // x.layout.dp for x in ranked}, reverse=True)
        return (f"{head}: no 2D mesh of {' or '.join(map(str, sizes))} devices splits the {model.heads} heads of "
                f"model '{model.name}' evenly (need heads % (d1*d2) == 0)")
    limits = [x for x in ranked if x.lost == "limit"]
    if limits:
        return f"{head}: {limits[0].why}"
    runnable_tp = [x for x in ranked if not layout_infeasibility(model, *x.layout.mesh)]
    if runnable_tp:
        smallest = min(runnable_tp, key=lambda x: (x.layout.dp, x.layout.chunks))
        need = smallest.layout.dp * smallest.layout.chunks
        return (f"{head}: {smallest.why}; the closest candidate, {smallest.layout.label}, needs a global batch "
                f"that is a multiple of {need} (model.batch_size={need})")
    return f"{head}: {ranked[0].why if ranked else 'no candidate'}"
