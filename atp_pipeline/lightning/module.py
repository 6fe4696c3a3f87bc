"""The built-in LightningModule: the plain GPT and its optimizer (no parallelism here)."""

from __future__ import annotations

from typing import Any, Tuple

import pytorch_lightning as pl
import torch

from atp_pipeline.models.gpt import GPT, GPTConfig


class GPTModule(pl.LightningModule):
    """A GPT trained with AdamW; every rank builds the same initial weights from ``seed``."""

    def __init__(self, cfg: GPTConfig, lr: float = 3e-3, weight_decay: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["cfg"])
        self.cfg = cfg
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.model = GPT(cfg)

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = self.model(idx, targets)
        self.log("loss", loss, prog_bar=True, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
