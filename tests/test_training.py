"""The training pipeline and the Lightning strategy "atp" on real processes.

Runs are kept tiny (tiny GPT, short sequences, few steps); each test is one launch.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from atp_pipeline.errors import ConfigError
from atp_pipeline.run.fit import fit
from atp_pipeline.run.report import read_metrics
from atp_pipeline.run.resolve import resolve
from atp_pipeline.run.worker import FAULT_KILL

from .conftest import ROOT, finish_train, run_side_by_side, run_train, start_train

FAST = ["model.seq_len=32", "trainer.progress_bar=false", "planner.plot=false"]


def _fit(compose_cfg, out: Path, *overrides: str) -> Dict[str, Any]:
    cfg = compose_cfg(*FAST, *overrides, f"paths.output_dir={out}")
    return fit(resolve(cfg), out)


def _losses(run_dir: Path) -> List[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.csv") if "loss" in r]


def test_fewer_devices_plan_on_the_occupied_sub_topology(compose_cfg):
    cfg = compose_cfg("topology=ic4", "trainer.devices=4", "stage=fit", "trainer.accelerator=gpu")
    with pytest.raises(ConfigError, match="needs 4 GPUs on this host, found 0"):
        resolve(cfg)
    cfg.trainer.accelerator = "cpu"
    with pytest.raises(ConfigError, match="describes A100-80GB devices but trainer.accelerator=cpu"):
        resolve(cfg)
    cfg = compose_cfg("topology=ic4", "trainer.devices=4", "stage=plan")
    plan = resolve(cfg).plan
    assert plan.world_size == 4 and [(lvl.name, lvl.count) for lvl in plan.topology.levels] == [("gpu", 4)]
    assert plan.notes[0] == "4 of 16 devices of 'ic4' are used: planned and run on that sub-topology"
    assert "sub-topology of 'ic4': the first 4 of 16 devices (one 'node')" in plan.to_dict()["notes"]


def test_plain_lightning_script_uses_strategy_atp(tmp_path):
    """No Hydra: Trainer(strategy="atp") after `import atp_pipeline` (popen launcher)."""
    script = tmp_path / "train_plain.py"
    script.write_text(textwrap.dedent("""
        import pytorch_lightning as pl
        import atp_pipeline  # registers strategy "atp"
        from atp_pipeline.lightning import LMModule, TokenDataModule
        from atp_pipeline.models.gpt import GPT, GPTConfig
        from atp_pipeline.parallel import ATPLinear

        class MyModule(LMModule):
            pass

        cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=32, heads=8, layers=2)
        module = MyModule(lambda: GPT(cfg))
        trainer = pl.Trainer(strategy="atp", accelerator="cpu", devices=4, max_steps=5, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(module, datamodule=TokenDataModule("corpus", cfg.seq_len, batch_size=8))
        linears = sum(isinstance(m, ATPLinear) for m in module.modules())
        print(f"RESULT rank={trainer.global_rank} mesh={trainer.strategy.mesh_shape} atp_linears={linears} "
              f"nn_linears={sum(type(m).__name__ == 'Linear' for m in module.modules())} "
              f"steps={trainer.global_step} loss={float(trainer.callback_metrics['loss']):.6f}")
    """))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = re.findall(r"RESULT rank=(\d) mesh=\((\d), (\d), (\d)\) atp_linears=9 nn_linears=0 steps=5 "
                         r"loss=(\d+\.\d{6})", out.stdout)  # ranks print concurrently
    assert sorted(r[0] for r in results) == ["0", "1", "2", "3"], out.stdout[-2000:]
    (dp, d1, d2), = {r[1:4] for r in results}  # the mesh the whole-layout search chose, the one it printed
    assert int(dp) * int(d1) * int(d2) == 4 and f"search chose dp{dp} x {d1}x{d2}," in out.stderr + out.stdout
    assert len({r[4] for r in results}) == 1  # tensor-parallel ranks and replicas agree


def test_lr_schedules_warm_up_then_decay_to_min_lr():
    """trainer.lr_schedule: a linear warmup to lr, then constant, or cosine / linear down to min_lr at max_steps."""
    from atp_pipeline.lightning.schedule import lr_factor

    assert [lr_factor(s, "constant", 4, 20, 0.1) for s in (0, 3, 4, 19)] == [0.25, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, "cosine", 2, 12, 0.1) for s in range(13)]
    assert cos[:3] == [0.5, 1.0, 1.0] and cos[7] == pytest.approx(0.55) and cos[12] == pytest.approx(0.1)
    assert all(x >= y for x, y in zip(cos[2:], cos[3:]))
    assert [lr_factor(s, "linear", 0, 4, 0.0) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_2x2_matches_single_process_resumes_exactly_and_dp_replicas_stay_identical(compose_cfg, tmp_path):
    """Under a warmup + cosine learning-rate schedule (trainer.lr_schedule): 2x2 equals one process,
    a resume from the middle repeats the second half exactly (the scheduler's step is in the
    checkpoint), and dp replicas stay identical."""
    from atp_pipeline.lightning.schedule import lr_factor

    sched = ["trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.lr=0.003", "trainer.min_lr=0.0003"]
    single = _fit(compose_cfg, tmp_path / "single", *sched, "trainer.devices=1", "trainer.max_steps=10")
    tp = _fit(compose_cfg, tmp_path / "tp", *sched, "mesh=2x2", "trainer.devices=4", "trainer.max_steps=10",
              "trainer.checkpoint_every_n_steps=5")
    a, b = _losses(tmp_path / "single"), _losses(tmp_path / "tp")
    assert len(a) == len(b) == 10
    lrs = [r["lr"] for r in read_metrics(tmp_path / "tp" / "metrics.csv") if "lr" in r]
    assert lrs == pytest.approx([0.003 * lr_factor(s, "cosine", 3, 10, 0.1) for s in range(10)], rel=1e-6)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4, list(zip(a, b))
    assert tp["selected"] == "2x2" and single["selected"] == "1x1"
    assert b[-1] < b[0]

    # resume from the sharded checkpoint of step 5: steps 6..10 again, exactly
    ckpt = tmp_path / "tp" / "checkpoints" / "step5.ckpt"
    assert ckpt.is_dir(), "a sharded (torch.distributed.checkpoint) checkpoint directory"
    assert len(list(ckpt.glob("*.distcp"))) == 4  # one shard file per rank
    _fit(compose_cfg, tmp_path / "second", *sched, "mesh=2x2", "trainer.max_steps=10", f"resume={ckpt}")
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "second" / "metrics.csv") if "loss" in r}
    assert sorted(resumed) == list(range(5, 10))  # steps 6..10
    for step in resumed:
        assert resumed[step] == pytest.approx(b[step], abs=1e-6), step

    dp = _fit(compose_cfg, tmp_path / "dp", *sched, "topology.levels.0.count=8", "mesh=2x2", "mesh.dp=2",
              "trainer.max_steps=10")
    results = dp["_results"]
    assert dp["dp"] == 2 and len(results) == 8
    by_tp_coord: Dict[tuple, List[Dict[str, str]]] = {}
    for r in results:
        by_tp_coord.setdefault(tuple(r["coord"][1:]), []).append(r["digest"])
    assert len(by_tp_coord) == 4
    for coord, digests in by_tp_coord.items():
        assert len(digests) == 2 and digests[0] == digests[1], f"dp replicas of {coord} diverged"
    assert dp["comm_dp_bytes"] > 0  # the gradient sync ran through the counted Comm


def test_four_run_sweep_leaves_one_sweep_dir(tmp_path):
    sweep = tmp_path / "sweep"
    out = run_train(["-m", "mesh=2x1,1x2", "overlap=chunk1,chunk2", "trainer.devices=2", *FAST,
                     "trainer.max_steps=4", "trainer.log_every_n_steps=2", "trainer.checkpoint_every_n_steps=0",
                     f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [p for p in sweep.iterdir() if p.is_dir()]
    assert len(runs) == 4
    for run in runs:
        assert (run / "metrics.csv").exists() and (run / "plan.json").exists()
        assert [r["step"] for r in read_metrics(run / "metrics.csv") if "loss" in r] == [1, 3]  # every 2nd step
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(rows) == 4
    assert {(r["selected"], r["chunks"]) for r in rows} == {
        (m, c) for m in ("2x1", "1x2") for c in ("1", "2")}
    assert (sweep / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("outputs")), "no second sweep directory from re-executed argv"


BAD_TRAINING_INPUT = [
    (["mesh=3x1"], "error: mesh 3x1 (3 devices a replica) does not divide the 4 devices (mesh.dp x d1 x d2 must "),
    (["model.heads=2", "model.hidden=64", "mesh=4x1"],
     "error: mesh 4x1: 2 heads of model 'tiny' do not split over d1*d2 = 4x1 = 4 devices"),
    (["+USERCONF", "model=badplan"], "error: parallel plan: pattern 'blocks.*.atn' matches no module of GPT"),
    (["trainer.devices=8"], "error: trainer.devices=8 but topology 'local' has only 4 devices"),
    (["topology=ic4", "model=m4", "model.layers=96"],
     "error: no layout of the 16 devices of 'ic4' can run model 'm4': every runnable one needs more memory than "
     "the 80 GB per device; the smallest device memory that fits is 244.2 GB"),
    (["topology=ic4", "model=m3"], "error: topology 'ic4' describes A100-80GB devices but trainer.accelerator=cpu"),
    (["model=llama_tiny", "overlap=chunk4", "model.batch_size=6"],
     "error: overlap.chunks=4 must be >= 1 and divide model.batch_size=6"),
    (["model=hf_pretrained"], "error: model 'hf_pretrained': set model.pretrained=<a local HF checkpoint directory>"),
    (["trainer.max_restarts=-1"], "error: trainer.max_restarts=-1 must be >= 0"),
    (["resume=auto"], "error: resume=auto: no complete checkpoint in "),  # (a new run directory: none)
    ([f"resume={Path(__file__).parent / 'data'}"],
     f"error: resume={Path(__file__).parent / 'data'}: not a complete checkpoint (no .metadata or meta.pt: partial"),
]
#: the cases that run as ``python train.py`` (the others resolve in this process: the same
#: :func:`resolve` raises, and tests/test_cli.py covers how the CLI prints it): a refusal after
#: the fit's fork server was started (it is stopped), and a user's config directory
BAD_TRAINING_CLI = (0, 2, 8, 9)  # (and trainer.max_restarts=-1, resume=auto: train.py reads the run directory)


def _user_conf(tmp: Path) -> Path:
    conf = tmp / "userconf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "badplan.yaml").write_text(  # a user's model whose plan has a typo
        "name: badplan\nhidden: 64\nheads: 8\nlayers: 2\nseq_len: 32\nbatch_size: 8\n"
        "vocab_size: 256\ndtype: fp32\nparallel_plan:\n  'blocks.*.atn': column\n")
    return conf


@pytest.fixture(scope="module")
def bad_training_runs(tmp_path_factory) -> Dict[int, Tuple[subprocess.CompletedProcess, Path]]:
    """:data:`BAD_TRAINING_CLI`'s cases as ``python train.py``, run side by side."""
    tmp = tmp_path_factory.mktemp("bad_input")
    runs = run_side_by_side(tmp, [BAD_TRAINING_INPUT[i][0] for i in BAD_TRAINING_CLI], _user_conf(tmp))
    return dict(zip(BAD_TRAINING_CLI, runs))


@pytest.mark.parametrize("case", range(len(BAD_TRAINING_INPUT)),
                         ids=[m for _, m in BAD_TRAINING_INPUT])
def test_bad_training_input_fails_before_any_worker(bad_training_runs, compose_cfg, case):
    args, message = BAD_TRAINING_INPUT[case]
    if case in bad_training_runs:
        out, run = bad_training_runs[case]
        assert out.returncode == 2, out.stderr[-2000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), out.stderr
        assert not (run / "lightning_logs").exists() and not (run / "checkpoints").exists()
        return
    with pytest.raises(ConfigError) as e:  # (the user config dir's case runs as train.py: BAD_TRAINING_CLI)
        resolve(compose_cfg(*args))
    text = f"error: {e.value}"
    assert "\n" not in text and text.startswith(message), text


def test_default_run_learns(tmp_path):
    """`python train.py`: tiny GPT on the corpus, 4 processes on `local`; loss falls >= 30%; a quiet
    console (no Lightning tip or deprecation warning, a progress bar of steps, memory in human units)."""
    run = tmp_path / "run"
    out = run_train([f"hydra.run.dir={run}"], cwd=tmp_path, timeout=600, fresh=True)  # (its imports' warnings too)
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    for noise in ("Tip", "deprecated", "Epoch 0/-2", "v_num", "~0.0 GB"):
        assert noise not in console, (noise, console[-3000:])
    assert re.search(r"step: (\d+)/\1\b", console) and "tokens/s" in console, console[-3000:]
    for name in ("plan.json", "metrics.csv", "loss.png", "summary.json", "summary.txt"):
        assert (run / name).exists(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["model"] == "tiny" and summary["topology"] == "local"
    assert summary["loss_drop"] >= 0.30, summary
    assert summary["atp_linears"] == 9
    assert summary["tflops_per_device"] > 0 and summary["comm_d1_bytes"] > 0


def test_max_restarts_relaunches_from_the_newest_checkpoint_as_if_uninterrupted(tmp_path):
    """Must-show (issue 62, Deliver 4): ``trainer.max_restarts=1``, rank 1 SIGKILLed in step 30 of 60
    (``ATP_FAULT_KILL_RANK_AT_STEP=1:30``), checkpoints every 25 steps: the fit is launched again from
    step25.ckpt and the losses of steps 31-60 equal an uninterrupted run's within 1e-5 (float32);
    metrics.csv has every step once. Then ``resume=auto`` in that run directory skips a partial
    checkpoint (no .metadata) and continues from the newest complete one; ``resume=`` that partial
    one is refused in one line, exit 2."""
    common = [*FAST, "trainer.devices=2", "trainer.max_steps=60", "trainer.checkpoint_every_n_steps=25"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    base = start_train([*common, f"hydra.run.dir={tmp_path / 'base'}"], cwd=tmp_path)
    restarted = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, "trainer.max_restarts=1",
                                  f"hydra.run.dir={tmp_path / 'rst'}"], cwd=tmp_path, env={**env, FAULT_KILL: "1:30"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for p in (base, restarted):
        out = finish_train(p, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    assert "restart 1 of 1: rank 1 died without reporting (exit code -9, signal 9); launching again from " \
           f"{tmp_path / 'rst' / 'checkpoints' / 'step25.ckpt'}" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "rst" / ".fault-kill-rank1-step30").exists()  # it did die at step 30
    a = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "base" / "metrics.csv") if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "rst" / "metrics.csv") if "loss" in r}
    assert sorted(a) == sorted(b) == list(range(60))
    worst = max(abs(a[s] - b[s]) for s in range(30, 60))  # steps 31-60 (0-based 30..59)
    print(f"max |loss difference| of steps 31-60 after the restart: {worst:.3g}")
    assert worst <= 1e-5, worst
    assert json.loads((tmp_path / "rst" / "summary.json").read_text())["restarts"] == 1

    ckpts = tmp_path / "rst" / "checkpoints"
    partial = ckpts / "step55.ckpt"  # a copy of step50 that lost its .metadata: as if killed while saving
    shutil.copytree(ckpts / "step50.ckpt", partial)
    (partial / ".metadata").unlink()
    auto = start_train([*common, "trainer.max_steps=55", "resume=auto", f"hydra.run.dir={tmp_path / 'rst'}"],
                       cwd=tmp_path)
    refused = start_train([*common, f"resume={partial}", f"hydra.run.dir={tmp_path / 'refused'}"], cwd=tmp_path)
    out, bad = finish_train(auto, timeout=600), finish_train(refused, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resume=auto: skipping step55.ckpt (partial" in out.stdout and \
           f"resume=auto: continuing from {ckpts / 'step50.ckpt'}" in out.stdout, out.stdout[-2000:]
    c = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "rst" / "metrics.csv") if "loss" in r}
    assert sorted(c) == list(range(50, 55)) and max(abs(c[s] - a[s]) for s in c) <= 1e-5
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: resume={partial}: not a complete checkpoint (no .metadata or meta.pt: partial, e.g. its run failed "
        "while writing it); resume=auto takes the newest complete one of a run directory"], bad.stderr
