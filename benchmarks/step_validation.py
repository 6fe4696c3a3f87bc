"""Validate the step-time model out of sample: predicted vs measured steps over a grid.

    python train.py stage=calibrate                      # the calibration (this host, topology local)
    python -m benchmarks.step_validation --models llama_tiny,gpt2_tiny,small --variants 6x204,14x104 --worlds 4,2

Run from the repository root. The calibration is the one ``stage=plan`` would use:
``--topology`` (default ``local``) with the file ``stage=calibrate`` wrote for it in
``--calibration-dir`` (:func:`atp_pipeline.run.calibration.with_calibration`), or a YAML path of
a topology that carries its own ``alpha_beta`` and ``device.compute``. This command measures
steps only; it never calibrates.

**Out of sample by construction.** A point is *in sample* when the calibration ran its model
(:func:`atp_pipeline.planning.compute_profile.shape_key`) or ran any probe at its mesh with its
batch and sequence length. Such points are refused (exit 2, listed) unless ``--allow-in-sample``,
which keeps them flagged and out of the out-of-sample figures.

**Grid.** Every model of ``--models`` × ``--variants`` (``<batch>x<seq>``) × process count of
``--worlds`` (the topology's first ``w`` devices) × every mesh the model can run × ``--chunks``;
with ``--emulate <topology>`` also on that emulated interconnect, reported apart.

**Measure.** A launch of ``w`` gloo processes per model variant and process count builds every
point's parallel model as training does (the family's own plan, AdamW); a step is forward +
backward + optimizer step between two barriers, after ``--warmup`` untimed steps, over
``--repeats`` rounds that interleave the points. Each group is launched ``--launches`` times
(default 2): one launch's own state moves a point by 0.13 in log. A point's time is the median
of its steps in all its launches; the other jobs' load while it ran is in its row.

**Predict.** :func:`atp_pipeline.planning.steptime.estimate_step`, what ``stage=plan`` predicts,
at the host's speed (``--retime``; by default the calibration's probe steps timed inside every
launch, never this grid's models, and a group priced at its launches' geometric mean speed).
Every row also carries the prediction at the calibration's own speed.

**Report** (``--out``, default ``outputs/benchmarks/step_validation``): ``<tag>.json`` (the
calibration, every point predicted vs measured with the prediction's split, the figures),
``<tag>.csv``, ``<tag>.png``. Figures per class: median and worst relative error, Spearman's ρ per
model, and per group whether the predicted best point is the measured best.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

CONF = Path("conf")
RETIME_MODES = ("launch", "off")


def _worker(rank: int, world: int, spec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from atp_pipeline.lightning.module import adamw
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import comm_for, init_mesh
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.emulation import TopologyEmulator
    from atp_pipeline.run.hostload import quiet_rounds
    from atp_pipeline.topology.model import Topology

    def batch_of(m: Dict[str, Any]) -> Tuple[Any, Any, Any, Any]:
        """A model's adapter, dense model and fixed batch, as training builds them."""
        adapter = get_adapter(m["family"])
        torch.manual_seed(0)
        dense = adapter.build(m["model_config"])
        g = torch.Generator().manual_seed(0)
        b, s, V = m["batch"], m["seq_len"], m["vocab"]
        return adapter, dense, torch.randint(0, V, (b, s), generator=g), torch.randint(0, V, (b, s), generator=g)

    emu_topo = Topology.from_config(spec["emulate"]) if spec["emulate"] else None
    # the group's points, then (--retime launch) the calibration's probe steps on the same meshes,
    # interleaved with them in every round: (key, step function, the mesh's Comm)
    runners: List[Tuple[str, Any, Any]] = []
    meshes: Dict[Tuple[int, int, bool], Any] = {}
    built = [batch_of(spec)] + [batch_of(m) for m in spec.get("probe_models", [])]
    todo = [(json.dumps(key), 0, tuple(key)) for key in spec["points"]]
    todo += [(json.dumps(["probe", label]), 1 + mi, (d1, d2, c, False))
             for label, mi, d1, d2, c in spec.get("probe_points", [])]
    for name, mi, (d1, d2, chunks, emulated) in todo:
        adapter, dense, idx, tgt = built[mi]
        # one mesh per shape (and interconnect), as training holds one: every mesh more holds gloo
        # process groups whose idle threads take CPU from the ranks (docs/step-time.md)
        mesh = meshes.get((d1, d2, emulated)) or meshes.setdefault((d1, d2, emulated), init_mesh((d1, d2)))
        model = copy.deepcopy(dense)
        apply_plan(model, adapter.parallel_plan(model), mesh, chunks)
        comm_for(mesh, TopologyEmulator(emu_topo, (d1, d2), spec["slowdown"]) if emulated else None)
        opt = adamw(model.parameters(), lr=1e-4)  # training's optimizer (foreach AdamW)

        def step(model: Any = model, opt: Any = opt, adapter: Any = adapter, idx: Any = idx, tgt: Any = tgt) -> None:
            adapter.lm_loss(model, idx, tgt).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runners.append((name, step, comm_for(mesh)))

    def timed(step: Any, n: int) -> List[float]:
        out = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            out.append(time.perf_counter() - t0)
        return out

    for _, step, _ in runners:
        timed(step, spec["warmup"])

    def one_round(r: int) -> Dict[str, Tuple[List[float], float, float]]:
        order = runners[r % len(runners):] + runners[:r % len(runners)]
        got = {}
        for k, step, comm in order:
            comm.stats.reset()
            cpu0 = time.process_time()
            ts = timed(step, spec["steps"])
            cpu = (time.process_time() - cpu0) / spec["steps"]  # this rank's CPU (its threads) per step
            got[k] = (ts, sum(c.wait_s for c in comm.stats.totals.values()) / spec["steps"], cpu)
        return got
    # rounds during which other jobs loaded the host are measured again (atp_pipeline.run.hostload)
    kept, foreign = quiet_rounds(spec["repeats"], spec["repeats"], one_round)
    times = {k: [t for rd in kept for t in rd[k][0]] for k, *_ in runners}
    waits = {k: [rd[k][1] for rd in kept] for k, *_ in runners}
    cpus = {k: [rd[k][2] for rd in kept] for k, *_ in runners}
    # every rank's phases (the step model predicts one rank; the host runs all of them)
    return {"times": times, "waits": waits, "cpus": cpus, "foreign": foreign}


def _loadavg() -> Optional[List[float]]:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def load_calibrated(ref: str, calibration_dir: str, conf: Path) -> Tuple[Any, Dict[str, Any]]:
    """The topology ``ref`` with the calibration ``stage=plan`` would use, and where it came
    from (file, SHA-256, date): a YAML path that carries its own calibration, or a config
    name with ``stage=calibrate``'s file for it."""
    from types import SimpleNamespace

    from atp_pipeline.errors import ConfigError
    from atp_pipeline.run.calibration import calibration_file, file_digest, with_calibration
    from atp_pipeline.run.compute_measure import load_topology_yaml
    from atp_pipeline.topology.model import Topology

    data, path = load_topology_yaml(ref, conf)
    topo = Topology.from_config(data)
    if topo.device.get("compute"):
        source = path
    else:
        topo = with_calibration(topo, SimpleNamespace(use=True, dir=calibration_dir))
        source = calibration_file(calibration_dir, topo.name)
        if not topo.device.get("compute"):
            raise ConfigError(f"step_validation: topology '{topo.name}' has no calibration ({source} missing or "
                              f"for other levels): run `python train.py stage=calibrate topology={topo.name}`")
    compute = topo.device["compute"]
    return topo, {"file": str(source), "sha256": file_digest(Path(source)), "date": compute.get("date", ""),
                  "profile": compute.get("name", ""), "source": compute.get("source", "")}


def rel_error(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def in_sample(profile: Any, shape: Any, mesh: Tuple[int, int], world: int) -> str:
    """Why a point is in the calibration's sample ('' if it is not): the calibration ran its
    model, or a probe at its mesh with its batch and sequence length."""
    from atp_pipeline.planning.compute_profile import shape_key

    key = shape_key(shape)
    for p in profile.probes:
        if p.key == key:
            return f"model calibrated (probe {p.name})"
        if (p.mesh == mesh and p.batch == shape.batch_size and p.seq_len == shape.seq_len
                and world == (p.processes or profile.processes)):
            return f"mesh {mesh[0]}x{mesh[1]} with batch {p.batch} and sequence {p.seq_len} calibrated (probe {p.name})"
    return ""


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Median / worst relative error, Spearman's ρ overall and per model, and predicted-best =
    measured-best per group (model variant × processes × interconnect)."""
    from atp_pipeline.planning.lstsq import spearman

    if not rows:
        return {"points": 0}
    errs = [r["rel_error"] for r in rows]
    groups: Dict[str, Dict[str, Any]] = {}
    for key in sorted({r["group"] for r in rows}):
        pts = [r for r in rows if r["group"] == key]
        pb = min(pts, key=lambda r: r["predicted_s"])
        mb = min(pts, key=lambda r: r["measured_s"])
        second = sorted(p["measured_s"] for p in pts)[1] if len(pts) > 1 else mb["measured_s"]
        bias = statistics.median(p["measured_s"] / p["predicted_s"] for p in pts)
        within = [abs(p["measured_s"] / (p["predicted_s"] * bias) - 1) for p in pts]
        probe = [p["probe_steps"]["ratio"] for p in pts if p.get("probe_steps")]
        groups[key] = {
            "host_load_cores": statistics.mean(p.get("host_load_cores", 0.0) for p in pts),
            "bias": bias, **({"probe_ratio": probe[0]} if probe else {}),
            "within_median_rel_error": statistics.median(within), "within_worst_rel_error": max(within),
            "predicted_best": pb["point"], "measured_best": mb["point"], "agree": pb["point"] == mb["point"],
            "measured_margin": second / mb["measured_s"] - 1,
            "predicted_best_measured_slower_by": pb["measured_s"] / mb["measured_s"] - 1,
            "spearman": spearman([p["predicted_s"] for p in pts], [p["measured_s"] for p in pts])
            if len(pts) > 1 else None}
    models = {m: spearman([r["predicted_s"] for r in rows if r["model"] == m],
                          [r["measured_s"] for r in rows if r["model"] == m])
              for m in sorted({r["model"] for r in rows}) if sum(r["model"] == m for r in rows) > 1}
    speeds = [r["host_speed"] for r in rows if r.get("host_speed")]
    speed = ({g: [min(x[g] for x in speeds), max(x[g] for x in speeds)] for g in ("compute", "overhead")}
             if speeds else None)  # the host's speed (now / at calibration) the predictions were priced at
    flat = [rel_error(r["predicted_at_calibration_speed_s"], r["measured_s"]) for r in rows
            if r.get("predicted_at_calibration_speed_s")]
    return {"points": len(rows), "median_rel_error": statistics.median(errs), "worst_rel_error": max(errs),
            "host_speed": speed, **probe_tracking(groups),
            # the same points predicted at the calibration's own host speed (no re-timing), for comparison
            "at_calibration_speed": {"median_rel_error": statistics.median(flat), "worst_rel_error": max(flat)}
            if flat and speeds else None,
            "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "spearman_per_model": models,
            "best_agrees": f"{sum(g['agree'] for g in groups.values())} of {len(groups)}",
            "best_agree_share": sum(g["agree"] for g in groups.values()) / len(groups),
            "short_share": sum(r["predicted_s"] < r["measured_s"] for r in rows) / len(rows),
            # the errors left once each group's common factor (its median measured/predicted: what the
            # host's load at the group's launch does to all its points alike) is divided out
            "within_group_median_rel_error": statistics.median(
                abs(r["measured_s"] / (r["predicted_s"] * groups[r["group"]]["bias"]) - 1) for r in rows),
            "within_group_worst_rel_error": max(
                abs(r["measured_s"] / (r["predicted_s"] * groups[r["group"]]["bias"]) - 1) for r in rows),
            "groups": groups}


def probe_tracking(groups: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Rows that carry ``probe_steps`` (the probes' steps re-timed before a
    launch, measured / predicted): the Pearson correlation over groups of that ratio (``probe_ratio``)
    with the group's own (``bias``); empty without it."""
    pairs = [(g["probe_ratio"], g["bias"]) for g in groups.values() if "probe_ratio" in g]
    if len(pairs) < 3:
        return {}
    xs, ys = zip(*pairs)
    corr = statistics.correlation(xs, ys) if len(set(xs)) > 1 and len(set(ys)) > 1 else None
    return {"probe_ratio_bias_correlation": corr, "probe_ratio_range": [min(xs), max(xs)]}


def plot(rows: List[Dict[str, Any]], summary: Dict[str, Any], path: Path, title: str) -> None:
    from atp_pipeline.figures import axes

    with axes(path, (6.5, 5.5)) as ax:
        colors = {m: f"C{i}" for i, m in enumerate(sorted({r["model"] for r in rows}))}
        marks = {(4, 1): "o", (4, 2): "s", (2, 1): "x", (2, 2): "+"}  # (processes, chunks); others: "D"
        for model in sorted({r["model"] for r in rows}):
            for world in sorted({r["processes"] for r in rows}):
                for chunks in sorted({r["chunks"] for r in rows}):
                    pts = [r for r in rows if (r["model"], r["processes"], r["chunks"]) == (model, world, chunks)]
                    if pts:
                        ax.scatter([p["measured_s"] * 1e3 for p in pts], [p["predicted_s"] * 1e3 for p in pts],
                                   marker=marks.get((world, chunks), "D"), s=26, color=colors[model],
                                   label=f"{model}, {world} proc., chunks {chunks}")
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.3
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.3
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="y = x")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15,
                        label="±10 %")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured step (ms, median)")
        ax.set_ylabel("predicted step (ms)")
        ax.set_title(f"{title}\nmedian error {summary['median_rel_error']:.1%}, worst "
                     f"{summary['worst_rel_error']:.1%}, Spearman {summary['spearman']:.3f}, "
                     f"best {summary['best_agrees']}", fontsize=8)
        ax.legend(fontsize=5, ncol=2)


def report(rows: List[Dict[str, Any]], meta: Dict[str, Any], out: Path, tag: str) -> Dict[str, Any]:
    """The figures per class, ``<tag>.{json,csv,png}``, and the table printed."""
    classes = {c: summarize([r for r in rows if r["class"] == c]) for c in sorted({r["class"] for r in rows})}
    _write(out, tag, rows, meta, classes)
    real = [r for r in rows if r["class"] == "real"] or rows
    plot(real, summarize(real), out / f"{tag}.png", f"step-time model vs measured, out of sample "
                                                    f"({real[0]['class']}): "
                                                    f"{', '.join(sorted({r['model'] for r in real}))}")
    print(f"{'model':<11} {'b x s':<8} {'proc':>4} {'interconnect':<20} {'point':<9} {'measured ms':>11} "
          f"{'predicted ms':>12} {'compute':>8} {'exposed':>8} {'waited':>8} {'error':>7} {'load':>5}")
    for r in rows:
        print(f"{r['model']:<11} {r['batch']:>2}x{r['seq_len']:<5} {r['processes']:>4} {r['interconnect']:<20} "
              f"{r['point']:<9} {r['measured_s'] * 1e3:11.1f} {r['predicted_s'] * 1e3:12.1f} "
              f"{r['predicted_compute_s'] * 1e3:8.1f} {r['predicted_exposed_comm_s'] * 1e3:8.1f} "
              f"{r['measured_comm_wait_s'] * 1e3:8.1f} {r['rel_error']:7.1%} {r.get('host_load_cores', 0.0):5.2f}"
              + (f"  IN SAMPLE: {r['in_sample']}" if r["in_sample"] else ""))
    if meta.get("warmup") == 0:  # e.g. the documented command's cheap form in tests/test_docs_commands.py
        print("note: --warmup 0: each point's first step is timed, start-up included (allocation, first "
              "collectives, caches), so the errors below measure start-up, not the model; a validation warms up "
              "(default --warmup 2; docs/step-time.md)")
    for cls, s in classes.items():
        print(f"{cls}: {s['points']} points: median relative error {s['median_rel_error']:.1%}, worst "
              f"{s['worst_rel_error']:.1%}, Spearman rho {s['spearman']:.3f} (per model: "
              + ", ".join(f"{m} {v:.2f}" for m, v in s["spearman_per_model"].items())
              + f"); predicted best = measured best in {s['best_agrees']} groups; "
              f"{s['short_share']:.0%} predicted short;"
              f" within a group (its common factor divided out): median {s['within_group_median_rel_error']:.1%}, "
              f"worst {s['within_group_worst_rel_error']:.1%}"
              + (f"; probe steps' ratio vs the groups' measured/predicted: correlation "
                 f"{s['probe_ratio_bias_correlation']:.2f}"
                 if s.get("probe_ratio_bias_correlation") is not None else ""))
        for g, v in s["groups"].items():
            print(f"  {g}: load {v['host_load_cores']:.2f} cores, measured/predicted x{v['bias']:.2f}"
                  + (f" (probe steps x{v['probe_ratio']:.2f})" if "probe_ratio" in v else "") + "; best "
                  + ("agrees" if v["agree"] else f"predicted {v['predicted_best']}, measured {v['measured_best']} "
                                                 f"(measured {v['predicted_best_measured_slower_by']:.1%} slower)"))
    return classes


def prediction_fields(est: Any, measured: float) -> Dict[str, Any]:
    """A row's predicted step and its split (:class:`~atp_pipeline.planning.steptime.StepEstimate`)."""
    return {"predicted_s": est.step_s, "rel_error": rel_error(est.step_s, measured),
            "predicted_compute_s": est.compute_s, "predicted_exposed_comm_s": est.exposed_comm_s,
            "predicted_total_comm_s": est.total_comm_s, "predicted_framework_s": est.dispatch_s,
            "predicted_optimizer_s": est.optimizer_s, "predicted_sync_s": est.sync_s,
            "predicted_timeline_s": est.timeline_s, "predicted_rank_cpu_s": est.cpu_s,
            "predicted_coll_cpu_s": est.coll_cpu_s,
            "predicted_host_bound": est.host_bound, "predicted_residual_s": est.residual_s}


def calibration_field(calibration: Dict[str, Any], est: Any) -> str:
    return f"{calibration['file']} sha256 {calibration['sha256']}: {est.calibration}"


def repredict(rows: List[Dict[str, Any]], meta: Dict[str, Any], ref: str, calibration_dir: str,
              conf: Path) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """``--rows ... --repredict``: an earlier run's measured rows predicted again from another
    calibration (``--topology``/``--calibration-dir``; the rows' measurements unchanged). A
    development check: a calibration taken after those rows were measured is not a validation
    of it, and the meta says so (``repredicted``)."""
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.planning.steptime import StepSetting, estimate_step
    from atp_pipeline.run.compute_measure import compose_models

    topo, calibration = load_calibrated(ref, calibration_dir, conf)
    profile = profile_of(topo)
    keys = sorted({(r["model"], r["batch"], r["seq_len"]) for r in rows})
    built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, conf)) for m, b, s in keys], conf)
    shapes = {k: sh for k, (sh, _) in zip(keys, built)}
    out = []
    for r in rows:
        if r["interconnect"] != "gloo":
            raise ValueError(f"step_validation: --repredict: row {r['group']} {r['point']} "
                             f"is emulated (real rows only)")
        d1, d2 = (int(x) for x in r["mesh"].split("x"))
        shape = shapes[(r["model"], r["batch"], r["seq_len"])]
        est = estimate_step(topo.restrict(r["processes"]), shape, (d1, d2), StepSetting(chunks=r["chunks"]), profile)
        why = in_sample(profile, shape, (d1, d2), r["processes"])
        out.append({**r, **prediction_fields(est, r["measured_s"]), "in_sample": why,
                    "class": ("in-sample " if why else "") + "real",
                    "calibration": calibration_field(calibration, est)})
    meta = {**meta, "calibration": calibration, "profile_terms": profile.describe(),
            "repredicted": f"measured rows re-predicted from {calibration['file']} (sha256 {calibration['sha256']}): "
                           f"a development check, not a validation of that calibration"}
    return out, meta


def resummarize(path: Path, out: Path, tag: str, again: Optional[Tuple[str, str, Path]] = None) -> int:
    """``--rows``: an earlier run's figures, files and plot again from its rows (this code's
    figures; the rows and their calibration unchanged). ``again`` (``--repredict``: topology,
    calibration directory, conf): the rows predicted again from that calibration (:func:`repredict`)."""
    from atp_pipeline.cli import EXIT_BAD_INPUT
    from atp_pipeline.errors import ConfigError

    try:
        data = json.loads(path.read_text())
        rows, meta = data["rows"], dict(data["meta"])
        if again is not None:
            rows, meta = repredict(rows, meta, *again)
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        sys.stderr.write(f"error: step_validation: --rows {path}: not a validation run ({type(exc).__name__}: {exc})\n")
        return EXIT_BAD_INPUT
    meta["resummarized_from"] = str(path)
    report(rows, meta, out, tag)
    print(f"wrote {out / tag}.{{json,csv,png}} (from the rows of {path}"
          + (f", re-predicted from {meta['calibration']['file']}" if again is not None else "") + ")")
    return 0


def _write(out: Path, tag: str, rows: List[Dict[str, Any]], meta: Dict[str, Any],
           summary: Optional[Dict[str, Any]] = None) -> None:
    """``<tag>.json`` (meta, the figures per class, every point) and ``<tag>.csv``."""
    if not rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "summary": summary or {}, "rows": rows}, indent=2)
                                     + "\n")
    with (out / f"{tag}.csv").open("w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def merge_launches(launches: Sequence[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One group's launches (each: per rank, the worker's result) as one: per rank, every point's
    timed steps, waits and CPU of all launches together, and the other jobs' load in all their rounds."""
    out = []
    for per_rank in zip(*launches):
        merged: Dict[str, Any] = {k: {} for k in ("times", "waits", "cpus")}
        for got in per_rank:
            for k in merged:
                for key, vals in got[k].items():
                    merged[k].setdefault(key, []).extend(vals)
        out.append({**merged, "foreign": [f for got in per_rank for f in got["foreign"]]})
    return out


def parse_variants(text: str) -> List[Tuple[int, int]]:
    from atp_pipeline.errors import ConfigError

    out = []
    for v in (x for x in text.split(",") if x):
        try:
            b, s = (int(x) for x in v.lower().split("x"))
        except ValueError:
            raise ConfigError(f"step_validation: --variants: '{v}' is not <batch>x<seq>") from None
        if b < 1 or s < 1:
            raise ConfigError(f"step_validation: --variants: '{v}' needs batch and seq >= 1")
        out.append((b, s))
    return out


def variant_overrides(name: str, batch: int, seq: int, conf: Path) -> List[str]:
    """``model=<name>`` with the batch and sequence length; a transformers config's learned
    positions (``hf.max_position_embeddings``) widened to the sequence where shorter."""
    from omegaconf import OmegaConf

    over = [f"model={name}", f"model.batch_size={batch}", f"model.seq_len={seq}"]
    path = conf / "model" / f"{name}.yaml"
    if path.is_file():
        hf = OmegaConf.load(path).get("hf") or {}
        if int(hf.get("max_position_embeddings", seq)) < seq:
            over.append(f"model.hf.max_position_embeddings={seq}")
    return over


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_validation", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="local", help="topology (name or YAML path) of the calibration")
    p.add_argument("--calibration-dir", default="outputs/calibration/profiles",
                   help="where stage=calibrate wrote the topology's calibration")
    p.add_argument("--models", default="llama_tiny,gpt2_tiny,small")
    p.add_argument("--variants", default="8x64,4x128", help="<batch>x<seq>, comma-separated")
    p.add_argument("--worlds", default="4,2", help="process counts")
    p.add_argument("--meshes", default="", help="only these meshes (<d1>x<d2>, comma-separated); default all")
    p.add_argument("--chunks", default="1,2")
    p.add_argument("--emulate", default="", help="topology of an emulated interconnect ('' for none)")
    p.add_argument("--slowdown", type=float, default=3000.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--launches", type=int, default=2,
                   help="launches per model variant and process count, a pass over the grid each; a point's time "
                        "is the median of its steps in all of them (one launch's own state moves a point by 0.13 "
                        "in log)")
    p.add_argument("--retime", default="launch", metavar="{" + ",".join(RETIME_MODES) + "}",
                   help="the host's speed the predictions are priced at: the probes' whole steps the calibration "
                        "recorded on the launch's process count timed inside each launch, interleaved with its "
                        "points in every round, over the calibrated model's time for them (launch); or the "
                        "calibration's own, no probe steps timed (off)")
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="seconds to wait before each launch for other jobs' load to fall below "
                        "hostload.QUIET_CORES (0: start at once; rounds under load are measured again either way)")
    p.add_argument("--allow-in-sample", action="store_true",
                   help="measure points the calibration ran (flagged, reported apart) instead of refusing")
    p.add_argument("--rows", default=None,
                   help="an earlier run's <tag>.json: its figures and plot again from its rows, nothing measured")
    p.add_argument("--repredict", action="store_true",
                   help="with --rows: predict those measured rows again from --topology/--calibration-dir "
                        "(a development check, flagged in the JSON)")
    p.add_argument("--tag", default="steps")
    p.add_argument("--out", default="outputs/benchmarks/step_validation")
    p.add_argument("--conf", type=Path, default=CONF)
    return p


def _prepare(args: argparse.Namespace) -> Any:
    """The grid to measure and what prices it: the calibration, the process counts, the probe steps
    timed inside each launch, every group's points; a ConfigError for bad input or in-sample points."""
    from types import SimpleNamespace

    from atp_pipeline.errors import ConfigError
    from atp_pipeline.planning.compute_profile import STEPS_GROUP, profile_of
    from atp_pipeline.planning.search import candidate_meshes, mesh_infeasibility
    from atp_pipeline.run.compute_measure import compose_models, load_topology_yaml
    from atp_pipeline.run.retime import probe_steps

    topo, calibration = load_calibrated(args.topology, args.calibration_dir, args.conf)
    calibrated = profile_of(topo)  # the calibration's own prices (at its host speed)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    if any(w < 1 or w > topo.world_size for w in worlds):
        raise ConfigError(f"step_validation: --worlds {args.worlds}: each in 1..{topo.world_size} "
                          f"(topology '{topo.name}')")
    if args.retime not in RETIME_MODES:
        raise ConfigError(f"step_validation: --retime {args.retime!r}: one of {', '.join(RETIME_MODES)}")
    in_launch = args.retime == "launch"
    if in_launch and min(worlds, default=2) < 2:
        raise ConfigError(f"step_validation: --retime launch: --worlds {args.worlds}: each >= 2 (the probes' "
                          f"steps run collectives)")
    if in_launch and not calibrated.reference.get(STEPS_GROUP):
        raise ConfigError(f"step_validation: --retime launch: calibration {calibration['file']} recorded no probe "
                          f"steps (calibrate again: python train.py stage=calibrate)")
    # --retime launch: per process count, the probe steps each launch also times
    # (on its own process count: the calibration must have recorded them there)
    probes_at = {w: probe_steps(calibrated, w, topo, args.conf) for w in sorted(set(worlds))} if in_launch else {}
    off = sorted(w for w, ps in probes_at.items() if ps.processes != w)
    if off:
        raise ConfigError(f"step_validation: --retime launch: "
                          f"--worlds {args.worlds}: the calibration recorded no probe steps on {off} processes "
                          f"(only on {sorted({ps.processes for ps in probes_at.values()})})")
    only = {tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",") if m}
    chunk_list = [int(c) for c in args.chunks.split(",")]
    names = [m for m in args.models.split(",") if m]
    variants = parse_variants(args.variants)
    entries = [(f"{n}@{b}x{s}", variant_overrides(n, b, s, args.conf)) for n in names for b, s in variants]
    built = compose_models(entries, args.conf)
    emu_full = (topology_from(load_topology_yaml(args.emulate, args.conf)[0]) if args.emulate else None)
    if (args.steps < 1 or args.repeats < 1 or args.launches < 1 or args.warmup < 0 or not args.slowdown > 0
            or not args.quiet_wait >= 0):
        raise ConfigError("step_validation: --steps, --repeats, --launches >= 1, --warmup >= 0, --slowdown > 0, "
                          "--quiet-wait >= 0")
    plan: List[Tuple[str, Any, Dict[str, Any], int, List[Tuple[int, int, int, bool]]]] = []
    refused: List[str] = []
    for (label, _), (shape, spec), in zip(entries, built):
        model = label.split("@")[0]
        for w in worlds:
            emu = emu_full.restrict(w) if emu_full is not None else None
            pts = [(d1, d2, c, e) for e in ([False, True] if emu is not None else [False])
                   for (d1, d2) in candidate_meshes(w) if not only or (d1, d2) in only
                   for c in chunk_list
                   if mesh_infeasibility(shape, (d1, d2)) is None and shape.batch_size % c == 0]
            for d1, d2, c, e in pts:
                why = in_sample(calibrated, shape, (d1, d2), w)
                if why and not args.allow_in_sample:
                    refused.append(f"{label} {d1}x{d2}/c{c}: {why}")
            plan.append((model, shape, spec, w, pts))
    if refused:
        raise ConfigError(f"step_validation: {len(refused)} points are in the calibration's sample "
                          f"(--allow-in-sample to measure them flagged): {'; '.join(refused[:4])}"
                          + (" ..." if len(refused) > 4 else ""))
    return SimpleNamespace(topo=topo, calibration=calibration, calibrated=calibrated, worlds=worlds,
                           in_launch=in_launch, probes_at=probes_at, emu_full=emu_full, plan=plan)


def _group_rows(args: argparse.Namespace, g: Any, launch: Dict[str, Any], each: List[List[Dict[str, Any]]],
                inside: Sequence[Any] = ()) -> List[Dict[str, Any]]:
    """A group's rows from its launches' measurements pooled (``each``: per launch, per rank):
    every point predicted beside its measurement at the geometric mean of its launches' host
    speeds (``inside``: each launch's, from the probe steps timed in it; none: at the
    calibration's own speed)."""
    from atp_pipeline.planning.compute_profile import HostSpeed
    from atp_pipeline.planning.steptime import StepSetting, estimate_step

    calibrated, topo, calibration = g.calibrated, g.topo, g.calibration
    rows: List[Dict[str, Any]] = []
    shape, w, points, emu = (launch[k] for k in ("shape", "w", "points", "emu"))
    ranks = merge_launches(each)
    got = ranks[0]
    priced = HostSpeed.over(inside) if inside else None
    at = calibrated if priced is None else calibrated.at_speed(priced)
    sub = topo.restrict(w)
    times, waits = got["times"], got["waits"]
    variant = f"b{shape.batch_size} s{shape.seq_len}"
    load = statistics.mean(got["foreign"]) if got["foreign"] else 0.0  # other jobs' cores while measured
    per_launch = [s.to_dict() for s in inside]
    record = None if priced is None else {**priced.to_dict(), "launches": args.launches, "per_launch": per_launch}
    for d1, d2, c, e in points:
        emulated = (emu, args.slowdown) if e else None
        est = estimate_step(sub, shape, (d1, d2), StepSetting(chunks=c), at, emulated)  # what stage=plan says
        # beside it, the same prediction at the calibration's own host speed (not re-timed)
        flat = est if at is calibrated else estimate_step(sub, shape, (d1, d2), StepSetting(chunks=c),
                                                          calibrated, emulated)
        # (--retime launch) the speed of the probe steps timed inside its launches, the one priced at
        extra = {} if priced is None else {"host_speed_in_launch": {**priced.to_dict(), "per_launch": per_launch},
                                           "predicted_at_in_launch_speed_s": est.step_s}
        key = json.dumps([d1, d2, c, e])
        meas = statistics.median(times[key])
        inter = f"emulated {emu.name} x{args.slowdown:g}" if e else "gloo"
        why = in_sample(calibrated, shape, (d1, d2), w)
        rows.append({"model": launch["model"], "batch": shape.batch_size, "seq_len": shape.seq_len,
                     "processes": w, "interconnect": inter,
                     "class": ("in-sample " if why else "") + ("emulated" if e else "real"),
                     "in_sample": why, "group": f"{launch['model']} {variant} / {w} proc. / {inter}",
                     "mesh": f"{d1}x{d2}", "chunks": c, "point": f"{d1}x{d2}/c{c}",
                     "measured_s": meas, **prediction_fields(est, meas), "host_load_cores": load,
                     "samples": len(times[key]), "launches": args.launches,
                     "measured_per_launch_s": [statistics.median(one[0]["times"][key]) for one in each],
                     "measured_comm_wait_s": statistics.median(waits[key]),
                     # per step, the mean over ranks: time blocked in collectives, CPU seconds (all threads)
                     "measured_rank_wait_s": statistics.mean(statistics.median(g["waits"][key]) for g in ranks),
                     "measured_rank_cpu_s": statistics.mean(statistics.median(g["cpus"][key]) for g in ranks),
                     "host_speed": record,
                     "predicted_at_calibration_speed_s": flat.step_s, **extra,
                     "calibration": calibration_field(calibration, est)})
    return rows


def _retime_note(args: argparse.Namespace) -> str:
    """What the predictions were priced at, for the report's meta."""
    return ("--retime launch: the probes' whole steps the calibration recorded timed inside each launch, "
            "interleaved with its points in every round, over the calibrated model's time for them, every "
            "group's points priced at the geometric mean of its launches' speeds (rows: host_speed, per_launch)"
            if args.retime == "launch" else "not re-timed: predicted at the calibration's host speed")


def _finish_grid(args: argparse.Namespace, argv: Optional[Sequence[str]], g: Any, rows: List[Dict[str, Any]],
                 speeds: List[Dict[str, Any]], foreign_load: List[Dict[str, Any]], load_start: Any,
                 wall_s: float) -> None:
    """The grid's report (figures, files, plot) and its summary lines."""
    topo, calibration, calibrated, worlds, in_launch = g.topo, g.calibration, g.calibrated, g.worlds, g.in_launch
    retimed = _retime_note(args)
    meta = {"topology": topo.name, "calibration": calibration, "profile_terms": calibrated.describe(),
            "host_speed": {"retime": args.retime, "note": retimed, "measured": speeds,
                           "probes_in_launch": in_launch},
            "contention": {str(k): v for k, v in sorted(calibrated.contention.items())},
            "probes": sorted({p.name for p in calibrated.probes}),
            "load_average": {"start": load_start, "end": _loadavg()},
            "foreign_load_cores": foreign_load,  # other jobs' CPU during each kept round (hostload)
            "worlds": worlds, "variants": args.variants, "emulate": args.emulate, "slowdown": args.slowdown,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "launches": args.launches,
            "wall_s": wall_s,
            "command": "python -m benchmarks.step_validation " + " ".join(sys.argv[1:] if argv is None else argv)}
    report(rows, meta, Path(args.out), args.tag)
    print(f"calibration: {calibration['file']} (sha256 {calibration['sha256']}, {calibration['date']}): "
          f"{calibrated.describe()}")
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {meta['load_average']['end']}")
    print(f"wrote {Path(args.out) / args.tag}.{{json,csv,png}} ({meta['wall_s']:.0f} s)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.rows:
        return resummarize(Path(args.rows), Path(args.out), args.tag,
                           (args.topology, args.calibration_dir, args.conf) if args.repredict else None)
    from atp_pipeline.cli import EXIT_BAD_INPUT
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.launch import spawn
    from atp_pipeline.planning.profile_fit import utc_now
    from atp_pipeline.run.hostload import wait_quiet

    try:
        g = _prepare(args)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    rows: List[Dict[str, Any]] = []
    foreign_load: List[Dict[str, Any]] = []
    speeds: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    load_start = _loadavg()
    launched: Dict[str, List[Tuple[Any, Any]]] = {}  # a group's launches so far: (ranks, in-launch speed)
    # every group once per pass, --launches passes (a group's launches minutes apart)
    order = [one for _ in range(args.launches) for one in sorted((x for x in g.plan if x[4]), key=lambda x: -x[3])]
    for n, (model, shape, spec, w, points) in enumerate(order):
        tag = f"{shape.name} / {w} proc." + (f" (launch {n // (len(order) // args.launches) + 1})"
                                              if args.launches > 1 else "")
        emu = g.emu_full.restrict(w) if g.emu_full is not None else None
        spec = {**spec, "points": points, "emulate": emu.to_dict() if emu is not None else None,
                "slowdown": args.slowdown, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}
        ps = g.probes_at.get(w)  # --retime launch: the probe steps, interleaved with the points in every round
        if ps is not None:
            spec["probe_models"] = [m for _, m in ps.built]
            spec["probe_points"] = [(label, mi, d1, d2, c) for label, (mi, d1, d2, c) in zip(ps.labels, ps.plans)]
        print(f"{tag}: measuring {len(points)} points on {w} processes ...", flush=True)
        wait_quiet(args.quiet_wait)  # other jobs' load: wait a while for a quiet host (rounds are checked too)
        ranks = spawn(_worker, w, spec, timeout=3600)
        foreign_load.append({"model": shape.name, "processes": w, "rounds": ranks[0]["foreign"]})
        inside = None
        if ps is not None:  # the host's speed in this launch: its probe steps over the model's time for them
            inside = ps.speed({label: statistics.median(ranks[0]["times"][json.dumps(["probe", label])])
                               for label in ps.labels}, f"inside {tag} ({utc_now()})")
            speeds.append({"at": f"inside {tag}", **inside.to_dict()})
            print(f"  {inside.describe()}", flush=True)
        done = launched.setdefault(f"{shape.name} / {w}", [])
        done.append((ranks, inside))
        if len(done) == args.launches:  # the group's rows (the partial report survives a crash)
            launch = {"model": model, "shape": shape, "w": w, "points": points, "emu": emu}
            rows.extend(_group_rows(args, g, launch, [r for r, _ in done], [s for _, s in done if s is not None]))
            _write(Path(args.out), args.tag, rows, {"partial": True, "calibration": g.calibration})
    _finish_grid(args, argv, g, rows, speeds, foreign_load, load_start, time.perf_counter() - t0)
    return 0


def topology_from(data: Dict[str, Any]) -> Any:
    from atp_pipeline.topology.model import Topology

    return Topology.from_config(data)


if __name__ == "__main__":
    raise SystemExit(main())
