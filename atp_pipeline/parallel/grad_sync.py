"""Data-parallel gradient synchronization behind one small interface.

Tensor parallelism alone leaves data-parallel replicas drifting apart; after every
backward pass the strategy averages each gradient over the replicas of its shard through a
:class:`GradSync`: :class:`RingSync` (torch.distributed's all-reduce through the counted
:class:`~atp_pipeline.parallel.comm.Comm`), or the in-network aggregation backend
(:class:`atp_pipeline.ina.live.sync.ATPSync`, modes ``atp``/``ps``), which implements the
same three calls. :func:`sync_gradients` flattens the step's gradients into one bucket.
"""

from __future__ import annotations

from typing import Dict, Iterable, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from atp_pipeline.parallel.comm import Comm
from atp_pipeline.parallel.mesh import Axis


@runtime_checkable
class GradSync(Protocol):
    def all_reduce_mean_(self, flat: torch.Tensor) -> None:
        """Replace ``flat`` (this rank's gradients) by their mean over the replicas, in place."""

    def step_metrics(self, with_roles: bool = False) -> Dict[str, float]:
        """Counters since the last call (empty when there are none)."""

    def close(self, ok: bool = True) -> None:
        """Release what the backend holds (after a barrier when ``ok``)."""


class RingSync:
    """torch.distributed all-reduce over the ``dp`` axis (counted by :class:`Comm`)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def all_reduce_mean_(self, flat: torch.Tensor) -> None:
        self.comm.all_reduce(flat, Axis.dp.value)
        flat.div_(self.comm.size(Axis.dp.value))

    def step_metrics(self, with_roles: bool = False) -> Dict[str, float]:
        return {}

    def close(self, ok: bool = True) -> None:
        return None


def sync_gradients(params: Iterable[torch.nn.Parameter], sync: GradSync) -> None:
    """Average every gradient over the data-parallel replicas, as one flat bucket."""
    with torch.no_grad():
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        sync.all_reduce_mean_(flat)
        for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(synced.view_as(g))
