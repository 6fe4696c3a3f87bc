"""Memory of the logits on a rank: transformers' whole-vocabulary head and loss against the
vocabulary-split head and loss (:mod:`atp_pipeline.parallel.vocab`), measured on CPU.

    python -m benchmarks.vocab_loss_memory           # writes outputs/benchmarks/vocab_loss_memory/

An LM head ``[V, h]`` (no bias) and the causal-LM loss on ``batch x seq`` tokens, forward and
backward, from a given final hidden state (the blocks before it are the same in every layout):

* ``dense`` — one process: ``nn.Linear`` and transformers' own ``ForCausalLMLoss`` (the whole
  ``[tokens, V]`` logits, upcast to float32);
* ``gathered`` — today's HF layout on each rank: column-first head with the logits gathered over
  d1 (``column(output=full)``), transformers' loss on the whole logits;
* ``vocab_split`` — :class:`~atp_pipeline.parallel.vocab.VocabSplitHead` (``[tokens/d2, V/d1]``)
  and :func:`~atp_pipeline.parallel.vocab.causal_lm_loss`;

on 2x2, 1x4 and 4x1 (one launch of 4 gloo processes). Two measurements per rank, each the
largest over the ranks:

* ``peak_bytes`` — the peak of the CPU allocator's live bytes during forward + loss + backward,
  above the level before it: every allocation and free the profiler records
  (``torch.profiler`` with ``profile_memory=True``, its raw ``[memory]`` events summed in time
  order). ``tracemalloc`` cannot be used: it sees Python's allocator, not torch's;
* ``saved_bytes`` — the bytes the autograd graph holds from the forward to the backward (the
  distinct storages packed by ``torch.autograd.graph.saved_tensors_hooks``), plus the logits
  tensor the model returns: the memory a step keeps while the rest of the backward runs.

Writes ``vocab_loss_memory.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

MESHES: List[Tuple[int, int]] = [(2, 2), (1, 4), (4, 1)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def measure(step: Callable[[], torch.Tensor]) -> Dict[str, float]:
    """Run ``step`` (forward + loss, returning ``(loss, logits)``) and its backward under the
    profiler's memory events and the saved-tensor hooks."""
    from torch.profiler import ProfilerActivity, profile

    saved: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, logits = step()
        held = sum(saved.values()) + logits.untyped_storage().nbytes()
        loss.backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return {"peak_bytes": float(peak), "saved_bytes": float(held), "logits_shape": list(logits.shape),
            "logits_bytes": float(logits.numel() * logits.element_size()), "loss": float(loss)}


def worker(rank: int, world: int, vocab: int, hidden: int, batch: int, seq: int, dtype: str) -> Dict[str, Any]:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.linear import ATPLinear
    from atp_pipeline.parallel.mesh import init_mesh
    from atp_pipeline.parallel.vocab import VocabSplitHead, causal_lm_loss

    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dt)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden ** 0.5)
    x0 = torch.randn(batch, seq, hidden, generator=g).to(dt)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)

    def dense_step(module: torch.nn.Module) -> Callable[[], Tuple[torch.Tensor, torch.Tensor]]:
        def step() -> Tuple[torch.Tensor, torch.Tensor]:
            x = x0.clone().requires_grad_()
            logits = module(x)
            return ForCausalLMLoss(logits, labels, vocab), logits
        return step

    out: Dict[str, Any] = {"rank": rank}
    if rank == 0:
        measure(dense_step(head))  # warm-up (first-call allocations)
        out["dense"] = measure(dense_step(head))
    for d1, d2 in MESHES:
        mesh = init_mesh((d1, d2))
        comm = comm_for(mesh)
        gathered = ATPLinear.from_linear(head, mesh, "column", input_is_parallel=False, gather_output=True)
        split = VocabSplitHead(mesh, linear=head)

        def split_step() -> Tuple[torch.Tensor, torch.Tensor]:
            x = x0.clone().requires_grad_()
            logits = split(x)
            return causal_lm_loss(logits, labels, vocab, comm), logits

        for name, step in (("gathered", dense_step(gathered)), ("vocab_split", split_step)):
            measure(step)  # warm-up
            out[f"{name}/{d1}x{d2}"] = measure(step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--out", default="outputs/benchmarks/vocab_loss_memory")
    a = ap.parse_args()

    from atp_pipeline.launch import spawn

    t0 = time.time()
    ranks = spawn(worker, 4, a.vocab, a.hidden, a.batch, a.seq, a.dtype)
    dense = ranks[0]["dense"]
    layouts: Dict[str, Any] = {}
    for key in sorted(k for k in ranks[0] if "/" in k):
        worst = {m: max(r[key][m] for r in ranks) for m in ("peak_bytes", "saved_bytes")}
        d1, d2 = (int(v) for v in key.split("/")[1].split("x"))
        layouts[key] = {**worst, "logits_shape": ranks[0][key]["logits_shape"],
                        "logits_bytes": ranks[0][key]["logits_bytes"], "loss": ranks[0][key]["loss"],
                        "d1*d2": d1 * d2,
                        "peak_reduction": dense["peak_bytes"] / worst["peak_bytes"],
                        "saved_reduction": dense["saved_bytes"] / worst["saved_bytes"]}
    result = {"command": "python -m benchmarks.vocab_loss_memory " + " ".join(
                  f"--{k} {v}" for k, v in vars(a).items()),
              "setup": {"vocab": a.vocab, "hidden": a.hidden, "batch": a.batch, "seq": a.seq, "dtype": a.dtype,
                        "tokens": a.batch * a.seq, "processes": 4, "backend": "gloo",
                        "host": platform.node(), "torch": torch.__version__},
              "method": {"peak_bytes": "torch.profiler(profile_memory=True) raw [memory] events (CPU allocator), "
                                       "live bytes summed in time order over forward + loss + backward, peak above "
                                       "the start; the largest over the ranks",
                         "saved_bytes": "distinct storages packed by autograd's saved_tensors_hooks during forward "
                                        "+ loss, plus the returned logits; the largest over the ranks"},
              "dense": dense, "layouts": layouts, "wall_s": round(time.time() - t0, 1)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab_loss_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"dense (one process): peak {dense['peak_bytes'] / 2**20:.1f} MiB, "
          f"saved {dense['saved_bytes'] / 2**20:.1f} MiB")
    for key, r in layouts.items():
        print(f"{key:18s} logits {r['logits_shape']}: peak {r['peak_bytes'] / 2**20:7.1f} MiB "
              f"({r['peak_reduction']:.2f}x less), saved {r['saved_bytes'] / 2**20:7.1f} MiB "
              f"({r['saved_reduction']:.2f}x less; d1*d2 = {r['d1*d2']})")
    print(f"wrote {out / 'vocab_loss_memory.json'}")


if __name__ == "__main__":
    main()
