"""``ATPStrategy``: Lightning's strategy ``"atp"`` — realizes a plan on real processes.

It only orchestrates: the mesh comes from :mod:`atp_pipeline.parallel.mesh` (sized by the
planner, a fixed mesh or Megatron's), the layers are wrapped by the declarative parallel
plan (:mod:`atp_pipeline.parallel.plan`), and gradients are synchronized across the
data-parallel dimension here. Pitfalls it handles (see ../shared/NOTES.md):

* Lightning resolves ``strategy="atp"`` from a registry filled at import time: importing
  :mod:`atp_pipeline` registers it (pytorch_lightning's registry, and lightning.pytorch's
  when that package is installed).
* Tensor parallelism alone leaves data-parallel replicas unsynchronized, and the stock DDP
  strategy registers communication hooks only on CUDA: this strategy all-reduces the
  gradients of every replica in :meth:`post_backward`, on CPU and GPU alike, through the
  counted :class:`~atp_pipeline.parallel.comm.Comm` (one flat bucket per step).
* The popen launcher re-executes ``sys.argv``; ``train.py`` therefore starts its worker
  processes itself and presents them to Lightning as externally created (torchrun's
  environment variables), so a Hydra multirun never re-runs its sweep in a child.

Built on ``ModelParallelStrategy`` for its process-group setup and its sharded
(``torch.distributed.checkpoint``) checkpoints of DTensor models and optimizers.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.strategies.model_parallel import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from atp_pipeline.config.schema import (GPT_PARALLEL_PLAN, AggregationConfig, AggregationMode, MeshConfig, MeshStrategy,
                                        ModelConfig, PlannerConfig)
from atp_pipeline.errors import ConfigError
from atp_pipeline.models.gpt import GPT
from atp_pipeline.parallel.comm import Comm, comm_for
from atp_pipeline.parallel.mesh import init_mesh
from atp_pipeline.parallel.plan import apply_parallel_plan

MeshSpec = Union[str, Tuple[int, int], Any, None]  # Any: an atp_pipeline.parallel.sbp_exec.SBPPlan


def _base(strategy: Any) -> type:
    """The ModelParallelStrategy this class derives from (pytorch_lightning's or lightning's)."""
    return next(c for c in type(strategy).__mro__ if c.__name__ == "ModelParallelStrategy")


def default_plan(root: torch.nn.Module) -> Dict[str, str]:
    """The built-in GPT's plan, prefixed with where the GPT sits in ``root``."""
    plan: Dict[str, str] = {}
    for name, module in root.named_modules():
        if isinstance(module, GPT):
            prefix = f"{name}." if name else ""
            plan.update({prefix + k: v.value for k, v in GPT_PARALLEL_PLAN.items()})
    if not plan:
        raise ConfigError(f"strategy 'atp': {type(root).__name__} has no built-in GPT; give a parallel "
                          f"plan (ATPStrategy(plan=...) or a `parallel_plan` attribute)")
    return plan


def _is_sbp_plan(spec: Any) -> bool:
    from atp_pipeline.parallel.sbp_exec import SBPPlan

    return isinstance(spec, SBPPlan)


def parse_mesh(spec: MeshSpec) -> MeshSpec:
    if isinstance(spec, str) and "x" in spec:
        d1, _, d2 = spec.partition("x")
        return int(d1), int(d2)
    return spec


class ATPStrategy(ModelParallelStrategy):
    """Adaptive tensor parallelism on a (dp, d1, d2) mesh.

    Args:
        mesh: ``(d1, d2)`` (or ``"2x2"``), ``"megatron"`` for ``(N/dp, 1)``, or ``"auto"``
            (default) for the ATP planner's choice on ``topology`` (this host's ``local``
            topology when none is given).
        dp: data-parallel size, or ``"auto"`` (whatever the world leaves over the mesh).
        chunks: chunk-based overlap inside each transformer block (§4.1).
        plan: module-name pattern -> style; default: the module's ``parallel_plan``
            attribute, else the built-in GPT's plan wherever a GPT sits in the module.
        topology: a topology config (dict/DictConfig) for ``mesh="auto"``.
        aggregation: data-parallel gradient sync: ``"ring"`` (torch.distributed all-reduce),
            ``"atp"`` (in-network aggregation through the live backend: the switch emulator
            and parameter server are started by global rank 0, or given by ``services``),
            ``"ps"`` (the same stack with a switch without aggregators), or an
            :class:`~atp_pipeline.config.schema.AggregationConfig` (or mapping) with the
            backend's knobs (payload size, aggregators, injected loss, a shared switch...).
        services: the running ATP roles (``Services.to_dict()``), e.g. started by the
            launching process so that it outlives the workers; default: start them.
    """

    strategy_name = "atp"

    def __init__(self, mesh: MeshSpec = "auto", dp: Union[int, str] = "auto", chunks: int = 1,
                 plan: Optional[Mapping[str, str]] = None, topology: Any = None,
                 aggregation: Union[str, AggregationConfig, Mapping[str, Any]] = "ring",
                 services: Optional[Mapping[str, Any]] = None, save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout) -> None:
        _base(self).__init__(self, data_parallel_size=1, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.aggregation_config = aggregation_config(aggregation)
        if chunks < 1:
            raise ConfigError(f"strategy 'atp': chunks must be >= 1, got {chunks}")
        self._mesh_spec, self._dp_spec, self._chunks = parse_mesh(mesh), dp, chunks
        self._plan, self._topology = plan, topology
        self.aggregation = self.aggregation_config.mode.value
        self._services, self._atp, self._failed = services, None, False
        self.mesh_shape: Optional[Tuple[int, int, int]] = None
        self.applied_plan: Dict[str, str] = {}

    # ------------------------------------------------------------------ mesh
    def _resolve_mesh(self, world: int) -> Tuple[int, int, int]:
        spec, dp = self._mesh_spec, self._dp_spec
        if spec == "sbp" or _is_sbp_plan(spec):
            return self._sbp_mesh(world)
        if isinstance(spec, tuple):
            d1, d2 = spec
            if dp == "auto":
                if world % (d1 * d2):
                    raise ConfigError(f"strategy 'atp': mesh {d1}x{d2} does not divide the {world} processes")
                dp = world // (d1 * d2)
            return int(dp), d1, d2
        dp = 1 if dp == "auto" else int(dp)
        if world % dp:
            raise ConfigError(f"strategy 'atp': dp={dp} does not divide the {world} processes")
        tp = world // dp
        if spec == "megatron":
            return dp, tp, 1
        if spec in ("auto", None):
            return (dp, *self._planned_mesh(tp))
        raise ConfigError(f"strategy 'atp': mesh must be (d1, d2), 'd1xd2', 'megatron' or 'auto', got {spec!r}")

    def _planned_mesh(self, tp: int) -> Tuple[int, int]:
        from atp_pipeline.planning.flops import ModelSummary
        from atp_pipeline.planning.search import make_plan
        from atp_pipeline.topology.builders import switched
        from atp_pipeline.topology.model import Topology

        gpts = [m for m in self.lightning_module.modules() if isinstance(m, GPT)]
        if not gpts:
            return tp, 1
        c = gpts[0].cfg
        topo = Topology.from_config(self._topology) if self._topology is not None else \
            Topology.from_config(switched(tp, 1.0, name="local", unit="process"))
        if topo.world_size != tp:
            topo = topo.restrict(tp)
        summary = ModelSummary.of(ModelConfig(name="model", hidden=c.hidden, heads=c.heads, layers=c.layers,
                                              seq_len=c.seq_len, batch_size=1, vocab_size=c.vocab_size,
                                              ffn_mult=c.ffn_mult))
        return make_plan(topo, summary, MeshConfig(strategy=MeshStrategy.auto), PlannerConfig()).selected

    def _sbp_mesh(self, world: int) -> Tuple[int, int, int]:
        """``mesh="sbp"`` (planned here on this host's ``local`` topology, or ``topology``)
        or an :class:`~atp_pipeline.parallel.sbp_exec.SBPPlan`: every rank loads the whole
        batch (the plan splits rows itself), so the bookkeeping mesh is ``(1, world, 1)``."""
        if self._dp_spec not in ("auto", 1) or self._chunks != 1:
            raise ConfigError("strategy 'atp': an SBP plan includes data parallelism and has no chunk overlap; "
                              "leave dp='auto' and chunks=1")
        if self._mesh_spec == "sbp":
            self._mesh_spec = self._planned_sbp(world)
        if self._mesh_spec.devices != world:
            raise ConfigError(f"strategy 'atp': the SBP plan is for {self._mesh_spec.devices} devices, "
                              f"not the {world} processes")
        return 1, world, 1

    def _planned_sbp(self, world: int) -> Any:
        from atp_pipeline.config.schema import SBPConfig
        from atp_pipeline.planning.flops import ModelSummary
        from atp_pipeline.planning.sbp.report import plan_sbp
        from atp_pipeline.topology.builders import switched
        from atp_pipeline.topology.model import Topology

        gpts = [m for m in self.lightning_module.modules() if isinstance(m, GPT)]
        trainer = self.lightning_module.trainer
        batch = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
        if not gpts or not batch:
            raise ConfigError("strategy 'atp': mesh='sbp' plans a built-in GPT and needs the global batch "
                              "size from the datamodule (batch_size); else pass an SBPPlan")
        c = gpts[0].cfg
        topo = Topology.from_config(self._topology) if self._topology is not None else \
            Topology.from_config(switched(world, 1.0, name="local", unit="process"))
        summary = ModelSummary.of(ModelConfig(name="model", hidden=c.hidden, heads=c.heads, layers=c.layers,
                                              seq_len=c.seq_len, batch_size=int(batch), vocab_size=c.vocab_size,
                                              ffn_mult=c.ffn_mult))
        return plan_sbp(topo, summary, SBPConfig(), devices=world).exec_plan

    def setup_environment(self) -> None:
        self._setup_distributed()
        self.mesh_shape = self._resolve_mesh(self.world_size)
        self._device_mesh = init_mesh(self.mesh_shape, device_type=self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def comm(self) -> Comm:
        return comm_for(self.device_mesh)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    # ------------------------------------------------------------------ build
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if _is_sbp_plan(self._mesh_spec):  # AutoDDL plan, executed with DTensor
            from atp_pipeline.parallel.sbp_exec import apply_sbp, plan_mesh

            sbp_mesh = plan_mesh(self._mesh_spec, self.root_device.type)
            self.applied_plan = {n: "sbp" for n in apply_sbp(module, self._mesh_spec, sbp_mesh)}
        else:
            plan = self._plan or getattr(module, "parallel_plan", None) or default_plan(module)
            self.applied_plan = apply_parallel_plan(module, dict(plan), self.device_mesh, self._chunks)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == "fit"  # TrainerFn is a str enum in both Lightning packages
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if fitting and self._atp is None and self.aggregation != "ring" and self.device_mesh["dp"].size() > 1:
            from atp_pipeline.ina.live.services import Services
            from atp_pipeline.ina.live.sync import ATPSync

            svc = Services.from_dict(dict(self._services)) if self._services is not None else None
            self._atp = ATPSync.setup(self.device_mesh["dp"].get_group(), self.aggregation_config, svc)

    # ------------------------------------------------------------------ data-parallel sync
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Average every gradient across the data-parallel dimension, one flat bucket: by
        the counted all-reduce (``ring``) or through the ATP job of this rank's
        data-parallel group (``atp``/``ps``)."""
        comm = self.comm
        dp = comm.size("dp")
        if dp == 1:
            return
        with torch.no_grad():
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                     for p in self.lightning_module.parameters() if p.grad is not None]
            if not grads:
                return
            flat = torch._utils._flatten_dense_tensors(grads)
            if self._atp is not None:
                self._atp.all_reduce_mean_(flat)
            else:
                comm.all_reduce(flat, "dp")
                flat.div_(dp)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)


    def aggregation_metrics(self) -> Dict[str, float]:
        """The ATP backend's counters since the last call (empty for ``ring``); global rank
        0 adds the run-wide fractions aggregated in the switch and falling back to the PS."""
        if self._atp is None:
            return {}
        return self._atp.step_metrics(with_roles=self.global_rank == 0)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Tear the ATP job down: after a barrier on success (no rank still collecting its
        last parameter packets), at once on failure; roles this run started are stopped."""
        if self._atp is not None:
            atp, self._atp = self._atp, None
            ok = not self._failed
            if ok:
                try:
                    torch.distributed.barrier()
                except Exception:  # noqa: BLE001 - a peer that failed meanwhile
                    ok = False
            atp.close(ok=ok)
            self.atp_jobs, self.atp_freed_at_teardown = atp.jobs, atp.freed_at_teardown
        super().teardown()


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
    if cfg.mode == AggregationMode.switchml:
        raise ConfigError("strategy 'atp': aggregation 'switchml' runs in the simulator only "
                          "(python -m atp_pipeline.ina.experiments); live modes: ring, atp, ps")
    return cfg


def _mode(value: Any) -> AggregationMode:
    try:
        return AggregationMode(getattr(value, "value", value))
    except ValueError:
        raise ConfigError(f"strategy 'atp': aggregation must be one of "
                          f"{[m.value for m in AggregationMode]}, got {value!r}") from None


def register() -> None:
    """Register ``"atp"`` in pytorch_lightning's registry (and lightning.pytorch's if present)."""
    from pytorch_lightning.strategies import StrategyRegistry

    StrategyRegistry.register("atp", ATPStrategy, description="ATP adaptive tensor parallelism "
                              "(atp_pipeline)", override=True)
    try:  # the unified `lightning` package keeps a separate registry and class hierarchy
        import lightning.pytorch as lp  # type: ignore[import-not-found]
    except ImportError:
        return
    unified = type("ATPStrategy", (lp.strategies.ModelParallelStrategy,),
                   {k: v for k, v in ATPStrategy.__dict__.items() if k not in ("__dict__", "__weakref__")})
    lp.strategies.StrategyRegistry.register("atp", unified, description="ATP adaptive tensor parallelism "
                                            "(atp_pipeline)", override=True)
