"""``init_mesh``: the data-parallel x d1 x d2 DeviceMesh of ATP (§3.2, Figure 9).

Ranks are laid out row-major over ``(dp, d1, d2)``, as ``init_device_mesh`` does, so the
ranks of one ``d2`` group are consecutive — the layout the planner's Eq. 3 assumes
(:mod:`atp_pipeline.planning.bandwidth`). Any dimension may be 1.
"""

from __future__ import annotations

import zlib
from enum import Enum
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from atp_pipeline.errors import ConfigError


class Axis(str, Enum):
    """The named dimensions of ATP's mesh: data parallel, then the 2D tensor-parallel (d1, d2)."""

    dp = "dp"
    d1 = "d1"
    d2 = "d2"

    def __str__(self) -> str:
        return self.value


DIM_NAMES = tuple(a.value for a in Axis)


def init_mesh(shape: Union[int, Sequence[int]], d2: Optional[int] = None, *, dp: int = 1,
              device_type: Optional[str] = None) -> DeviceMesh:
    """``init_mesh((d1, d2))`` or ``init_mesh(d1, d2, dp=...)``: a named (dp, d1, d2) mesh.

    The default process group must be initialized (gloo on CPU, NCCL on CUDA); the device
    type follows the backend unless given.
    """
    if isinstance(shape, int):
        if d2 is None:
            raise TypeError("init_mesh(d1, d2) needs both sizes (or init_mesh((d1, d2)))")
        d1 = shape
    else:
        if d2 is not None:
            raise TypeError("give the mesh as init_mesh((d1, d2)) or init_mesh(d1, d2), not both")
        dims = tuple(int(x) for x in shape)
        if len(dims) == 3:
            dp, d1, d2 = dims
        elif len(dims) == 2:
            d1, d2 = dims
        else:
            raise ConfigError(f"init_mesh takes (d1, d2) or (dp, d1, d2), got {tuple(shape)}")
    if not dist.is_initialized():
        raise RuntimeError("init_mesh: call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    for name, size in (("dp", dp), ("d1", d1), ("d2", d2)):
        if size < 1:
            raise ConfigError(f"mesh dimension {name} must be >= 1, got {size}")
    if dp * d1 * d2 != world:
        raise ConfigError(f"mesh dp x d1 x d2 = {dp} x {d1} x {d2} = {dp * d1 * d2} does not match "
                          f"the world size {world}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dp, d1, d2), mesh_dim_names=DIM_NAMES)


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (d1, d2) submesh that tensor-parallel weights live on: sliced once per mesh and kept
    on it (``DeviceMesh.__getitem__`` builds a new mesh each call, ~2 ms of CPU; laying out a
    model asks for it once per parameter and coordinate)."""
    sub = mesh.__dict__.get(_TP_MESH)
    if sub is not None:
        return sub
    names = mesh.mesh_dim_names or ()
    if "d1" not in names or "d2" not in names:
        raise ConfigError(f"expected a mesh with dimensions named d1 and d2 (init_mesh), got {names}")
    sub = mesh if tuple(names) == ("d1", "d2") else mesh["d1", "d2"]
    mesh.__dict__[_TP_MESH] = sub
    return sub


_TP_MESH = "_atp_tp_mesh"


def tp_coordinate(mesh: DeviceMesh) -> Tuple[int, int]:
    sub = tp_mesh(mesh)
    coord = sub.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    return int(coord[0]), int(coord[1])


def device_of(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def shard_seed(seed: int, name: str, coord: Tuple[int, ...]) -> int:
    """A seed for one shard of a layer: the same on every data-parallel replica of it."""
    return (seed * 1_000_003 + zlib.crc32(f"{name}@{tuple(coord)}".encode())) % (2**63)


def full_tensor(t: DTensor, host: Optional[bool] = None) -> torch.Tensor:
    """``t.full_tensor()``; where the mesh's process groups are gloo and ``t`` lives on a GPU
    (ranks sharing one GPU: NCCL refuses two ranks on one device), gathered through host copies
    with gloo's CPU collectives instead, since gloo's all-gather of CUDA tensors ends the
    process (a segmentation fault, torch 2.11 on an H100). ``host`` forces either way (the
    tests check the host path against ``full_tensor()`` on CPU). Collective over ``t``'s mesh."""
    mesh = t.device_mesh
    if host is None:
        host = t.device.type != "cpu" and dist.get_backend(mesh.get_group(0)) == "gloo"
    if not host:
        return t.full_tensor()
    out = t.to_local().detach().cpu()
    for i in reversed(range(mesh.ndim)):  # mesh dim 0 splits outermost: gather the inner ones first
        placement, group = t.placements[i], mesh.get_group(i)
        if placement.is_partial():
            op = getattr(placement, "reduce_op", "sum")
            if op not in ("sum", "avg"):
                raise ConfigError(f"full_tensor: a partial placement reducing by {op!r} is not gathered on gloo")
            dist.all_reduce(out, group=group)
            if op == "avg":
                out /= dist.get_world_size(group)
        elif placement.is_shard():
            dim = placement.dim  # type: ignore[attr-defined]
            sizes: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(sizes, out.shape[dim], group=group)
            pad = list(out.shape)
            pad[dim] = max(sizes)
            held = torch.zeros(pad, dtype=out.dtype)
            held.narrow(dim, 0, out.shape[dim]).copy_(out)
            parts = [torch.empty_like(held) for _ in sizes]
            dist.all_gather(parts, held, group=group)
            out = torch.cat([q.narrow(dim, 0, n) for q, n in zip(parts, sizes)], dim)
    return out.to(t.device)
