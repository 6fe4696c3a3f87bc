"""``python train.py stage=calibrate``: one command writes the topology's
calibration, ``stage=plan`` finds it without a flag and predicts steps from it, and the step
validation refuses points the calibration ran."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from atp_pipeline.planning import compute_profile as cp
from atp_pipeline.planning import kernels as kn
from atp_pipeline.planning.alphabeta_fit import write_topology
from atp_pipeline.planning.shape import ModelShape

from .conftest import CONF


def test_stage_calibrate_writes_what_stage_plan_then_predicts_steps_from(compose_cfg, tmp_path, capsys, monkeypatch):
    """A quick calibration of a 2-process 'local' (its own levels), found by the plan by the
    topology's name; a file for other levels is named and not used. The host's speed is the
    probes' steps now over the calibrated model's time for them, exactly, timed only when asked
    (``calibration.retime=true``)."""
    from atp_pipeline.run import run
    from atp_pipeline.run.resolve import plan_from_config

    two = ("topology=local", "topology.levels.0.count=2", f"calibration.dir={tmp_path}")
    row = run(compose_cfg("stage=calibrate", "calibration.quick=true", "calibration.passes=1", *two))
    path = tmp_path / "local.yaml"
    assert row["calibration"] == str(path) and path.is_file()
    out = capsys.readouterr().out
    assert "kernels, probes, loops" in out and f"wrote {path}" in out  # the progress bar's parts, the file
    prof = cp.ComputeProfile.from_config(__import__("yaml").safe_load(path.read_text())["device"]["compute"])
    assert prof.processes == 2 and set(prof.contention) == {1, 2} and prof.framework is not None
    assert {p.name for p in prof.probes} == {"probe_gpt_s"} and prof.date
    steps = json.loads((tmp_path / "local_probe_steps.json").read_text())  # what the step residual was fitted over
    assert steps["profile"] == prof.name and ({(r["probe"], r["processes"]) for r in steps["rows"]}
                                              == {("probe_gpt_s", 2)})
    assert {(r["mesh"], r["chunks"]) for r in steps["rows"]} == {("2x1", 1), ("1x2", 1), ("2x1", 2), ("1x2", 2)}
    assert all(r["measured_s"] > 0 and r["measured_cpu_s"] > 0 and r["cpu_s"] > 0 and r["predicted_s"] > 0
               for r in steps["rows"])
    assert {g: sorted(v) for g, v in prof.reference.items()} == {  # the host's speed at calibration: the probe's steps
        "steps": sorted(f"probe_gpt_s {m}/c{c} on 2" for m in ("2x1", "1x2") for c in (1, 2))}
    assert all(v > 0 for v in prof.reference["steps"].values())
    plain = plan_from_config(compose_cfg(*two, "model=tiny"))  # by default: the calibration's speed, no timing
    assert plain.objective.value == "step" and plain.profile.speed is None
    assert any("calibration.retime=true times the host again" in n for n in plain.notes)
    assert not (tmp_path / "local_speed.json").exists()
    plan = plan_from_config(compose_cfg(*two, "model=tiny", "calibration.retime=true"))  # re-times the probe's steps
    assert plan.objective.value == "step" and all(c.step is not None for c in plan.candidates)
    assert plan.profile.name == prof.name and plan.profile.speed is not None
    speed = plan.profile.speed
    assert speed.processes == 2 and speed.compute == speed.overhead > 0
    assert any(f"calibration {path} (sha256 {row['sha256']}" in n for n in plan.notes)
    assert any(speed.describe() in n for n in plan.notes)
    assert "the probes' whole steps on 2 processes ran x" in speed.describe()
    cached = json.loads((tmp_path / "local_speed.json").read_text())
    assert cached["sha256"] == row["sha256"] and cached["compute"] == speed.compute and cached["basis"] == "steps"
    again = plan_from_config(compose_cfg(*two, "model=tiny", "calibration.retime=true"))  # within retime_s: reused
    assert again.profile.speed == speed and any("reused for calibration.retime_s" in n for n in again.notes)
    other = plan_from_config(compose_cfg("topology=local", f"calibration.dir={tmp_path}", "model=tiny"))
    assert other.objective.value == "comm"  # 4 processes: the file is for 2
    assert any("is for levels (('process', 2),)" in n and "not used" in n for n in other.notes)
    off = plan_from_config(compose_cfg(*two, "calibration.use=false", "model=tiny"))
    assert off.objective.value == "comm"
    from atp_pipeline.planning import profile_fit as pf
    from atp_pipeline.run import compute_measure as cm
    from atp_pipeline.run import retime as hs
    from atp_pipeline.topology.model import Topology

    topo = Topology.from_config(__import__("yaml").safe_load(path.read_text()))
    labels = sorted(prof.reference["steps"])
    shape = cm.compose_models(cm.probe_entries(["probe_gpt_s"]), cm.CONF)[0][0]
    model = {label: est.step_s for label, est in zip(labels, pf.probe_step_predictions(
        prof, topo, [shape], [(0, *cp.parse_step_label(label)[1], cp.parse_step_label(label)[2]) for label in labels]))}
    monkeypatch.setattr(hs, "time_probe_steps", lambda probes, n, conf, built: {k: 1.25 * v for k, v in model.items()})
    assert hs.retime_steps(prof, 4, topo).compute == pytest.approx(1.25)  # 2 recorded: the nearest count
    assert model != prof.reference["steps"]  # not the steps' own wall times at calibration


def test_validation_refuses_points_the_calibration_ran(tmp_path, capsys):
    """A point whose model a probe was, or whose mesh, batch and sequence length a probe ran
    with, is in sample: refused in one line (exit 2), or flagged with --allow-in-sample."""
    from benchmarks import step_validation as sv

    tiny = ModelShape(name="tiny", hidden=64, heads=8, layers=2, seq_len=64, vocab_size=256, ffn=256,
                         batch_size=8)
    other = ModelShape(name="other", hidden=32, heads=4, layers=1, seq_len=64, vocab_size=256, ffn=128,
                          batch_size=8)
    probes = (cp.Probe("p_tiny", cp.shape_key(tiny), (4, 1), 6, 48), cp.Probe("p_b", "x", (2, 2), 8, 64))
    prof = cp.ComputeProfile("c", "test", {k: cp.KindFit(1e-6, 1e-9) for k in kn.KINDS}, processes=4,
                             probes=probes)
    assert sv.in_sample(prof, tiny, (1, 4), 4) == "model calibrated (probe p_tiny)"
    assert sv.in_sample(prof, other, (2, 2), 4).startswith("mesh 2x2 with batch 8 and sequence 64 calibrated")
    assert sv.in_sample(prof, other, (2, 2), 2) == "" and sv.in_sample(prof, other, (4, 1), 4) == ""
    # step residual's
    two = dataclasses.replace(prof, probes=(*probes, cp.Probe("p_b", "x", (2, 1), 8, 64, processes=2)))
    assert sv.in_sample(two, other, (2, 1), 2).startswith("mesh 2x1 with batch 8 and sequence 64 calibrated")
    assert sv.in_sample(two, other, (2, 1), 4) == ""
    assert cp.ComputeProfile.from_config(two.to_config()).probes == two.probes
    cfg = {"name": "cal4", "levels": [{"name": "process", "count": 4, "p2p_GBps": 1.0, "group_GBps": 1.0}],
           "device": {"name": "cpu", "compute": prof.to_config()}}
    write_topology(cfg, tmp_path / "cal4.yaml")
    code = sv.main(["--topology", str(tmp_path / "cal4.yaml"), "--models", "tiny", "--variants", "8x64",
                    "--worlds", "4", "--retime", "off", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: step_validation: 6 points are in the calibration's sample (--allow-in-sample")
    assert "tiny@8x64 4x1/c1: model calibrated (probe p_tiny)" in err[0]
    assert not (tmp_path / "out").exists()


def test_repredict_keeps_the_measurements_and_names_the_new_calibration():
    """``--rows ... --repredict``: an earlier run's measured rows predicted again from a
    calibration (``tests/data``), flagged, their measurements kept and their predictions at the
    calibration's own speed what they were; emulated rows are refused; a calibration of an older
    format is refused in one line naming ``stage=calibrate``."""
    from benchmarks import step_validation as sv

    data = Path(__file__).resolve().parent / "data"
    group = json.loads((data / "step_rows.json").read_text())["rows"]
    cal = str(data / "step_calibration.yaml")
    digest = sv.load_calibrated(cal, "unused", CONF)[1]["sha256"]
    out, meta = sv.repredict(group, {"command": "x"}, cal, "unused", CONF)
    assert len(out) == len(group) == 8
    assert [(r["point"], r["measured_s"]) for r in out] == [(r["point"], r["measured_s"]) for r in group]
    assert all(r["calibration"].startswith(f"{cal} sha256 {digest}: ") for r in out)
    assert meta["calibration"]["sha256"] == digest and "development check" in meta["repredicted"]
    assert [r["predicted_s"] for r in out] == pytest.approx([r["predicted_at_calibration_speed_s"] for r in group],
                                                            rel=1e-9)
    assert all(r["rel_error"] == abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in out)
    with pytest.raises(ValueError, match="emulated"):
        sv.repredict([dict(group[0], interconnect="emulated ic1 x3000")], {}, cal, "unused", CONF)


def test_rounds_other_jobs_loaded_are_measured_again(monkeypatch):
    """A round with more than QUIET_CORES of other jobs' load is run again (at most `retries`
    more); the least loaded are kept, in their order."""
    from atp_pipeline.run import hostload

    loads = iter([0.9, 0.1, 0.6, 0.2, 0.0])

    class FakeRound:
        def start(self) -> None:
            pass

        def foreign(self) -> float:
            return next(loads)

    monkeypatch.setattr(hostload, "Round", FakeRound)
    kept, foreign = hostload.quiet_rounds(2, 2, lambda i: f"round {i}")
    assert kept == ["round 1", "round 3"] and foreign == [0.1, 0.2]  # round 0 and 2 loaded; stops at two quiet
    loads = iter([0.9, 0.8, 0.7])
    kept, foreign = hostload.quiet_rounds(1, 2, lambda i: i)
    assert kept == [2] and foreign == [0.7]  # never quiet: the least loaded of 1 + 2 rounds
    # --quiet-wait 0 (or any max_s <= 0): no wait, not even one window (it had slept a 2 s window)
    monkeypatch.setattr(hostload, "host_busy_s", lambda: (_ for _ in ()).throw(AssertionError("measured a window")))
    assert hostload.wait_quiet(0) == 0.0 and hostload.wait_quiet(-1.0) == 0.0


def test_retime_option_refusals_and_the_probe_ratios_correlation(tmp_path, capsys):
    """``--retime launch`` (the default) is refused at one process (its probes run collectives) and
    on a calibration that recorded no probe steps, any other mode than ``launch`` and ``off`` is
    refused, and no launch a group, each in one line (exit 2); ``--probes-in-launch`` is no option
    (argparse's exit 2, one error line after the usage, as for any unknown flag). The summary's
    correlation of the groups' re-timed probe ratio (rows that carry ``probe_steps``) with their
    measured/predicted is Pearson's over the groups that have one."""
    import statistics

    from benchmarks import step_validation as sv

    prof = cp.ComputeProfile("c", "test", {k: cp.KindFit(1e-6, 1e-9) for k in kn.KINDS}, processes=4)
    cfg = {"name": "cal4", "levels": [{"name": "process", "count": 4, "p2p_GBps": 1.0, "group_GBps": 1.0}],
           "device": {"name": "cpu", "compute": prof.to_config()}}
    write_topology(cfg, tmp_path / "cal4.yaml")
    base = ["--topology", str(tmp_path / "cal4.yaml"), "--models", "tiny", "--variants", "9x40",
            "--out", str(tmp_path / "out")]
    for extra, says in ((["--retime", "bogus", "--worlds", "4"], "--retime 'bogus': one of launch, off"),
                        (["--retime", "bracket", "--worlds", "4"], "--retime 'bracket': one of launch, off"),
                        (["--retime", "steps", "--worlds", "4"], "--retime 'steps': one of launch, off"),
                        (["--worlds", "2"], "--retime launch: calibration " + str(tmp_path / "cal4.yaml")
                         + " recorded no probe steps (calibrate again: python train.py stage=calibrate)"),
                        (["--worlds", "2,1"], "--retime launch: --worlds 2,1: each >= 2"),
                        (["--retime", "off", "--worlds", "2", "--launches", "0"],
                         "--steps, --repeats, --launches >= 1")):
        assert sv.main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    with pytest.raises(SystemExit) as exc:
        sv.main([*base, "--retime", "off", "--worlds", "2", "--probes-in-launch"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[0].startswith("usage: python -m benchmarks.step_validation")
    assert [line for line in err if "error" in line] == [
        "python -m benchmarks.step_validation: error: unrecognized arguments: --probes-in-launch"] == err[-1:]
    assert not (tmp_path / "out").exists()
    rows = [{"model": "m", "group": g, "point": f"{i}x1/c1", "predicted_s": 1.0, "measured_s": b * (1 + 0.01 * i),
             "rel_error": 0.0, **({"probe_steps": {"ratio": r}} if r else {})}
            for g, b, r in (("a", 0.8, 0.9), ("b", 1.0, 1.1), ("c", 1.1, 1.0), ("d", 1.2, None)) for i in (1, 2, 3)]
    got = sv.summarize(rows)
    biases = [got["groups"][g]["bias"] for g in "abc"]
    assert got["probe_ratio_bias_correlation"] == pytest.approx(statistics.correlation([0.9, 1.1, 1.0], biases))
    assert got["probe_ratio_range"] == [0.9, 1.1] and "probe_ratio" not in got["groups"]["d"]
    assert "probe_ratio_bias_correlation" not in sv.summarize([{**r, "probe_steps": None} for r in rows])


def test_retime_launch_prices_a_group_at_the_probe_steps_timed_inside_its_launches(tmp_path, monkeypatch, capsys):
    """``--retime launch`` (the default): every launch also times the probe steps the calibration
    recorded on its process count (the probe models, meshes and chunk counts of ``probe_steps``),
    interleaved with its points; the launch's speed is their steps over the calibrated model's time
    for them and a group is priced at the geometric mean of its launches' (:meth:`HostSpeed.over`),
    no probe launch around it. With ``--launches 2`` (the default) each group is launched once per
    pass over the grid, its points' steps pooled. ``--retime off`` times no probe steps and prices at
    the calibration's own speed. A process count the calibration recorded no probe steps on is
    refused in one line. Launches are stand-ins (the bookkeeping is what is checked; the worker's
    probe runners run in tests/test_docs_commands.py)."""
    import math

    from atp_pipeline import launch
    from atp_pipeline.planning.steptime import StepSetting, estimate_step
    from atp_pipeline.run import compute_measure as cm
    from atp_pipeline.run import retime as hs
    from atp_pipeline.topology.model import Topology
    from benchmarks import step_validation as sv

    prof = dataclasses.replace(cp.ComputeProfile("c", "test", {k: cp.KindFit(1e-6, 1e-9) for k in kn.KINDS},
                                                 processes=4),
                               reference={"steps": {"probe_gpt_s 2x1/c1 on 2": 0.02, "probe_gpt_s 1x2/c2 on 2": 0.03,
                                                    "probe_gpt_s 4x1/c1 on 4": 0.04}})
    cfg = {"name": "cal4", "levels": [{"name": "process", "count": 4, "p2p_GBps": 1.0, "group_GBps": 1.0}],
           "device": {"name": "cpu", "compute": prof.to_config()}}
    write_topology(cfg, tmp_path / "cal4.yaml")
    topo = Topology.from_config(cfg)
    profile = cp.ComputeProfile.from_config(prof.to_config())
    ps = hs.probe_steps(profile, 2, topo)
    assert ps.labels == ("probe_gpt_s 1x2/c2 on 2", "probe_gpt_s 2x1/c1 on 2") and ps.processes == 2
    # the probe steps ran x1.3, x1.2 / x0.8, x0.9 the model's time in the 1st, 2nd launch of seq 16 / 24
    factor = {16: (1.3, 1.2), 24: (0.8, 0.9)}
    seen = []

    def spawn(fn, w, spec, timeout):  # every point 10 ms in a group's 1st launch, 20 ms in its 2nd
        seen.append(spec)
        i = sum(s["seq_len"] == spec["seq_len"] for s in seen) - 1
        keys = [json.dumps(list(p)) for p in spec["points"]]
        probes = {json.dumps(["probe", label]): factor[spec["seq_len"]][i] * ps.model_s[label]
                  for label, *_ in spec.get("probe_points", [])}
        got = {"times": {**{k: [0.01 * (i + 1)] for k in keys}, **{k: [t] for k, t in probes.items()}},
               "waits": {k: [0.001] for k in [*keys, *probes]}, "cpus": {k: [0.005] for k in [*keys, *probes]},
               "foreign": [0.0]}
        return [got] * w
    monkeypatch.setattr(launch, "spawn", spawn)
    monkeypatch.setattr(hs, "retime_steps", lambda *a: pytest.fail("a probe launch"))

    def run(*extra: str) -> dict:
        seen.clear()
        out = tmp_path / "-".join(extra)
        assert sv.main(["--topology", str(tmp_path / "cal4.yaml"), "--models", "tiny", "--variants", "2x16,2x24",
                        "--worlds", "2", "--chunks", "1", "--quiet-wait", "0", "--out", str(out), "--tag", "t",
                        *extra]) == 0
        return json.loads((out / "t.json").read_text())

    def estimate(r: dict, at: cp.ComputeProfile) -> float:
        d1, d2 = (int(x) for x in r["mesh"].split("x"))
        shape = cm.compose_models([(f"tiny@2x{r['seq_len']}", sv.variant_overrides("tiny", 2, r["seq_len"], CONF))],
                                  CONF)[0][0]
        return estimate_step(topo.restrict(2), shape, (d1, d2), StepSetting(chunks=1), at).step_s

    got = run("--launches", "2")  # the default --retime
    assert [s["seq_len"] for s in seen] == [16, 24, 16, 24] and got["meta"]["host_speed"]["retime"] == "launch"
    assert all(s["probe_points"] == [(label, mi, d1, d2, c) for label, (mi, d1, d2, c) in zip(ps.labels, ps.plans)]
               and [m["family"] for m in s["probe_models"]] == ["gpt"] for s in seen)
    assert got["meta"]["host_speed"]["probes_in_launch"] is True
    assert [m["at"] for m in got["meta"]["host_speed"]["measured"]] == [
        f"inside tiny@2x{seq} / 2 proc. (launch {n})" for n in (1, 2) for seq in (16, 24)]
    assert sorted(r["seq_len"] for r in got["rows"]) == [16, 16, 24, 24]  # 2x1 and 1x2
    for r in got["rows"]:
        f = math.sqrt(math.prod(factor[r["seq_len"]]))
        sp = r["host_speed"]
        assert (sp["basis"], sp["processes"], sp["launches"]) == ("steps", 2, 2) and sp["compute"] == pytest.approx(f)
        assert [s["compute"] for s in sp["per_launch"]] == pytest.approx(factor[r["seq_len"]]) and "bracket" not in sp
        assert r["host_speed_in_launch"] == {k: v for k, v in sp.items() if k != "launches"}
        assert r["predicted_s"] == pytest.approx(estimate(r, profile.at_speed(cp.HostSpeed(f, f, "", 2))), rel=1e-9)
        assert r["predicted_at_in_launch_speed_s"] == r["predicted_s"]
        assert r["predicted_at_calibration_speed_s"] == pytest.approx(estimate(r, profile), rel=1e-9)
        # the median of 10 and 20 ms, one step in each launch
        assert r["measured_s"] == pytest.approx(0.015) and r["samples"] == 2 and r["launches"] == 2
        assert r["measured_per_launch_s"] == pytest.approx([0.01, 0.02])
    got = run("--retime", "off", "--launches", "1")
    assert len(seen) == 2 and not any("probe_points" in s for s in seen)
    assert got["meta"]["host_speed"]["measured"] == [] and got["meta"]["host_speed"]["probes_in_launch"] is False
    assert got["meta"]["host_speed"]["note"] == "not re-timed: predicted at the calibration's host speed"
    for r in got["rows"]:
        assert r["host_speed"] is None and "host_speed_in_launch" not in r and "predicted_at_in_launch_speed_s" not in r
        assert r["predicted_s"] == r["predicted_at_calibration_speed_s"]
        assert r["predicted_s"] == pytest.approx(estimate(r, profile), rel=1e-9)
    capsys.readouterr()
    assert sv.main(["--topology", str(tmp_path / "cal4.yaml"), "--models", "tiny", "--variants", "2x16",
                    "--worlds", "3", "--retime", "launch", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--retime launch: --worlds 3: the calibration recorded no probe steps on [3] processes" \
        in err[0], err
