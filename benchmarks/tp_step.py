"""Step time of ATP's tensor parallelism per mesh and chunk count, beside PyTorch's own.

    python -m benchmarks.tp_step --model tiny --world 4
    python -m benchmarks.tp_step --model small --world 8 --emulate ic1 --slowdown 200

Run from the repository root (``--conf``, default ``conf``, is the config tree the model and
topology names are read from). On ``world`` CPU processes (gloo) it trains the GPT of
``<conf>/model/<model>.yaml`` for a few steps on every 2D mesh of ``world`` devices with
each chunk count, and — unless emulating —
PyTorch-native tensor parallelism (``parallelize_module``, ColwiseParallel/RowwiseParallel)
and plain data parallelism (DDP) on the same model, ranks and global batch. Configurations
are interleaved over ``--repeats`` rounds so machine noise hits them alike; a step is
forward + backward + SGD update between two barriers. It writes JSON and CSV (step time
median, tokens/s, measured communication per mesh dimension, the planner's predicted
T_comm) and a bar chart into ``--out``.

``--emulate TOPOLOGY`` stretches every collective to the time the topology model predicts
for it (times ``--slowdown``; :mod:`atp_pipeline.parallel.emulation`); those rows are
labelled ``emulated``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from atp_pipeline.config.schema import CostModel, ModelConfig, TopologyConfig
from atp_pipeline.launch import spawn
from atp_pipeline.models.adapter import find_adapters, prefixed
from atp_pipeline.models.gpt import GPT, GPTConfig
from atp_pipeline.models.gpt.native import data_parallel, native_tensor_parallel
from atp_pipeline.parallel import comm_for, init_mesh
from atp_pipeline.parallel.apply import apply_plan
from atp_pipeline.parallel.emulation import TopologyEmulator
from atp_pipeline.planning.search import candidate_meshes, evaluate
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.topology.model import Topology

CONF = Path("conf")  # the repository's config tree, relative to the current directory
DTYPES = {"fp16": torch.float32, "bf16": torch.float32, "fp32": torch.float32, "fp64": torch.float64}


def load_model(name: str, conf: Path = CONF) -> ModelConfig:
    """``<conf>/model/<name>.yaml`` as a typed :class:`ModelConfig`."""
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(Path(conf) / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def load_topology(name: str, world: int, conf: Path = CONF) -> Topology:
    """``<conf>/topology/<name>.yaml``, restricted to ``world`` devices."""
    raw = OmegaConf.merge(OmegaConf.structured(TopologyConfig),
                          OmegaConf.load(Path(conf) / "topology" / f"{name}.yaml"))
    topo = Topology.from_config(raw)
    return topo if topo.world_size == world else topo.restrict(world)


def _time_steps(step, steps: int) -> List[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def dense_model(cfg: GPTConfig, family: str) -> nn.Module:
    """The built-in GPT of ``cfg``, or (``family="llama"``) a transformers Llama of the same size:
    hidden, heads, layers, sequence, vocabulary, and a SwiGLU width of ``8h/3`` rounded to 64
    (the same MLP parameters as the GPT's ``4h``), no dropout, untied head."""
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(cfg)
    from transformers import AutoConfig, AutoModelForCausalLM

    ffn = max(64, round(8 * cfg.hidden / 3 / 64) * 64)
    config = AutoConfig.for_model(family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden,
                                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                  num_key_value_heads=cfg.heads, intermediate_size=ffn,
                                  max_position_embeddings=cfg.seq_len, tie_word_embeddings=False,
                                  attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def laid_out(dense: nn.Module, mesh: Any, chunks: int) -> Tuple[nn.Module, Any]:
    """A copy of ``dense`` laid out by its family's plan on ``mesh``, blocks in ``chunks`` (§4.1),
    and its adapter (whose ``lm_loss`` calls it)."""
    model = copy.deepcopy(dense)
    (name, adapter, sub), = find_adapters(model)
    apply_plan(model, prefixed(name, adapter.parallel_plan(sub)), mesh, chunks)
    return model, adapter


def worker(rank: int, world: int, spec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    cfg = GPTConfig(**spec["gpt"])
    dtype = DTYPES[spec["dtype"]]
    batch = spec["batch"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    dense = dense_model(cfg, spec["family"]).to(dtype)
    topo = Topology.from_config(spec["topology"]) if spec["topology"] else None

    runners: Dict[str, Any] = {}
    loss_of: Dict[str, Any] = {}  # how each runner computes the loss (its family's convention)
    for d1, d2 in spec["meshes"]:
        for chunks in spec["chunks"]:
            mesh = init_mesh((d1, d2))
            model, adapter = laid_out(dense, mesh, chunks)
            comm = comm_for(mesh, TopologyEmulator(topo, (d1, d2), spec["slowdown"]) if topo else None)
            runners[f"atp {d1}x{d2} chunks={chunks}"] = (model, comm, (d1, d2), chunks)
            loss_of[f"atp {d1}x{d2} chunks={chunks}"] = adapter.lm_loss
            if spec.get("fused") and spec["family"] == "gpt":  # the hand-scheduled fused block, same mesh and chunks
                from benchmarks.fused_block import fused_gpt

                mesh = init_mesh((d1, d2))
                fused = fused_gpt(dense, mesh, chunks)
                comm = comm_for(mesh, TopologyEmulator(topo, (d1, d2), spec["slowdown"]) if topo else None)
                runners[f"fused {d1}x{d2} chunks={chunks}"] = (fused, comm, (d1, d2), chunks)
    if spec["comparators"] and spec["family"] == "gpt":
        native = native_tensor_parallel(dense, world)
        runners["native-tp"] = (native, None, (world, 1), 1)
        ddp = data_parallel(dense)
        runners["ddp"] = (ddp, None, None, 1)

    samples: Dict[str, List[float]] = {k: [] for k in runners}
    comm: Dict[str, List[Dict[str, Any]]] = {k: [] for k in runners}
    for _ in range(spec["repeats"]):
        for name, (model, comm_of, mesh, chunks) in runners.items():
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            if name == "ddp":
                lo = rank * batch // world
                x, y = idx[lo:lo + batch // world], tgt[lo:lo + batch // world]
            else:
                x, y = idx, tgt

            def step() -> None:
                loss = loss_of.get(name, lambda m, a, b: m(a, b))(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            _time_steps(step, spec["warmup"])
            if comm_of is not None:
                comm_of.stats.reset()
            samples[name] += _time_steps(step, spec["steps"])
            if comm_of is not None:
                by_axis = comm_of.stats.by_axis()
                comm[name].append({a: {"bytes": c.bytes / spec["steps"], "wait_s": c.wait_s / spec["steps"],
                                       "emulated_s": c.emulated_s / spec["steps"]}
                                   for a, c in by_axis.items()})
    if rank != 0:
        return None
    rows = []
    for name, (_, _, mesh, chunks) in runners.items():
        med = statistics.median(samples[name])
        row: Dict[str, Any] = {"impl": name.split()[0], "name": name, "mesh": mesh, "chunks": chunks,
                               "emulated": topo is not None, "step_s_median": med,
                               "step_s_min": min(samples[name]),
                               "tokens_per_s": batch * cfg.seq_len / med, "samples": len(samples[name])}
        if comm[name]:
            last = comm[name][-1]
            for axis in ("d1", "d2"):
                row[f"{axis}_bytes_per_step"] = last.get(axis, {}).get("bytes", 0.0)
                row[f"{axis}_wait_s_per_step"] = statistics.median(
                    [c.get(axis, {}).get("wait_s", 0.0) for c in comm[name]])
        rows.append(row)
    return {"rows": rows}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--fused", action="store_true",
                   help="also time the hand-scheduled fused GPT block (benchmarks/fused_block.py) "
                        "on each mesh and chunks")
    p.add_argument("--family", default="gpt", choices=("gpt", "llama"),
                   help="the built-in GPT of --model's size, or a transformers Llama of the same size")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--chunks", default="1,2,4")
    p.add_argument("--meshes", default="all", help="all, or e.g. 4x1,2x2")
    p.add_argument("--emulate", default=None, help="topology name in <conf>/topology (emulated interconnect)")
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="outputs/benchmarks/tp_step")
    p.add_argument("--conf", type=Path, default=CONF,
                   help="config tree with model/ and topology/ (default: conf under the current directory)")
    args = p.parse_args(argv)

    mcfg = load_model(args.model, args.conf)
    if args.batch is not None:
        mcfg.batch_size = args.batch
    meshes = candidate_meshes(args.world) if args.meshes == "all" else [
        tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    topo = load_topology(args.emulate, args.world, args.conf) if args.emulate else None
    spec = {"gpt": asdict(GPTConfig.from_model_config(mcfg)), "dtype": mcfg.dtype.value,
            "batch": mcfg.batch_size, "meshes": meshes, "chunks": [int(c) for c in args.chunks.split(",")],
            "topology": topo.to_dict() if topo else None, "slowdown": args.slowdown,
            "comparators": topo is None, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "family": args.family, "fused": args.fused}
    t0 = time.perf_counter()
    result = spawn(worker, args.world, spec, timeout=3600)[0]
    rows: List[Dict[str, Any]] = result["rows"]

    summary = ModelShape.of(mcfg)
    native = next((r["step_s_median"] for r in rows if r["impl"] == "native-tp"), None)
    for r in rows:
        if r["impl"] == "atp" and topo is not None:
            r["predicted_t_comm_s"] = (evaluate(topo, summary, tuple(r["mesh"]), CostModel.runtime).t_comm_s
                                       * args.slowdown)
        if native:
            r["ratio_to_native_tp"] = r["step_s_median"] / native
        twin = next((f for f in rows if f["impl"] == "fused" and f["mesh"] == r["mesh"] and f["chunks"] == r["chunks"]),
                    None)
        if r["impl"] == "atp" and twin is not None:
            r["ratio_to_fused"] = r["step_s_median"] / twin["step_s_median"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = (f"{args.model}{'' if args.family == 'gpt' else '_' + args.family}_b{mcfg.batch_size}_w{args.world}"
           + (f"_emu-{args.emulate}-x{args.slowdown:g}" if topo else ""))
    meta = {"model": args.model, "family": args.family, "batch": mcfg.batch_size, "world": args.world,
            "emulated": topo is not None,
            "topology": args.emulate, "slowdown": args.slowdown if topo else None,
            "torch": torch.__version__, "wall_s": time.perf_counter() - t0}
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=list) + "\n")
    keys = sorted({k for r in rows for k in r})
    with (out / f"{tag}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    _plot(rows, out / f"{tag}.png", meta)
    print(f"{'config':<24} {'step ms':>9} {'tokens/s':>10} {'vs native':>10} {'predicted comm ms':>18} "
          f"{'d1 wait ms':>10} {'d2 wait ms':>10}")
    for r in rows:
        pred = r.get("predicted_t_comm_s")
        print(f"{r['name']:<24} {r['step_s_median'] * 1e3:9.2f} {r['tokens_per_s']:10.0f} "
              f"{r.get('ratio_to_native_tp', float('nan')):10.3f} "
              f"{'' if pred is None else f'{pred * 1e3:.2f}':>18} "
              f"{r.get('d1_wait_s_per_step', 0) * 1e3:10.2f} {r.get('d2_wait_s_per_step', 0) * 1e3:10.2f}")
    print(f"{'emulated interconnect: ' + args.emulate + f' x{args.slowdown:g}' if topo else 'no emulation'}; "
          f"wrote {out / tag}.{{json,csv,png}}")
    return 0


def _plot(rows: List[Dict[str, Any]], path: Path, meta: Dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(rows) + 2), 3.8))
    colors = ["tab:gray" if r["impl"] != "atp" else "tab:blue" for r in rows]
    ax.bar([r["name"].replace("atp ", "").replace(" chunks=", "/c") for r in rows],
           [r["step_s_median"] * 1e3 for r in rows], color=colors)
    ax.set_ylabel("step time, median (ms)")
    label = f"emulated {meta['topology']} x{meta['slowdown']:g}" if meta["emulated"] else "no emulation"
    ax.set_title(f"{meta['model']} on {meta['world']} CPU processes ({label})", fontsize=9)
    ax.tick_params(axis="x", labelrotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
