"""Worker functions for tests/test_hf_models.py: transformers causal LMs built from tiny
configs, laid out by the HF adapter's plan on real gloo processes, against the
single-process model. Each returns plain data; the test asserts."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch

VOCAB, SEQ, BATCH = 96, 8, 4

# Tiny configs of each supported family: 8 query heads (split over d1*d2 <= 4), and key/value
# heads that exercise every layout: split over d1*d2 (8), over d1 only (2 on 1x4 is
# "pick"), fewer than d1 (1 head, Mistral: "gathered"). GPT-2 (Conv1D, fused concatenated
# q|k|v, learned positions, tied head), OPT (per-rank num_heads, positions derived in its
# forward, tied head, ReLU) and GPT-NeoX (per-head interleaved q|k|v, partial rotary,
# parallel residual, untied), dropout 0 (the exactness checks compare with one process).
COMMON: Dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                              max_position_embeddings=64, attn_implementation="sdpa")
TINY: Dict[str, Dict[str, Any]] = {
    "llama": dict(intermediate_size=48, num_key_value_heads=4, attention_bias=False, tie_word_embeddings=False),
    "mistral": dict(intermediate_size=48, num_key_value_heads=1, sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(intermediate_size=48, num_key_value_heads=2, tie_word_embeddings=True),  # tied, as Qwen2-0.5B
    "gpt2": dict(n_inner=48, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "opt": dict(ffn_dim=48, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, activation_function="relu"),
    "gpt_neox": dict(intermediate_size=48, hidden_dropout=0.0, attention_dropout=0.0, rotary_pct=0.5,
                     use_parallel_residual=True, tie_word_embeddings=False),
    # families no table of ours names, laid out from transformers' declaration alone: per-head
    # q/k norms (Qwen3), a fused q|k|v read whole and a packed gate|up (Phi-3), embedding,
    # residual, attention and logit multipliers (Granite)
    "qwen3": dict(intermediate_size=48, num_key_value_heads=4, head_dim=4, tie_word_embeddings=False),
    "phi3": dict(intermediate_size=48, num_key_value_heads=4, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                 tie_word_embeddings=False),
    "granite": dict(intermediate_size=48, num_key_value_heads=2, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.3, logits_scaling=2.0, tie_word_embeddings=True),
    # a mixture of experts: layer 0 a dense MLP, layer 1 routed (4 experts, 2 a token,
    # style hf_experts) beside a shared expert run whole and its sigmoid gate (gradient summed
    # over d2), the router run whole
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], num_key_value_heads=4,
                      use_sliding_window=False, tie_word_embeddings=False),
}


def build(family: str, dtype: torch.dtype = torch.float64, **over: Any) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**COMMON, **TINY[family], **over}
    config = AutoConfig.for_model(family, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(type(model), "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")  # the default grouped GEMM computes in float32 at most
    # non-trivial norm weights and biases, so one applied on the wrong slice cannot hide
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """Max error relative to the reference tensor's magnitude, or to ``floor`` where that is
    smaller (a gradient that is zero in exact arithmetic, e.g. of a key bias, is rounding noise)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


class _Counting:
    """A stored tensor (safetensors slice) that counts the elements read out of it."""

    read = 0

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self.inner[index]
        _Counting.read += t.numel()
        return t


def _round_trip(family: str, idx: torch.Tensor, sub: torch.nn.Module, adapter: Any, mesh: Any, plan: Dict[str, Any],
                saved: str, export_dir: str) -> Dict[str, Any]:
    """Weights in and out in HF format: the dense model's checkpoint loaded into the layout
    from the meta device (each rank reading only its blocks) gives the same loss; the laid-out
    model exported is the dense model again, loadable by ``from_pretrained``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from atp_pipeline.models.hf.adapter import load_pretrained
    from atp_pipeline.models.hf.weights import safetensors_reader
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.dense import load_dense
    from atp_pipeline.parallel.materialize import materialize

    adapter.export(sub, export_dir)
    export_diff = None
    if dist.get_rank() == 0:
        back = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float64)
        ref = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64).state_dict()
        export_diff = max(float((v - ref[k]).abs().max()) for k, v in back.state_dict().items())
    fresh = load_pretrained(saved).to(torch.float64)
    apply_plan(fresh, plan, mesh)
    materialize(fresh, torch.device("cpu"), loaded=[fresh])
    reader = safetensors_reader(saved, fresh)
    _Counting.read = 0
    load_dense(fresh, lambda name: None if reader(name) is None else _Counting(reader(name)))
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in fresh.parameters())
    loss = fresh(input_ids=idx, labels=idx).loss.item()
    return {"export_diff": export_diff, "loaded_loss": loss, "read": _Counting.read, "held": held}


def exactness(rank: int, world: int, families: List[str], meshes: List[Tuple[int, int]],
              workdir: str = "", device: str = "cpu", chunked: Tuple[Tuple[Tuple[int, int], int], ...] = (),
              round_trip_mesh: Tuple[int, int] = (2, 2)) -> List[Dict[str, Any]]:
    """Float64, one forward + backward: loss and every full gradient vs the single process,
    with the counted collectives per (collective, axis); with ``workdir``, the HF checkpoint
    round trip (:func:`_round_trip`) on ``round_trip_mesh`` (both mesh axes split); also with
    the blocks in chunks (§4.1 overlap) for each ``(mesh, chunks)`` of ``chunked``.
    ``device="cuda"``: models, batch and mesh on this rank's GPU (ranks may share one GPU over
    gloo, which carries CUDA tensors)."""
    import torch.distributed as dist

    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.dense import dense_tensors
    from atp_pipeline.parallel.mesh import init_mesh

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    idx = batch().to(dev)
    out = []
    for family in families:
        dense = build(family).to(dev)
        ref = dense(input_ids=idx, labels=idx).loss
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
        dense.zero_grad(set_to_none=True)
        saved = f"{workdir}/{family}"
        if workdir and rank == 0:
            dense.save_pretrained(saved)
        if workdir:
            dist.barrier()
        for (d1, d2), chunks in [(tuple(m), 1) for m in meshes] + [(tuple(m), c) for m, c in chunked]:
            mesh = init_mesh((d1, d2), device_type=dev.type)
            model = copy.deepcopy(dense)
            (name, adapter, sub), = find_adapters(model)
            plan = prefixed(name, adapter.parallel_plan(sub))
            applied = apply_plan(model, plan, mesh, chunks)
            comm = comm_for(mesh)
            comm.stats.reset()
            loss = model(input_ids=idx, labels=idx).loss
            loss.backward()
            grads = dense_tensors(model, grad=True)
            floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values())
            err = {n: _rel(grads[n], ref_grads[n], floor) for n in ref_grads if n in grads}
            out.append({"family": family, "mesh": (d1, d2), "chunks": chunks,
                        "loss_rel": abs(loss.item() - ref.item()) / abs(ref.item()),
                        "grad_rel": max(err.values()), "worst": max(err, key=err.get),
                        "same_params": sorted(grads) == sorted(ref_grads), "applied": len(applied),
                        "counted": {f"{k}/{a}": n for (k, a), n in comm.stats.elements().items()},
                        "shape": adapter.shape(sub).to_dict(), "loss": loss.item(),
                        **(_round_trip(family, idx, sub, adapter, mesh, plan, saved, f"{saved}-{d1}x{d2}")
                           if workdir and chunks == 1 and (d1, d2) == tuple(round_trip_mesh) else {})})
    return out


STEPS, LR = 20, 0.05


def token_data(n: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(2))


def reference_losses(family: str = "llama", steps: int = STEPS) -> List[float]:
    """One process, float32: the losses the Lightning run must reproduce (plain order, dp=1)."""
    model = build(family, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = token_data()
    out = []
    for step in range(steps):
        x = data[(step * BATCH) % len(data):][:BATCH]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def lightning_case(rank: int, world: int, packages: List[str], runs: Dict[str, int]) -> Dict[str, Any]:
    """:func:`lightning_run` of each family in ``runs`` (its step count) under each Lightning
    package, one after another: ``{"package/family": result}``."""
    return {f"{p}/{f}": lightning_run(p, world, f, steps) for f, steps in runs.items() for p in packages}


def lightning_run(package: str, world: int, family: str = "llama", steps: int = STEPS) -> Dict[str, Any]:
    """A user's plain LightningModule holding a transformers causal LM; ``strategy="atp"``
    with no plan and ``mesh="auto"``: the planner picks the mesh from the model's shape."""
    import importlib

    from torch.utils.data import DataLoader

    pl = importlib.import_module(package)
    import atp_pipeline  # noqa: F401  (registers "atp" in the Lightning package)

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(family, torch.float32)
            self.losses: List[float] = []

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=x, labels=x).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(token_data(), batch_size=BATCH, shuffle=False)

    module = CausalLM()
    trainer = pl.Trainer(strategy="atp", accelerator="cpu", devices=world, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    strategy = trainer.strategy
    return {"losses": module.losses, "dims": strategy.mesh_shape, "notes": strategy.notes,
            "applied": strategy.applied_plan}


def predicted(shape: Dict[str, Any], mesh: Tuple[int, int], chunks: int = 1) -> Dict[str, int]:
    """The runtime cost model's elements per (collective, axis) for one step of ``batch()``."""
    from atp_pipeline.planning.cost import predicted_counts

    return predicted_counts(shape, mesh, BATCH * SEQ, chunks)
