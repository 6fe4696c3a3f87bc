"""Diagnosis e45 (session 55): where the step from a rank's CPU misses, and the CPU's line per cell.

    python docs/step_validation/diagnosis/e45.py > docs/step_validation/diagnosis/e45.log

Reads every committed calibration that has its probe steps (``local_<tag>.yaml`` with
``local_<tag>_probe_steps.json``), whose probes the current configs still compose and whose residual
chose the CPU form, and every committed grid that names it (its SHA-256). Nothing is measured: the
probes' steps and every grid row are priced again by the current program at the speed the row was
priced at (inside its launches where it has one, else the one ``--retime`` read), and the residual's
CPU form (``CpuStep``) is refitted from the probe steps each way below.

(1) Each grid's log error (measured / predicted) per process count split in two: the rank's CPU
    (measured rank CPU over the line's ``a·Û + b``) and the step from it (measured step over the
    cell's ``ratio·U + wait`` at the *measured* CPU).
(2) The CPU part per (model, mesh, chunks), each grid's mean per process count taken out: whether it
    sits apart by mesh alike in every model.
(3) The CPU's line per process and chunk count (as calibrated before run 57) against one per
    (mesh, chunk count) cell (``calibrate_compute.fit_cpu_step`` since run 57), the rest of the form
    refitted the same from the same steps: every grid's median / worst, the root mean square of the
    log error over all its points, how many grids hold worst <= 25 %.
(4) A lead that did not hold: the line with its own slope for the kernels' time and the rest
    (``U = k·K + a·(Û - K) + b``) on the counts other than the calibration's.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from atp_pipeline.planning.compute_profile import CpuStep, HostSpeed, cell_key, profile_of  # noqa: E402
from atp_pipeline.planning.lstsq import nnls  # noqa: E402
from atp_pipeline.planning.steptime import StepSetting, estimate_step  # noqa: E402
from atp_pipeline.run.calibrate_compute import (_line, compose_models, fit_cpu_step, probe_entries,  # noqa: E402
                                                probe_step_predictions)
from benchmarks.step_validation import load_calibrated, variant_overrides  # noqa: E402

SV = ROOT / "docs" / "step_validation"
RECENT = ("la", "lb", "at1", "at2", "at3", "inl1", "inl2", "ln1", "ln2", "cell1", "cell2")  # runs 47-58, in order


def per_chunks(cpu: CpuStep, u_hat: List[float], u: List[float], procs: List[int], chunks: List[int]) -> CpuStep:
    """The same form with the CPU's line per process and chunk count (before run 57)."""
    pts: Dict[int, Dict[int, List[Tuple[float, float]]]] = {}
    for uh, uu, n, c in zip(u_hat, u, procs, chunks):
        pts.setdefault(n, {}).setdefault(c, []).append((uh, uu))
    return CpuStep(cpu.ratio, {n: {c: _line(p) for c, p in per.items()} for n, per in pts.items()}, cpu.wait)


def split(u_hat: List[float], k_s: List[float], u: List[float], procs: List[int], chunks: List[int],
          world: int, base: CpuStep) -> Dict[Tuple[int, int], Tuple[float, float, float]]:
    """Part (4): per process and chunk count other than ``world``, ``U = k·K + a·(Û - K) + b``."""
    pts: Dict[Tuple[int, int], List[Tuple[float, float, float]]] = {}
    for uh, kk, uu, n, c in zip(u_hat, k_s, u, procs, chunks):
        pts.setdefault((n, c), []).append((kk, uh - kk, uu))
    out = {}
    for key, p in pts.items():
        a, b = base.cpu[key[0]][key[1]]
        out[key] = (a, a, b)
        if key[0] != world:
            x = nnls(np.array([[k / y, o / y, 1 / y] for k, o, y in p]), np.ones(len(p)))
            if x[0] > 0 and x[1] > 0:
                out[key] = (float(x[0]), float(x[1]), float(x[2]))
    return out


def kernel_s(e: Any) -> float:
    """Of a prediction's compute: its kernels at the sweep's prices (no framework, no optimizer)."""
    return e.compute_s - e.dispatch_s - e.optimizer_s


def main() -> None:
    errs: Dict[str, Dict[str, List[float]]] = {"per chunks": {}, "per cell": {}, "kernels apart": {}}
    dec: Dict[Tuple[str, int], List[Tuple[float, float]]] = {}
    cells: Dict[int, Dict[Tuple[str, str], List[float]]] = {2: {}, 4: {}}
    tags = []
    for y in sorted(glob.glob(str(SV / "local_*.yaml"))):
        tag = Path(y).stem[len("local_"):]
        steps_file = SV / f"local_{tag}_probe_steps.json"
        if not steps_file.exists():
            continue
        sha = hashlib.sha256(Path(y).read_bytes()).hexdigest()[:12]
        grids = [g for g in sorted(glob.glob(str(SV / "*.json"))) if f"sha256 {sha}" in Path(g).read_text()]
        if not grids:
            continue
        try:
            topo, _ = load_calibrated(y, "", ROOT / "conf")
            prof = profile_of(topo)
            rows = json.loads(steps_file.read_text())["rows"]
            names = sorted({r["probe"] for r in rows})
            shapes = [s for s, _ in compose_models(probe_entries(names), ROOT / "conf")]
        except Exception as exc:  # a calibration older than the current configs or schema
            print(f"{tag}: skipped ({str(exc).splitlines()[0][:90]})")
            continue
        if prof.step_residual is None or prof.step_residual.form != "cpu":
            print(f"{tag}: skipped (its residual chose the terms' form)")
            continue
        tags.append(tag)
        plans = [(names.index(r["probe"]), *map(int, r["mesh"].split("x")), r["chunks"]) for r in rows]
        est = probe_step_predictions(prof, topo, shapes, plans)
        u_hat, u, t = [e.cpu_s for e in est], [r["measured_cpu_s"] for r in rows], [r["measured_s"] for r in rows]
        procs, chunks = [r["processes"] for r in rows], [r["chunks"] for r in rows]
        meshes = [tuple(map(int, r["mesh"].split("x"))) for r in rows]
        cell = fit_cpu_step(u_hat, u, t, procs, meshes, chunks)
        forms = {"per chunks": per_chunks(cell, u_hat, u, procs, chunks), "per cell": cell}
        kapart = split(u_hat, [kernel_s(e) for e in est], u, procs, chunks, prof.processes, forms["per chunks"])
        line = [f"{tag}:"]
        for g in grids:
            grid = Path(g).stem
            data = json.loads(Path(g).read_text())["rows"]
            keys = sorted({(r["model"], r["batch"], r["seq_len"]) for r in data})
            built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, ROOT / "conf")) for m, b, s in keys],
                                   ROOT / "conf")
            shape = {k: s for k, (s, _) in zip(keys, built)}
            got: Dict[str, List[float]] = {f: [] for f in errs}
            for r in data:
                if r.get("class", "real") != "real" or r.get("in_sample"):
                    continue
                hs = r.get("host_speed_in_launch") or r.get("host_speed")
                speed = HostSpeed(hs["compute"], hs["overhead"], "", "steps", r["processes"]) if hs else None
                n, c = r["processes"], r["chunks"]
                mesh = tuple(map(int, r["mesh"].split("x")))
                for form, cpu in forms.items():
                    p = dataclasses.replace(prof, step_residual=dataclasses.replace(prof.step_residual, anchored=cpu))
                    p = p.at_speed(speed) if speed else p
                    e = estimate_step(topo.restrict(n), shape[(r["model"], r["batch"], r["seq_len"])], mesh,
                                      StepSetting(chunks=c), p)
                    got[form].append(math.log(r["measured_s"] / e.step_s))
                    if form == "per chunks":
                        anch = p.step_residual.anchored
                        a, b = anch.line(n, mesh, c)
                        kk = kernel_s(e)
                        ka, oa, kb = kapart[(n, c)]
                        ratio = (anch.step(n, mesh, c, e.cpu_s * 1.01) - anch.step(n, mesh, c, e.cpu_s)) / (0.01 * e.cpu_s * a)
                        alt = e.step_s + ratio * ((ka * kk + oa * (e.cpu_s - kk) + kb * (hs["overhead"] if hs else 1.0))
                                                  - (a * e.cpu_s + b))
                        got["kernels apart"].append(math.log(r["measured_s"] / alt))
                        if r.get("measured_rank_cpu_s"):
                            uu = r["measured_rank_cpu_s"]
                            step_at_u = anch.step(n, mesh, c, (uu - b) / a)
                            dec.setdefault((grid, n), []).append((math.log(uu / (a * e.cpu_s + b)),
                                                                  math.log(r["measured_s"] / step_at_u)))
                            cells[n].setdefault((grid, f"{r['model']} {cell_key(mesh, c)}"), []).append(
                                math.log(uu / (a * e.cpu_s + b)))
            for f, v in got.items():
                errs[f][grid] = v
            line.append(f"{grid} " + ", ".join(f"{f} {fig(v)}" for f, v in got.items()))
        print("  ".join(line[:1]) + "\n    " + "\n    ".join(line[1:]))
    print("\n(1) log error split: CPU (measured rank CPU / the line) | the step from the measured CPU")
    for (grid, n), v in sorted(dec.items()):
        print(f"    {grid:16s} {n} processes: CPU {statistics.fmean(x for x, _ in v):+.3f} | "
              f"step from it {statistics.fmean(y for _, y in v):+.3f}")
    print("\n(2) the CPU part per model and cell, each grid's mean per process count taken out")
    for n, per in cells.items():
        means = {g: statistics.fmean(x for (gg, _), v in per.items() if gg == g for x in v) for g, _ in per}
        by: Dict[str, List[float]] = {}
        for (g, k), v in per.items():
            by.setdefault(k, []).extend(x - means[g] for x in v)
        for k, v in sorted(by.items(), key=lambda kv: (kv[0].split()[1], kv[0])):
            print(f"    {n} processes {k:22s} {statistics.fmean(v):+.3f} (sd {statistics.pstdev(v):.3f}, {len(v)} points)")
    print("\n(3)/(4) every grid priced again, each form")
    for subset, keep in (("all", None), ("runs 47-58", RECENT)):
        for f, per in errs.items():
            chosen = {g: v for g, v in per.items() if keep is None or any(
                f"sha256 {hashlib.sha256((SV / f'local_{t}.yaml').read_bytes()).hexdigest()[:12]}"
                in (SV / f"{g}.json").read_text() for t in keep)}
            pts = [x for v in chosen.values() for x in v]
            ok = sum(max(abs(math.exp(-x) - 1) for x in v) <= 0.25 for v in chosen.values())
            print(f"    {subset:10s} {f:13s} {len(chosen)} grids, {len(pts)} points: {fig(pts)}, "
                  f"rms log {math.sqrt(statistics.fmean(x * x for x in pts)):.3f}, worst <= 25 % in {ok}")


def fig(logs: List[float]) -> str:
    """Median / worst relative error of predictions whose log(measured / predicted) are ``logs``."""
    rel = [abs(math.exp(-x) - 1) for x in logs]
    return f"{100 * statistics.median(rel):.1f} / {100 * max(rel):.1f} %"


if __name__ == "__main__":
    main()
