"""Attention heads on DeviceMesh(d1, d2): which heads a rank computes (ATP §3.2.1, Figure 6a).

The query projection is column-first, so each rank of d1 holds a contiguous block of
``heads / d1`` query heads (replicated over d2). ATP then *scatters* those heads over d2,
so the attention core is fully sharded (``heads / (d1·d2)`` per rank), and *gathers* the
core's output back over d2 before the row-first output projection.

Keys and values (grouped-query attention: ``kv_heads`` divides ``heads``, query head ``i``
reads key/value head ``i // (heads / kv_heads)``) follow one of three layouts:

* ``kv_heads`` divides by ``d1·d2`` — split like the queries: column-first over d1, then
  scattered over d2; every rank keeps the model's group size;
* ``kv_heads`` divides by ``d1`` only — column-first over d1, replicated over d2; each rank
  picks the heads its own query heads read, and the gradient is summed over d2
  (:class:`~atp_pipeline.parallel.mappings.CopyToAxis`);
* fewer ``kv_heads`` than ``d1`` (``d1`` divisible by ``kv_heads``) — the key/value
  projection's output is gathered over d1 (every rank holds all key/value heads); each rank
  picks its heads, and the gradient is summed over d1 and d2.

:class:`HeadSharding` holds that arithmetic; a model family's attention calls
:meth:`~HeadSharding.localize` on the projected ``[batch, heads, seq, head_dim]`` tensors
and :meth:`~HeadSharding.gather` on the core's output. Nothing here knows a model family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import Comm
from atp_pipeline.parallel.mappings import copy_to_axis, gather_dim0, scatter_dim0
from atp_pipeline.planning.shape import KV_GATHERED, KV_SCATTER, kv_layout


@dataclass
class HeadSharding:
    """The heads of one attention module on ``comm``'s (d1, d2) mesh."""

    comm: Comm
    heads: int
    kv_heads: int

    def __post_init__(self) -> None:
        d1, d2 = self.comm.size("d1"), self.comm.size("d2")
        if self.heads % (d1 * d2) or self.heads % self.kv_heads:
            raise ConfigError(f"{self.heads} query heads ({self.kv_heads} key/value heads) do not split over "
                              f"d1*d2 = {d1}x{d2}")
        try:
            self.layout = kv_layout(self.kv_heads, d1, d2)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.group = self.heads // self.kv_heads
        self.local_heads = self.heads // (d1 * d2)
        # the first query head of this rank, and the first key/value head this rank holds
        self.q_first = self.comm.rank("d1") * (self.heads // d1) + self.comm.rank("d2") * self.local_heads
        self.kv_first = 0 if self.layout == KV_GATHERED else self.comm.rank("d1") * (self.kv_heads // d1)

    @property
    def kv_gathered(self) -> bool:
        """Whether the key/value projections gather their output over d1."""
        return self.layout == KV_GATHERED

    def _pick(self, t: torch.Tensor) -> torch.Tensor:
        """The key/value heads of this rank's query heads, one per query head."""
        idx = (torch.arange(self.local_heads, device=t.device) + self.q_first) // self.group - self.kv_first
        return t.index_select(1, idx)

    def localize(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[int]]:
        """``q``: ``[b, heads/d1, s, hd]``; ``k``/``v``: ``[b, kv_heads/d1 (or all), s, hd]`` ->
        this rank's ``q, k, v`` and the group size the core must use (None: the model's)."""
        def scatter(t: torch.Tensor) -> torch.Tensor:
            if self.comm.size("d2") == 1:  # nothing to scatter (and no copy to make)
                return t
            return scatter_dim0(t.transpose(0, 1).contiguous(), self.comm, "d2").transpose(0, 1)

        if self.layout == KV_SCATTER:
            if q.shape == k.shape == v.shape and self.comm.size("d2") > 1:
                # multi-head: one scatter (and one gather of its gradient), from one copy [heads, 3, b, s, hd]
                heads_first = torch.stack([t.transpose(0, 1) for t in (q, k, v)], dim=1)
                qkv = scatter_dim0(heads_first, self.comm, "d2")
                q, k, v = (qkv[:, i].transpose(0, 1) for i in range(3))
                return q, k, v, None
            return scatter(q), scatter(k), scatter(v), None
        q = scatter(q)
        axes = ("d1", "d2") if self.layout == KV_GATHERED else ("d2",)
        picked = []
        for t in (k, v):
            for axis in axes:
                t = copy_to_axis(t, self.comm, axis)
            picked.append(self._pick(t))
        return q, picked[0], picked[1], 1

    def gather(self, out: torch.Tensor, dim: int) -> torch.Tensor:
        """The core's output (heads along ``dim``) gathered over d2: ``heads/d1`` heads."""
        if self.comm.size("d2") == 1:
            return out
        return gather_dim0(out.movedim(dim, 0).contiguous(), self.comm, "d2").movedim(0, dim)
