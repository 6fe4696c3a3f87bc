"""Worker functions for tests/test_hf_models.py: transformers causal LMs built from tiny
configs, laid out by the HF adapter's plan on real gloo processes, against the
single-process model. Each returns plain data; the test asserts."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch

VOCAB, SEQ, BATCH = 96, 8, 2

# Tiny configs of each supported family: 8 query heads (split over d1*d2 <= 4), and key/value
# heads that exercise every layout: split over d1*d2 (8), over d1 only (2 on 1x4 is
# "pick"), fewer than d1 (1 head, Mistral: "gathered").
TINY: Dict[str, Dict[str, Any]] = {
    "llama": dict(num_key_value_heads=4, attention_bias=False),
    "mistral": dict(num_key_value_heads=1, sliding_window=None),
    "qwen2": dict(num_key_value_heads=2),
}


def build(family: str, dtype: torch.dtype = torch.float64, **over: Any) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=8, max_position_embeddings=64, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    fields.update(TINY[family])
    fields.update(over)
    config = AutoConfig.for_model(family, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # non-trivial norm weights, so a norm applied on the wrong slice cannot hide
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def exactness(rank: int, world: int, families: List[str], meshes: List[Tuple[int, int]]) -> List[Dict[str, Any]]:
    """Float64, one forward + backward: loss and every full gradient vs the single process,
    with the counted collectives per (collective, axis)."""
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.mesh import init_mesh

    idx = batch()
    out = []
    for family in families:
        dense = build(family)
        ref = dense(input_ids=idx, labels=idx).loss
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
        dense.zero_grad(set_to_none=True)
        for d1, d2 in meshes:
            mesh = init_mesh((d1, d2))
            model = copy.deepcopy(dense)
            (name, adapter, sub), = find_adapters(model)
            applied = apply_plan(model, prefixed(name, adapter.parallel_plan(sub)), mesh)
            comm = comm_for(mesh)
            comm.stats.reset()
            loss = model(input_ids=idx, labels=idx).loss
            loss.backward()
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            err = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads if n in grads}
            out.append({"family": family, "mesh": (d1, d2), "loss_rel": abs(loss.item() - ref.item()) / abs(ref.item()),
                        "grad_rel": max(err.values()), "worst": max(err, key=err.get),
                        "same_params": sorted(grads) == sorted(ref_grads), "applied": len(applied),
                        "counted": {f"{k}/{a}": n for (k, a), n in comm.stats.elements().items()},
                        "shape": adapter.shape(sub).to_dict()})
    return out


STEPS, LR = 20, 0.05


def token_data(n: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(2))


def reference_losses(family: str = "llama") -> List[float]:
    """One process, float32: the losses the Lightning run must reproduce (plain order, dp=1)."""
    model = build(family, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = token_data()
    out = []
    for step in range(STEPS):
        x = data[(step * BATCH) % len(data):][:BATCH]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def lightning_case(rank: int, world: int, packages: List[str], family: str = "llama") -> Dict[str, Any]:
    """:func:`lightning_run` under each Lightning package, one after another."""
    return {p: lightning_run(p, world, family) for p in packages}


def lightning_run(package: str, world: int, family: str = "llama") -> Dict[str, Any]:
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
    trainer = pl.Trainer(strategy="atp", accelerator="cpu", devices=world, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    strategy = trainer.strategy
    return {"losses": module.losses, "dims": strategy.mesh_shape, "notes": strategy.notes,
            "applied": strategy.applied_plan}


def predicted(shape: Dict[str, Any], mesh: Tuple[int, int]) -> Dict[str, int]:
    """The runtime cost model's elements per (collective, axis) for one step of ``batch()``."""
    from atp_pipeline.config.schema import CostModel
    from atp_pipeline.planning.cost import comm_terms, predicted_elements
    from atp_pipeline.planning.shape import ModelShape

    keep = {k: v for k, v in shape.items() if k in ModelShape.__dataclass_fields__}
    s = ModelShape(**keep)
    got = predicted_elements(comm_terms(CostModel.runtime, s, mesh), BATCH * SEQ, s.layers)
    return {f"{k}/{a}": n for (k, a), n in got.items()}
