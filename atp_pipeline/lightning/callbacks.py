"""Per-step training metrics from the runtime's counters (§5's achieved TFLOP/s)."""

from __future__ import annotations

import time
from typing import Any, Dict


AXES = ("dp", "d1", "d2")


class StepMetricsMixin:
    """Logs, every step: step time, tokens/s, achieved TFLOP/s per device (the model's FLOPs
    per step by the paper's §5 formula over step time and device count), and the bytes and
    blocked time of the collectives on each mesh dimension (the strategy's Comm counters),
    and with ``aggregation=atp``/``ps`` the backend's sync time, GB/s per worker, packets,
    retransmissions, window and the fractions aggregated in the switch / sent to the PS.
    """

    def __init__(self, flops_per_step: float, tokens_per_step: int) -> None:
        self.flops_per_step, self.tokens_per_step = flops_per_step, tokens_per_step
        self._t0 = 0.0
        self.last: Dict[str, float] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        comm = getattr(trainer.strategy, "comm", None)
        if comm is not None:
            comm.stats.reset()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        dt = time.perf_counter() - self._t0
        m: Dict[str, float] = {
            "step_time_s": dt,
            "tokens_per_s": self.tokens_per_step / dt,
            "tflops_per_device": self.flops_per_step / dt / max(trainer.world_size, 1) / 1e12,
        }
        comm = getattr(trainer.strategy, "comm", None)
        if comm is not None:
            by_axis = comm.stats.by_axis()
            for axis in AXES:
                c = by_axis.get(axis)
                m[f"comm_{axis}_bytes"] = float(c.bytes) if c else 0.0
                m[f"comm_{axis}_wait_s"] = c.wait_s if c else 0.0
        metrics = getattr(trainer.strategy, "aggregation_metrics", None)
        if metrics is not None:
            m.update(metrics())  # the ATP backend's per-step counters (sync time, switch share...)
        self.last = m
        pl_module.log_dict(m, on_step=True, on_epoch=False, rank_zero_only=True)
