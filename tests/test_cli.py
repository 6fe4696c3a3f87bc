"""``python train.py`` as a user runs it: plan outputs, the multirun summary, bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Set, Tuple

import pytest
import yaml

from .conftest import descendants, run_side_by_side, run_train, start_train


def _user_conf(tmp_path: Path) -> Path:
    conf = tmp_path / "userconf"
    (conf / "topology").mkdir(parents=True)
    (conf / "topology" / "typo.yaml").write_text(yaml.safe_dump({"name": "typo", "levels": [
        {"name": "node", "count": 2, "p2p_gbps": 50, "group_GBps": 50}]}))
    (conf / "topology" / "skewed.yaml").write_text(yaml.safe_dump({"name": "skewed", "levels": [
        {"name": "gpu", "count": 4, "p2p_GBps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]], "group_GBps": 2}]}))
    return conf


#: bad input to ``python train.py``: every config group (topology, model, mesh, overlap, aggregation,
#: planner, data, trainer, calibration, stage, resume) -> the one line it prints (exit 2)
TRAIN_BAD_INPUT = [
    (["topology=ic9"], "error: unknown topology 'ic9' (available: fig7a, fig7b, ic1, ic2, ic3, ic4, "
                       "ic5, ic6, local); did you mean 'ic6'?"),
    (["topology=./my_topology.yaml"], "error: topology=./my_topology.yaml: topology takes a name, not a file path; put "
                                      "the file at <dir>/topology/my_topology.yaml and run with "
                                      "hydra.searchpath=[file://<dir>] topology=my_topology"),
    (["topology=ic1", "model.hiden=64"], "error: unknown key 'hiden' at model.hiden (ModelConfig keys: "),
    (["+USERCONF", "topology=typo"], "error: in topology/typo: unknown key 'p2p_gbps' (LevelConfig keys: "),
    (["+USERCONF", "topology=skewed"], "error: topology 'skewed': level 'gpu' (levels[0]): p2p_GBps is a "
                                       "3x3 matrix but count is 4 (need 4x4)"),
    (["topology=ic1", "mesh=3x3"], "error: mesh 3x3 needs 9 devices but topology 'ic1' has 8"),
    (["mesh=3x1"], "error: mesh 3x1 (3 devices a replica) does not divide the 4 devices (mesh.dp x d1 x d2 must "
                   "equal them)"),
    (["mesh.dp=3"], "error: mesh.dp=3 does not divide trainer.devices=4"),
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
    # CPU ranks share the host's memory: the estimate times the ranks against what it has
    (["model=m2"], "error: model 'm2' needs ~87.9 GB per rank x 4 CPU ranks = 351.4 GB of host memory, but this "
                   "host has "),
    (["overlap=chunk3"], "error: unknown overlap 'chunk3' (available: auto, chunk1, chunk2, chunk4); did you mean "
                         "'chunk4'?"),
    (["aggregation=foo"], "error: unknown aggregation 'foo' (available: atp, auto, ps, ring, switchml)"),
    (["aggregation=atp", "mesh=2x2", "mesh.dp=1"],
     "error: aggregation=atp aggregates the gradients of data-parallel replicas, but mesh.dp=1: there is nothing to "
     "aggregate; set mesh.dp > 1 or aggregation=auto"),
    (["mesh=1x1", "mesh.dp=4", "aggregation=atp", "aggregation.racks=3"],
     "error: aggregation.racks=3 must divide the 4 data-parallel workers (mesh.dp)"),
    (["mesh=1x1", "mesh.dp=4", "aggregation=ps", "aggregation.switch_impl=bmv2"],
     "error: aggregation.switch_impl=bmv2 runs the ATP program: it needs aggregation=atp, not ps"),
    (["aggregation=atp", "aggregation.loss=1.5"], "error: aggregation.loss=1.5 must be in [0, 1)"),
    (["aggregation=atp", "aggregation.role_max_bytes=1000000"],
     "error: the switch, aggregation.aggregators=4096 × 62 values needs 2,064,384 bytes, above the role's memory "
     "bound aggregation.role_max_bytes=1,000,000"),
    (["planner.objective=speed"], "error: planner.objective: Invalid value 'speed', expected one of [step, comm]"),
    (["data.source=web"], "error: data.source: Invalid value 'web', expected one of [corpus, synthetic]"),
    (["stage=deploy"], "error: stage: Invalid value 'deploy', expected one of [plan, fit, calibrate]"),
    (["resume=/nonexistent/ckpt"], "error: resume=/nonexistent/ckpt: no such checkpoint"),
    # a count <= 0: one line right after composition, before any rank starts
    (["trainer.max_steps=-5"], "error: trainer.max_steps=-5 must be >= 1"),
    (["trainer.devices=0"], "error: trainer.devices=0 must be >= 1"),
    (["trainer.lr=-1"], "error: trainer.lr=-1.0 must be >= 0"),
    (["trainer.max_restarts=-1"], "error: trainer.max_restarts=-1 must be >= 0"),
    (["trainer.gradient_clip_val=-1"], "error: trainer.gradient_clip_val=-1.0 must be >= 0"),
    (["trainer.precision=fp8"], "error: trainer.precision=fp8 must be one of 32-true, bf16-mixed, bf16-true"),
    (["trainer.lr_schedule=step"], "error: trainer.lr_schedule=step must be one of constant, cosine, linear"),
    (["stage=plan", "model.batch_size=0"], "error: model.batch_size=0 must be >= 1"),
    (["calibration.passes=0"], "error: calibration.passes=0 must be >= 1"),
    # a config transformers' own validation rejects (huggingface_hub's strict dataclasses)
    (["model=llama_tiny", "model.hf.num_attention_heads=6"],
     "error: model 'llama_tiny': transformers rejects model.hf.hidden_size=64, model.hf.num_attention_heads=6: "
     "The hidden size (64) is not a multiple of the number of attention heads (6)"),
    (["model=hf_pretrained", "model.pretrained=meta-llama/Llama-3.2-1B"],
     "error: model 'hf_pretrained': model.pretrained=meta-llama/Llama-3.2-1B is not a local directory, and hub ids "
     "are not fetched: download it first"),
]

#: bad arguments of the aggregation roles' CLI (``python -m atp_pipeline.ina.live.nodes``) -> its one line
ROLE_BAD_INPUT = [
    (["switch", "--host", "0.0.0.0"], "error: --host 0.0.0.0 is not a loopback address: give the control channel a "
                                      "secret with --secret-file PATH or ATP_AUTHKEY (at least 32 characters)"),
    (["switch", "--secret-file", "/nonexistent"], "error: --secret-file /nonexistent: No such file or directory"),
    (["nosuchrole"], "error: argument role: invalid choice: 'nosuchrole' (choose from 'switch', 'ps')"),
    (["switch", "--control-port", "99999"], "error: argument --control-port: 99999 is not a port (0-65535)"),
    (["ps", "--payload-k", "x"], "error: argument --payload-k: invalid int value: 'x'"),
    (["switch", "--max-bytes", "0"], "error: argument --max-bytes: 0 is not a positive number of bytes"),
]

#: bad arguments of strategy "atp" in a user's own Trainer -> the ConfigError it raises at construction
STRATEGY_BAD_INPUT = [
    ({"mesh": "banana"}, "strategy 'atp': mesh='banana' must be one of 'auto', 'megatron', 'sbp', '<d1>x<d2>'"),
    ({"mesh": (2,)}, "strategy 'atp': mesh=(2,) must be a (d1, d2) pair of positive integers"),
    ({"dp": 0}, "mesh.dp=0 must be >= 1"),
    ({"dp": "many"}, "strategy 'atp': dp='many' must be an integer or 'auto'"),
    ({"chunks": "x"}, "strategy 'atp': chunks='x' must be an integer or 'auto'"),
    ({"fsdp": "yes"}, "strategy 'atp': fsdp='yes' must be True, False or 'auto'"),
    ({"topology": "ic9"}, "strategy 'atp': topology='ic9' must be a topology config"),
    ({"aggregation": "foo"}, "strategy 'atp': aggregation must be one of"),
    ({"aggregation": {"bogus": 1}}, "strategy 'atp': unknown aggregation option(s) ['bogus']"),
]

BAD_INPUT = ([("train.py", a, m) for a, m in TRAIN_BAD_INPUT] + [("role", a, m) for a, m in ROLE_BAD_INPUT]
             + [("strategy", a, m) for a, m in STRATEGY_BAD_INPUT])


def _left_after(before: Set[int]) -> Set[int]:
    """Processes started since ``before`` that are still running 5 s on (none expected)."""
    until = time.monotonic() + 5
    while (left := descendants(os.getpid()) - before) and time.monotonic() < until:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> Dict[int, Tuple[Any, str]]:
    """Every :data:`BAD_INPUT` row run: ``python train.py`` and the role CLI side by side, the
    strategy built in this process; per row, its exit code (the exception's type for the strategy)
    and what it printed; no process of theirs may be left."""
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.lightning import ATPStrategy

    tmp = tmp_path_factory.mktemp("bad_input")
    start_train(["--help"], tmp).communicate(timeout=300)  # the zygote up before the snapshot of processes
    before = descendants(os.getpid())
    train_rows = [i for i, r in enumerate(BAD_INPUT) if r[0] == "train.py"]
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "ATP_AUTHKEY")}
    roles = {i: subprocess.Popen([sys.executable, "-m", "atp_pipeline.ina.live.nodes", *BAD_INPUT[i][1]],
                                 cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, r in enumerate(BAD_INPUT) if r[0] == "role"}
    trains = run_side_by_side(tmp, [BAD_INPUT[i][1] for i in train_rows], _user_conf(tmp))
    out: Dict[int, Tuple[Any, str]] = {}
    for i, (done, run) in zip(train_rows, trains):
        assert not (run / "plan.json").exists(), BAD_INPUT[i]
        out[i] = (done.returncode, done.stderr + done.stdout)
    for i, p in roles.items():
        o, e = p.communicate(timeout=120)
        out[i] = (p.returncode, e + o)
    for i, r in enumerate(BAD_INPUT):
        if r[0] == "strategy":
            try:
                ATPStrategy(**r[1])
                out[i] = (0, "")
            except ConfigError as exc:
                out[i] = ("ConfigError", str(exc) + "\n")
    assert not _left_after(before)
    return out


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[f"{k} {a}" for k, a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(bad_input_runs, case):
    """Must-show (issue 62, Deliver 3): every row exits 2 (the strategy: raises ConfigError) with the one
    line, no traceback, and leaves no process (the fixture)."""
    kind, given, message = BAD_INPUT[case]
    code, printed = bad_input_runs[case]
    lines = printed.strip().splitlines()
    print(f"\n{kind} {given} -> {code} -> {lines[0] if lines else ''}", end="")
    assert code == (2 if kind != "strategy" else "ConfigError"), printed
    assert len(lines) == 1 and lines[0].startswith(message), printed
    assert "Traceback" not in printed


def test_the_bad_input_table_covers_every_group_and_surface():
    """At least 30 rows, every config group among them, and the strategy's and the roles' arguments."""
    given = " ".join(" ".join(a) for k, a, _ in BAD_INPUT if k == "train.py")
    groups = ("topology", "model", "mesh", "overlap", "aggregation", "planner", "data", "trainer", "calibration",
              "stage", "resume")
    assert len(BAD_INPUT) >= 30 and all(f"{g}=" in given or f"{g}." in given for g in groups)
    assert {k for k, _, _ in BAD_INPUT} == {"train.py", "role", "strategy"}


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
