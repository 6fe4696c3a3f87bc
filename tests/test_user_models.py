"""A user's own LightningModules under ``Trainer(strategy="atp")``: an MLP with
no plan, with a column/row plan on every 2D mesh of 4 processes (both Lightning packages),
Megatron's split boundaries, user blocks that only look like the GPT's, the DataLoader
order with one replica, and a meta-device model materialized as shards; a transformers
Llama trained with Lightning's own loop features (validation, a per-step schedule,
gradient clipping, accumulation, bf16-mixed) against the same script on one process.

Four launches: 4 processes for each Lightning package, 4 for the Llama, 2 for the rest.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch

from atp_pipeline.launch import spawn

from . import user_workers as uw


def _mean_over_replicas(runs: List[Dict[str, Any]]) -> List[float]:
    """Per step, the mean of the data-parallel replicas' local losses (one rank per replica)."""
    first = {}
    for r in runs:
        first.setdefault(tuple(r["coord"][0:1]), r["losses"])
    per = list(first.values())
    return [sum(x) / len(per) for x in zip(*per)]


@pytest.fixture(scope="module")
def pl_runs() -> List[Dict[str, Any]]:
    return spawn(uw.meshes_case, 4, "pytorch_lightning", init=False, timeout=900)


@pytest.fixture(scope="module")
def unified_runs() -> List[Dict[str, Any]]:
    pytest.importorskip("lightning.pytorch", reason="pip install lightning")
    return spawn(uw.meshes_case, 4, "lightning.pytorch", init=False, timeout=900)


@pytest.fixture(scope="module")
def light() -> List[Dict[str, Any]]:
    return spawn(uw.light_case, 2, init=False, timeout=900)


@pytest.fixture(scope="module")
def llama_runs() -> List[Dict[str, Any]]:
    pytest.importorskip("lightning.pytorch", reason="pip install lightning")
    return spawn(uw.llama_case, 4, init=False, timeout=900)


def _replicas(ranks: List[Dict[str, Any]], name: str, key: str) -> List[float]:
    """Per entry, the mean over the data-parallel replicas of ``key`` of run ``name``."""
    first: Dict[int, List[float]] = {}
    for r in ranks:
        first.setdefault(r[name]["coord"][0], r[name][key])
    per = list(first.values())
    return [sum(x) / len(per) for x in zip(*per)]


def test_user_llama_with_validation_schedule_clipping_accumulation_matches_single_process(llama_runs):
    """A user's LightningModule holding a transformers Llama (GQA, 2 key/value heads) with
    ``validation_step`` (``sync_dist``), a per-step LambdaLR warmup-cosine schedule,
    ``gradient_clip_val`` small enough to clip at every step and ``accumulate_grad_batches=2``,
    under ``ATPStrategy(mesh=...)`` on 2x2, 1x4, 2x1 with dp=2, 2x1 dp=2 with FSDP, and clipping
    by value on 2x1 dp=2 (both Lightning packages among them): train and validation losses and
    the gradient norm equal the same script on one process (float32; the norm clipped by is the
    one logged as ``grad_norm``); ``precision="bf16-mixed"`` on 2x2 within 3e-2 of it."""
    torch.set_num_threads(1)  # the references run in this process, beside others
    refs: Dict[Any, Dict[str, Any]] = {}
    measured = []
    for run in uw.LLAMA_RUNS:
        key = (run.dp, run.clip)
        if key not in refs:
            refs[key] = uw.llama_reference(run.dp, run.clip)
        ref, first = refs[key], llama_runs[0][run.name]
        assert first["dims"] == (run.dp, *run.mesh), (run.name, first["dims"])
        exact = run.precision == "32-true"
        tol = 1e-5 if exact else 3e-2
        if run.clip == "norm":  # clipped at every step, by the single-process norm, which is logged
            assert min(ref["norms"]) > 10 * uw.CLIP, ref["norms"]
            norm_err = max(abs(a - b) / b for a, b in zip(first["norms"], ref["norms"]))
            assert norm_err <= tol, (run.name, first["norms"], ref["norms"])
            assert first["logged_norm"] == pytest.approx(first["norms"][-1], rel=1e-6), run.name
        else:  # elements beyond the clip value at every step; no norm is measured
            assert min(ref["peaks"]) > 2 * uw.CLIP_VALUE and first["logged_norm"] is None, ref["peaks"]
            norm_err = max(abs(a - b) / b for a, b in zip(first["peaks"], ref["peaks"]))
            assert norm_err <= tol, (run.name, first["peaks"], ref["peaks"])
        worst = {}
        for what in ("losses", "val_losses"):
            got, want = _replicas(llama_runs, run.name, what), ref[what]
            n = uw.LLAMA_STEPS * uw.ACCUMULATE if what == "losses" else 2 * uw.VAL_BATCHES
            assert len(got) == len(want) == n, (run.name, what, len(got), len(want))
            worst[what] = max(abs(a - b) for a, b in zip(got, want))
            assert worst[what] <= tol, (run.name, what, worst[what], got, want)
        measured.append(f"{run.name} ({run.package}): max |dloss| train {worst['losses']:.1e}, "
                        f"val {worst['val_losses']:.1e}, norm rel {norm_err:.1e}")
    print("\n".join(measured))
    line = llama_runs[0]["2x1 dp2 fsdp"]["notes"][-1]
    assert line.startswith("mesh dp x d1 x d2 = 2 x 2 x 1 (given), dp=2, FSDP on, plan: 15 modules laid out ("), line


def test_threads_per_process_follow_torchrun_unless_the_user_set_them(monkeypatch):
    """Several processes on this host and no ``OMP_NUM_THREADS``: each takes its share of the
    cores (at least one), as torchrun and ``train.py``'s launcher keep ranks from
    oversubscribing the host; a value the user set is left alone, and so is a single process."""
    import os

    from atp_pipeline.lightning.pl import ATPStrategy

    before = torch.get_num_threads()
    share = max(1, len(os.sched_getaffinity(0)) // 4)
    try:
        for env, processes, want in ((None, 4, share), ("2", 4, before), (None, 1, before)):
            if env is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            torch.set_num_threads(before)
            strategy = ATPStrategy(mesh=(1, 1) if processes == 1 else (2, 2))
            strategy.parallel_devices = [torch.device("cpu")] * processes
            strategy._set_threads()
            assert torch.get_num_threads() == want, (env, processes)
            if processes == 1:  # one process: nothing to share the cores with
                assert strategy._threads is None and "OMP_NUM_THREADS" not in os.environ
            elif env is None:
                assert os.environ["OMP_NUM_THREADS"] == str(share)
                assert strategy._threads.startswith(f"{share} thread(s) per process ("), strategy._threads
            else:
                assert strategy._threads == f"{before} thread(s) per process (OMP_NUM_THREADS=2)"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("runs_name", ["pl_runs", "unified_runs"])
def test_user_mlp_plan_on_every_mesh_matches_single_process(runs_name, request):
    ranks = request.getfixturevalue(runs_name)
    for i, (mesh, kind) in enumerate((((2, 1), "full"), ((1, 2), "full"), ((2, 2), "full"), ((2, 2), "split"))):
        runs = [r["runs"][i] for r in ranks]
        assert all(r["mesh"] == mesh and r["kind"] == kind for r in runs)
        dp = 4 // (mesh[0] * mesh[1])
        assert runs[0]["dims"] == (dp, *mesh)
        assert set(runs[0]["applied"]) == {"net.0", "net.2"}
        assert len(runs[0]["sharded"]) == 4, runs[0]["sharded"]  # both linears are DTensors
        got, want = _mean_over_replicas(runs), uw.reference_losses(dp)
        assert len(got) == len(want) == uw.STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert worst <= 1e-5, (mesh, kind, worst, got[:3], want[:3])
        assert got[-1] < got[0]


@pytest.mark.parametrize("runs_name", ["pl_runs", "unified_runs"])
def test_user_mlp_with_fsdp_over_dp_matches_single_process(runs_name, request):
    """(2, 1) x dp 2 with ``fsdp=True``: each TP shard is split again over the 2 replicas
    (a DTensor on (dp, d1, d2)); the losses are the single-process ones fed by DDP's samplers."""
    runs = [r["runs"][4] for r in request.getfixturevalue(runs_name)]
    assert runs[0]["kind"] == "fsdp" and runs[0]["dims"] == (2, 2, 1)
    # net.0 weight 32x16 column-first over d1=2 -> 16x16, then over dp=2 -> 8x16
    assert runs[0]["sharded"][0] == (uw.HID // 4, uw.IN), runs[0]["sharded"]
    assert all("Shard(dim=0)" in p.split(",")[0] or "_StridedShard" in p for p in runs[0]["placements"]), runs[0]
    got, want = _mean_over_replicas(runs), uw.reference_losses(2)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (got[:3], want[:3])


def test_dataloader_keeps_single_process_order_with_one_replica(pl_runs):
    """dp = 1 on (2, 2): every rank sees the user's unshuffled batches, in order."""
    ds = uw.dataset()
    want = [float(ds[s * uw.BATCH][0][0]) for s in range(uw.STEPS)]
    for r in pl_runs:
        assert r["runs"][2]["first_x"] == want


def test_no_plan_trains_data_parallel_and_says_so(light):
    for package in ("pytorch_lightning", "lightning.pytorch"):
        runs = [r[package] for r in light]
        assert runs[0]["dims"] == (2, 1, 1) and runs[0]["applied"] == {}
        assert any("no parallel plan and no model adapter for Regressor" in n for n in runs[0]["notes"])
        got = [sum(x) / 2 for x in zip(*(r["losses"] for r in runs))]
        want = uw.reference_losses(2)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5


def test_meta_device_model_is_materialized_as_shards(light):
    for r in light:
        meta = r["meta"]
        assert meta["full"] == [], meta["full"][:5]  # no rank ever made a whole 48x24 weight
        assert meta["global"] == [(48, 24), (48,), (24, 48), (24,)]
        assert meta["local"] == [(48, 12), (48,), (12, 48), (12,)]  # (1, 2): inputs of fc1, outputs of fc2 halved
        assert meta["finite"]


def test_a_gpt_with_a_users_block_is_refused_in_one_line():
    """The GPT's plan keeps activations split between its modules, which is exact only where
    the code between them is the GPT's own (elementwise): a block subclass overriding
    ``forward``, or a module of another class, is refused by name, before anything is laid out."""
    import torch.nn.functional as F

    from atp_pipeline.errors import ConfigError
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.models.gpt import GPT, GPTConfig
    from atp_pipeline.models.gpt.model import MLP, Block

    class ReluBlock(Block):
        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp.fc2(F.relu(self.mlp.fc1(self.ln2(x))))

    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, layers=2)
    gpt = GPT(cfg)
    adapter = get_adapter("gpt")
    assert "blocks.*.attn.core" in adapter.parallel_plan(gpt)
    gpt.blocks[1] = ReluBlock(cfg)
    with pytest.raises(ConfigError) as exc:
        adapter.parallel_plan(gpt)
    assert str(exc.value).startswith("GPT layout: 'blocks.1' is a ReluBlock (a Block subclass), not the built-in GPT's")
    assert "\n" not in str(exc.value)
    gpt.blocks[1] = Block(cfg)
    gpt.blocks[0].mlp = torch.nn.Sequential(MLP(cfg))
    with pytest.raises(ConfigError, match=r"'blocks.0.mlp' is a Sequential, not the built-in GPT's"):
        adapter.parallel_plan(gpt)


def test_import_is_light_and_registers_in_both_lightning_packages():
    code = ("import atp_pipeline, sys; assert 'pytorch_lightning' not in sys.modules and 'hydra' not in sys.modules; "
            "import lightning.pytorch as L; import pytorch_lightning as pl; "
            "assert 'atp' in L.strategies.StrategyRegistry and 'atp' in pl.strategies.StrategyRegistry; "
            "from atp_pipeline.lightning import ATPStrategy; print(ATPStrategy.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "atp_pipeline.lightning.pl"


def test_strategy_arguments_are_checked_by_the_config_schema_and_resolve():
    """``ATPStrategy``'s arguments are the config keys of ``train.py``, refused by the same
    checks (the schema's own, then :mod:`atp_pipeline.run.resolve`'s), in one line naming the key."""
    from atp_pipeline.config.schema import AggregationMode, MeshConfig, MeshStrategy
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.lightning.pl import ATPStrategy
    from atp_pipeline.run.resolve import unplanned_mesh

    with pytest.raises(ConfigError, match=r"^overlap.chunks=0 must be >= 1$"):
        ATPStrategy(chunks=0)
    with pytest.raises(ConfigError, match=r"^aggregation.payload_k=0 must be >= 1$"):
        ATPStrategy(aggregation={"mode": "atp", "payload_k": 0})
    with pytest.raises(ConfigError, match=r"^mesh.dp=0 must be >= 1$"):
        ATPStrategy(mesh=(2, 1), dp=0)._mesh_config()
    fixed = MeshConfig(strategy=MeshStrategy.fixed, d1=2, d2=1)
    assert unplanned_mesh(fixed, AggregationMode.ring, 4, shardable=True) == (2, 2, 1)
    with pytest.raises(ConfigError, match=r"^mesh 2x1 with mesh.dp=1 needs 2 devices, not 3$"):
        unplanned_mesh(fixed, AggregationMode.ring, 3, shardable=True)
    assert unplanned_mesh(MeshConfig(), AggregationMode.ring, 4, shardable=False) == (4, 1, 1)
    assert unplanned_mesh(MeshConfig(), AggregationMode.ring, 4, shardable=True) == (1, 4, 1)
    assert unplanned_mesh(MeshConfig(), AggregationMode.atp, 4, shardable=True) == (4, 1, 1)  # as resolve_dp
