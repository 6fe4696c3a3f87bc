"""Build -> fit, in one worker process: a Lightning ``Trainer`` with ``ATPStrategy`` realizing
the resolved :class:`~atp_pipeline.run.resolve.RunSpec` (the model from its family's
adapter, the data module, per-step metrics every ``trainer.log_every_n_steps``, sharded
checkpoints)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch

from atp_pipeline.models.adapter import get_adapter
from atp_pipeline.run.resolve import RunSpec


def digest(module: torch.nn.Module) -> Dict[str, str]:
    """A short hash of every parameter's local values (replicas compare equal)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        out[name] = hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]
    return out


class _NoLightningTip(logging.Filter):
    """Drops Lightning's advertisement (``💡 Tip: ... litlogger``), nothing else it logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_lightning() -> None:
    """Silence, at their source and by their exact text, two lines Lightning prints into every run
    that say nothing about it: its logger tip, and the FutureWarning torch raises for
    Lightning's own use of ``LeafSpec`` (``pytorch_lightning/utilities/_pytree.py``). Our
    warnings and Lightning's other messages stay."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning,
                            module=r"(pytorch_lightning|lightning\.pytorch)\.utilities\._pytree")
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "lightning_fabric.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoLightningTip) for f in log.filters):
            log.addFilter(_NoLightningTip())


def progress_bar() -> Any:
    """Lightning's rich progress bar showing what a run is about: ``step n/max_steps``, loss and
    tokens/s (not an epoch count of an epoch-less run, nor the logger's version)."""
    from pytorch_lightning.callbacks import RichProgressBar

    class RunProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            return "train"

        def get_metrics(self, trainer: Any, pl_module: Any) -> Dict[str, Any]:
            shown = super().get_metrics(trainer, pl_module)
            out: Dict[str, Any] = {"step": f"{trainer.global_step}/{trainer.max_steps}"}
            if "loss" in shown:
                out["loss"] = shown["loss"]
            tps = trainer.callback_metrics.get("tokens_per_s")
            if tps is not None:
                out["tokens/s"] = f"{float(tps):.0f}"
            return out

    return RunProgressBar()


FAULT_KILL = "ATP_FAULT_KILL_RANK_AT_STEP"  # "<rank>:<step>": a test's fault, see fault_callbacks


def fault_callbacks(rank: int, out: Path) -> List[Any]:
    """Fault injection for tests of failure and recovery: with ``ATP_FAULT_KILL_RANK_AT_STEP=R:S``
    rank ``R`` kills itself (SIGKILL: no cleanup, no report) in the middle of step ``S`` (0-based;
    after its backward and gradient sync, before the optimizer step), once per run directory (a
    relaunch from a checkpoint does not die again)."""
    import os
    import signal

    from pytorch_lightning.callbacks import Callback

    spec = os.environ.get(FAULT_KILL, "")
    if not spec:
        return []
    victim, step = (int(x) for x in spec.split(":"))
    if victim != rank:
        return []
    marker = out / f".fault-kill-rank{victim}-step{step}"

    class KillAtStep(Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == step:
                try:
                    marker.touch(exist_ok=False)
                except FileExistsError:  # fired already, before a restart
                    return
                os.kill(os.getpid(), signal.SIGKILL)

    return [KillAtStep()]


def fit_worker(rank: int, world: int, spec: RunSpec, out_dir: str) -> Dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    from atp_pipeline.lightning.pl import ATPStrategy, LMModule, StepMetrics, TokenDataModule

    quiet_lightning()

    out = Path(out_dir)
    c, t = spec.config, spec.config.trainer
    dtype = torch.float64 if spec.shape.dtype == "fp64" else torch.float32
    adapter = get_adapter(c.model.family)
    module = LMModule(lambda: adapter.build(c.model), lr=t.lr, weight_decay=t.weight_decay, seed=c.seed,
                      loss=adapter.lm_loss, lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, min_lr=t.min_lr,
                      max_steps=t.max_steps).to(dtype)
    data = TokenDataModule(c.data.source.value, spec.shape.seq_len, spec.shape.batch_size, spec.shape.vocab_size,
                           seed=c.seed)
    strategy = ATPStrategy.for_run(spec)
    every = t.checkpoint_every_n_steps or t.max_steps
    ckpt = ModelCheckpoint(dirpath=out / "checkpoints", filename="step{step}", save_last=True,
                           every_n_train_steps=every, save_top_k=-1, auto_insert_metric_name=False)
    logger = CSVLogger(save_dir=str(out), name="", version="lightning_logs")
    loggers: List[Any] = [logger]
    if importlib.util.find_spec("tensorboard") is not None:  # optional
        from pytorch_lightning.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(out), name="", version="tensorboard"))
    trainer = pl.Trainer(strategy=strategy, accelerator=t.accelerator, devices=world, num_nodes=1,
                         max_steps=t.max_steps, logger=loggers, log_every_n_steps=t.log_every_n_steps,
                         callbacks=[StepMetrics(spec.shape.flops_per_step, spec.shape.tokens_per_step), ckpt]
                         + ([progress_bar()] if t.progress_bar else []) + fault_callbacks(rank, out),
                         enable_progress_bar=t.progress_bar, enable_model_summary=False, precision=spec.precision,
                         gradient_clip_val=t.gradient_clip_val, gradient_clip_algorithm=t.gradient_clip_algorithm)
    trainer.fit(module, datamodule=data, ckpt_path=c.resume)
    exported = adapter.export(module.model, str(out / "hf")) if t.export else None
    coord = strategy.device_mesh.get_coordinate()
    return {"rank": rank, "coord": list(coord) if coord else None, "global_step": trainer.global_step,
            "metrics_csv": str(Path(logger.log_dir) / "metrics.csv"), "digest": digest(module),
            "applied_plan": strategy.applied_plan, "exported": exported,
            "atp_linears": sum(type(m).__name__ == "ATPLinear" for m in module.modules())}
