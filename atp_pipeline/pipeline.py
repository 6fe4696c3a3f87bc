"""compose -> plan -> build -> fit -> report: what ``train.py`` runs for a composed config.

``stage=plan`` validates the topology and model, costs every mesh (ATP §3.5), prints the
table and writes ``plan.json``, ``plan.png`` and ``summary.json`` into the run directory;
nothing is launched. ``stage=fit`` (the default) does the same checks and more before any
worker starts, then trains (:mod:`atp_pipeline.training`). Input errors are one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig

from atp_pipeline.config.schema import MeshStrategy, Stage
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.flops import ModelSummary
from atp_pipeline.planning.search import Plan, make_plan
from atp_pipeline.topology.model import Topology


def model_summary(cfg: DictConfig) -> ModelSummary:
    """Check the model config's numbers and summarize it (sizes, FLOPs)."""
    m = cfg.model
    for key in ("hidden", "heads", "layers", "seq_len", "batch_size", "vocab_size", "ffn_mult"):
        if m[key] < 1:
            raise ConfigError(f"model '{m.name}': {key} must be >= 1, got {m[key]}")
    if m.hidden % m.heads:
        raise ConfigError(f"model '{m.name}': hidden {m.hidden} is not divisible by heads {m.heads}")
    chunks = cfg.overlap.chunks
    if chunks < 1 or m.batch_size % chunks:
        raise ConfigError(f"overlap.chunks={chunks} must be >= 1 and divide model.batch_size="
                          f"{m.batch_size} (chunks split the batch, §4.1)")
    return ModelSummary.of(m)


def plan_from_config(cfg: DictConfig) -> Plan:
    """The plan of ``stage=plan``; with ``mesh.dp > 1`` the tensor-parallel mesh is planned
    on the devices of one data-parallel replica, exactly as ``stage=fit`` does."""
    from atp_pipeline.training import prepare, resolve_dp

    summary = model_summary(cfg)
    if cfg.mesh.strategy == MeshStrategy.sbp:  # an SBPReport (planning/sbp/report.py)
        return prepare(cfg, summary)["plan"]
    if not cfg.trainer.devices and resolve_dp(cfg, Topology.from_config(cfg.topology).world_size) == 1:
        return make_plan(Topology.from_config(cfg.topology), summary, cfg.mesh, cfg.planner)
    return prepare(cfg, summary)["plan"]


def _job_info() -> Dict[str, Any]:
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except ValueError:  # compose API: no Hydra run
        return {}
    return {"job_num": hc.job.get("num"), "overrides": hc.job.override_dirname}


def run(cfg: DictConfig, output_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Run the composed config; returns the run's summary row."""
    stage = Stage(cfg.stage)
    out = Path(output_dir if output_dir is not None else cfg.paths.output_dir)
    if stage == Stage.plan:
        from atp_pipeline.planning.report import report_plan

        return report_plan(cfg, plan_from_config(cfg), out, _job_info())
    if stage == Stage.fit:
        from atp_pipeline.training import fit

        row = fit(cfg, model_summary(cfg), out, _job_info())
        row.pop("_results", None)
        return row
    raise ConfigError(f"unknown stage {stage}")
