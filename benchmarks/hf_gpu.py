"""One GPU, mesh 1x1: a ~1B-parameter Hugging Face Llama trained under ATP's layout against
plain ``transformers``.

    python -m benchmarks.hf_gpu                       # Llama-3.2-1B shape, bf16, batch 4 x 2048
    python -m benchmarks.hf_gpu --steps 10 --lightning
    python -m benchmarks.hf_gpu --device cpu --layers 1 --batch 1 --seq 32   # the code path, on CPU

Run from the repository root on a machine with a CUDA GPU (one process; NCCL world of 1).
The model is built from the Llama-3.2-1B config (hidden 2048, 16 layers, 32 query and 8
key/value heads, gated FFN 8192, vocabulary 128,256, tied embeddings; random weights: no
hub here) in bfloat16 with ``attn_implementation="sdpa"``; every configuration starts from
the same weights and trains on the same random tokens with AdamW (``foreach``; the
ATP model through :func:`atp_pipeline.lightning.module.adamw`, one group per kind):

* ``transformers`` — the model as transformers builds it: ``model(input_ids=x,
  labels=x).loss``, backward, optimizer step, ``zero_grad``;
* ``atp 1x1`` — the same model laid out by the HF adapter's plan
  (:func:`atp_pipeline.parallel.apply.apply_plan`) on a 1x1 :func:`init_mesh`, in the same loop.

After ``--warmup`` steps, ``--repeats`` rounds each time one step of every configuration in
turn (``torch.cuda.synchronize`` around each step), so clock and thermal drift hit them
alike; rows give the median step, tokens/s and the ratio to ``transformers``, plus the first
step's losses (the two must agree: same weights, same batch).

``--lightning`` adds two Trainer runs of ``--steps`` steps each on the same model and data:
``Trainer(strategy="atp", devices=1)`` and Lightning's default single-device strategy
(per-step times from a callback, medians after ``--warmup``), so the Lightning figure is
compared like for like.

Writes ``hf_gpu.json`` and ``hf_gpu.csv`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

# Llama-3.2-1B (its config.json, as published)
LLAMA_1B: Dict[str, Any] = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                tie_word_embeddings=True, attention_bias=False, mlp_bias=False)
LR = 1e-5


def build(layers: int, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**LLAMA_1B, "num_hidden_layers": layers},
                                  attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def atp_layout(model: torch.nn.Module, device: torch.device) -> Dict[str, str]:
    """The HF adapter's plan applied on a 1x1 mesh: what ``Trainer(strategy="atp", devices=1)``
    does to the model."""
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.mesh import init_mesh

    (name, adapter, sub), = find_adapters(model)
    return apply_plan(model, prefixed(name, adapter.parallel_plan(sub)), init_mesh((1, 1), device_type=device.type))


def stepper(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    from benchmarks.hf_tp import lm_step

    return lambda x: lm_step(model, opt, x)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def lightning_runs(base: torch.nn.Module, data: torch.Tensor, steps: int, warmup: int,
                   accelerator: str) -> Dict[str, List[float]]:
    """Per-step seconds of ``Trainer(strategy=...)`` fits of a plain LightningModule holding
    a copy of ``base``, for the ATP strategy and Lightning's default."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    import atp_pipeline  # noqa: F401  (registers "atp")
    from atp_pipeline.lightning.module import adamw

    class CausalLM(pl.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self) -> Any:
            return adamw(self.parameters(), lr=LR)

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: List[float] = []
            self.t0 = 0.0

        def on_train_batch_start(self, *a: Any) -> None:
            sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            sync()
            self.times.append(time.perf_counter() - self.t0)

    out: Dict[str, List[float]] = {}
    for strategy in ("atp", "auto"):
        cb = StepTimes()
        trainer = pl.Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[cb])
        trainer.fit(CausalLM(copy.deepcopy(base)), DataLoader(data, batch_size=None, shuffle=False))
        out[f"lightning {strategy}"] = cb.times[warmup:]
        del trainer
    return out


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--steps", type=int, default=15, help="steps of each --lightning fit")
    ap.add_argument("--lightning", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same code path without a GPU (for checking the benchmark, not a figure)")
    ap.add_argument("--out", default="outputs/benchmarks/hf_gpu")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.hf_gpu: needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "--device cpu runs the code path on CPU")
    from atp_pipeline.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)

    from atp_pipeline.lightning.module import adamw

    base = build(args.layers, device)
    params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    vocab = LLAMA_1B["vocab_size"]
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
               for _ in range(args.warmup + args.repeats)]
    plain = copy.deepcopy(base)
    atp = copy.deepcopy(base)
    applied = atp_layout(atp, device)
    configs = {"transformers": stepper(plain, torch.optim.AdamW(plain.parameters(), lr=LR, foreach=True)),
               "atp 1x1": stepper(atp, adamw(atp.parameters(), lr=LR))}
    first = {k: float(fn(batches[0])) for k, fn in configs.items()}
    times: Dict[str, List[float]] = {k: [] for k in configs}
    for i, x in enumerate(batches[1:]):
        for k, fn in (configs.items() if i % 2 == 0 else reversed(list(configs.items()))):
            t = timed(lambda: fn(x))
            if i >= args.warmup - 1:
                times[k].append(t)
    del configs, plain, atp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.lightning:
        data = torch.stack([b.cpu() for b in batches[: max(args.steps, 1)]])
        times.update(lightning_runs(base, data, args.steps, args.warmup,
                                    "gpu" if device.type == "cuda" else "cpu"))
    tokens = args.batch * args.seq
    ref = {"transformers": "transformers", "atp 1x1": "transformers",
           "lightning atp": "lightning auto", "lightning auto": "lightning auto"}
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"config": k, "median_step_s": med[k], "tokens_per_s": tokens / med[k],
             "vs": ref[k], "tokens_per_s_ratio": med[ref[k]] / med[k], "steps_timed": len(times[k]),
             "first_loss": first.get(k), "step_s": times[k]} for k in times]
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "parameters": params,
            "layers": args.layers, "batch": args.batch, "seq": args.seq, "dtype": "bfloat16",
            "applied_styles": len(applied), "first_losses_equal": abs(first["transformers"] - first["atp 1x1"])
            <= 1e-2 * abs(first["transformers"])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(out / "hf_gpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "step_s"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(json.dumps(meta))
    for r in rows:
        print(f"{r['config']:16s} {r['median_step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tok/s  "
              f"x{r['tokens_per_s_ratio']:.3f} of {r['vs']}  first loss {r['first_loss']}")
    dist.destroy_process_group()
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
