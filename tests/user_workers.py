"""Worker functions for tests/test_user_models.py: a user's own LightningModules under
``Trainer(strategy="atp")`` in real gloo processes (torchrun environment, several Trainers
one after another in the same processes). Each returns plain data; the test asserts."""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN, HID, OUT, N, BATCH, STEPS = 8, 32, 8, 640, 8, 20


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(N, OUT, generator=g))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def reference_losses(dp: int) -> List[float]:
    """Single process: what ``dp`` replicas fed by DDP's samplers (Lightning's
    DistributedSampler, shuffle=True, seed 0) compute together; ``dp=1``: the plain order."""
    from torch.utils.data import DistributedSampler

    ds, model = dataset(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    orders = [list(range(N))] if dp == 1 else [
        list(DistributedSampler(ds, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    per = BATCH
    out = []
    for step in range(STEPS):
        idx = [i for order in orders for i in order[step * per:(step + 1) * per]]
        x, y = ds[idx]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _pl(package: str) -> Any:
    return importlib.import_module(package)


def _module_class(package: str) -> type:
    pl = _pl(package)

    class Regressor(pl.LightningModule):
        """A user's own module: no family, no adapter."""

        def __init__(self, plan: Optional[Dict[str, str]] = None) -> None:
            super().__init__()
            self.net = mlp()
            if plan is not None:
                self.parallel_plan = plan
            self.losses: List[float] = []
            self.first_x: List[float] = []

        def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            self.first_x.append(float(x[0, 0]))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(dataset(), batch_size=BATCH, shuffle=False)

    return Regressor


def _trainer(package: str, strategy: Any, world: int, steps: int = STEPS) -> Any:
    pl = _pl(package)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _strategy(package: str, **kwargs: Any) -> Any:
    importlib.import_module(package)
    flavor = importlib.import_module("atp_pipeline.lightning.pl" if package == "pytorch_lightning"
                                     else "atp_pipeline.lightning.unified")
    return flavor.ATPStrategy(**kwargs)


def meshes_case(rank: int, world: int, package: str) -> Dict[str, Any]:
    """The MLP with a column/row plan on (2,1), (1,2), (2,2) (dp = what is left), with
    Megatron's split boundaries on (2,2), and on (2,1) with FSDP over its dp = 2 replicas;
    plain Lightning code with strategy "atp"."""
    Regressor = _module_class(package)
    out: Dict[str, Any] = {"runs": []}
    plans = {"full": {"net.0": "column", "net.2": "row"},
             "split": {"net.0": "column(output=split)", "net.2": "row(input=split)"}}
    plans["fsdp"] = plans["full"]
    for mesh, kind in (((2, 1), "full"), ((1, 2), "full"), ((2, 2), "full"), ((2, 2), "split"), ((2, 1), "fsdp")):
        module = Regressor(plans[kind])
        strategy = _strategy(package, mesh=mesh, fsdp=kind == "fsdp")
        trainer = _trainer(package, strategy, world)
        trainer.fit(module)
        sharded = [tuple(p.to_local().shape) for p in module.net.parameters() if hasattr(p, "to_local")]
        placements = [str(p.placements) for p in module.net.parameters() if hasattr(p, "placements")]
        out["runs"].append({"mesh": mesh, "kind": kind, "dims": strategy.mesh_shape,
                            "coord": list(strategy.device_mesh.get_coordinate()), "losses": module.losses,
                            "first_x": module.first_x, "applied": strategy.applied_plan, "sharded": sharded,
                            "placements": placements})
    return out


def light_case(rank: int, world: int) -> Dict[str, Any]:
    """2 processes: no plan (both Lightning packages), and a model created on the meta
    device in configure_model, materialized as shards (no rank holds a full weight)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    out: Dict[str, Any] = {}
    for package in ("pytorch_lightning", "lightning.pytorch"):
        Regressor = _module_class(package)
        module = Regressor()
        strategy = _strategy(package)
        trainer = _trainer(package, strategy, world)
        trainer.fit(module)
        out[package] = {"dims": strategy.mesh_shape, "losses": module.losses, "notes": strategy.notes,
                        "applied": strategy.applied_plan}

    import pytorch_lightning as pl

    full_shapes = {(48, 24), (24, 48)}  # the sharded layers' whole weights (out x in)

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.full: List[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            res = func(*args, **(kwargs or {}))
            for t in (res if isinstance(res, (tuple, list)) else (res,)):
                # a DTensor's shape is the global one and holds no memory: its local shard is
                # allocated by its own (plain-tensor) op, which this mode sees too
                if (isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and not t.is_meta
                        and tuple(t.shape) in full_shapes):
                    self.full.append(f"{func} -> {tuple(t.shape)}")
            return res

    class MetaNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.parallel_plan = {"fc1": "column", "fc2": "row"}

        def configure_model(self) -> None:
            with torch.device("meta"):
                self.fc1, self.fc2 = nn.Linear(24, 48), nn.Linear(48, 24)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = batch[0]
            return self.fc2(F.gelu(self.fc1(x))).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(32, 24, generator=torch.Generator().manual_seed(1))),
                              batch_size=8)

    rec = Recorder()
    module = MetaNet()
    with rec:
        _trainer("pytorch_lightning", _strategy("pytorch_lightning", mesh=(1, 2)), world, 3).fit(module)
    out["meta"] = {"full": rec.full,
                   "local": [tuple(p.to_local().shape) for p in module.parameters() if hasattr(p, "to_local")],
                   "global": [tuple(p.shape) for p in module.parameters()],
                   "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in module.parameters())}
    return out


# ---------------------------------------------------------------- a user's HF Llama: the training loop's features
# A tiny transformers Llama with grouped-query attention (8 query heads, 2 key/value heads);
# each replica's batch is LLAMA_BATCH // dp, so every layout trains on global batches of LLAMA_BATCH
# samples (with dp = 2, the union of the replicas' DistributedSampler batches).
LLAMA_BATCH, LLAMA_STEPS, ACCUMULATE, CLIP, CLIP_VALUE, LLAMA_LR = 4, 4, 2, 0.05, 0.002, 2.0
VAL_EVERY, VAL_BATCHES, WARMUP = 4, 2, 2


def llama() -> nn.Module:
    from .hf_workers import build

    return build("llama", torch.float32, num_key_value_heads=2)


def llama_data(n: int, seed: int) -> torch.Tensor:
    from .hf_workers import SEQ, VOCAB

    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def warmup_cosine(step: int) -> float:
    """LambdaLR's factor: linear warmup over WARMUP steps, then a cosine down to 0.1."""
    import math

    if step < WARMUP:
        return (step + 1) / WARMUP
    t = min(1.0, (step - WARMUP) / max(1, LLAMA_STEPS - WARMUP))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * t))


def llama_module_class(package: str) -> type:
    """A user's own LightningModule holding a transformers Llama: ``validation_step`` logging
    with ``sync_dist``, SGD with a per-step LambdaLR warmup-cosine schedule. Records each
    micro-batch's local train loss, each validation batch's local loss and, before each
    optimizer step, the global gradient norm (one process: torch's; under "atp":
    :func:`atp_pipeline.parallel.clip.grad_norm`) and largest gradient element."""
    pl = _pl(package)

    class LlamaLM(pl.LightningModule):
        def __init__(self, batch: int, order: Optional[List[int]] = None) -> None:
            super().__init__()
            self.model = llama()
            self.batch, self.order = batch, order
            self.losses: List[float] = []
            self.val_losses: List[float] = []
            self.norms: List[float] = []
            self.peaks: List[float] = []

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=x, labels=x).loss
            self.log("loss", loss, sync_dist=True)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, x: torch.Tensor, batch_idx: int) -> None:
            loss = self.model(input_ids=x, labels=x).loss
            self.log("val_loss", loss, sync_dist=True)
            self.val_losses.append(loss.item())

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            comm = getattr(self.trainer.strategy, "comm", None)
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if comm is None:
                self.norms.append(float(torch.nn.utils.get_total_norm(grads)))
                self.peaks.append(max(float(g.abs().max()) for g in grads))
            else:
                from atp_pipeline.parallel.clip import grad_norm

                self.norms.append(float(grad_norm(self.parameters(), comm)))
                from torch.distributed.tensor import DTensor

                peak = torch.tensor(max(float((g.to_local() if isinstance(g, DTensor) else g).abs().max())
                                        for g in grads))
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
                self.peaks.append(float(peak))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=LLAMA_LR)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            data = llama_data(64, 2)
            if self.order is not None:
                data = data[self.order]
            return DataLoader(data, batch_size=self.batch, shuffle=False)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(llama_data(16, 3), batch_size=self.batch, shuffle=False)

    return LlamaLM


def llama_trainer(package: str, strategy: Any, devices: int, precision: str = "32-true", clip: str = "norm") -> Any:
    pl = _pl(package)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=LLAMA_STEPS,
                      accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP if clip == "norm" else CLIP_VALUE,
                      gradient_clip_algorithm=clip, val_check_interval=VAL_EVERY,
                      limit_val_batches=VAL_BATCHES, num_sanity_val_steps=0, precision=precision, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def llama_reference(dp: int, clip: str = "norm", package: str = "pytorch_lightning") -> Dict[str, Any]:
    """The same script on one process (float32): global batches of LLAMA_BATCH in the order the
    layout's replicas see together (dp = 2: Lightning's DistributedSampler, shuffle, seed 0)."""
    from torch.utils.data import DistributedSampler

    order = None
    if dp > 1:
        per = LLAMA_BATCH // dp
        shards = [list(DistributedSampler(range(64), num_replicas=dp, rank=r, shuffle=True, seed=0))
                  for r in range(dp)]
        order = [i for k in range(len(shards[0]) // per) for s in shards for i in s[k * per:(k + 1) * per]]
    module = llama_module_class(package)(LLAMA_BATCH, order)
    trainer = llama_trainer(package, "auto", 1, clip=clip)
    trainer.fit(module)
    return {"losses": module.losses, "val_losses": module.val_losses, "norms": module.norms, "peaks": module.peaks}


class LlamaRun(NamedTuple):
    """One Trainer of the grouped launch: a layout, a precision, a clipping algorithm, a package."""

    name: str
    mesh: Tuple[int, int]
    dp: int = 1
    fsdp: bool = False
    precision: str = "32-true"
    clip: str = "norm"
    package: str = "pytorch_lightning"


#: the grouped launch's runs (the two Lightning packages in turn)
LLAMA_RUNS = (LlamaRun("2x2", (2, 2)),
              LlamaRun("1x4", (1, 4), package="lightning.pytorch"),
              LlamaRun("2x1 dp2", (2, 1), dp=2, package="lightning.pytorch"),
              LlamaRun("2x1 dp2 fsdp", (2, 1), dp=2, fsdp=True),
              LlamaRun("2x1 dp2 value", (2, 1), dp=2, clip="value"),
              LlamaRun("2x2 bf16-mixed", (2, 2), precision="bf16-mixed", package="lightning.pytorch"))


def llama_case(rank: int, world: int, runs: Tuple[LlamaRun, ...] = LLAMA_RUNS) -> Dict[str, Any]:
    """Each of ``runs`` in turn: the user's Llama module (:func:`llama_module_class`) under
    ``Trainer(strategy=ATPStrategy(mesh=..., dp=..., fsdp=...), gradient_clip_val=...,
    gradient_clip_algorithm=..., accumulate_grad_batches=2, precision=...)``."""
    out: Dict[str, Any] = {}
    for name, mesh, dp, fsdp, precision, clip, package in runs:
        module = llama_module_class(package)(LLAMA_BATCH // dp)
        strategy = _strategy(package, mesh=mesh, dp=dp, fsdp=fsdp)
        trainer = llama_trainer(package, strategy, world, precision, clip)
        trainer.fit(module)
        logged = trainer.callback_metrics.get("grad_norm")
        out[name] = {"losses": module.losses, "val_losses": module.val_losses, "norms": module.norms,
                     "peaks": module.peaks,
                     "logged_norm": None if logged is None else float(logged), "dims": strategy.mesh_shape,
                     "coord": list(strategy.device_mesh.get_coordinate()), "notes": strategy.notes,
                     "threads": torch.get_num_threads()}
    return out
