"""A minimal GPT (pre-LayerNorm decoder, learned positions, GeLU MLP), single device.

It knows nothing of parallelism. Two layout choices let a tensor-parallel runtime shard it
by slicing alone: the QKV projection's outputs are ordered head by head, ``(heads, 3,
head_dim)``, so any contiguous split of its output features holds whole heads with their
q, k and v; and the attention output is ordered ``(heads, head_dim)`` for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 64
    heads: int = 8
    layers: int = 2
    ffn_mult: int = 4

    @classmethod
    def from_model_config(cls, m) -> "GPTConfig":  # a ModelConfig / DictConfig
        return cls(vocab_size=m.vocab_size, seq_len=m.seq_len, hidden=m.hidden, heads=m.heads,
                   layers=m.layers, ffn_mult=m.ffn_mult)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(QK^T/sqrt(d))V (Eq. 1) on ``[b, heads, s, d]`` tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class AttentionCore(nn.Module):
    """The attention core as a module (no parameters), so a layout can place it (torchtitan's ``sdpa``)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_core(q, k, v)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.core = AttentionCore()
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)  # (heads, 3, head_dim) order
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        out = self.core(q, k, v).transpose(1, 2).reshape(b, s, -1)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden {cfg.hidden} is not divisible by heads {cfg.heads}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.loss_fn = nn.CrossEntropyLoss()
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]``, or the mean cross-entropy if ``targets`` are given."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

