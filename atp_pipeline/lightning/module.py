"""``LMModule``: a LightningModule for any causal LM (no parallelism here).

``model(idx, targets)`` must return the mean cross-entropy (a tensor, or an output object
with ``.loss``), unless ``loss`` says how to call it (a model family's ``lm_loss``). The model
is given built, or as a factory called under ``seed`` so every rank builds the same initial weights.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import nn

ModelOrFactory = Union[nn.Module, Callable[[], nn.Module]]


class LMModuleMixin:
    """A causal LM trained with AdamW (``lr``, ``weight_decay``) under a learning-rate schedule
    (``lr_schedule``, ``warmup_steps``, ``min_lr`` over ``max_steps``:
    :mod:`atp_pipeline.lightning.schedule`); logs ``loss`` and ``lr`` every step."""

    def __init__(self, model: ModelOrFactory, lr: float = 3e-3, weight_decay: float = 0.0, seed: int = 0,
                 loss: Optional[Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]] = None,
                 lr_schedule: str = "constant", warmup_steps: int = 0, min_lr: float = 0.0,
                 max_steps: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "loss"])  # type: ignore[attr-defined]
        self._loss = loss
        if not isinstance(model, nn.Module):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model = model()
        self.model = model

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        out = self._loss(self.model, idx, targets) if self._loss else self.model(idx, targets)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        self.log("loss", loss, prog_bar=True, on_step=True, on_epoch=False, sync_dist=True)  # type: ignore[attr-defined]
        hp = self.hparams  # type: ignore[attr-defined]
        if hp.get("lr_schedule", "constant") != "constant" or hp.get("warmup_steps", 0):
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]  # type: ignore[attr-defined]
            self.log("lr", float(lr), on_step=True, on_epoch=False)  # type: ignore[attr-defined]
        return loss

    def configure_optimizers(self) -> Any:
        hp = self.hparams  # type: ignore[attr-defined]
        opt = adamw(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)  # type: ignore[attr-defined]
        schedule, warmup = hp.get("lr_schedule", "constant"), hp.get("warmup_steps", 0)
        if schedule == "constant" and not warmup:
            return opt
        from atp_pipeline.lightning.schedule import scheduler

        return {"optimizer": opt, "lr_scheduler": scheduler(opt, schedule, warmup, hp.get("max_steps", 0), hp.lr,
                                                            hp.get("min_lr", 0.0))}


def adamw(params: Any, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer training runs (also what the compute calibration times and the step
    validation steps with): AdamW with ``foreach=True`` (one kernel per op for all tensors of a
    group) whose kernels update DTensor parameters' local shards
    (:class:`~atp_pipeline.parallel.optim.LocalShardAdamW`: the same numbers as DTensor
    dispatch, without its sharding propagation).

    DTensor and plain parameters (an HF model's replicated norms beside its parallel layers)
    go into one group each, as the DTensor path needed (a foreach kernel refused the mix), so
    checkpoints keep their groups; the update of each parameter is unchanged."""
    from atp_pipeline.parallel.optim import LocalShardAdamW

    params = list(params)
    if params and isinstance(params[0], dict):
        return LocalShardAdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    from torch.distributed.tensor import DTensor

    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return LocalShardAdamW([{"params": g} for g in groups if g] or params, lr=lr, weight_decay=weight_decay,
                           foreach=True)
