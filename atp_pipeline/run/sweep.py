"""Multirun summary: one table of every run's headline, in the sweep directory.

Each run writes ``summary.json`` (plan or training headline); at the end of a ``-m`` sweep
this Hydra callback gathers them into ``summary.csv`` and ``summary.png`` (one bar per run,
like the paper's Figure 11) and prints the table.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

COLUMNS = ["job_num", "topology", "model", "world_size", "dp", "strategy", "selected", "chunks",
           "t_comm_s", "megatron_t_comm_s", "ratio_to_megatron", "source", "final_loss",
           "step_time_s", "tokens_per_s", "tflops_per_device", "overrides"]


def collect(sweep_dir: Path) -> List[Dict[str, Any]]:
    rows = [json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")]
    return sorted(rows, key=lambda r: (r.get("job_num") is None, r.get("job_num"), r.get("overrides")))


def write_summary(sweep_dir: Path, rows: List[Dict[str, Any]]) -> Path:
    keys = [c for c in COLUMNS if any(c in r for r in rows)]
    keys += sorted({k for r in rows for k in r} - set(keys))
    path = sweep_dir / "summary.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in keys})
    return path


def summary_table(rows: List[Dict[str, Any]]) -> Table:
    table = Table(title=f"sweep summary: {len(rows)} runs", title_justify="left")
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in cols])
    return table


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def plot_summary(rows: List[Dict[str, Any]], path: Path) -> None:
    """One bar per run, like the paper's Figure 11: achieved TFLOP/s per device for training
    runs, the planner's T_comm for plan-only sweeps."""
    from atp_pipeline.figures import axes

    key, label = (("tflops_per_device", "achieved TFLOP/s per device (median step)")
                  if any(r.get("tflops_per_device") is not None for r in rows)
                  else ("t_comm_s", "T_comm per step (s, planner)"))
    names = [str(r.get("overrides") or r.get("job_num")) for r in rows]
    values = [float(r.get(key) or 0.0) for r in rows]
    with axes(path, (max(5.0, 0.6 * len(rows) + 2), 4.0), dpi=110) as ax:
        ax.bar(range(len(rows)), values, color="tab:blue")
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(label)
        ax.set_title(f"sweep: {len(rows)} runs", fontsize=9)


class SweepSummaryCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        if not rows:
            return
        path = write_summary(sweep_dir, rows)
        plot_summary(rows, sweep_dir / "summary.png")
        console = Console(width=200)
        console.print(summary_table(rows))
        console.print(f"wrote {path}")
