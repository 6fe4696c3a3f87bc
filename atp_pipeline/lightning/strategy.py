"""``ATPStrategy``: Lightning's strategy ``"atp"`` — realizes a plan on real processes.

It only orchestrates (Lightning's ``ModelParallelStrategy`` is its base, for process
groups and sharded ``torch.distributed.checkpoint`` checkpoints); every decision and check
is :mod:`atp_pipeline.run.resolve`'s:

1. **mesh** (``setup_environment``): ``(dp, d1, d2)`` as resolve decided it for a run of
   ``train.py`` (:meth:`~ATPStrategyMixin.for_run`); in a user's own ``Trainer``, resolved
   from ``mesh`` through the same functions — a fixed ``(d1, d2)``, ``"megatron"``,
   ``"auto"`` (ATP's planner) or ``"sbp"`` planned on the model's shape, which the model's
   family adapter (:mod:`atp_pipeline.models.adapter`) gives
   (:func:`~atp_pipeline.run.resolve.plan_devices`), a model no adapter knows laid out by
   :func:`~atp_pipeline.run.resolve.unplanned_mesh`, or a plan result
   (:class:`~atp_pipeline.planning.interface.PlanResult`: ATP's mesh or an SBP plan);
2. **layout** (``setup``, after ``configure_model``): the plan's styles
   (:mod:`atp_pipeline.parallel.styles`) replace the modules they name — the user's
   ``plan``, else the ``parallel_plan`` attribute of the LightningModule, else each known
   family's own plan — or an SBP plan's executor; a model built on the meta device is then
   materialized shard by shard (:mod:`atp_pipeline.parallel.materialize`) and replicated
   parameters are broadcast from rank 0, as DDP does; a family's checkpoint
   (``ModelAdapter.weights``) fills the shards, each rank reading only its own;
3. **gradient sync** (``post_backward``): every gradient averaged over the data-parallel
   replicas through one :class:`~atp_pipeline.parallel.grad_sync.GradSync` (``ring``, or the
   in-network aggregation backend for ``atp``/``ps``) — or, with ``fsdp=True``, **sharded
   data parallelism**: FSDP2 over the ``dp`` axis after the layout
   (:mod:`atp_pipeline.parallel.fsdp`), whose reduce-scatter averages the gradients;
4. **Lightning's loop** around it: ``gradient_clip_val`` (by norm or value) reaches the
   precision plugin, into which the global clipping of :mod:`atp_pipeline.lightning.precision`
   is mixed (the norm over every shard and replica, :mod:`atp_pipeline.parallel.clip`; logged
   as ``grad_norm``); ``precision="bf16-mixed"``/``"bf16-true"`` are Lightning's own (the
   runtime follows autocast, :mod:`atp_pipeline.parallel.amp`); several processes on one host
   each take their share of its cores unless ``OMP_NUM_THREADS`` is set; in a user's Trainer,
   rank 0 prints one line naming the mesh, dp, FSDP, the plan applied and the threads.

With no plan and no adapter, the model stays whole: replicated over the tensor-parallel
ranks, data parallel over the rest (``mesh="auto"`` then uses every device for data
parallelism), and the strategy says so in one line. Data: with one data-parallel replica
a user's DataLoader keeps its single-device order (under any distributed strategy Lightning
would inject a shuffling ``DistributedSampler``); a shuffling loader gets a sampler seeded
alike on every rank; with ``dp > 1`` Lightning's DDP behaviour applies (a
``DistributedSampler`` the loader already has — the data modules' ``RunSampler`` — is kept,
sized by :attr:`distributed_sampler_kwargs`: the replica's rank on the ``dp`` axis).

Pitfalls handled: ``pytorch_lightning`` and ``lightning.pytorch`` are separate class
hierarchies — this mixin is joined with each in :mod:`.flavor`; the stock DDP strategy
registers communication hooks only on CUDA — the sync here runs on CPU and GPU.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from atp_pipeline.config.schema import (
    AggregationConfig,
    AggregationMode,
    MeshConfig,
    MeshStrategy,
    OverlapConfig,
    PlannerConfig,
    PlannerKind,
)
from atp_pipeline.errors import ConfigError
from atp_pipeline.lightning.precision import GlobalClipMixin, with_global_clipping
from atp_pipeline.models.adapter import adapters, find_adapters, prefixed
from atp_pipeline.parallel.apply import apply_plan
from atp_pipeline.parallel.comm import Comm, comm_for
from atp_pipeline.parallel.dense import load_dense
from atp_pipeline.parallel.fsdp import is_sharded, shard_data_parallel
from atp_pipeline.parallel.grad_sync import GradSync, RingSync, sync_gradients
from atp_pipeline.parallel.materialize import broadcast_replicated, has_meta, materialize
from atp_pipeline.parallel.mesh import Axis, init_mesh
from atp_pipeline.planning.interface import PlanResult

MeshSpec = Union[str, Tuple[int, int], PlanResult, Any, None]
Mesh3 = Tuple[int, int, int]


MESH_WORDS = ("auto", "megatron", "sbp")


def parse_mesh(spec: MeshSpec) -> MeshSpec:
    """``"2x2"``/``[2, 2]`` -> ``(2, 2)``; a word of :data:`MESH_WORDS` or a plan as given; anything
    else is refused in one line."""
    if isinstance(spec, str) and spec not in MESH_WORDS:
        d1, x, d2 = spec.partition("x")
        if not (x and d1.isdigit() and d2.isdigit()):
            raise ConfigError(f"strategy 'atp': mesh={spec!r} must be one of {', '.join(map(repr, MESH_WORDS))}, "
                              f"'<d1>x<d2>' (e.g. '2x2'), a (d1, d2) pair or a plan")
        spec = (int(d1), int(d2))
    if isinstance(spec, (list, tuple)):
        if len(spec) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in spec):
            raise ConfigError(f"strategy 'atp': mesh={spec!r} must be a (d1, d2) pair of positive integers")
        return tuple(spec)
    return spec


def _count_or_auto(name: str, value: Any) -> Optional[int]:
    """``"auto"`` -> None; an integer as given (its config schema checks its range); anything else
    one line naming ``name``."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"strategy 'atp': {name}={value!r} must be an integer or 'auto'")
    return value


def _is_sbp(spec: Any) -> bool:
    return getattr(spec, "kind", None) == "sbp" or type(spec).__name__ == "SBPLayout"


class ATPStrategyMixin:
    """Adaptive tensor parallelism on a (dp, d1, d2) mesh.

    The arguments are the config keys of ``train.py`` (and checked as they are, by their
    schema and :mod:`atp_pipeline.run.resolve`; errors name those keys):

    Args:
        mesh: ``(d1, d2)`` (or ``"2x2"``; ``mesh.d1``/``mesh.d2``), ``"megatron"`` for
            ``(N/dp, 1)``, ``"auto"`` (default: the ATP planner's choice for the model's shape
            on ``topology``, this host's ``local`` topology when none is given), ``"sbp"`` (the
            SBP planner), or a plan result (``MeshPlan``, ``SBPPlan``) / an ``SBPLayout``.
        dp: data-parallel size (``mesh.dp``), or ``"auto"``
            (:func:`~atp_pipeline.run.resolve.resolve_dp`).
        chunks: chunk-based overlap inside each transformer block (§4.1; ``overlap.chunks``), or
            ``"auto"`` (default: the whole-layout search's choice with ``mesh="auto"``; 1 where nothing is planned).
        plan: module-name pattern -> style (names or :class:`ParallelStyle` objects);
            default: the module's ``parallel_plan`` attribute, else its families' plans.
        topology: a topology config (dict/DictConfig) for ``mesh="auto"``/``"sbp"``.
        aggregation: ``"ring"``, ``"atp"``, ``"ps"``, ``"switchml"``, ``"auto"`` (default: the
            search's choice among the modes ``topology`` supports; ring where nothing is planned),
            or an ``AggregationConfig`` (or a mapping of its fields).
        services: the running ATP roles (``Services.to_dict()``); default: start them.
        fsdp: shard parameters, gradients and optimizer state over the data-parallel
            replicas with FSDP2, composed with the (d1, d2) tensor parallelism
            (:mod:`atp_pipeline.parallel.fsdp`; ``mesh.fsdp``); needs dp > 1 and
            ``aggregation="ring"``; ``"auto"`` (default): the search's choice (off where nothing is planned).
    """

    strategy_name = "atp"

    def __init__(self, mesh: MeshSpec = "auto", dp: Union[int, str] = "auto", chunks: Union[int, str] = "auto",
                 plan: Optional[Mapping[str, Any]] = None, topology: Any = None,
                 aggregation: Union[str, AggregationConfig, Mapping[str, Any]] = "auto",
                 services: Optional[Mapping[str, Any]] = None, fsdp: Union[bool, str] = "auto",
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = timedelta(seconds=1800)) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,  # type: ignore[call-arg]
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.aggregation_config = aggregation_config(aggregation)
        self._chunks: Optional[int] = OverlapConfig(chunks=_count_or_auto("chunks", chunks)).chunks
        MeshConfig(dp=_count_or_auto("dp", dp))  # the schema's check of mesh.dp, now
        if fsdp != "auto" and not isinstance(fsdp, bool):
            raise ConfigError(f"strategy 'atp': fsdp={fsdp!r} must be True, False or 'auto'")
        if topology is not None and not isinstance(topology, Mapping):
            raise ConfigError(f"strategy 'atp': topology={topology!r} must be a topology config (a dict or DictConfig "
                              f"with 'levels', as conf/topology/*.yaml), not a {type(topology).__name__}")
        self._mesh_spec, self._dp_spec = parse_mesh(mesh), dp
        self._plan, self._topology = plan, topology
        self.aggregation = self.aggregation_config.mode.value
        self._services, self._sync, self._failed = services, None, False
        self.fsdp: Optional[bool] = None if fsdp == "auto" else bool(fsdp)
        self._decided: Optional[Mesh3] = None  # the mesh a resolved run brings (for_run)
        self._training = False  # set up and fitting: a failure now may leave peers in a collective
        self.mesh_shape: Optional[Mesh3] = None
        self.applied_plan: Dict[str, str] = {}
        self.notes: List[str] = []
        self.grad_norm: Optional[torch.Tensor] = None  # the global norm the last clip by norm measured
        self._threads: Optional[str] = None  # what setup_environment did about threads (the layout line)

    @classmethod
    def for_run(cls, spec: Any) -> Any:
        """The strategy of a resolved run (:class:`~atp_pipeline.run.resolve.RunSpec`, what
        ``train.py``'s workers get): its mesh, plan, chunks, aggregation, FSDP and collective
        timeout as resolve decided and checked them."""
        c = spec.config
        strategy = cls(mesh=spec.plan, dp=spec.dp, chunks=c.overlap.chunks, plan=c.model.parallel_plan,
                       aggregation=c.aggregation, services=spec.services, fsdp=c.mesh.fsdp,
                       timeout=timedelta(seconds=c.trainer.collective_timeout_s))
        strategy._decided = spec.mesh
        return strategy

    # ------------------------------------------------------------------ precision, clipping
    @property
    def precision_plugin(self) -> Any:
        """Lightning's precision plugin, clipping gradients over the whole mesh
        (:mod:`atp_pipeline.lightning.precision`): ``gradient_clip_val`` and
        ``gradient_clip_algorithm`` ("norm" | "value") as on one process."""
        plugin = super().precision_plugin  # type: ignore[misc]
        if not isinstance(plugin, GlobalClipMixin):
            plugin = with_global_clipping(plugin, self)
            self._precision_plugin = plugin
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = plugin  # mixed in when next asked for

    def record_grad_norm(self, norm: torch.Tensor) -> None:
        """Keep the global gradient norm a clip measured (``grad_norm``) and log it as
        ``grad_norm`` where Lightning allows logging (its clipping hooks do)."""
        self.grad_norm = norm
        module = self.lightning_module  # type: ignore[attr-defined]
        package = getattr(self, "lightning_package", "pytorch_lightning")
        refused = importlib.import_module(f"{package}.utilities.exceptions").MisconfigurationException
        try:
            module.log("grad_norm", norm.float(), on_step=True, on_epoch=False, sync_dist=False)
        except refused:  # a hook where Lightning allows no logging: the norm stays on self.grad_norm
            pass

    def _set_threads(self) -> None:
        """Several processes on this host and no ``OMP_NUM_THREADS``: each takes its share of the
        cores (``torch.set_num_threads`` and ``OMP_NUM_THREADS``: cores // processes, at least 1),
        as torchrun and ``train.py``'s launcher keep ranks from oversubscribing the host (4 CPU
        ranks each using every core ran 4.5-11x slower). Lightning's own launcher sets that share
        in the process it runs in, but not in the processes it starts; a value the user set is kept."""
        local = int(getattr(self, "num_processes", 1) or 1)
        value = os.environ.get("OMP_NUM_THREADS")
        if value is None and local > 1:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            n = max(1, cores // local)
            os.environ["OMP_NUM_THREADS"] = str(n)
            torch.set_num_threads(n)
            self._threads = (f"{n} thread(s) per process ({cores} cores / {local} processes on this host; "
                             f"OMP_NUM_THREADS chooses)")
        elif value is not None:
            self._threads = f"{torch.get_num_threads()} thread(s) per process (OMP_NUM_THREADS={value})"

    # ------------------------------------------------------------------ mesh
    def _say(self, line: str) -> None:
        self.notes.append(line)
        if self.global_rank == 0:  # type: ignore[attr-defined]
            print(f"strategy 'atp': {line}", flush=True)

    def _families(self) -> List[Tuple[str, Any, torch.nn.Module]]:
        module = self.lightning_module  # type: ignore[attr-defined]
        return find_adapters(module) if module is not None else []

    def _user_plan(self) -> Optional[Mapping[str, Any]]:
        return self._plan or getattr(self.lightning_module, "parallel_plan", None)  # type: ignore[attr-defined]

    def _mesh_config(self) -> Tuple[MeshConfig, PlannerConfig]:
        """The constructor's ``mesh``/``dp`` as the config groups resolve reads."""
        spec, dp = self._mesh_spec, self._dp_spec
        dp = None if dp == "auto" else int(dp)
        if spec == "sbp":
            return MeshConfig(dp=dp), PlannerConfig(name=PlannerKind.sbp)
        if hasattr(spec, "mesh_shape") and getattr(spec, "kind", None) == "atp":
            spec = tuple(spec.mesh_shape)
        if isinstance(spec, tuple):
            d1, d2 = (int(x) for x in spec)
            return MeshConfig(strategy=MeshStrategy.fixed, d1=d1, d2=d2, dp=dp), PlannerConfig()
        if spec in ("auto", "megatron", None):
            return MeshConfig(strategy=MeshStrategy(spec or "auto"), dp=dp), PlannerConfig()
        raise ConfigError(f"strategy 'atp': mesh must be (d1, d2), 'd1xd2', 'megatron', 'auto', 'sbp' or a "
                          f"plan, got {spec!r}")

    def _resolve_mesh(self, world: int) -> Mesh3:
        """The ``(dp, d1, d2)`` of the ``world`` processes, through :mod:`atp_pipeline.run.resolve`."""
        from atp_pipeline.run import resolve as rs

        if self._decided is not None:
            if self._decided[0] * self._decided[1] * self._decided[2] != world:
                raise ConfigError(f"strategy 'atp': the run was resolved for mesh dp x d1 x d2 = "
                                  f"{' x '.join(map(str, self._decided))}, not the {world} processes")
            return self._decided
        dims = self._plan_mesh(world)
        # what the search did not decide (nothing planned): one chunk, no FSDP, ring
        self._chunks = 1 if self._chunks is None else self._chunks
        self.fsdp = bool(self.fsdp)
        if self.aggregation_config.mode == AggregationMode.auto:
            self._decide_mode("ring")
        rs.check_aggregation(self.aggregation_config, dims[0], world // dims[0])
        return dims

    def _decide_mode(self, mode: str) -> None:
        from dataclasses import replace

        self.aggregation_config = replace(self.aggregation_config, mode=AggregationMode(mode))
        self.aggregation = mode

    def _plan_mesh(self, world: int) -> Mesh3:
        """The mesh of the ``world`` processes: a given SBP plan's, an unplanned model's, or the
        whole-layout search's (which also decides chunks, FSDP and aggregation left ``"auto"``)."""
        from atp_pipeline.run import resolve as rs

        mode = self.aggregation_config.mode
        if _is_sbp(self._mesh_spec):  # a given SBP plan
            layout = getattr(self._mesh_spec, "layout", self._mesh_spec)
            dp = 1 if self._dp_spec == "auto" else int(self._dp_spec)
            if self.fsdp:
                rs.check_fsdp(dp, PlannerKind.sbp, mode)
            rs.check_sbp(dp, self._chunks)
            if layout.devices != world:
                raise ConfigError(f"strategy 'atp': the SBP plan is for {layout.devices} devices, not the {world} "
                                  f"processes")
            return 1, world, 1
        mesh, planner = self._mesh_config()
        families = self._families()
        if not families:  # no shape to plan with
            if planner.name == PlannerKind.sbp:
                raise ConfigError("strategy 'atp': mesh='sbp' plans a model of a known family; else pass an SBP plan")
            if mode == AggregationMode.auto:  # nothing is planned: nothing chooses another mode than ring
                self._decide_mode("ring")
                mode = self.aggregation_config.mode
            dims = rs.unplanned_mesh(mesh, mode, world, shardable=bool(self._user_plan()))
            self._say_unplanned(dims, mesh)
        else:
            planned = rs.plan_devices(self._local_topology(), world, self._shape(families, planner), mesh, planner,
                                      self._chunks, mode, self.fsdp, self.aggregation_config)
            if planned.plan.kind == "sbp":
                self._mesh_spec = planned.plan
            lay = planned.plan.whole_layout
            self._chunks, self.fsdp = lay.chunks, lay.fsdp
            self._decide_mode(lay.aggregation)
            dims = planned.mesh
            if planned.plan.kind == "atp" and mesh.strategy == MeshStrategy.auto:
                self._say(f"mesh 'auto': the whole-layout search chose {lay.label} "
                          f"({getattr(planned.plan, 'planning_s', 0.0) or 0.0:.2f} s)")
        if self.fsdp and not families:
            rs.check_fsdp(dims[0], PlannerKind.atp, mode)
        return dims

    def _say_unplanned(self, dims: Mesh3, mesh: MeshConfig) -> None:
        name = type(self.lightning_module).__name__  # type: ignore[attr-defined]
        if dims[1] * dims[2] == 1 and not self._user_plan():
            self._say(f"no parallel plan and no model adapter for {name}: nothing to shard, so its {dims[0]} "
                      f"processes run data parallel")
        elif mesh.strategy == MeshStrategy.auto:
            self._say(f"mesh 'auto': no model adapter knows {name}, so the planner cannot cost it; using "
                      f"Megatron's ({dims[1]}, 1) (give mesh=(d1, d2) to choose)")

    def _local_topology(self) -> Any:
        """The ``topology`` given, else this host's processes behind one switch (``local``)."""
        from atp_pipeline.topology.builders import switched
        from atp_pipeline.topology.model import Topology

        if self._topology is not None:
            return Topology.from_config(self._topology)
        world = self.world_size  # type: ignore[attr-defined]
        return Topology.from_config(switched(world, 1.0, name="local", unit="process"))

    def _batch_size(self) -> Optional[int]:
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        return getattr(getattr(trainer, "datamodule", None), "batch_size", None)

    def _shape(self, families: List[Tuple[str, Any, torch.nn.Module]], planner: PlannerConfig) -> Any:
        """The first family's model shape, with the datamodule's global batch size."""
        _, adapter, module = families[0]
        batch = self._batch_size()
        if planner.name == PlannerKind.sbp and not batch:
            raise ConfigError("strategy 'atp': mesh='sbp' needs the global batch size from the datamodule "
                              "(batch_size); else pass an SBP plan")
        if not batch and self._dp_spec != "auto":
            # no global batch known, dp given: each replica runs its loader's batches; priced at 4 sequences a replica
            batch = 4 * int(self._dp_spec)
            self._say(f"the datamodule names no batch_size: layouts priced at a global batch of {batch}")
        return adapter.shape(module).with_step(batch_size=batch)

    def setup_environment(self) -> None:
        self._set_threads()
        self._setup_distributed()  # type: ignore[attr-defined]
        self.mesh_shape = self._resolve_mesh(self.world_size)  # type: ignore[attr-defined]
        self._device_mesh = init_mesh(self.mesh_shape, device_type=self.root_device.type)  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        module._device_mesh = self._device_mesh
        trainer = getattr(module, "_trainer", None)
        if self.mesh_shape[0] == 1 and trainer is not None:
            # one replica: no sampler injection, so a DataLoader keeps its single-device order
            trainer._accelerator_connector.use_distributed_sampler = False

    @property
    def comm(self) -> Comm:
        return comm_for(self.device_mesh)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        dp = self.device_mesh[Axis.dp.value]  # type: ignore[attr-defined]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def process_dataloader(self, dataloader: Any) -> Any:
        """One replica: a shuffling loader gets ``DistributedSampler(num_replicas=1)``
        (seed 0, epoch-aware), so every tensor-parallel rank draws the same order."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        if (self.mesh_shape and self.mesh_shape[0] == 1 and isinstance(dataloader, DataLoader)
                and isinstance(dataloader.sampler, RandomSampler) and dataloader.batch_sampler is not None):
            sampler = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
                              num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                              pin_memory=dataloader.pin_memory, drop_last=dataloader.drop_last,
                              worker_init_fn=dataloader.worker_init_fn, generator=dataloader.generator,
                              persistent_workers=dataloader.persistent_workers)
        return dataloader

    # ------------------------------------------------------------------ build
    def _lightning_base(self) -> type:
        return next(c for c in type(self).__mro__ if c.__name__ == "ModelParallelStrategy")

    def _layout(self, module: torch.nn.Module) -> Dict[str, str]:
        if _is_sbp(self._mesh_spec):
            from atp_pipeline.parallel.sbp_exec import plan_mesh

            layout = getattr(self._mesh_spec, "layout", self._mesh_spec)
            families = self._families()
            if not families:
                raise ConfigError(f"strategy 'atp': an SBP plan runs on a model of a known family; "
                                  f"{type(module).__name__} has none")
            mesh = plan_mesh(layout, self.root_device.type)  # type: ignore[attr-defined]
            done = {}
            for name, adapter, sub in families:
                replaced = adapter.apply_sbp(sub, layout, mesh)
                parent_name, _, attr = name.rpartition(".")
                if not name:
                    raise ConfigError("strategy 'atp': an SBP plan cannot replace the LightningModule itself")
                setattr(module.get_submodule(parent_name) if parent_name else module, attr, replaced)
                done[name] = "sbp"
            return done
        adapters()  # the families' styles (e.g. "block") are registered before a plan names them
        plan: Dict[str, Any] = dict(self._user_plan() or {})
        if not plan:
            for name, adapter, sub in self._families():
                plan.update(prefixed(name, adapter.parallel_plan(sub)))
        if not plan:
            d = self.mesh_shape
            if d is not None and d[1] * d[2] > 1:
                self._say(f"no parallel plan and no model adapter for {type(module).__name__}: its modules stay "
                          f"whole, replicated over the {d[1] * d[2]} tensor-parallel ranks (mesh dp x d1 x d2 = "
                          f"{d[0]} x {d[1]} x {d[2]})")
            return {}
        return apply_plan(module, plan, self.device_mesh, self._chunks)  # type: ignore[attr-defined]

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        device = self.root_device  # type: ignore[attr-defined]
        meta = has_meta(module)
        if not meta:  # replicas start from rank 0's values (DDP), whatever each rank's RNG did
            broadcast_replicated(module, device)
        self.applied_plan = self._layout(module)
        sources = [(sub, r) for _, adapter, sub in self._families() if (r := adapter.weights(sub)) is not None]
        if meta:
            materialize(module, device, loaded=[sub for sub, _ in sources])
        for sub, read in sources:  # a family's checkpoint: each rank reads only its shards
            load_dense(sub, read)
        if self.fsdp and not is_sharded(module):  # sharded data parallelism: FSDP2 over dp, after the TP layout
            units = shard_data_parallel(module, self.device_mesh, comm=self.comm)  # type: ignore[attr-defined]
            self._say(f"FSDP over dp={self.mesh_shape[0]}: {len(units)} units "  # type: ignore[index]
                      f"({len(units) - 1} blocks + root); parameters, gradients and optimizer state sharded")
        # Lightning's Strategy.setup: precision, device, optimizers (ModelParallelStrategy's own
        # would insist on configure_model and re-materialize).
        super(self._lightning_base(), self).setup(trainer)  # type: ignore[misc]
        fitting = trainer.state.fn == "fit"
        dp = self.device_mesh[Axis.dp.value]  # type: ignore[attr-defined]
        if fitting and self._sync is None and dp.size() > 1 and not self.fsdp:  # FSDP reduce-scatters itself
            self._sync = self._grad_sync(dp)
        self._training = fitting
        if self._decided is None:  # a user's Trainer (train.py reports its resolved run itself)
            self._say(self.layout_line())

    def layout_line(self) -> str:
        """What this strategy realized, in one line: the mesh and where it came from, dp, FSDP,
        the plan applied (styles and how many modules each), the threads per process."""
        dp, d1, d2 = self.mesh_shape or (1, 1, 1)
        spec = self._mesh_spec
        source = ("an SBP plan" if _is_sbp(spec) else "given" if isinstance(spec, tuple) or hasattr(spec, "mesh_shape")
                  else "ATP's planner" if spec in ("auto", None) and self._families() else f"'{spec}'")
        styles = Counter(str(v).partition("(")[0] for v in self.applied_plan.values())
        plan = (f"plan: {len(self.applied_plan)} modules laid out ("
                + ", ".join(f"{n} {style}" for style, n in styles.most_common()) + ")"
                if self.applied_plan else "plan: none (modules whole)")
        agg = "" if self.aggregation == "ring" or dp == 1 else f", aggregation {self.aggregation}"
        threads = f"; {self._threads}" if self._threads else ""
        return (f"mesh dp x d1 x d2 = {dp} x {d1} x {d2} ({source}), dp={dp}, FSDP "
                f"{'on' if self.fsdp else 'off'}{agg}, {plan}{threads}")

    def _grad_sync(self, dp_mesh: Any) -> GradSync:
        if self.aggregation == "ring":
            return RingSync(self.comm)
        from atp_pipeline.ina.live.services import Services
        from atp_pipeline.ina.live.sync import ATPSync

        svc = Services.from_dict(dict(self._services)) if self._services is not None else None
        return ATPSync.setup(dp_mesh.get_group(), self.aggregation_config, svc)

    # ------------------------------------------------------------------ data-parallel sync
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Average every gradient across the data-parallel dimension (one flat bucket)."""
        if self._sync is not None:
            sync_gradients(self.lightning_module.parameters(), self._sync)  # type: ignore[attr-defined]

    def aggregation_metrics(self) -> Dict[str, float]:
        """The gradient sync's counters since the last call (empty for ``ring``); global
        rank 0 adds the run-wide fractions aggregated in the switch and sent to the PS."""
        if self._sync is None:
            return {}
        return self._sync.step_metrics(with_roles=self.global_rank == 0)  # type: ignore[attr-defined]

    def on_exception(self, exception: BaseException) -> None:
        """A rank that fails while training closes its process groups at once: a peer blocked
        in a collective with it then fails with gloo's "Connection closed by peer" instead of
        waiting forever (after a peer died, the survivors otherwise sat in mismatched
        collectives, e.g. one in Lightning's per-step broadcast and another in its logging's
        all-reduce). A refusal (:class:`ConfigError`, every rank alike, before any step) keeps
        them: the user may catch it and fit again on the same processes."""
        self._failed = True
        super().on_exception(exception)  # type: ignore[misc]
        dist = torch.distributed
        if (self._training and not isinstance(exception, ConfigError) and dist.is_available()
                and dist.is_initialized() and dist.get_world_size() > 1):
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already torn down; the original error is what counts
                pass

    def teardown(self) -> None:
        """Close the gradient sync: after a barrier on success (no rank still collecting its
        last packets), at once on failure; roles this run started are stopped."""
        if self._sync is not None:
            sync, self._sync = self._sync, None
            ok = not self._failed
            if ok and not isinstance(sync, RingSync):
                try:
                    torch.distributed.barrier()
                except Exception:  # noqa: BLE001 - a peer that failed meanwhile
                    ok = False
            sync.close(ok=ok)
            self.atp_jobs = getattr(sync, "jobs", None)
            self.atp_freed_at_teardown = getattr(sync, "freed_at_teardown", None)
        super().teardown()  # type: ignore[misc]


def aggregation_config(spec: Union[str, AggregationConfig, Mapping[str, Any]]) -> AggregationConfig:
    """``"ring"``/``"atp"``/``"ps"``, a mapping of :class:`AggregationConfig` fields, or one."""
    if isinstance(spec, AggregationConfig):
        cfg = spec
    elif isinstance(spec, str):
        cfg = AggregationConfig(mode=_mode(spec))
    else:
        d = dict(spec)
        unknown = set(d) - set(AggregationConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"strategy 'atp': unknown aggregation option(s) {sorted(unknown)}")
        d["mode"] = _mode(d.get("mode", "ring"))
        cfg = AggregationConfig(**d)
    return cfg


def _mode(value: Any) -> AggregationMode:
    try:
        return AggregationMode(getattr(value, "value", value))
    except ValueError:
        raise ConfigError(f"strategy 'atp': aggregation must be one of "
                          f"{[m.value for m in AggregationMode]}, got {value!r}") from None
