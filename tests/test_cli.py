"""``python train.py`` as a user runs it: plan outputs, the multirun summary, bad input."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest
import yaml

from .conftest import run_side_by_side, run_train


def _user_conf(tmp_path: Path) -> Path:
    conf = tmp_path / "userconf"
    (conf / "topology").mkdir(parents=True)
    (conf / "topology" / "typo.yaml").write_text(yaml.safe_dump({"name": "typo", "levels": [
        {"name": "node", "count": 2, "p2p_gbps": 50, "group_GBps": 50}]}))
    (conf / "topology" / "skewed.yaml").write_text(yaml.safe_dump({"name": "skewed", "levels": [
        {"name": "gpu", "count": 4, "p2p_GBps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]], "group_GBps": 2}]}))
    return conf


BAD_INPUT = [
    (["topology=ic9"], "error: unknown topology 'ic9' (available: fig7a, fig7b, ic1, ic2, ic3, ic4, "
                       "ic5, ic6, local); did you mean 'ic6'?"),
    (["topology=ic1", "model.hiden=64"], "error: unknown key 'hiden' at model.hiden (ModelConfig keys: "),
    (["+USERCONF", "topology=typo"], "error: in topology/typo: unknown key 'p2p_gbps' (LevelConfig keys: "),
    (["+USERCONF", "topology=skewed"], "error: topology 'skewed': level 'gpu' (levels[0]): p2p_GBps is a "
                                       "3x3 matrix but count is 4 (need 4x4)"),
    (["topology=ic1", "mesh=3x3"], "error: mesh 3x3 needs 9 devices but topology 'ic1' has 8"),
    # fixed fields of the whole layout that contradict each other (or the devices, or the batch)
    (["stage=plan", "topology=ic3", "mesh=2x2", "mesh.dp=4", "trainer.devices=8"],
     "error: mesh 2x2 with mesh.dp=4 needs 16 devices, not 8"),
    (["mesh.fsdp=true", "mesh.dp=1"], "error: mesh.fsdp=true shards over data-parallel replicas, but mesh.dp=1"),
    (["stage=plan", "model.batch_size=3", "mesh.dp=2"],
     "error: no layout of the 4 devices of 'local' with mesh.dp=2 can run model 'tiny': global batch 3 does not "
     "split over dp=2"),
    (["stage=plan", "topology=ic4", "model=llama3_8b", "topology.device.memory_GB=16"],
     "error: no layout of the 16 devices of 'ic4' can run model 'llama3_8b': every runnable one needs more memory "
     "than the 16 GB per device; the smallest device memory that fits is 31.8 GB (dp1 x 1x16"),
    # a count <= 0: one line right after composition, before any rank starts
    (["trainer.max_steps=-5"], "error: trainer.max_steps=-5 must be >= 1"),
    (["trainer.gradient_clip_val=-1"], "error: trainer.gradient_clip_val=-1.0 must be >= 0"),
    (["stage=plan", "model.batch_size=0"], "error: model.batch_size=0 must be >= 1"),
    # a config transformers' own validation rejects (huggingface_hub's strict dataclasses)
    (["model=llama_tiny", "model.hf.num_attention_heads=6"],
     "error: model 'llama_tiny': transformers rejects model.hf.hidden_size=64, model.hf.num_attention_heads=6: "
     "The hidden size (64) is not a multiple of the number of attention heads (6)"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> List[Tuple[subprocess.CompletedProcess, Path]]:
    """Every :data:`BAD_INPUT` case's ``python train.py``, run side by side."""
    tmp = tmp_path_factory.mktemp("bad_input")
    return run_side_by_side(tmp, [args for args, _ in BAD_INPUT], _user_conf(tmp))


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(bad_input_runs, case):
    message = BAD_INPUT[case][1]
    out, run = bad_input_runs[case]
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(message), lines[0]
    assert "Traceback" not in out.stderr + out.stdout
    assert not (run / "plan.json").exists()


def test_stage_plan_writes_report(tmp_path):
    run_dir = tmp_path / "run"
    # the §3.5 worked example: one replica, no chunks (the whole-layout search then picks the mesh alone)
    out = run_train(["stage=plan", "topology=fig7a", "model=m1", "mesh.dp=1", "overlap=chunk1",
                     f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "8 x 2" in out.stdout and "selected DeviceMesh(4, 4)" in out.stdout
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["topology"]["name"] == "fig7a" and plan["world_size"] == 16
    c82 = next(c for c in plan["candidates"] if c["mesh"] == [8, 2])
    assert (c82["B1_prime_GBps"], c82["B2_prime_GBps"]) == (12.5, 200.0)
    assert plan["selected"] == [4, 4]
    png = (run_dir / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert json.loads((run_dir / "summary.json").read_text())["selected"] == "4x4"


def test_plan_stage_of_the_embedded_default(tmp_path):
    out = run_train(["stage=plan", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    search = plan["layout_search"]  # the whole layout of the 4 devices; world_size: one replica's
    assert (search["world"]["name"], plan["model"]["name"], search["devices"]) == ("local", "tiny", 4)
    assert plan["world_size"] * plan["layout"]["dp"] == 4
    assert "chosen layout: dp" in out.stdout and "why the other" in out.stdout


def test_multirun_leaves_one_summary(tmp_path):
    sweep = tmp_path / "sweep"
    # 2 x 2 points (docs/planning.md's 4 x 4 sweep of the same groups runs in tests/test_docs_commands.py)
    out = run_train(["-m", "stage=plan", "topology=ic1,ic4", "model=m1,m3",
                     f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(rows) == 4
    assert {(r["topology"], r["model"]) for r in rows} == {(t, m) for t in ("ic1", "ic4") for m in ("m1", "m3")}
    assert {r["selected"] for r in rows if r["topology"] == "ic1"} == {"2x4"}
    assert len([p for p in sweep.iterdir() if p.is_dir()]) == 4
    assert "sweep summary: 4 runs" in out.stdout


_PLAN_ONLY = r"""
import runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
try:
    runpy.run_path(TRAIN, run_name="__main__")
finally:
    heavy = sorted(m for m in sys.modules if m in ("pytorch_lightning", "lightning", "torch", "transformers")
                   or m.startswith(("atp_pipeline.run.fit", "atp_pipeline.run.worker",
                                    "atp_pipeline.lightning.", "atp_pipeline.launch"))
                   and m != "atp_pipeline.lightning.hook")  # stdlib-only post-import hook
    print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize("planner", ["atp", "sbp"])
def test_stage_plan_imports_no_training_module(tmp_path, planner):
    """``stage=plan`` is resolve -> report: the fit and worker modules, the launcher and
    Lightning are never imported; nor, for the built-in model planned from its config, torch or
    transformers (a plan is a second or two, not the ~3 s of importing torch)."""
    import subprocess
    import sys

    from .conftest import ROOT

    code = _PLAN_ONLY.replace("TRAIN", repr(str(ROOT / "train.py")))
    args = ["stage=plan", f"planner={planner}", f"hydra.run.dir={tmp_path / 'run'}"]
    if planner == "sbp":
        args.append("planner.sbp.budget_s=2")
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "plan.json").exists()
    heavy = [line for line in out.stdout.splitlines() if line.startswith("HEAVY=")]
    assert heavy == ["HEAVY="], heavy


def test_fork_server_started_for_a_run_is_gone_when_the_run_is_refused():
    """``stage=fit`` starts the ranks' fork server before resolving (its imports overlap);
    bad input found meanwhile stops it at once, instead of leaving it importing on."""
    import subprocess
    import sys

    code = ("import os, time\nfrom multiprocessing import forkserver\n"
            "from atp_pipeline.launch import prestart, stop_prestarted\n"
            "prestart(); pid = forkserver._forkserver._forkserver_pid; assert pid\n"
            "stop_prestarted(); time.sleep(0.2)\n"
            "try:\n    os.kill(pid, 0); print('ALIVE')\nexcept ProcessLookupError:\n    print('GONE')\n"
            "assert 'torch' not in __import__('sys').modules, 'prestart imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["GONE"]



_RESOLVE_FIT = r"""
import sys
from hydra import compose, initialize_config_dir
from torch.nn import init
from atp_pipeline.config import register_mesh_source, register_schemas
from atp_pipeline.models.meta import INITIALIZERS, outline_device
from atp_pipeline.run.resolve import resolve

register_schemas(); register_mesh_source()
before = {n: getattr(init, n) for n in INITIALIZERS}
with initialize_config_dir(version_base="1.3", config_dir=CONF):
    spec = resolve(compose(config_name="config", overrides=["stage=fit"]))
with outline_device():
    import torch
    w = init.normal_(torch.empty(3, 4), std=0.02)
print("META", w.is_meta, "RESTORED", all(getattr(init, n) is f for n, f in before.items()) and bool(before),
      "DYNAMO", "torch._dynamo" in sys.modules)
"""


def test_resolving_the_default_fit_runs_no_initializer_and_imports_no_dynamo():
    """The launcher checks the plan on a model built on the meta device (its structure only):
    :func:`~atp_pipeline.models.meta.outline_device` runs no initializer there and restores them
    after — on meta, ``normal_`` alone imports TorchDynamo (~1.5 s of CPU a launch)."""
    import subprocess
    import sys

    from .conftest import CONF

    out = subprocess.run([sys.executable, "-c", _RESOLVE_FIT.replace("CONF", repr(str(CONF)))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-6:] == ["META", "True", "RESTORED", "True", "DYNAMO", "False"], out.stdout
