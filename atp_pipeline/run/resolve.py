"""Resolve: the composed config -> one :class:`RunSpec`, with every input check.

The run's flow is one-way: compose (Hydra) -> **resolve** -> plan -> build -> fit ->
report. Resolving happens once, in the parent, before any process starts: each group's
own values (:func:`~atp_pipeline.config.schema.typed`), the topology and its restriction
to the devices used, the data-parallel size, the model family's adapter and the model's
shape, the plan (one planner interface: ATP's mesh or SBP's per-layer strategies), the
parallel plan's patterns against the model's modules (on the meta device), the per-device
memory, the accelerator, the aggregation backend's knobs and the checkpoint to resume. Each
failure is one :class:`~atp_pipeline.errors.ConfigError` line. Workers receive the
:class:`RunSpec` itself: the config as its schema dataclasses and what was decided from it.

The decisions that need no composed config — the data-parallel size (:func:`resolve_dp`),
the plan on a number of devices (:func:`plan_devices`), the mesh of a model no planner can
cost (:func:`unplanned_mesh`), the aggregation backend's knobs (:func:`check_aggregation`)
— take the schema's groups, so strategy ``"atp"`` in a user's own ``Trainer`` resolves
through the same functions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from omegaconf import OmegaConf

from atp_pipeline.config.schema import (
    AggregationConfig,
    AggregationMode,
    Config,
    DataSource,
    DType,
    MeshStrategy,
    PlannerKind,
    Stage,
    SwitchImpl,
    typed,
)
from atp_pipeline.errors import ConfigError
from atp_pipeline.ina import budget
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.models.adapter import get_adapter
from atp_pipeline.planning.fmt import human_bytes
from atp_pipeline.planning.interface import PlanResult, plan_layout
from atp_pipeline.planning.layout import nothing_to_aggregate
from atp_pipeline.planning.memory import MemoryEstimate, memory_infeasibility, per_device_memory
from atp_pipeline.planning.shape import ModelShape, layout_infeasibility
from atp_pipeline.topology.model import Topology

Mesh3 = Tuple[int, int, int]


def mesh_of(plan: PlanResult, dp: int, devices: int) -> Mesh3:
    """``(dp, d1, d2)`` of a plan; an SBP plan keeps its own mesh, the strategy's is ``(1, N, 1)``."""
    if plan.kind == "sbp":
        return 1, devices, 1
    d1, d2 = plan.mesh_shape
    return dp, d1, d2


@dataclass(frozen=True)
class RunSpec:
    """A resolved run: the composed config as its schema dataclasses (``config``) and what
    resolve decided from it. Workers receive this object."""

    config: Config
    topology: Topology  # as configured
    occupied: Topology  # restricted to the devices used
    devices: int
    dp: int
    shape: ModelShape  # with the step's batch and dtype
    plan: PlanResult
    memory: Optional[MemoryEstimate] = None  # per device, ATP plans (planning/memory.py)
    memory_unsharded: Optional[MemoryEstimate] = None  # with mesh.fsdp: the same run without it
    services: Optional[Dict[str, Any]] = None  # the live roles, once started
    job: Dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> str:
        return Stage(self.config.stage).value

    @property
    def mesh(self) -> Mesh3:
        return mesh_of(self.plan, self.dp, self.devices)

    @property
    def fsdp(self) -> bool:
        """Whether parameters, gradients and optimizer state are sharded over dp (``mesh.fsdp``)."""
        return self.config.mesh.fsdp

    @property
    def live_aggregation(self) -> bool:
        """Whether gradients go through the live in-network aggregation backend."""
        return self.config.aggregation.mode in LIVE_MODES and self.dp > 1

    @property
    def precision(self) -> str:
        """Lightning's precision plugin (``trainer.precision``): ``32-true`` (no casting) runs the
        dtype the worker builds in — an fp64 model is cast before fit (Lightning's ``64-true`` is
        refused by ``ModelParallelStrategy``, the base of strategy "atp"); ``bf16-mixed`` and
        ``bf16-true`` start from float32 (:func:`check_precision`)."""
        return self.config.trainer.precision


def _mode(mode: Any) -> AggregationMode:
    return AggregationMode(getattr(mode, "value", mode))


def resolve_dp(mesh: Any, mode: Any, devices: int) -> int:
    """``mesh.dp`` (a :class:`~atp_pipeline.config.schema.MeshConfig`), or for ``dp: null``: the
    devices a fixed d1 x d2 mesh leaves over; else every device when gradients go through the
    aggregation backend (``mode`` atp/ps/switchml), 1 for ring."""
    if mesh.dp is not None:
        return int(mesh.dp)
    if mesh.strategy == MeshStrategy.fixed and mesh.d1 and mesh.d2:
        tp = int(mesh.d1) * int(mesh.d2)
        return devices // tp if devices % tp == 0 else 1  # 1: the planner names the mismatch
    return devices if _mode(mode) in LIVE_MODES else 1


def check_dp(dp: int, devices: int) -> None:
    if dp < 1 or devices % dp:
        raise ConfigError(f"mesh.dp={dp} does not divide trainer.devices={devices}")


def needed_devices(cfg: Any) -> Optional[int]:
    """The devices a fixed mesh with a given data-parallel size occupies (dp x d1 x d2), when
    ``trainer.devices`` is not set: ``mesh=1x1 mesh.dp=2`` runs on 2 of the topology's
    devices, the sub-topology they occupy, as ``mesh=2x1 mesh.dp=1`` does."""
    mesh = cfg.mesh
    if mesh.dp is None or mesh.strategy != MeshStrategy.fixed or not mesh.d1 or not mesh.d2:
        return None
    return int(mesh.dp) * int(mesh.d1) * int(mesh.d2)


#: the modes whose gradients go through the live in-network aggregation backend (ina/live)
LIVE_MODES = (AggregationMode.atp, AggregationMode.ps, AggregationMode.switchml)
#: knobs that only one group of modes reads; given to another mode they are refused
MODE_KNOBS = {"racks": (AggregationMode.atp,), "aggregators": (AggregationMode.atp,),
              "pool": (AggregationMode.switchml,), "transport": (AggregationMode.switchml,),
              "n_ps": (AggregationMode.atp, AggregationMode.ps),
              "duplicate": (AggregationMode.atp, AggregationMode.ps),
              "switch": (AggregationMode.atp, AggregationMode.ps)}


def check_aggregation(agg: Any, dp: int, jobs: int = 1) -> AggregationConfig:
    """Validate ``aggregation`` (an :class:`AggregationConfig` or its DictConfig, whose own
    values its schema checked) for ``dp`` data-parallel workers in each of ``jobs`` jobs (one per
    model-parallel coordinate)."""
    cfg = agg if isinstance(agg, AggregationConfig) else OmegaConf.to_object(agg)
    assert isinstance(cfg, AggregationConfig)
    mode = _mode(cfg.mode)
    if cfg.switch_impl == SwitchImpl.bmv2 and mode != AggregationMode.atp:
        if mode == AggregationMode.switchml:
            raise ConfigError("aggregation.switch_impl=bmv2 runs the ATP program; SwitchML has no v1model program "
                              "(its slot pool runs on the emulator only; what a port needs: docs/ina.md, "
                              "'Why SwitchML is not on BMv2')")
        raise ConfigError(f"aggregation.switch_impl=bmv2 runs the ATP program: it needs aggregation=atp, not "
                          f"{mode.value} (with ps, a switch without aggregators, there is no P4 equivalent)")
    if dp == 1 and mode not in (AggregationMode.ring, AggregationMode.auto):
        raise nothing_to_aggregate(mode.value, "mesh.dp=1")
    default = AggregationConfig()
    for key, modes in MODE_KNOBS.items():
        if mode not in modes and getattr(cfg, key) != getattr(default, key):
            value = getattr(getattr(cfg, key), "value", getattr(cfg, key))  # an enum by its value
            raise ConfigError(f"aggregation.{key}={value} applies to aggregation="
                              f"{'/'.join(m.value for m in modes)}, not {mode.value}")
    if dp % cfg.racks:
        raise ConfigError(f"aggregation.racks={cfg.racks} must divide the {dp} data-parallel workers (mesh.dp): "
                          f"every rack has as many workers")
    if mode == AggregationMode.ring or dp == 1:
        return cfg
    from atp_pipeline.ina.live.engine import MAX_DATAGRAM

    limit = (MAX_DATAGRAM - PacketFormat(1).header_bytes) // 4
    if not 1 <= cfg.payload_k <= limit:
        raise ConfigError(f"aggregation.payload_k={cfg.payload_k} must be 1..{limit} (one UDP datagram)")
    if cfg.aggregators & (cfg.aggregators - 1):
        raise ConfigError(f"aggregation.aggregators={cfg.aggregators} must be 0 or a power of two "
                          f"(the switch indexes aggregators with a hash bit mask, as P4 targets do)")
    if not 1 <= cfg.n_ps <= 4:
        raise ConfigError(f"aggregation.n_ps={cfg.n_ps} must be 1..4 (2-bit PS index)")
    bits = PacketFormat().bitmap_bits
    if mode == AggregationMode.switchml and dp > 255:
        raise ConfigError(f"mesh.dp={dp} exceeds SwitchML's 8-bit worker id")
    elif mode != AggregationMode.switchml and (dp // cfg.racks > bits or cfg.racks > bits):
        raise ConfigError(f"mesh.dp={dp} exceeds the {bits}-bit worker bitmap of one ATP job "
                          + ("(single-level aggregation; two levels: aggregation.racks)" if cfg.racks == 1 else
                             f"level ({cfg.racks} racks of {dp // cfg.racks})"))
    if cfg.switch is not None:
        from atp_pipeline.ina.live.rpc import parse_addr

        try:
            parse_addr(cfg.switch)
        except ValueError as e:
            raise ConfigError(f"aggregation.switch: {e}") from None
        if cfg.loss or cfg.duplicate:
            raise ConfigError("aggregation.loss/duplicate are set when the switch is started; a shared "
                              "switch (aggregation.switch) keeps its own")
    check_role_memory(cfg, mode, dp, jobs)
    if cfg.switch_impl == SwitchImpl.bmv2:
        check_bmv2_switch(cfg)
    return cfg


def check_role_memory(cfg: AggregationConfig, mode: AggregationMode, dp: int, jobs: int) -> None:
    """What the roles the run starts will store (:mod:`atp_pipeline.ina.budget`, the figures the roles
    themselves refuse by) against ``aggregation.role_max_bytes``: one line naming both, before any
    process starts. A shared switch (``aggregation.switch``) checks its own at job setup."""
    k, bound, key = cfg.payload_k, cfg.role_max_bytes, "aggregation.role_max_bytes"
    try:
        if mode == AggregationMode.switchml:
            budget.check(f"the SwitchML switch, {jobs} job(s) of aggregation.pool={cfg.pool} slots × 2 × {k} values",
                         jobs * budget.sml_job_bytes(cfg.pool, k), bound, key=key)
            return
        if mode == AggregationMode.atp and cfg.switch is None and cfg.switch_impl == SwitchImpl.python:
            budget.check(f"the switch, aggregation.aggregators={cfg.aggregators} × {k} values",
                         budget.switch_bytes(cfg.aggregators, k), bound, key=key)
        budget.check(f"each parameter server, {jobs} job(s) of {dp} workers at {k} values a packet",
                     jobs * budget.ps_job_bytes(dp, k, PacketFormat(k).wire_bytes), bound, key=key)
    except budget.BudgetError as e:
        raise ConfigError(str(e)) from None


def check_bmv2_switch(cfg: AggregationConfig) -> None:
    """``aggregation.switch_impl=bmv2``: what the BMv2 switch needs, each in one line, before
    any process starts (the program's header is generated for K = 62 and 32-bit bitmaps)."""
    from atp_pipeline.ina.live.services import p4_program
    from atp_pipeline.ina.p4.toolchain import why_missing

    if cfg.switch is not None:
        raise ConfigError("aggregation.switch_impl=bmv2 starts its own switch; aggregation.switch names a running "
                          "one: set only one of them")
    if cfg.racks > 1 and cfg.n_ps > 1:
        raise ConfigError(f"aggregation.switch_impl=bmv2 with aggregation.racks={cfg.racks} needs aggregation.n_ps=1, "
                          f"not {cfg.n_ps}: the v1model program's ⑦ flush clone session reaches one PS port")
    fmt = PacketFormat()
    if cfg.payload_k != fmt.payload_k:
        raise ConfigError(f"aggregation.payload_k={cfg.payload_k}: the P4 program's header carries "
                          f"{fmt.payload_k} values per packet (p4/generated); use aggregation.payload_k="
                          f"{fmt.payload_k} with switch_impl=bmv2")
    if cfg.aggregators < 1:
        raise ConfigError("aggregation.aggregators=0: a P4 register array needs at least one entry "
                          "(switch_impl=bmv2)")
    why = why_missing()
    if why:
        raise ConfigError(f"aggregation.switch_impl=bmv2: {why}")
    if os.geteuid() != 0:
        raise ConfigError("aggregation.switch_impl=bmv2 runs simple_switch on veth pairs in a network namespace "
                          "of its own: it needs root")
    if not Path(p4_program(cfg)).is_file():
        raise ConfigError(f"aggregation.switch_impl=bmv2: no P4 program at {p4_program(cfg)} "
                          "(set aggregation.p4_program to p4/v1model/atp.p4 of a checkout)")


def check_fsdp(dp: int, planner: PlannerKind, mode: Any) -> None:
    """``mesh.fsdp=true``: what sharded data parallelism needs, each in one line."""
    if planner == PlannerKind.sbp:
        raise ConfigError("mesh.fsdp=true shards over the data-parallel dimension, which planner=sbp lays out per "
                          "layer itself: use planner=atp")
    if dp < 2:
        raise ConfigError(f"mesh.fsdp=true shards over data-parallel replicas, but mesh.dp={dp}: set mesh.dp > 1 "
                          f"(the world is dp x d1 x d2)")
    mode = _mode(mode)
    if mode != AggregationMode.ring:
        raise ConfigError(f"mesh.fsdp=true reduce-scatters gradients with torch.distributed; aggregation={mode.value} "
                          f"all-reduces whole buckets in the network and has no reduce-scatter: use "
                          f"aggregation=ring with mesh.fsdp=true")


def check_sbp(dp: int, chunks: int) -> None:
    """An SBP plan lays out data parallelism per layer itself and has no chunk overlap."""
    if dp != 1 or chunks != 1:
        raise ConfigError(f"planner=sbp plans data parallelism per layer itself: it needs mesh.dp=1 (got {dp}), "
                          f"aggregation=ring and overlap=chunk1 (got chunks={chunks})")


def model_shape(cfg: Any) -> ModelShape:
    """The model's shape from its family's adapter, checked (sizes, chunks)."""
    m = cfg.model
    try:
        shape = get_adapter(m.family).shape_from_config(m)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if m.vocab_parallel_loss and shape.head_layout != "vocab_split":
        raise ConfigError(f"model.vocab_parallel_loss=true: family '{m.family}' lays out its head "
                          f"'{shape.head_layout}', not split by vocabulary over d1 x d2 (family 'hf' does)")
    chunks = cfg.overlap.chunks
    if chunks is not None and (chunks < 1 or shape.batch_size % chunks):
        raise ConfigError(f"overlap.chunks={chunks} must be >= 1 and divide model.batch_size="
                          f"{shape.batch_size} (chunks split the batch, §4.1)")
    return shape


def _job_info() -> Dict[str, Any]:
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except ValueError:  # compose API: no Hydra run
        return {}
    return {"job_num": hc.job.get("num"), "overrides": hc.job.override_dirname}


@dataclass(frozen=True)
class Planned:
    """The planning half of a resolved run (what ``stage=plan`` needs)."""

    shape: ModelShape
    topology: Topology
    occupied: Topology
    devices: int
    dp: int
    plan: PlanResult

    @property
    def mesh(self) -> Mesh3:
        return mesh_of(self.plan, self.dp, self.devices)


def resolve_plan(cfg: Config) -> Planned:
    """Shape, devices, dp and the plan (on the devices of one data-parallel replica)."""
    shape = model_shape(cfg)
    from atp_pipeline.run.calibration import with_calibration

    topo = with_calibration(Topology.from_config(cfg.topology), cfg.calibration)
    devices = cfg.trainer.devices or needed_devices(cfg) or topo.world_size
    if devices > topo.world_size:
        asked = (f"trainer.devices={devices}" if cfg.trainer.devices else
                 f"mesh {cfg.mesh.d1}x{cfg.mesh.d2} with mesh.dp={cfg.mesh.dp} needs {devices} devices")
        raise ConfigError(f"{asked} but topology '{topo.name}' has only {topo.world_size} devices")
    return plan_devices(topo, devices, shape, cfg.mesh, cfg.planner, cfg.overlap.chunks, cfg.aggregation.mode,
                        cfg.mesh.fsdp, cfg.aggregation)


def plan_from_config(cfg: Any) -> PlanResult:
    """The plan of a composed config (``stage=plan``'s table), without the fit checks."""
    return resolve_plan(typed(cfg)).plan


def aggregation_limit(agg: Any) -> Callable[[str, int], Optional[str]]:
    """Why a mode's live backend cannot synchronize ``dp`` workers (None: it can), for the
    whole-layout search: SwitchML's 8-bit worker id, ATP's per-job worker bitmap (per rack),
    ``aggregation.racks`` dividing the workers."""
    racks = int(getattr(agg, "racks", 1) or 1)
    bits = PacketFormat().bitmap_bits

    def why(mode: str, dp: int) -> Optional[str]:
        if mode == "switchml" and dp > 255:
            return f"aggregation=switchml: dp={dp} exceeds SwitchML's 8-bit worker id"
        if mode == "atp" and dp % racks:
            return f"aggregation.racks={racks} does not divide dp={dp}"
        per = dp // racks if mode == "atp" else dp
        if mode in ("atp", "ps") and per > bits:
            return f"aggregation={mode}: dp={dp} exceeds the {bits}-bit worker bitmap of one ATP job"
        return None
    return why


def plan_devices(topo: Topology, devices: int, shape: ModelShape, mesh: Any, planner: Any, chunks: Optional[int],
                 mode: Any, fsdp: Optional[bool], aggregation: Any = None) -> Planned:
    """The plan of ``shape`` on the first ``devices`` devices of ``topo``: for ATP, the whole
    layout (dp x d1 x d2, FSDP, chunks, aggregation: :func:`~atp_pipeline.planning.interface.plan_layout`)
    within the fields given (``mesh.dp``, a fixed mesh, ``fsdp``, ``chunks``, ``mode``; None or
    ``auto``: searched); for SBP, one replica over every device. ``mesh``, ``planner``: the
    schema's groups (or their DictConfigs); ``aggregation``: the aggregation group (its knobs
    bound the backends' workers). ``stage=plan``, ``stage=fit`` and strategy ``"atp"`` alike."""
    from atp_pipeline.planning.layout import Space

    occupied = topo.restrict(devices)
    kind = PlannerKind(getattr(planner.name, "value", planner.name))
    mode_v = _mode(mode).value
    strategy = MeshStrategy(getattr(mesh.strategy, "value", mesh.strategy))
    if strategy == MeshStrategy.fixed:
        if mesh.d1 is None or mesh.d2 is None or mesh.d1 < 1 or mesh.d2 < 1:
            raise ConfigError(f"mesh.strategy=fixed needs positive mesh.d1 and mesh.d2, got {mesh.d1} and {mesh.d2}")
    elif mesh.d1 is not None or mesh.d2 is not None:
        raise ConfigError(f"mesh.d1/mesh.d2 apply to strategy 'fixed' only, not '{strategy.value}'")
    if kind == PlannerKind.sbp:
        dp = 1 if mesh.dp is None else int(mesh.dp)
        check_dp(dp, devices)
        if fsdp:
            check_fsdp(dp, kind, mode)
        check_sbp(dp, 1 if chunks is None else int(chunks))
    space = Space(dp=None if mesh.dp is None else int(mesh.dp), strategy=strategy,
                  mesh=(int(mesh.d1), int(mesh.d2)) if strategy == MeshStrategy.fixed else None,
                  fsdp=None if fsdp is None else bool(fsdp), chunks=None if chunks is None else int(chunks),
                  aggregation=None if mode_v == "auto" else mode_v, modes=occupied.aggregation_modes,
                  limit=aggregation_limit(aggregation if aggregation is not None else AggregationConfig()))
    result = plan_layout(occupied, shape, planner, space)
    dp = result.whole_layout.dp
    notes = list(result.notes)
    chosen = result.candidate(result.selected) if result.kind == "atp" else None  # type: ignore[attr-defined]
    if chosen is not None and chosen.infeasible:  # only with planner.require_divisible=false
        notes.append(f"selected mesh {chosen.mesh[0]}x{chosen.mesh[1]} is NOT RUNNABLE ({chosen.infeasible}): "
                     f"planned for an interconnect study (planner.require_divisible=false); stage=fit refuses it")
    if devices < topo.world_size:
        notes.insert(0, f"{devices} of {topo.world_size} devices of '{topo.name}' are used: planned and "
                        f"run on that sub-topology")
    if result.kind == "atp":
        result = replace(result, top=int(getattr(planner, "top", 5)))  # type: ignore[type-var]
    return Planned(shape, topo, occupied, devices, dp, result.with_notes(notes))


def decided(cfg: Config, result: PlanResult) -> Config:
    """``cfg`` with the layout the plan decided written into its groups (``mesh.dp``,
    ``mesh.fsdp``, ``overlap.chunks``, ``aggregation.mode``): what the run and its workers read."""
    lay = result.whole_layout
    return replace(cfg, mesh=replace(cfg.mesh, dp=lay.dp, fsdp=lay.fsdp),
                   overlap=replace(cfg.overlap, chunks=lay.chunks),
                   aggregation=replace(cfg.aggregation, mode=AggregationMode(lay.aggregation)))


def unplanned_mesh(mesh: Any, mode: Any, devices: int, shardable: bool) -> Mesh3:
    """``(dp, d1, d2)`` of a model no planner can cost (no family adapter gives its shape): a
    fixed mesh as given, else Megatron's ``(devices / dp, 1)``; a model with nothing to shard
    (``shardable`` false: no parallel plan either) runs data parallel on every device unless
    the mesh or ``dp`` is given."""
    if not shardable and mesh.strategy == MeshStrategy.auto and mesh.dp is None:
        return devices, 1, 1
    dp = resolve_dp(mesh, mode, devices)
    check_dp(dp, devices)
    if mesh.strategy != MeshStrategy.fixed:
        return dp, devices // dp, 1
    d1, d2 = int(mesh.d1), int(mesh.d2)
    if dp * d1 * d2 != devices:
        raise ConfigError(f"mesh {d1}x{d2} with mesh.dp={dp} needs {dp * d1 * d2} devices, not {devices}")
    return dp, d1, d2


def resolve(cfg: Any) -> RunSpec:
    """Every check that can fail, before any process starts; the resolved run. ``cfg``: the
    composed config (or its :class:`~atp_pipeline.config.schema.Config`)."""
    cfg = typed(cfg)
    planned = resolve_plan(cfg)
    shape, topo, devices, dp, result = planned.shape, planned.topology, planned.devices, planned.dp, planned.plan
    cfg = decided(cfg, result)
    fitting = cfg.stage == Stage.fit
    if fitting:
        check_aggregation(cfg.aggregation, dp, devices // dp)
    fsdp = cfg.mesh.fsdp  # checked in resolve_plan
    if result.kind == "atp":
        d1, d2 = result.mesh_shape
        why = layout_infeasibility(shape, d1, d2)
        if why and (fitting or cfg.planner.require_divisible):
            raise ConfigError(f"model '{shape.name}' on mesh {d1}x{d2}: {why}"
                              + (" (planned with planner.require_divisible=false for an interconnect study: "
                                 "the selected mesh is not runnable)" if fitting and not cfg.planner.require_divisible
                                 else ""))
    else:
        d1, d2 = devices, 1
    local_batch = shape.batch_size // dp
    if shape.batch_size % dp or local_batch % cfg.overlap.chunks:
        raise ConfigError(f"model.batch_size={shape.batch_size} must split over mesh.dp={dp} and then "
                          f"over overlap.chunks={cfg.overlap.chunks}")
    if cfg.data.source == DataSource.corpus and shape.vocab_size < 256:
        raise ConfigError(f"data.source=corpus is byte-level and needs model.vocab_size >= 256, got "
                          f"{shape.vocab_size}")
    if fitting or cfg.model.parallel_plan:  # the plan's patterns name real modules (stage=plan: only a user's plan)
        check_layout(cfg, result.kind)
    capacity = topo.device.get("memory_GB")
    mem = per_device_memory(shape, (d1, d2), dp, fsdp) if result.kind == "atp" else None  # sbp: its own limit
    unsharded = per_device_memory(shape, (d1, d2), dp) if mem is not None and fsdp else None
    if mem is not None:
        why = memory_infeasibility(shape, (d1, d2), dp, fsdp, capacity, f"'{topo.name}' devices")
        if why:
            raise ConfigError(why)
    if fitting:
        check_accelerator(cfg.trainer.accelerator, topo, devices)
        check_precision(cfg)
        if mem is not None and cfg.trainer.accelerator == "cpu":
            check_host_memory(shape.name, mem, devices)
    if cfg.resume and cfg.resume != "auto":  # auto: the run directory's newest (run(): it knows the directory)
        from atp_pipeline.run.checkpoints import resolve_resume

        resolve_resume(cfg.resume, Path("."))
    return RunSpec(config=cfg, topology=topo, occupied=planned.occupied, devices=devices, dp=dp, shape=shape,
                   plan=result, memory=mem, memory_unsharded=unsharded, job=_job_info())


def check_layout(cfg: Config, planner: str) -> None:
    """The parallel plan's patterns (the user's ``model.parallel_plan``, else the family's)
    name real modules of the model, built on the meta device; with an SBP plan the family has
    its SBP layer chain, with ``mesh.fsdp`` FSDP2 can shard the model."""
    from atp_pipeline.models.meta import outline_device
    from atp_pipeline.parallel.apply import match_plan

    adapter = get_adapter(cfg.model.family)
    user_plan = cfg.model.parallel_plan
    with outline_device():  # a user's plan may name any block; the family's is per block
        model = adapter.build(cfg.model) if user_plan else adapter.build_outline(cfg.model)
    match_plan(model, dict(user_plan) if user_plan else adapter.parallel_plan(model))
    if planner == "sbp":
        adapter.sbp_linears(model)  # the family's SBP layer chain (one line if it has none)
    if cfg.mesh.fsdp:  # what FSDP2 cannot shard, named before any process starts
        from atp_pipeline.parallel.fsdp import fsdp_infeasibility

        why = fsdp_infeasibility(model)
        if why:
            raise ConfigError(f"mesh.fsdp=true: model '{cfg.model.name}': {why}")


def check_precision(cfg: Config) -> None:
    """``trainer.precision`` against the model's dtype: the bf16 precisions cast a float32
    model; a float64 one (``model.dtype=fp64``, the exactness checks' dtype) runs ``32-true``."""
    if cfg.trainer.precision != "32-true" and cfg.model.dtype == DType.fp64:
        raise ConfigError(f"trainer.precision={cfg.trainer.precision} casts a float32 model, but model.dtype=fp64 "
                          f"trains in float64: use trainer.precision=32-true, or another model.dtype")


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(model: str, mem: MemoryEstimate, ranks: int) -> None:
    """CPU ranks all live in this host's memory: the per-rank estimate times the ranks against
    what the host has available now (a CPU topology declares no device memory to check)."""
    available = host_available_bytes()
    need = (mem.total_bytes + mem.logits_bytes) * ranks
    if available is not None and need > available:
        raise ConfigError(f"model '{model}' needs ~{human_bytes(mem.total_bytes + mem.logits_bytes)} per rank x "
                          f"{ranks} CPU ranks = {human_bytes(need)} of host memory, but this host has "
                          f"{human_bytes(available)} available (MemAvailable); use fewer ranks or a smaller model")


def check_accelerator(accel: str, topo: Topology, devices: int) -> None:
    """``trainer.accelerator`` against the topology's devices and this host's GPUs."""
    device_name = str(topo.device.get("name") or "unknown")
    if accel == "cpu" and device_name not in ("cpu", "unknown"):
        raise ConfigError(f"topology '{topo.name}' describes {device_name} devices but trainer.accelerator=cpu; "
                          f"set trainer.accelerator=gpu to train on them, or stage=plan to only plan")
    if accel in ("gpu", "cuda") and not os.environ.get("TORCHELASTIC_RUN_ID"):
        import torch

        local = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local < devices:
            raise ConfigError(f"trainer.accelerator={accel} with {devices} processes needs {devices} GPUs on "
                              f"this host, found {local} (several nodes: launch with torchrun)")
