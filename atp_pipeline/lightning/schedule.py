"""Learning-rate schedules of ``train.py`` (``trainer.lr_schedule``), stepped once per optimizer step.

A linear warmup over ``warmup_steps`` (from ``lr / warmup_steps`` to ``lr``), then ``constant``,
``cosine`` (half a cosine from ``lr`` down to ``min_lr`` at ``max_steps``) or ``linear`` (a straight
line down to ``min_lr``) — the shapes of nanoGPT, torchtitan and Megatron. The factor depends on the
step alone, so every rank and every layout applies the same learning rate, and a resumed run
continues it (Lightning saves the scheduler's step in the checkpoint).
"""

from __future__ import annotations

import math
from typing import Any


def lr_factor(step: int, schedule: str, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based); ``schedule``
    one of :data:`~atp_pipeline.config.schema.LR_SCHEDULES`; ``min_ratio`` is ``min_lr / lr``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


def scheduler(optimizer: Any, schedule: str, warmup_steps: int, max_steps: int, lr: float, min_lr: float) -> Any:
    """A per-step ``LambdaLR`` of :func:`lr_factor` for ``optimizer``, as Lightning's
    ``configure_optimizers`` returns it (``interval="step"``)."""
    from torch.optim.lr_scheduler import LambdaLR

    ratio = min_lr / lr if lr > 0 else 0.0
    return {"scheduler": LambdaLR(optimizer, lambda s: lr_factor(s, schedule, warmup_steps, max_steps, ratio)),
            "interval": "step", "frequency": 1}
