"""Training-step time of a Hugging Face causal LM: ATP's 2D tensor parallelism beside
transformers' and DeepSpeed's own (1-D) tensor parallelism and plain data parallelism.

    python -m benchmarks.hf_tp --world 4 --repeats 5
    python -m benchmarks.hf_tp --family gpt_neox --world 2
    python -m benchmarks.hf_tp --world 4 --emulate ic1 --slowdown 2000

Run from the repository root. One transformers causal LM is built from a small config
(default: a Llama of hidden 256, 8 heads, 4 key/value heads, FFN 512, 2 layers, vocabulary
1024, sequence 128, batch 8, float32, ``attn_implementation="sdpa"``; ``--family`` picks
gpt2, opt, gpt_neox, qwen2 or mistral with analogous shapes, dropout 0) and trained for a
few steps on ``world`` CPU processes (gloo), in each of these configurations:

* ``atp d1xd2`` — ATP's row-/column-first layout on every feasible 2D mesh ``DeviceMesh(d1,
  d2)`` with ``d1*d2 == world`` (ATP §3.2), laid out from what transformers declares by the
  HF adapter (:mod:`atp_pipeline.models.hf.adapter`);
* ``hf-tp`` — transformers' own tensor parallelism: the same weights saved with
  ``save_pretrained`` and loaded with ``from_pretrained(..., distributed_config=
  DistributedConfig(tp_plan="auto", tp_size=world))`` (the successor of ``tp_plan="auto"``;
  DTensor on a 1-D mesh of all ranks; transformers refuses it without ``accelerate``);
* ``deepspeed-autotp`` — DeepSpeed's AutoTP training API (``tensor_parallel.autotp_size =
  world`` in the config of ``deepspeed.initialize``, ZeRO stage 0, the same SGD, gradient
  clipping off — DeepSpeed clips at norm 1.0 by default), 1-D;
* ``ddp`` — ``DistributedDataParallel`` over the same global batch (``batch/world`` rows a rank).

transformers and DeepSpeed split over one dimension only (Megatron-LM's ``(N, 1)``); only
ATP searches the 2D meshes. A comparator that cannot run here (not installed, refuses CPU or
gloo, fails) is a row with its reason (the exception's first line) instead of a number.

A step is forward + backward (transformers' own loss, ``model(input_ids=x, labels=x).loss``)
+ SGD update, between two ``dist.barrier()``s. Every configuration starts from the same
weights; after ``--warmup`` steps, ``--repeats`` rounds each time one step of every
configuration in turn, so machine noise hits them alike. Rows give the median step time,
tokens/s (global tokens per step / median), the first two steps' losses against the
single-process dense model's on the same batch (``loss_match``: within ``--tolerance``
relative), and for ATP the counted communication per (collective, mesh axis) and step beside
the runtime cost model's prediction (``planning/cost.py``, ``CostModel.runtime``) and the
planner's predicted T_comm on ``--topology`` (default: the emulated topology, times
``--slowdown``; else ``local``, this host).

``--emulate TOPOLOGY`` stretches ATP's collectives to the time the topology model predicts
for them, times ``--slowdown`` (:class:`~atp_pipeline.parallel.emulation.TopologyEmulator`,
as :mod:`benchmarks.tp_step` does); those rows are labelled ``emulated``. The comparators'
collectives cannot be stretched: they are measured without emulation, and say so.

Writes ``hf_tp.json`` (rows + metadata), ``hf_tp.csv`` and ``hf_tp.png`` (median step time
per configuration) into ``--out``; a run with another family, world or emulation appends
them to the name (e.g. ``hf_tp_w2_emu-ic1-x2000.json``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import importlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from atp_pipeline.launch import spawn
from atp_pipeline.planning.search import candidate_meshes
from atp_pipeline.planning.shape import layout_infeasibility
from benchmarks.tp_step import CONF, load_topology

LR = 0.05
# Small configs per family (8 query heads, so every mesh of <= 8 ranks splits them); the
# shared fields are in :func:`hf_fields`. Key/value heads: Llama 4,
# Mistral and Qwen2 2 (their 7B models' 4:1 grouping).
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(intermediate_size=512, num_key_value_heads=4, attention_bias=False, tie_word_embeddings=False),
    "mistral": dict(intermediate_size=512, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(intermediate_size=512, num_key_value_heads=2, tie_word_embeddings=False),
    "gpt2": dict(n_inner=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "opt": dict(ffn_dim=512, word_embed_proj_dim=256, dropout=0.0, attention_dropout=0.0),
    "gpt_neox": dict(intermediate_size=512, hidden_dropout=0.0, attention_dropout=0.0,
                     tie_word_embeddings=False),
}


def hf_fields(family: str, hidden: int, layers: int, heads: int, vocab: int, seq: int) -> Dict[str, Any]:
    """The ``AutoConfig.for_model`` fields of the benchmark's model."""
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  max_position_embeddings=max(seq, 256), attn_implementation="sdpa")
    return {**common, **FAMILIES[family]}


def build(spec: Dict[str, Any]) -> torch.nn.Module:
    """The dense model, seeded (every rank builds the same weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(spec["hf"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def version_of(module: str) -> Optional[str]:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001 - not installed, or fails to import
        return None


# ---------------------------------------------------------------- configurations (worker side)
@dataclass
class Runner:
    """One configuration: its step, and what it records."""

    name: str
    impl: str
    step: Optional[Callable[[], torch.Tensor]] = None  # one training step; returns the loss
    mesh: Optional[Tuple[int, int]] = None
    comm: Any = None  # ATP's counted collectives (atp_pipeline.parallel.comm.Comm)
    emulated: bool = False
    reduce_loss: bool = False  # data parallel: the step's loss is the mean of the ranks' losses
    error: Optional[str] = None  # why it did not run
    note: str = ""
    losses: List[float] = field(default_factory=list)
    times: List[float] = field(default_factory=list)
    counted: List[Dict[str, int]] = field(default_factory=list)
    waits: List[Dict[str, Dict[str, float]]] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


def lm_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One training step of a causal LM on transformers' own loss; the loss, detached."""
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def sgd_step(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return lambda: lm_step(model, opt, x)


def atp_runners(dense: torch.nn.Module, x: torch.Tensor, spec: Dict[str, Any]) -> List[Runner]:
    """ATP on every 2D mesh of the world (infeasible ones as rows with the reason)."""
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.emulation import TopologyEmulator
    from atp_pipeline.parallel.mesh import init_mesh
    from atp_pipeline.topology.model import Topology

    topo = Topology.from_config(spec["topology"]) if spec["topology"] else None
    out = []
    for d1, d2 in spec["meshes"]:
        model = copy.deepcopy(dense)
        (name, adapter, sub), = find_adapters(model)
        r = Runner(f"atp {d1}x{d2}", "atp", mesh=(d1, d2), emulated=topo is not None)
        r.error = layout_infeasibility(adapter.shape(sub), d1, d2)
        if r.error is None:
            mesh = init_mesh((d1, d2))
            apply_plan(model, prefixed(name, adapter.parallel_plan(sub)), mesh)
            r.comm = comm_for(mesh, TopologyEmulator(topo, (d1, d2), spec["slowdown"]) if topo else None)
            r.step = sgd_step(model, x)
        out.append(r)
    return out


def hf_tp_runner(x: torch.Tensor, spec: Dict[str, Any], world: int) -> Runner:
    """transformers' own TP: ``from_pretrained`` of the saved dense model with its ``tp_plan``."""
    from transformers import AutoModelForCausalLM

    r = Runner("hf-tp", "hf-tp", mesh=(world, 1), note="transformers tp_plan='auto' (1-D DTensor)")
    try:
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            spec["saved"], distributed_config=DistributedConfig(tp_plan="auto", tp_size=world),
            dtype=torch.float32, attn_implementation="sdpa").train()
        r.step = sgd_step(model, x)
    except Exception as exc:  # noqa: BLE001 - recorded as the row's reason
        r.error = first_line(exc)
    return r


def deepspeed_runner(dense: torch.nn.Module, x: torch.Tensor, batch: int, rank: int, world: int) -> Runner:
    """DeepSpeed AutoTP (training API): ``tensor_parallel.autotp_size = world``, ZeRO stage 0."""
    r = Runner("deepspeed-autotp", "deepspeed-autotp", mesh=(world, 1),
               note="DeepSpeed AutoTP training, ZeRO 0, no gradient clipping")
    try:
        import deepspeed

        r.note += f" (deepspeed {deepspeed.__version__})"
        # DeepSpeed reads its launcher's environment; the process group already exists (gloo)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        deepspeed.init_distributed(dist_backend="gloo")
        model = copy.deepcopy(dense)
        config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 0}, "tensor_parallel": {"autotp_size": world},
                  "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default: not the same SGD
                  "steps_per_print": 1 << 30}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                               config=config)

        def step() -> torch.Tensor:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()

        r.step = step
    except Exception as exc:  # noqa: BLE001 - recorded as the row's reason
        r.error = first_line(exc)
    return r


def ddp_runner(dense: torch.nn.Module, x: torch.Tensor, rank: int, world: int) -> Runner:
    """Data parallel over the same global batch: ``batch/world`` rows a rank."""
    from torch.nn.parallel import DistributedDataParallel

    r = Runner("ddp", "ddp", reduce_loss=True, note=f"DistributedDataParallel, {x.shape[0] // world} rows a rank")
    if x.shape[0] % world:
        r.error = f"batch {x.shape[0]} does not split over {world} ranks"
        return r
    rows = x.shape[0] // world
    r.step = sgd_step(DistributedDataParallel(copy.deepcopy(dense)), x[rank * rows:(rank + 1) * rows])
    return r


def agree(runners: List[Runner]) -> None:
    """A configuration that failed on any rank is dropped on every rank (the collectives of
    the others would otherwise wait for it); the reason is the lowest failing rank's."""
    for r in runners:
        failed = torch.tensor([float(r.error is not None)])
        dist.all_reduce(failed)
        if failed.item() and r.error is None:
            r.error = "failed on another rank"
        if r.error is not None:
            r.step = None
    reasons: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, [r.error for r in runners])
    for i, r in enumerate(runners):
        r.error = next((rs[i] for rs in reasons if rs[i] and rs[i] != "failed on another rank"), r.error)


def run_step(r: Runner, timed: bool) -> None:
    """One step of ``r`` between two barriers; the loss (all ranks' mean for DDP) and, if
    ``timed``, the time and ATP's counted collectives."""
    if r.comm is not None:
        r.comm.stats.reset()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        loss = r.step()
        ok = 1.0
    except Exception as exc:  # noqa: BLE001 - recorded as the row's reason
        r.error, loss, ok = first_line(exc), torch.tensor(float("nan")), 0.0
    dist.barrier()
    dt = time.perf_counter() - t0
    value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    status = torch.tensor([ok, value])
    dist.all_reduce(status)
    if status[0].item() < dist.get_world_size():
        r.error, r.step = r.error or "failed on another rank", None
        return
    r.losses.append(status[1].item() / dist.get_world_size() if r.reduce_loss else value)
    if timed:
        r.times.append(dt)
        if r.comm is not None:
            r.counted.append({f"{k}/{a}": n for (k, a), n in sorted(r.comm.stats.elements().items())})
            r.waits.append({a: {"wait_s": c.wait_s, "emulated_s": c.emulated_s}
                            for a, c in r.comm.stats.by_axis().items()})


def reference_losses(dense: torch.nn.Module, x: torch.Tensor, steps: int) -> List[float]:
    """The single-process dense model's first losses on the same batch (same SGD)."""
    step = sgd_step(copy.deepcopy(dense), x)
    return [float(step()) for _ in range(steps)]


def worker(rank: int, world: int, spec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    batch, seq = spec["batch"], spec["seq"]
    x = torch.randint(0, spec["hf"]["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    dense = build(spec)
    ref = reference_losses(dense, x, 2)
    if rank == 0:
        dense.save_pretrained(spec["saved"])
    dist.barrier()

    runners = atp_runners(dense, x, spec)
    runners.append(hf_tp_runner(x, spec, world))
    runners.append(deepspeed_runner(dense, x, batch, rank, world))
    runners.append(ddp_runner(dense, x, rank, world))
    agree(runners)
    for _ in range(spec["warmup"]):
        for r in runners:
            if r.step is not None:
                run_step(r, timed=False)
    for _ in range(spec["repeats"]):
        for r in runners:
            if r.step is not None:
                run_step(r, timed=True)
    agree(runners)
    if rank != 0:
        return None
    return {"rows": [row_of(r, ref, spec) for r in runners], "reference_losses": ref}


def row_of(r: Runner, ref: List[float], spec: Dict[str, Any]) -> Dict[str, Any]:
    tokens = spec["batch"] * spec["seq"]
    row: Dict[str, Any] = {"impl": r.impl, "name": r.name, "mesh": r.mesh, "emulated": r.emulated,
                           "topology": spec["emulate"] if r.emulated else None,
                           "note": r.note or ("ATP 2D layout (HF adapter)" if r.impl == "atp" else ""),
                           "status": "ok" if r.error is None and r.times else "not run", "error": r.error}
    if r.impl != "atp" and spec["emulate"]:
        row["note"] += "; measured without emulation (its collectives are not ATP's)"
    if r.losses:
        row["loss_step1"] = r.losses[0]
        row["loss_step1_rel_err"] = abs(r.losses[0] - ref[0]) / abs(ref[0])
        if len(r.losses) > 1:
            row["loss_step2"] = r.losses[1]
            row["loss_step2_rel_err"] = abs(r.losses[1] - ref[1]) / abs(ref[1])
        row["loss_match"] = all(row.get(f"loss_step{i}_rel_err", 0.0) <= spec["tolerance"] for i in (1, 2))
    if r.times and r.error is None:
        med = statistics.median(r.times)
        row.update(step_s_median=med, step_s_min=min(r.times), tokens_per_s=tokens / med, samples=len(r.times))
    if r.counted:
        row["counted_elements"] = r.counted[-1]
        row["counted_constant"] = all(c == r.counted[-1] for c in r.counted)
        for axis in ("d1", "d2"):
            row[f"{axis}_wait_s_per_step"] = statistics.median([w.get(axis, {}).get("wait_s", 0.0) for w in r.waits])
            row[f"{axis}_emulated_s_per_step"] = statistics.median(
                [w.get(axis, {}).get("emulated_s", 0.0) for w in r.waits])
    return row


# ---------------------------------------------------------------- predictions (parent side)
def model_shape(spec: Dict[str, Any]) -> Any:
    """The HF adapter's :class:`ModelShape` of the benchmark model, with the step's batch."""
    from transformers import AutoConfig

    from atp_pipeline.models.hf.adapter import shape_of_config

    fields = dict(spec["hf"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return shape_of_config(config).with_step(batch_size=spec["batch"], seq_len=spec["seq"], dtype="fp32")


def predict(rows: List[Dict[str, Any]], shape: Any, topo: Any, slowdown: float) -> None:
    """ATP rows: the runtime cost model's elements per (collective, axis) and step, whether the
    counted ones equal them, and the planner's T_comm on ``topo`` (times ``slowdown``)."""
    from atp_pipeline.config.schema import CostModel
    from atp_pipeline.planning.cost import comm_terms, predicted_elements
    from atp_pipeline.planning.search import evaluate

    for r in rows:
        if r["impl"] != "atp" or r["status"] != "ok":
            continue
        mesh = tuple(r["mesh"])
        got = predicted_elements(comm_terms(CostModel.runtime, shape, mesh), shape.batch_size * shape.seq_len,
                                 shape.layers)
        r["predicted_elements"] = {f"{k}/{a}": n for (k, a), n in sorted(got.items())}
        r["counted_equals_predicted"] = r["predicted_elements"] == r.get("counted_elements")
        r["predicted_t_comm_s"] = evaluate(topo, shape, mesh, CostModel.runtime).t_comm_s * slowdown
        r["predicted_topology"] = f"{topo.name} x{slowdown:g}" if slowdown != 1 else topo.name


# ---------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=1e-5, help="relative loss difference allowed vs one process")
    p.add_argument("--emulate", default=None, help="topology name in <conf>/topology (emulated interconnect)")
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--topology", default=None,
                   help="topology the planner's T_comm is predicted on (default: --emulate, else local)")
    p.add_argument("--out", default="outputs/benchmarks/hf_tp")
    p.add_argument("--conf", type=Path, default=CONF,
                   help="config tree with topology/ (default: conf under the current directory)")
    args = p.parse_args(argv)

    topo = load_topology(args.emulate, args.world, args.conf) if args.emulate else None
    ptopo = load_topology(args.topology or args.emulate or "local", args.world, args.conf)
    hf = {"model_type": args.family, **hf_fields(args.family, args.hidden, args.layers, args.heads, args.vocab,
                                                 args.seq)}
    saved = tempfile.mkdtemp(prefix="hf_tp_")
    spec = {"hf": hf, "batch": args.batch, "seq": args.seq, "meshes": candidate_meshes(args.world),
            "topology": topo.to_dict() if topo else None, "emulate": args.emulate, "slowdown": args.slowdown,
            "warmup": args.warmup, "repeats": args.repeats, "tolerance": args.tolerance, "saved": saved}
    started = datetime.datetime.now().astimezone()
    load = os.getloadavg()
    t0 = time.perf_counter()
    try:
        result = spawn(worker, args.world, spec, timeout=3600)[0]
    finally:
        shutil.rmtree(saved, ignore_errors=True)
    rows: List[Dict[str, Any]] = result["rows"]
    shape = model_shape(spec)
    pslow = args.slowdown if (topo and ptopo.name == topo.name) else 1.0
    predict(rows, shape, ptopo, pslow)
    for r in rows:
        if r["status"] == "ok" and r["impl"] == "ddp":
            ddp = r["step_s_median"]
            for s in rows:
                if s.get("step_s_median"):
                    s["ratio_to_ddp"] = s["step_s_median"] / ddp

    meta = {"family": args.family, "world": args.world, "batch": args.batch, "seq": args.seq, "dtype": "fp32",
            "tokens_per_step": args.batch * args.seq, "hf_config": hf, "shape": shape.to_dict(), "lr": LR,
            "warmup": args.warmup, "repeats": args.repeats, "tolerance": args.tolerance,
            "reference_losses": result["reference_losses"], "emulated": topo is not None,
            "topology": args.emulate, "slowdown": args.slowdown if topo else None,
            "predicted_on": ptopo.name + (f" x{pslow:g}" if pslow != 1 else ""),
            "date": started.isoformat(timespec="seconds"),
            "torch": torch.__version__, "transformers": version_of("transformers"),
            "accelerate": version_of("accelerate"), "deepspeed": version_of("deepspeed"),
            "python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count(),
            "loadavg_at_start": load, "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "hf_tp" + (f"_{args.family}" if args.family != "llama" else "") + (
        f"_w{args.world}" if args.world != 4 else "") + (f"_emu-{args.emulate}-x{args.slowdown:g}" if topo else "")
    write(rows, meta, out / stem)
    report(rows, meta, out / stem)
    return 0


def write(rows: List[Dict[str, Any]], meta: Dict[str, Any], stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=list) + "\n")
    keys = sorted({k for r in rows for k in r})
    with stem.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (dict, list, tuple)) else v for k, v in r.items()})
    _plot(rows, stem.with_suffix(".png"), meta)


def report(rows: List[Dict[str, Any]], meta: Dict[str, Any], stem: Path) -> None:
    print(f"{'config':<18} {'step ms':>9} {'tokens/s':>9} {'vs ddp':>7} {'loss step 1':>12} {'match':>6} "
          f"{'comm = model':>12} {'pred. comm ms':>13}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['name']:<18} not run: {r['error']}")
            continue
        pred = r.get("predicted_t_comm_s")
        print(f"{r['name']:<18} {r['step_s_median'] * 1e3:9.1f} {r['tokens_per_s']:9.0f} "
              f"{r.get('ratio_to_ddp', float('nan')):7.2f} {r.get('loss_step1', float('nan')):12.7f} "
              f"{str(r.get('loss_match', '')):>6} {str(r.get('counted_equals_predicted', '')):>12} "
              f"{'' if pred is None else f'{pred * 1e3:.2f}':>13}")
    emu = f"ATP rows emulate {meta['topology']} x{meta['slowdown']:g}, comparators do not" if meta["emulated"] \
        else "no emulation"
    print(f"{meta['family']}, {meta['world']} processes, {meta['tokens_per_step']} tokens a step; {emu}; "
          f"predicted T_comm on {meta['predicted_on']}; wrote {stem}.{{json,csv,png}}")


def _plot(rows: List[Dict[str, Any]], path: Path, meta: Dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(rows) + 2), 3.8))
    names = [r["name"] + (" (emulated)" if r["emulated"] else "") for r in rows]
    heights = [r.get("step_s_median", 0.0) * 1e3 for r in rows]
    colors = ["tab:blue" if r["impl"] == "atp" else "tab:gray" for r in rows]
    bars = ax.bar(names, heights, color=colors)
    top = max(heights) if any(heights) else 1.0
    for bar, r in zip(bars, rows):
        if r["status"] != "ok":
            ax.text(bar.get_x() + bar.get_width() / 2, 0.02 * top, "not run", ha="center", va="bottom",
                    rotation=90, fontsize=8)
    ax.set_ylabel("step time, median (ms)")
    label = (f"ATP emulated {meta['topology']} x{meta['slowdown']:g}, comparators not" if meta["emulated"]
             else "no emulation")
    ax.set_title(f"HF {meta['family']} ({meta['tokens_per_step']} tokens/step) on {meta['world']} CPU processes\n"
                 f"({label})", fontsize=9)
    ax.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
