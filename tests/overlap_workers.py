"""Worker functions for tests/test_overlap.py (real gloo processes): every family laid out by
its adapter's plan with its blocks run in chunks (§4.1), against the single-process model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

STEPS, LR, BATCH, SEQ, VOCAB = 8, 0.05, 4, 8, 256
CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The preset ``conf/model/<name>.yaml`` built by its family's adapter (``llama_tiny_kv2``:
    ``llama_tiny`` with 2 key/value heads), non-trivial norm weights and biases."""
    from omegaconf import OmegaConf

    from atp_pipeline.config.schema import ModelConfig
    from atp_pipeline.models.adapter import get_adapter

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{name.replace('_kv2', '')}.yaml"))
    if name.endswith("_kv2"):
        cfg.hf.num_key_value_heads = 2
    torch.manual_seed(0)
    model = get_adapter(str(cfg.get("family", "gpt"))).build(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "config"):  # transformers: its own loss
        return model(input_ids=x, labels=x).loss
    return model(x[:, :-1], x[:, 1:])


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(2))


def _losses(model: torch.nn.Module, data: torch.Tensor) -> List[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        loss = _loss(model, data[step * BATCH:(step + 1) * BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def fan_in_with_an_unused_reader(mesh_shape: Tuple[int, int]) -> float:
    """Three column-first linears reading one input with shared input gradients (the q/k/v
    fan-in), one of them not in the loss: the input's gradient (float64) against one process
    (the guard reduces what the readers that ran left)."""
    from torch import nn

    from atp_pipeline.parallel.mesh import init_mesh
    from atp_pipeline.parallel.styles import parse_style

    torch.manual_seed(0)
    dense = nn.ModuleDict({n: nn.Linear(16, 8).double() for n in ("a", "b", "c")})
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    (dense["a"](x).sum() + dense["b"](x).pow(2).sum()).backward()
    want = x.grad.clone()
    mesh = init_mesh(mesh_shape)
    style = parse_style("column(input=full, output=full, shared=true)")
    par = {n: style.apply(n, copy.deepcopy(m), _ctx(mesh)) for n, m in dense.items()}
    for m in par.values():  # the same tensor object reaches every reader: the input split once
        m.input_is_parallel = True
    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.layers import gather_last, split_last

    comm = comm_for(mesh)
    x2 = x.detach().clone().requires_grad_(True)
    xs = split_last(x2, comm, "d2")
    outs = {n: gather_last(m(xs), comm, "d1") for n, m in par.items()}
    (outs["a"].sum() + outs["b"].pow(2).sum() + 0 * outs["c"].detach().sum()).backward()
    return float((x2.grad - want).abs().max() / want.abs().max())


def _ctx(mesh: Any) -> Any:
    from atp_pipeline.parallel.styles import StyleContext

    return StyleContext(mesh)


def chunked_training(rank: int, world: int, models: List[str], meshes: List[Tuple[int, int]],
                     chunk_list: List[int]) -> List[Dict[str, Any]]:
    """Per model, mesh and chunk count: the float64 gradients of one step (max error relative to
    each gradient's magnitude) against one process; at the most chunks (the finest split, one
    sample a chunk at chunks=4) on the first mesh also ``STEPS`` float32 SGD losses; and
    :func:`fan_in_with_an_unused_reader` on each mesh."""
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.dense import dense_tensors
    from atp_pipeline.parallel.mesh import init_mesh

    data = _data()
    out: List[Dict[str, Any]] = [{"model": "fan_in_unused_reader", "mesh": m,
                                  "grad_rel": fan_in_with_an_unused_reader(m)}
                                 for m in meshes + [(4, 1)]]
    for name in models:
        dense64 = _model(name, torch.float64)
        _loss(dense64, data[:BATCH]).backward()
        ref_grads = {n: p.grad.clone() for n, p in dense64.named_parameters()}
        dense64.zero_grad(set_to_none=True)
        dense32 = _model(name, torch.float32)
        ref_losses = _losses(copy.deepcopy(dense32), data)
        for mesh_shape in meshes:
            for chunks in chunk_list:
                row: Dict[str, Any] = {"model": name, "mesh": mesh_shape, "chunks": chunks}
                trains = chunks == max(chunk_list) and mesh_shape == meshes[0]
                for dense in (dense64, dense32) if trains else (dense64,):
                    mesh = init_mesh(mesh_shape)
                    model = copy.deepcopy(dense)
                    (prefix, adapter, sub), = find_adapters(model)
                    apply_plan(model, prefixed(prefix, adapter.parallel_plan(sub)), mesh, chunks)
                    if dense is dense64:
                        _loss(model, data[:BATCH]).backward()
                        grads = dense_tensors(model, grad=True)
                        err = {n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                               for n, g in ref_grads.items()}
                        row.update(grad_rel=max(err.values()), worst=max(err, key=err.get),
                                   same_params=sorted(grads) == sorted(ref_grads))
                    else:
                        losses = _losses(model, data)
                        row.update(loss_err=max(abs(a - b) for a, b in zip(losses, ref_losses)), steps=len(losses))
                out.append(row)
    return out
