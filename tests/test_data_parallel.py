"""Data parallelism against single-process training.

Every run here is a real launch (gloo processes, Lightning, the run's own data module) of
the same global batches a single process trains on: the replicas must split each batch
(strided), log the global batch's loss, run one epoch, resume at the right sample, and —
with ``mesh.fsdp=true`` — shard parameters, gradients and optimizer state over the
replicas (FSDP2 composed with the (d1, d2) tensor parallelism) without changing a loss.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

from atp_pipeline.errors import ConfigError
from atp_pipeline.run.fit import fit
from atp_pipeline.run.report import read_metrics
from atp_pipeline.run.resolve import resolve

FAST = ["model.seq_len=32", "trainer.progress_bar=false", "planner.plot=false", "trainer.export=false"]
TOL = 1e-5  # float32: the summation order of a split batch differs from one process's


def _fit(compose_cfg, out: Path, *overrides: str) -> Dict[str, Any]:
    cfg = compose_cfg(*FAST, *overrides, f"paths.output_dir={out}")
    return fit(resolve(cfg), out)


def _rows(run_dir: Path) -> List[Dict[str, float]]:
    return [r for r in read_metrics(run_dir / "metrics.csv") if "loss" in r]


def _losses(run_dir: Path) -> List[float]:
    return [r["loss"] for r in _rows(run_dir)]


def _worst(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def test_data_parallel_reproduces_single_process_in_one_epoch_and_resumes(compose_cfg, tmp_path):
    steps = 12
    _fit(compose_cfg, tmp_path / "single", "mesh=1x1", "trainer.devices=1", f"trainer.max_steps={steps}")
    want = _losses(tmp_path / "single")
    assert len(want) == steps
    runs = {"dp4": ["mesh=1x1", "mesh.dp=4"], "tp2_dp2": ["mesh=2x1", "mesh.dp=2"],
            # mesh=1x1 mesh.dp=2 occupies 2 of local's 4 devices (no trainer.devices needed)
            "dp2": ["mesh=1x1", "mesh.dp=2", f"trainer.checkpoint_every_n_steps={steps // 2}"]}
    for name, overrides in runs.items():
        row = _fit(compose_cfg, tmp_path / name, *overrides, f"trainer.max_steps={steps}")
        got = _losses(tmp_path / name)
        assert _worst(got, want) <= TOL, (name, list(zip(got, want)))
        # the logged loss is the global batch's (step 0: same weights, same batch)
        assert got[0] == pytest.approx(want[0], abs=1e-6), name
        assert {r.get("epoch") for r in _rows(tmp_path / name)} == {0.0}, f"{name}: a run is one epoch"
        assert row["steps"] == steps
    assert json.loads((tmp_path / "dp2" / "summary.json").read_text())["world_size"] == 2

    # resume at dp = 2 from the middle: the second half again, at the same samples
    ckpt = tmp_path / "dp2" / "checkpoints" / f"step{steps // 2}.ckpt"
    _fit(compose_cfg, tmp_path / "resumed", "mesh=1x1", "mesh.dp=2", f"trainer.max_steps={steps}", f"resume={ckpt}")
    first = {int(r["step"]): r["loss"] for r in _rows(tmp_path / "dp2")}
    again = {int(r["step"]): r["loss"] for r in _rows(tmp_path / "resumed")}
    assert sorted(again) == list(range(steps // 2, steps))
    assert all(again[s] == first[s] for s in again), [(first[s], again[s]) for s in sorted(again)]


def test_float64_data_parallel_is_exact_and_atp_within_its_quantization(compose_cfg, tmp_path):
    """float64 removes float32's summation-order noise: ring data parallelism (with and
    without TP) equals one process to round-off; the in-network backends (integer sums of
    quantized gradients, ``aggregation=atp``/``ps``) stay within their quantization error."""
    steps, f64 = 8, ["model.dtype=fp64", "trainer.max_steps=8"]
    _fit(compose_cfg, tmp_path / "single", *f64, "mesh=1x1", "trainer.devices=1")
    want = _losses(tmp_path / "single")
    for name, overrides, tol in (("dp4", ["mesh=1x1", "mesh.dp=4"], 1e-12),
                                 ("tp2_dp2", ["mesh=2x1", "mesh.dp=2"], 1e-12),
                                 ("atp_dp4", ["mesh=1x1", "mesh.dp=4", "aggregation=atp"], 1e-6)):
        _fit(compose_cfg, tmp_path / name, *f64, *overrides)
        got = _losses(tmp_path / name)
        assert len(got) == steps and _worst(got, want) <= tol, (name, _worst(got, want))


FSDP_MESHES = {"tp2_dp2": ["mesh=2x1", "mesh.dp=2"], "dp4": ["mesh=1x1", "mesh.dp=4"]}


@pytest.mark.parametrize("model", ["tiny", "llama_tiny", "gpt2_tiny"])
def test_fsdp_matches_single_process_and_shards_the_state(compose_cfg, tmp_path, model):
    steps = 5
    base = [f"model={model}", f"trainer.max_steps={steps}"]
    _fit(compose_cfg, tmp_path / "single", *base, "mesh=1x1", "trainer.devices=1")
    want = _losses(tmp_path / "single")
    rows = {}
    # every family sharded with tensor parallelism (2x1 x dp 2); the GPT also on dp 4 alone
    for name, mesh in FSDP_MESHES.items() if model == "tiny" else [("tp2_dp2", FSDP_MESHES["tp2_dp2"])]:
        extra = ["trainer.checkpoint_every_n_steps=3"] if name == "tp2_dp2" and model == "tiny" else []
        rows[name] = _fit(compose_cfg, tmp_path / name, *base, *mesh, "mesh.fsdp=true", *extra)
        got = _losses(tmp_path / name)
        assert _worst(got, want) <= TOL, (model, name, list(zip(got, want)))
        assert rows[name]["fsdp"] is True
        memory = json.loads((tmp_path / name / "plan.json").read_text())
        dp = int(mesh[1].split("=")[1])
        sharded, whole = memory["memory_per_device"], memory["memory_per_device_without_fsdp"]
        assert sharded["fsdp"] is True and sharded["optimizer_bytes"] == pytest.approx(whole["optimizer_bytes"] / dp)
    if model != "tiny":
        return

    # the state each rank holds, measured: about 1/dp of the unsharded run's (padding aside)
    plain = _fit(compose_cfg, tmp_path / "plain", *base, *FSDP_MESHES["tp2_dp2"])
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    ratio = sum(rows["tp2_dp2"][k] for k in keys) / sum(plain[k] for k in keys)
    print(f"FSDP state per rank on 2x1 x dp 2: {ratio:.4f} of the unsharded run's")
    assert 0.5 <= ratio <= 0.51, ratio
    assert all(plain[k] > 0 for k in keys) and plain["fsdp"] is False
    # FSDP's collectives pass through the counted Comm (dp axis): per step each unit's
    # parameters are gathered for forward and again for backward, and its gradients
    # reduce-scattered; the unsharded run all-reduces the gradients once
    assert plain["comm_dp_bytes"] == plain["param_bytes"]
    assert rows["tp2_dp2"]["comm_dp_bytes"] == 3 * plain["comm_dp_bytes"]

    # sharded (torch.distributed.checkpoint) checkpoint of FSDP x TP: resume is exact
    ckpt = tmp_path / "tp2_dp2" / "checkpoints" / "step3.ckpt"
    assert len(list(ckpt.glob("*.distcp"))) == 4
    _fit(compose_cfg, tmp_path / "resumed", *base, *FSDP_MESHES["tp2_dp2"], "mesh.fsdp=true", f"resume={ckpt}")
    first = {int(r["step"]): r["loss"] for r in _rows(tmp_path / "tp2_dp2")}
    again = {int(r["step"]): r["loss"] for r in _rows(tmp_path / "resumed")}
    assert sorted(again) == [3, 4] and all(again[s] == first[s] for s in again)


@pytest.mark.parametrize("overrides, message", [
    (["mesh=2x2", "mesh.fsdp=true"],
     "mesh.fsdp=true shards over data-parallel replicas, but mesh 2x2 uses all 4 devices (dp=1)"),
    (["mesh=1x1", "mesh.dp=4", "mesh.fsdp=true", "aggregation=atp"], "mesh.fsdp=true reduce-scatters gradients"),
    (["planner=sbp", "mesh.fsdp=true"], "mesh.fsdp=true shards over the data-parallel dimension, which planner=sbp"),
    (["mesh=2x1", "mesh.dp=4"], "mesh 2x1 with mesh.dp=4 needs 8 devices but topology 'local' has only 4"),
])
def test_bad_data_parallel_input_is_one_line(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(compose_cfg(*overrides))


def test_fsdp_memory_estimate_divides_the_state_over_dp(compose_cfg):
    spec = resolve(compose_cfg("stage=plan", "topology=ic4", "model=m3", "mesh=2x2", "mesh.dp=4", "mesh.fsdp=true"))
    mem, whole = spec.memory, spec.memory_unsharded
    assert spec.fsdp and mem is not None and whole is not None
    assert mem.optimizer_bytes == pytest.approx(whole.optimizer_bytes / 4)
    assert mem.activation_bytes == whole.activation_bytes
    assert mem.total_bytes < whole.total_bytes
    # the run's memory check uses the sharded estimate: 24 layers of m4 on 4x1 x dp 4 fit
    # 80 GB devices only with FSDP (~204 GB per device without it, ~65 GB with)
    big = ("stage=plan", "topology=ic4", "model=m4", "model.layers=24", "mesh=4x1", "mesh.dp=4")
    with pytest.raises(ConfigError, match=r"the smallest device memory that fits is 204\.0 GB \(dp4 x 4x1"):
        resolve(compose_cfg(*big, "mesh.fsdp=false"))
    assert resolve(compose_cfg(*big, "mesh.fsdp=true")).memory.total_bytes < 80e9
    # and the mesh search's feasibility: no mesh of the replica's 4 devices fits without it
    auto = ("stage=plan", "topology=ic4", "model=m4", "model.layers=24", "mesh.dp=4", "planner.plot=false")
    with pytest.raises(ConfigError, match="no layout of the 16 devices of 'ic4' with mesh.dp=4 mesh.fsdp=false can run "
                                          "model 'm4': every runnable one needs more memory than the 80 GB per device"):
        resolve(compose_cfg(*auto, "mesh.fsdp=false"))
    plan = resolve(compose_cfg(*auto, "mesh.fsdp=true")).plan
    assert all(c.infeasible is None for c in plan.candidates), [c.infeasible for c in plan.candidates]
    assert resolve(compose_cfg(*auto)).fsdp  # mesh.fsdp left open: the search turns FSDP on to fit


def test_figure12_interconnect_study_plans_past_the_head_count(compose_cfg):
    """``planner.require_divisible=false`` (README, Figure 12): 32x8 at N = 256 for m1,
    marked not runnable; a fit of it is refused in one line."""
    paper = ("mesh.dp=1", "overlap=chunk1")  # the paper's setting: tensor parallelism over every device
    spec = resolve(compose_cfg("stage=plan", "topology=ic5", "model=m1", "planner.require_divisible=false", *paper))
    assert spec.plan.selected == (32, 8)
    d = spec.plan.to_dict()
    assert d["selected_runnable"] is False
    assert any("NOT RUNNABLE" in n for n in d["notes"])
    with pytest.raises(ConfigError, match="the selected mesh is not runnable"):
        resolve(compose_cfg("stage=fit", "topology=ic5", "model=m1", "planner.require_divisible=false", *paper))


def test_fsdp_units_come_from_the_module_tree_and_unwrappable_models_are_named():
    """Units: each element of the outermost ModuleLists (a model's blocks); a block's own
    lists stay inside it. A parameter FSDP2 cannot shard is named, before any process."""
    import torch
    from torch import nn

    from atp_pipeline.parallel.fsdp import block_units, fsdp_infeasibility

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([Block(), Block(), nn.ReLU()])

    net = Net()
    assert [name for name, _ in block_units(net)] == ["layers.0", "layers.1"]
    assert fsdp_infeasibility(net) is None
    net.embed.weight = nn.Parameter(torch.randn(4, 8).t())
    assert fsdp_infeasibility(net) == "parameter 'embed.weight' is not contiguous (FSDP2 shards contiguous " \
                                      "parameters only)"
    # a module whose gradients hooks sum over a tensor-parallel axis (the HF attention's per-head
    # norms): FSDP re-creates parameters and would drop the hooks, so it is refused by name
    net.embed.weight = nn.Parameter(torch.randn(8, 4))
    from atp_pipeline.parallel.fsdp import GRAD_SUM

    setattr(net.layers[0], GRAD_SUM, "d1")
    assert fsdp_infeasibility(net).startswith("'layers.0' keeps its parameters whole with their gradients summed "
                                              "over d1 by hooks")
