"""Per-step training metrics from the runtime's counters (§5's achieved TFLOP/s)."""

from __future__ import annotations

import time
from typing import Any, Dict

AXES = ("dp", "d1", "d2")


class StepMetricsMixin:
    """Logs, every step: step time, tokens/s, achieved TFLOP/s per device (the model's FLOPs
    per step by the paper's §5 formula over step time and device count), and the bytes and
    blocked time of the collectives on each mesh dimension (the strategy's Comm counters),
    this rank's bytes of parameters, gradients and optimizer state (before the update;
    optimizer state exists from the second step on), and with ``aggregation=atp``/``ps``
    the backend's sync time, GB/s per worker, packets, retransmissions, window and the
    fractions aggregated in the switch / sent to the PS.
    """

    def __init__(self, flops_per_step: float, tokens_per_step: int) -> None:
        self.flops_per_step, self.tokens_per_step = flops_per_step, tokens_per_step
        self._t0 = 0.0
        self.last: Dict[str, float] = {}
        self.state: Dict[str, float] = {}  # this rank's parameter/gradient/optimizer bytes

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """This rank's bytes of parameters, gradients and optimizer state just before the
        update (what sharded data parallelism divides over the replicas). Measured on the
        first two steps of a fit only: after its first update an optimizer holds all the
        state it will hold, so the sizes are fixed (and walking every tensor each step would
        cost the hot path a Python call per tensor)."""
        from atp_pipeline.parallel.fsdp import state_bytes

        if self.state and trainer.global_step >= 2:
            return

        params, grads, opt = state_bytes(pl_module, optimizer)
        self.state = {"param_bytes": float(params), "grad_bytes": float(grads), "optimizer_bytes": float(opt)}

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
        m.update(self.state)
        metrics = getattr(trainer.strategy, "aggregation_metrics", None)
        if metrics is not None:
            m.update(metrics())  # the ATP backend's per-step counters (sync time, switch share...)
        self.last = m
        pl_module.log_dict(m, on_step=True, on_epoch=False, rank_zero_only=True)
