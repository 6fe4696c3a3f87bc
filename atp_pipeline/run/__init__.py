"""The run layer: compose -> resolve -> plan -> report (``stage=plan``) and on to build ->
fit -> report (``stage=fit``); ``stage=calibrate`` measures this host for the topology
(:mod:`atp_pipeline.run.calibration`); also the sweep summary and calibration's measuring half.

:func:`run` is what ``train.py`` calls for a composed config. ``stage=plan`` imports
neither the fit nor the worker modules (nor Lightning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig


def run(cfg: DictConfig, output_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Run the composed config; returns the run's summary row."""
    stage = str(getattr(cfg.stage, "value", cfg.stage))
    if stage == "calibrate":
        from atp_pipeline.run.calibration import run_calibrate

        return run_calibrate(cfg)
    fitting = stage == "fit"
    if fitting:
        from atp_pipeline.launch import prestart

        prestart()  # the ranks' fork server imports torch and Lightning while the run is resolved
    out = Path(output_dir if output_dir is not None else cfg.paths.output_dir)
    try:
        from atp_pipeline.run.resolve import resolve

        spec = resolve(cfg)
        if fitting and spec.config.resume == "auto":  # the newest complete checkpoint of the run directory
            import dataclasses

            from atp_pipeline.run.checkpoints import resolve_resume

            spec = dataclasses.replace(spec, config=dataclasses.replace(
                spec.config, resume=resolve_resume("auto", out)))
    except BaseException:
        if fitting:
            from atp_pipeline.launch import stop_prestarted

            stop_prestarted()
        raise
    if spec.stage == "plan":
        from atp_pipeline.run.report import report_plan

        return report_plan(spec, out, extra=spec.job)
    from atp_pipeline.run.console import logged_console
    from atp_pipeline.run.fit import fit

    with logged_console(out / "train.log"):  # what is printed, and a failure's full report
        row = fit(spec, out)
    row.pop("_results", None)
    return row
