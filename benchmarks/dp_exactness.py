"""Data-parallel and FSDP runs against the single-process run of the same global batches.

    python -m benchmarks.dp_exactness --steps 50      # writes outputs/benchmarks/dp_exactness/

Each case trains with ``train.py``'s own pipeline (compose -> resolve -> fit, real gloo
processes and Lightning); its logged losses are compared, step by step, with the
single-process run of the same model, dtype and steps (``mesh=1x1 trainer.devices=1``):

* data parallelism: ``mesh=1x1 mesh.dp=4`` with ``aggregation=ring``, ``ps`` and ``atp``,
  ``mesh=1x1 mesh.dp=2`` and ``mesh=2x1 mesh.dp=2`` — in float32 and in float64 (where
  float32's summation-order noise is gone, so what remains is the run's own error);
* ``aggregation.switch_impl=bmv2`` at dp = 2 (``--bmv2``: needs root and the P4 tools);
* resume at dp = 2 from the middle checkpoint: the second half again;
* FSDP (``mesh.fsdp=true``) on ``2x1 x dp 2`` and ``1x1 x dp 4`` for each ``--fsdp-models``
  model, and rank 0's bytes of parameters + gradients + optimizer state against the
  unsharded run on ``2x1 x dp 2``.

Writes ``dp_exactness.json`` (every case: max |Δloss|, and the losses), ``dp_exactness.csv``
(per step |Δloss| of every case) and ``dp_exactness.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from atp_pipeline.config import register_mesh_source, register_schemas
from atp_pipeline.run.fit import fit
from atp_pipeline.run.report import read_metrics
from atp_pipeline.run.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["trainer.progress_bar=false", "planner.plot=false", "trainer.export=false"]
DP_CASES = {
    "dp4 ring": ["mesh=1x1", "mesh.dp=4"],
    "dp4 ps": ["mesh=1x1", "mesh.dp=4", "aggregation=ps"],
    "dp4 atp": ["mesh=1x1", "mesh.dp=4", "aggregation=atp"],
    "dp2 ring": ["mesh=1x1", "mesh.dp=2"],
    "2x1 dp2 ring": ["mesh=2x1", "mesh.dp=2"],
}
FSDP_MESHES = {"2x1 dp2": ["mesh=2x1", "mesh.dp=2"], "1x1 dp4": ["mesh=1x1", "mesh.dp=4"]}
STATE = ("param_bytes", "grad_bytes", "optimizer_bytes")


_RUNS: Dict[str, Dict[str, Any]] = {}  # composed config (output dir aside) -> its run


def run(overrides: Sequence[str], out: Path) -> Dict[str, Any]:
    """One ``train.py`` fit with ``overrides``, into ``out``: its summary and logged losses.
    A config already run (the single-process reference of the data-parallel cases and of FSDP's
    when they coincide: same model, dtype and steps) is not run again."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            cfg = compose(config_name="config", overrides=[*QUIET, *overrides, f"paths.output_dir={out}"])
    finally:
        GlobalHydra.instance().clear()
    key = OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "paths"]))
    if key not in _RUNS:
        row = fit(resolve(cfg), out)
        row.pop("_results", None)
        losses = {int(r["step"]): r["loss"] for r in read_metrics(out / "metrics.csv") if "loss" in r}
        _RUNS[key] = {"summary": row, "losses": [losses[k] for k in sorted(losses)], "first_step": min(losses)}
    return _RUNS[key]


def gaps(got: List[float], want: List[float], first: int = 0) -> List[float]:
    """|Δloss| per step of ``got`` (starting at step ``first``) against ``want``."""
    return [abs(g - want[first + i]) for i, g in enumerate(got)]


def main(argv: Sequence[str] = ()) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dtypes", default="fp32,fp64", help="comma-separated model.dtype values")
    ap.add_argument("--cases", default=",".join(DP_CASES), help="comma-separated data-parallel cases")
    ap.add_argument("--fsdp-models", default="tiny,llama_tiny,gpt2_tiny", help="'' for none")
    ap.add_argument("--fsdp-steps", type=int, default=20)
    ap.add_argument("--bmv2", action="store_true", help="also aggregation.switch_impl=bmv2 at dp=2 (root, P4 tools)")
    ap.add_argument("--out", default="outputs/benchmarks/dp_exactness")
    args = ap.parse_args(list(argv) or None)
    register_schemas()
    register_mesh_source()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dp_exactness_"))
    cases: Dict[str, Dict[str, Any]] = {}
    t0 = time.time()

    def case(name: str, ref: List[float], overrides: Sequence[str], **extra: Any) -> Dict[str, Any]:
        r = run(overrides, work / name.replace(" ", "_"))
        d = gaps(r["losses"], ref, r["first_step"])
        cases[name] = {"overrides": list(overrides), "max_abs_dloss": max(d), "dloss": d, "losses": r["losses"],
                       "first_step": r["first_step"], **{k: r["summary"].get(k) for k in STATE}, **extra}
        print(f"{name:<34} max |Δloss| {max(d):.3g}  over {len(d)} steps", flush=True)
        return r

    try:
        for dtype in [d for d in args.dtypes.split(",") if d]:
            base = [f"model.dtype={dtype}", f"trainer.max_steps={args.steps}"]
            ref = run([*base, "mesh=1x1", "trainer.devices=1"], work / f"single_{dtype}")["losses"]
            for name in [c for c in args.cases.split(",") if c]:
                extra = ["trainer.checkpoint_every_n_steps=" + str(args.steps // 2)] if name == "dp2 ring" else []
                case(f"{dtype} {name}", ref, [*base, *DP_CASES[name], *extra])
                if extra and args.steps >= 2:  # resume from the middle: the second half again
                    ckpt = work / f"{dtype}_{name}".replace(" ", "_") / "checkpoints" / f"step{args.steps // 2}.ckpt"
                    first = cases[f"{dtype} {name}"]["losses"]
                    case(f"{dtype} {name} resumed", first, [*base, *DP_CASES[name], f"resume={ckpt}"])
            if args.bmv2 and dtype == "fp32":
                case(f"{dtype} dp2 atp bmv2", ref, [*base, "mesh=1x1", "mesh.dp=2", "aggregation=atp",
                                                    "aggregation.switch_impl=bmv2"])
        for model in [m for m in args.fsdp_models.split(",") if m]:
            base = [f"model={model}", f"trainer.max_steps={args.fsdp_steps}"]
            ref = run([*base, "mesh=1x1", "trainer.devices=1"], work / f"single_{model}")["losses"]
            for mesh, overrides in FSDP_MESHES.items():
                case(f"fsdp {model} {mesh}", ref, [*base, *overrides, "mesh.fsdp=true"])
            case(f"unsharded {model} 2x1 dp2", ref, [*base, *FSDP_MESHES["2x1 dp2"]])
            sharded, whole = cases[f"fsdp {model} 2x1 dp2"], cases[f"unsharded {model} 2x1 dp2"]
            ratio = sum(sharded[k] for k in STATE) / sum(whole[k] for k in STATE)
            sharded["state_ratio_to_unsharded"] = ratio
            print(f"fsdp {model} 2x1 dp2: rank 0 holds {sum(sharded[k] for k in STATE)} B of parameters + gradients "
                  f"+ optimizer state, {ratio:.4f} of the unsharded run's {sum(whole[k] for k in STATE)} B "
                  f"(1/dp = 0.5)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({platform.processor() or 'cpu'}, "
              f"{os.cpu_count()} cores)", "steps": args.steps, "fsdp_steps": args.fsdp_steps,
              "seconds": time.time() - t0, "cases": cases}
    (out / "dp_exactness.json").write_text(json.dumps(report, indent=1) + "\n")
    with (out / "dp_exactness.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "step", "abs_dloss"])
        for name, c in cases.items():
            for i, d in enumerate(c["dloss"]):
                w.writerow([name, c["first_step"] + i, f"{d:.6g}"])
    plot(cases, out / "dp_exactness.png")
    print(f"wrote {out / 'dp_exactness.json'}, {out / 'dp_exactness.csv'}, {out / 'dp_exactness.png'}")
    return report


def plot(cases: Dict[str, Dict[str, Any]], path: Path) -> None:
    from atp_pipeline.figures import axes

    with axes(path, (7.5, 4.2)) as ax:
        for name, c in cases.items():
            if name.startswith("unsharded") or "resumed" in name:
                continue
            steps = [c["first_step"] + i + 1 for i in range(len(c["dloss"]))]
            worst = [max(max(c["dloss"][:i + 1]), 1e-16) for i in range(len(c["dloss"]))]
            style = ":" if name.startswith("fsdp") else "--" if name.startswith("fp64") else "-"
            ax.semilogy(steps, worst, lw=1.1, ls=style, label=name)
        ax.axhline(1e-5, color="k", ls=":", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("max |loss - single-process loss| so far")
        ax.set_title("data parallel and FSDP vs one process (same global batches)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        ax.grid(alpha=0.3)


if __name__ == "__main__":
    main()
