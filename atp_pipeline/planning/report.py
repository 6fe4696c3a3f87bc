"""The plan report, for any planner: console table, ``plan.json``, ``plan.txt``, ``plan.png``
and ``summary.json`` (the run's headline, which the sweep collects).

It reads a plan only through :class:`~atp_pipeline.planning.interface.PlanResult`; the
data-parallel gradient-sync estimate (:mod:`.gradsync`), when given, is printed under the
plan, added to ``plan.json`` (``gradient_sync``) and to the summary (seconds per mode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from rich.console import Console

from atp_pipeline.planning.gradsync import GradSyncReport, print_gradsync
from atp_pipeline.planning.interface import PlanResult


def gradsync_summary(gs: GradSyncReport) -> Dict[str, Any]:
    """Flat summary columns of a gradient-sync estimate (seconds per mode, the fastest)."""
    return {**{f"gradsync_{m.mode}_s": m.seconds for m in gs.modes},
            "gradsync_best": gs.best if gs.synchronizes else None}


def print_report(plan: PlanResult, gradsync: Optional[GradSyncReport] = None, console: Any = None) -> None:
    console = console or Console(width=180)
    plan.print(console)
    if gradsync is not None:
        print_gradsync(gradsync, console)


def write_report(plan: PlanResult, out_dir: Path, plot: bool = True, gradsync: Optional[GradSyncReport] = None,
                 extra_summary: Optional[Dict[str, Any]] = None, echo: bool = True,
                 extra_plan: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Path], Dict[str, Any]]:
    """Print (``echo``) and write the report into ``out_dir``; returns the paths and the summary
    row. ``extra_plan`` adds keys to ``plan.json``."""
    if echo:
        print_report(plan, gradsync)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"plan": out_dir / "plan.json", "text": out_dir / "plan.txt", "summary": out_dir / "summary.json"}
    data = plan.to_dict()
    if gradsync is not None:
        data["gradient_sync"] = gradsync.to_dict()
    data.update(extra_plan or {})
    paths["plan"].write_text(json.dumps(data, indent=2) + "\n")
    with open(paths["text"], "w") as sink:
        recorder = Console(record=True, width=180, file=sink)
        print_report(plan, gradsync, recorder)
        text = recorder.export_text()
    paths["text"].write_text(text)
    row = plan.summary_row()
    if gradsync is not None:
        row.update(gradsync_summary(gradsync))
    row.update(extra_summary or {})
    paths["summary"].write_text(json.dumps(row, indent=2) + "\n")
    if plot and plan.plot(out_dir / "plan.png"):
        paths["plot"] = out_dir / "plan.png"
    return paths, row
