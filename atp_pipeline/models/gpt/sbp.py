"""The built-in GPT run by an SBP layout (AutoDDL, issue 8 item 5) with DTensor.

:class:`SBPGPT`: per block QKV (heads split evenly: every rank holds whole heads with their
q, k and v, because the dense model orders QKV outputs head by head), the attention core on
local sequences and heads, the output projection, FC1, GeLU, FC2, each with its planned
strategy (layout keys :data:`~atp_pipeline.planning.sbp.layout.TRANSFORMER_KEYS`: ``qkv``,
``proj``, ``fc1``, ``fc2``, tied over the blocks). LayerNorms need whole rows: the residual
stream is redistributed to the consumer's rows (``S0`` over its ``b``, replicated
elsewhere), normalized, then chunked locally into the consumer's input layout. Embeddings,
the final LayerNorm, the LM head and the loss are outside the SBP search space: they run
split by tokens over all ranks with replicated weights (data parallel).

The generic pieces (one SBP matmul, the mesh, gradient sync) are
:mod:`atp_pipeline.parallel.sbp_exec`; the layout and its checks are
:mod:`atp_pipeline.planning.sbp.layout`. :class:`~atp_pipeline.models.gpt.adapter.GPTAdapter`
applies :class:`SBPGPT` through the model seam; :func:`apply_sbp` replaces every GPT inside
a module tree.
"""

from __future__ import annotations

import copy
from typing import List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.gpt.model import GPT, attention_core
from atp_pipeline.parallel.sbp_exec import (LayerLayout, SBPLinear, _distribute, _replicated, _rows_all,
                                            plan_mesh)
from atp_pipeline.planning.sbp.layout import TRANSFORMER_KEYS, SBPLayout, _check_div, check_transformer_layout

__all__ = ["SBPGPT", "apply_sbp"]


class _SBPAttention(nn.Module):
    def __init__(self, attn: nn.Module, layouts: Mapping[str, LayerLayout], mesh: DeviceMesh) -> None:
        super().__init__()
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.qkv = SBPLinear(attn.qkv, "qkv", layouts["qkv"], mesh)
        self.proj = SBPLinear(attn.proj, "proj", layouts["proj"], mesh)


class _SBPMLPPart(nn.Module):
    def __init__(self, mlp: nn.Module, layouts: Mapping[str, LayerLayout], mesh: DeviceMesh) -> None:
        super().__init__()
        self.fc1 = SBPLinear(mlp.fc1, "fc1", layouts["fc1"], mesh)
        self.fc2 = SBPLinear(mlp.fc2, "fc2", layouts["fc2"], mesh)


class _SBPBlock(nn.Module):
    def __init__(self, block: nn.Module, layouts: Mapping[str, LayerLayout], mesh: DeviceMesh,
                 seq_len: int) -> None:
        super().__init__()
        self.layouts, self.mesh, self.seq_len = layouts, mesh, seq_len
        self.ln1, self.ln2 = block.ln1, block.ln2
        for ln in (self.ln1, self.ln2):
            _distribute(ln, "weight", mesh, [Replicate()] * mesh.ndim)
            _distribute(ln, "bias", mesh, [Replicate()] * mesh.ndim)
        self.attn = _SBPAttention(block.attn, layouts, mesh)
        self.mlp = _SBPMLPPart(block.mlp, layouts, mesh)

    def _norm(self, ln: nn.LayerNorm, x: DTensor, key: str) -> DTensor:
        """LayerNorm on whole rows: the consumer's rows (S0 over its b), then its input."""
        lay = self.layouts[key]
        h = F.layer_norm(x.redistribute(self.mesh, lay["rows"]), ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        return h.redistribute(self.mesh, lay["X"])  # Replicate -> Shard: local chunks

    def _attention(self, qkv: DTensor) -> DTensor:
        """The attention core on local whole sequences and whole heads (§4.2: heads split
        evenly); the output keeps QKV's split layout, with ``h`` instead of ``3h`` columns."""
        local = qkv.to_local()
        seqs = local.shape[0] // self.seq_len
        t = local.view(seqs, self.seq_len, -1, 3, self.attn.head_dim)
        q, k, v = (t[:, :, :, i].transpose(1, 2) for i in range(3))
        out = attention_core(q, k, v).transpose(1, 2).reshape(seqs * self.seq_len, -1)
        rows, cols = qkv.shape
        return DTensor.from_local(out, self.mesh, qkv.placements, run_check=False,
                                  shape=torch.Size((rows, cols // 3)), stride=(cols // 3, 1))

    def forward(self, x: DTensor) -> DTensor:
        a = self.attn.proj(self._attention(self.attn.qkv(self._norm(self.ln1, x, "qkv"))))
        x = x.redistribute(self.mesh, a.placements) + a
        m = self.mlp.fc2(F.gelu(self.mlp.fc1(self._norm(self.ln2, x, "fc1"))))
        return x.redistribute(self.mesh, m.placements) + m


class SBPGPT(nn.Module):
    """A dense :class:`~atp_pipeline.models.gpt.model.GPT` run by an SBP layout (keys
    ``qkv``, ``proj``, ``fc1``, ``fc2``, tied over the blocks); same parameter names, every
    parameter a DTensor on the layout's mesh, same loss and gradients as the dense model."""

    def __init__(self, model: GPT, layout: SBPLayout, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        cfg = model.cfg
        check_transformer_layout(layout, cfg.hidden, cfg.heads, cfg.ffn_mult)
        self.cfg, self.layout = cfg, layout
        self.mesh = mesh or plan_mesh(layout)
        shape = tuple(self.mesh.shape)
        if shape != layout.mesh_shape():
            raise ConfigError(f"sbp plan: mesh {shape} is not the plan's mesh {layout.mesh_shape()}")
        layouts = {k: LayerLayout.of(layout.strategies[k], shape) for k in TRANSFORMER_KEYS}
        dense = copy.deepcopy(model)
        everywhere = [Replicate()] * self.mesh.ndim
        self.wte, self.wpe, self.ln_f, self.head = dense.wte, dense.wpe, dense.ln_f, dense.head
        for mod in (self.wte, self.wpe, self.ln_f, self.head):
            _distribute(mod, "weight", self.mesh, everywhere)
            if isinstance(mod, nn.LayerNorm):
                _distribute(mod, "bias", self.mesh, everywhere)
        self.blocks = nn.ModuleList(_SBPBlock(b, layouts, self.mesh, cfg.seq_len) for b in dense.blocks)
        self._first_rows = layouts["qkv"]["rows"]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` (full tensor), or the mean cross-entropy (identical on
        every rank) if ``targets`` are given; ``idx``/``targets`` are the full batch."""
        b, s = idx.shape
        for k in TRANSFORMER_KEYS:
            _check_div("batch (sequences)", b, self.layout.strategies[k].pb, "pb", k)
        pos = torch.arange(s, device=idx.device).repeat(b)
        rows = self._first_rows
        tok = _replicated(idx.reshape(-1), self.mesh).redistribute(self.mesh, rows)
        pos_dt = _replicated(pos, self.mesh).redistribute(self.mesh, rows)
        x = F.embedding(tok, self.wte.weight) + F.embedding(pos_dt, self.wpe.weight)
        for block in self.blocks:
            x = block(x)
        final = _rows_all(self.mesh, b * s)
        x = x.redistribute(self.mesh, final)
        x = F.layer_norm(x, self.ln_f.normalized_shape, self.ln_f.weight, self.ln_f.bias, self.ln_f.eps)
        logits = F.linear(x, self.head.weight)
        if targets is None:
            return logits.full_tensor().view(b, s, -1)
        tgt = _replicated(targets.reshape(-1), self.mesh).redistribute(self.mesh, final)
        return F.cross_entropy(logits, tgt).full_tensor()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def apply_sbp(root: nn.Module, layout: SBPLayout, mesh: Optional[DeviceMesh] = None) -> List[str]:
    """Replace every :class:`GPT` inside ``root`` (or ``root`` itself, not replaceable in
    place) by its :class:`SBPGPT`; returns the names replaced."""
    done: List[str] = []
    for name, module in list(root.named_modules()):
        if isinstance(module, GPT) and name:
            parent_name, _, attr = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            setattr(parent, attr, SBPGPT(module, layout, mesh))
            done.append(name)
    if not done:
        raise ConfigError(f"sbp plan: {type(root).__name__} has no built-in GPT submodule to execute the "
                          f"plan on")
    return done
