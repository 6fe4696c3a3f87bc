"""Gradient clipping over a laid-out model: the global norm of every gradient, whatever holds it.

``torch.nn.utils.clip_grad_norm_`` sees one process's tensors: beside plain tensors it meets
DTensors (``_foreach_norm`` refuses the mix) and, under FSDP2 x TP, DTensors on other meshes
(the norm's ``stack`` fails sharding propagation); and even where it runs, a local norm is
not the model's. Here each gradient's *local* squared sum is weighted by ``1 / copies`` —
``copies``: how many ranks of the world hold the same elements (the world divided by the
number of distinct blocks its placements cut it into; a plain tensor is replicated on every
rank, as the data-parallel sync and the tensor-parallel layout keep it) — and the weighted
sums are all-reduced once over the whole ``(dp, d1, d2)`` mesh, in float64. The result is the
norm of the whole model's gradient, as one process computes it (to float32 rounding), on
every rank alike. Where a gradient's elements are partial sums (a ``Partial`` placement),
their sum is formed first, for the norm only.

:func:`clip_grad_norm_` then scales every local block by ``min(1, max_norm / (norm + 1e-6))``
(torch's formula); :func:`clip_grad_value_` clamps each local block, which is exact as is —
except for partial sums, which it refuses in one line. Nothing here knows a model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import Comm
from atp_pipeline.parallel.mesh import DIM_NAMES


def _grads(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def world_of(comm: Comm) -> int:
    """The processes of ``comm``'s ``(dp, d1, d2)`` mesh."""
    n = 1
    for axis in DIM_NAMES:
        n *= comm.size(axis)
    return n


def blocks(g: torch.Tensor) -> int:
    """How many distinct blocks ``g``'s elements are cut into across its mesh (1: a plain
    tensor, or a DTensor replicated on every dimension). Any placement that is neither
    ``Replicate`` nor ``Partial`` (``Shard``, FSDP's ``_StridedShard``) cuts."""
    if not isinstance(g, DTensor):
        return 1
    n = 1
    for i, p in enumerate(g.placements):
        if not (p.is_replicate() or p.is_partial()):
            n *= g.device_mesh.size(i)
    return n


def _local_for_norm(g: torch.Tensor) -> torch.Tensor:
    """``g``'s local elements; partial sums are summed first (a copy, for the norm only)."""
    if not isinstance(g, DTensor):
        return g
    if any(p.is_partial() for p in g.placements):
        g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
    return g.to_local()


def grad_norm(params: Iterable[torch.Tensor], comm: Comm) -> torch.Tensor:
    """The 2-norm of the gradients of ``params`` over the whole model (module docstring), a
    float64 scalar on their device, equal on every rank. Collective over ``comm``'s mesh:
    every rank calls it with its parameters in the same order."""
    world = world_of(comm)
    # (device, dtype, copies) -> local blocks: one foreach norm per group
    groups: Dict[Tuple[torch.device, torch.dtype, int], List[torch.Tensor]] = defaultdict(list)
    device: Optional[torch.device] = None
    for g in _grads(params):
        copies, rem = divmod(world, blocks(g))
        if rem:
            raise ConfigError(f"gradient clipping: a gradient cut into {blocks(g)} blocks does not tile the "
                              f"{world} processes of the mesh")
        local = _local_for_norm(g)
        device = device or local.device
        groups[(local.device, local.dtype, copies)].append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, copies), locals_ in groups.items():
        norms = torch._foreach_norm(locals_, 2.0)
        total += torch.stack(norms).to(device=device, dtype=torch.float64).square().sum() / copies
    for axis in DIM_NAMES:  # the whole world, axis by axis (counted by Comm; size-1 axes cost nothing)
        comm.all_reduce(total, axis)
    return total.sqrt()


def _local_blocks(grads: List[torch.Tensor]) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    out: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # (no autograd: the block itself)
        out[(local.device, local.dtype)].append(local)
    return out


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, comm: Comm,
                    norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so that their global norm
    (:func:`grad_norm`) is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does
    for one process: by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm before
    clipping. Collective (unless ``norm`` is given)."""
    params = list(params)
    if norm is None:
        norm = grad_norm(params, comm)
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for (dev, dtype), locals_ in _local_blocks(_grads(params)).items():
        torch._foreach_mul_(locals_, coef.to(device=dev, dtype=dtype))
    return norm


@torch.no_grad()
def clip_grad_value_(params: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element of ``params`` to ``[-clip_value, clip_value]`` in place
    (no communication: each rank clamps its own blocks). A gradient of partial sums cannot be
    clamped block by block and is refused in one line."""
    grads = _grads(params)
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            raise ConfigError(f"gradient_clip_algorithm='value': a gradient holds partial sums ({g.placements}), "
                              f"which clamping block by block would change; clip by norm instead")
    for locals_ in _local_blocks(grads).values():
        torch._foreach_clamp_min_(locals_, -float(clip_value))
        torch._foreach_clamp_max_(locals_, float(clip_value))
