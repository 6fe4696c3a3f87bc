"""``ATPStrategy``: Lightning's strategy ``"atp"`` — realizes a plan on real processes.

It only orchestrates (Lightning's ``ModelParallelStrategy`` is its base, for process
groups and sharded ``torch.distributed.checkpoint`` checkpoints):

1. **mesh** (``setup_environment``): ``(dp, d1, d2)`` from ``mesh`` — a fixed ``(d1, d2)``,
   ``"megatron"``, a plan result (:class:`~atp_pipeline.planning.interface.PlanResult`:
   ATP's mesh or an SBP plan), or ``"auto"``: ATP's planner run on the model's shape, which
   the model's family adapter (:mod:`atp_pipeline.models.adapter`) gives;
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
   (:mod:`atp_pipeline.parallel.fsdp`), whose reduce-scatter averages the gradients.

With no plan and no adapter, the model stays whole: replicated over the tensor-parallel
ranks, data parallel over the rest (``mesh="auto"`` then uses every device for data
parallelism), and the strategy says so in one line. Data: with one data-parallel replica
a user's DataLoader keeps its single-device order (Lightning would inject a shuffling
``DistributedSampler``, ../shared/NOTES.md); a shuffling loader gets a sampler seeded alike
on every rank; with ``dp > 1`` Lightning's DDP behaviour applies (a ``DistributedSampler``
the loader already has — the data modules' ``RunSampler`` — is kept, sized by
:attr:`distributed_sampler_kwargs`: the replica's rank on the ``dp`` axis).

Pitfalls handled (../shared/NOTES.md): ``pytorch_lightning`` and ``lightning.pytorch`` are
separate hierarchies — this mixin is joined with each in :mod:`.flavor`; the stock DDP
strategy registers communication hooks only on CUDA — the sync here runs on CPU and GPU.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from atp_pipeline.config.schema import (AggregationConfig, AggregationMode, MeshConfig, MeshStrategy,
                                        PlannerConfig)
from atp_pipeline.errors import ConfigError
from atp_pipeline.models.adapter import adapters, find_adapters, prefixed
from atp_pipeline.parallel.apply import apply_plan
from atp_pipeline.parallel.comm import Comm, comm_for
from atp_pipeline.parallel.grad_sync import GradSync, RingSync, sync_gradients
from atp_pipeline.parallel.dense import load_dense
from atp_pipeline.parallel.fsdp import is_sharded, shard_data_parallel
from atp_pipeline.parallel.materialize import broadcast_replicated, has_meta, materialize
from atp_pipeline.parallel.mesh import Axis, init_mesh
from atp_pipeline.planning.interface import PlanResult

MeshSpec = Union[str, Tuple[int, int], PlanResult, Any, None]
Mesh3 = Tuple[int, int, int]


def parse_mesh(spec: MeshSpec) -> MeshSpec:
    if isinstance(spec, str) and "x" in spec:
        d1, _, d2 = spec.partition("x")
        return int(d1), int(d2)
    if isinstance(spec, list):
        return tuple(spec)
    return spec


def _is_sbp(spec: Any) -> bool:
    return getattr(spec, "kind", None) == "sbp" or type(spec).__name__ == "SBPLayout"


class ATPStrategyMixin:
    """Adaptive tensor parallelism on a (dp, d1, d2) mesh.

    Args:
        mesh: ``(d1, d2)`` (or ``"2x2"``), ``"megatron"`` for ``(N/dp, 1)``, ``"auto"``
            (default: the ATP planner's choice for the model's shape on ``topology``, this
            host's ``local`` topology when none is given), ``"sbp"`` (the SBP planner), or a
            plan result (``MeshPlan``, ``SBPPlan``) / an ``SBPLayout``.
        dp: data-parallel size, or ``"auto"`` (whatever the world leaves over the mesh).
        chunks: chunk-based overlap inside each transformer block (§4.1).
        plan: module-name pattern -> style (names or :class:`ParallelStyle` objects);
            default: the module's ``parallel_plan`` attribute, else its families' plans.
        topology: a topology config (dict/DictConfig) for ``mesh="auto"``/``"sbp"``.
        aggregation: ``"ring"``, ``"atp"``, ``"ps"``, or an ``AggregationConfig`` (mapping).
        services: the running ATP roles (``Services.to_dict()``); default: start them.
        fsdp: shard parameters, gradients and optimizer state over the data-parallel
            replicas with FSDP2, composed with the (d1, d2) tensor parallelism
            (:mod:`atp_pipeline.parallel.fsdp`); needs dp > 1 and ``aggregation="ring"``.
    """

    strategy_name = "atp"

    def __init__(self, mesh: MeshSpec = "auto", dp: Union[int, str] = "auto", chunks: int = 1,
                 plan: Optional[Mapping[str, Any]] = None, topology: Any = None,
                 aggregation: Union[str, AggregationConfig, Mapping[str, Any]] = "ring",
                 services: Optional[Mapping[str, Any]] = None, fsdp: bool = False,
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = timedelta(seconds=1800)) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1,  # type: ignore[call-arg]
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.aggregation_config = aggregation_config(aggregation)
        if chunks < 1:
            raise ConfigError(f"strategy 'atp': chunks must be >= 1, got {chunks}")
        self._mesh_spec, self._dp_spec, self._chunks = parse_mesh(mesh), dp, chunks
        self._plan, self._topology = plan, topology
        self.aggregation = self.aggregation_config.mode.value
        self._services, self._sync, self._failed = services, None, False
        if fsdp and self.aggregation_config.mode != AggregationMode.ring:
            raise ConfigError(f"strategy 'atp': fsdp=True reduce-scatters gradients with torch.distributed; "
                              f"aggregation '{self.aggregation}' all-reduces whole buckets in the network and "
                              f"has no reduce-scatter: use aggregation='ring' with fsdp")
        self.fsdp = bool(fsdp)
        self._training = False  # set up and fitting: a failure now may leave peers in a collective
        self.mesh_shape: Optional[Mesh3] = None
        self.applied_plan: Dict[str, str] = {}
        self.notes: List[str] = []

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

    def _resolve_mesh(self, world: int) -> Mesh3:
        spec, dp = self._mesh_spec, self._dp_spec
        if spec == "sbp" or _is_sbp(spec):
            return self._sbp_mesh(world)
        if hasattr(spec, "mesh_shape") and getattr(spec, "kind", None) == "atp":
            spec = tuple(spec.mesh_shape)
        if isinstance(spec, tuple):
            d1, d2 = (int(x) for x in spec)
            if dp == "auto":
                if world % (d1 * d2):
                    raise ConfigError(f"strategy 'atp': mesh {d1}x{d2} does not divide the {world} processes")
                dp = world // (d1 * d2)
            if int(dp) * d1 * d2 != world:
                raise ConfigError(f"strategy 'atp': dp x d1 x d2 = {dp} x {d1} x {d2} is not the {world} processes")
            return int(dp), d1, d2
        if spec not in ("auto", "megatron", None):
            raise ConfigError(f"strategy 'atp': mesh must be (d1, d2), 'd1xd2', 'megatron', 'auto', 'sbp' or a "
                              f"plan, got {spec!r}")
        families = self._families()
        if spec in ("auto", None) and dp == "auto" and not families and not self._user_plan():
            self._say(f"no parallel plan and no model adapter for {type(self.lightning_module).__name__}: "  # type: ignore[attr-defined]
                      f"nothing to shard, so its {world} processes run data parallel")
            return world, 1, 1
        dp = 1 if dp == "auto" else int(dp)
        if dp < 1 or world % dp:
            raise ConfigError(f"strategy 'atp': dp={dp} does not divide the {world} processes")
        tp = world // dp
        if spec == "megatron":
            return dp, tp, 1
        if not families:
            self._say(f"mesh 'auto': no model adapter knows {type(self.lightning_module).__name__}, so the planner "  # type: ignore[attr-defined]
                      f"cannot cost it; using Megatron's ({tp}, 1) (give mesh=(d1, d2) to choose)")
            return dp, tp, 1
        return (dp, *self._planned_mesh(tp, families))

    def _local_topology(self, devices: int) -> Any:
        from atp_pipeline.topology.builders import switched
        from atp_pipeline.topology.model import Topology

        if self._topology is not None:
            topo = Topology.from_config(self._topology)
            return topo if topo.world_size == devices else topo.restrict(devices)
        return Topology.from_config(switched(devices, 1.0, name="local", unit="process"))

    def _batch_size(self) -> Optional[int]:
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        return getattr(getattr(trainer, "datamodule", None), "batch_size", None)

    def _planned_mesh(self, tp: int, families: List[Tuple[str, Any, torch.nn.Module]]) -> Tuple[int, int]:
        from atp_pipeline.planning.search import make_plan

        name, adapter, module = families[0]
        shape = adapter.shape(module).with_step(batch_size=self._batch_size())
        plan = make_plan(self._local_topology(tp), shape, MeshConfig(strategy=MeshStrategy.auto), PlannerConfig())
        return plan.selected

    def _sbp_mesh(self, world: int) -> Mesh3:
        """SBP plans split rows themselves: every rank loads the whole batch, so the
        bookkeeping mesh is ``(1, world, 1)``."""
        if self.fsdp:
            raise ConfigError("strategy 'atp': fsdp=True shards over the data-parallel dimension, which an SBP plan "
                              "lays out per layer itself; use a (d1, d2) mesh with dp > 1")
        if self._dp_spec not in ("auto", 1) or self._chunks != 1:
            raise ConfigError("strategy 'atp': an SBP plan includes data parallelism and has no chunk overlap; "
                              "leave dp='auto' and chunks=1")
        if self._mesh_spec == "sbp":
            self._mesh_spec = self._planned_sbp(world)
        layout = getattr(self._mesh_spec, "layout", self._mesh_spec)
        if layout.devices != world:
            raise ConfigError(f"strategy 'atp': the SBP plan is for {layout.devices} devices, not the {world} "
                              f"processes")
        return 1, world, 1

    def _planned_sbp(self, world: int) -> Any:
        from atp_pipeline.config.schema import SBPConfig
        from atp_pipeline.planning.sbp.report import plan_sbp

        families = self._families()
        batch = self._batch_size()
        if not families or not batch:
            raise ConfigError("strategy 'atp': mesh='sbp' plans a model of a known family and needs the global "
                              "batch size from the datamodule (batch_size); else pass an SBP plan")
        _, adapter, module = families[0]
        shape = adapter.shape(module).with_step(batch_size=int(batch))
        return plan_sbp(self._local_topology(world), shape, SBPConfig(), devices=world)

    def setup_environment(self) -> None:
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
