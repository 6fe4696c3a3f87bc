"""The dense view of a parallel model: every parameter (or gradient) whole, under the name and
in the layout of the module the styles replaced — what the single-process model holds, so a
parallel run is compared with it tensor by tensor, exported in the model's own format, and
loaded from a checkpoint of the dense model with each rank reading only its blocks.

:func:`dense_tensors` is collective (every rank of the tensor-parallel mesh calls it; DTensor
parameters are gathered with ``full_tensor()``). :func:`load_dense` is local: each rank slices
its blocks out of the stored tensors (a safetensors slice reads only those bytes). A module
sharing another's parameter (a head tied to its embedding) holds none of its own and adds
no name; plain parameters (norms run whole) are whole on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.linear import GROUPED, ATPLinear, shard_index, ungroup_rows
from atp_pipeline.parallel.mesh import full_tensor

# name -> the stored tensor, sliceable (``t[a:b, c:d]``), or None if the checkpoint lacks it
Reader = Callable[[str], Optional[Any]]


def _own_tensors(module: nn.Module) -> List[Tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` of a module's own parameters and persistent buffers."""
    skip = getattr(module, "_non_persistent_buffers_set", set())
    return [(k, p, True) for k, p in module.named_parameters(recurse=False)] + \
        [(k, b, False) for k, b in module.named_buffers(recurse=False) if k not in skip and b is not None]


def dense_tensors(root: nn.Module, grad: bool = False) -> Dict[str, torch.Tensor]:
    """``{name: whole tensor}`` of ``root``'s parameters and persistent buffers in the dense
    model's names and layouts (``grad=True``: the parameters' gradients, where they have one)."""
    out: Dict[str, torch.Tensor] = {}
    for name, module in root.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, ATPLinear):
            for key, t in module.dense(grad).items():
                if t is not None:
                    out[prefix + key] = t
            continue
        for key, t, is_param in _own_tensors(module):
            grouped = getattr(module, GROUPED, {}).get(key)  # (dim, parts): rows stored grouped by rank block
            if grad:
                if not is_param or t.grad is None:
                    continue
                t = t.grad
            if isinstance(t, DTensor):
                whole = full_tensor(t)
                out[prefix + key] = whole if grouped is None else \
                    ungroup_rows(whole, grouped[1], _blocks(t, grouped[0]), dim=grouped[0])
            else:
                out[prefix + key] = t.detach()
    return out


def _blocks(t: DTensor, dim: int) -> int:
    """Into how many blocks ``t``'s mesh splits dimension ``dim``."""
    n = 1
    for i, p in enumerate(t.placements):
        if isinstance(p, Shard) and p.dim == dim:
            n *= t.device_mesh.size(i)
    return n


def _grouped_block(stored: Any, t: DTensor, dim: int, parts: int) -> torch.Tensor:
    """This rank's block of ``t``, whose rows along ``dim`` are stored grouped
    (:func:`~atp_pipeline.parallel.linear.group_rows`), read from the dense ``stored`` tensor:
    its part of each of the ``parts`` segments, each read as one slice."""
    index = list(shard_index(t.shape, t.device_mesh, t.placements))
    n, rows = _blocks(t, dim), t.shape[dim]
    per = rows // (parts * n)  # rows of one segment in one block
    block = index[dim].start // (rows // n)
    pieces = []
    for p in range(parts):
        start = p * (rows // parts) + block * per
        index[dim] = slice(start, start + per)
        pieces.append(torch.as_tensor(stored[tuple(index)]))
    return torch.cat(pieces, dim=dim)


def load_dense(root: nn.Module, read: Reader, optional: Callable[[str], bool] = lambda name: False) -> int:
    """Fill every parameter and persistent buffer of ``root`` (already laid out and allocated)
    from the dense model's stored tensors, each rank reading only its blocks; returns how
    many tensors were read. A name the checkpoint lacks is an error unless ``optional``."""
    missing: List[str] = []
    count = 0
    for name, module in root.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, ATPLinear):
            weight, bias = read(prefix + "weight"), read(prefix + "bias") if module.bias is not None else None
            if weight is None or (module.bias is not None and bias is None):
                missing.append(prefix + ("weight" if weight is None else "bias"))
                continue
            module.load_dense(weight, bias)
            count += 1 + (module.bias is not None)
            continue
        for key, t, is_param in _own_tensors(module):
            stored = read(prefix + key)
            if stored is None:
                if is_param and not optional(prefix + key):
                    missing.append(prefix + key)
                continue
            with torch.no_grad():
                grouped = getattr(module, GROUPED, {}).get(key)
                if isinstance(t, DTensor) and grouped is not None:
                    t.to_local().copy_(_grouped_block(stored, t, *grouped))
                elif isinstance(t, DTensor):
                    t.to_local().copy_(stored[shard_index(t.shape, t.device_mesh, t.placements)])
                else:
                    t.copy_(stored[tuple(slice(0, n) for n in t.shape)] if t.dim() else stored[()])
            count += 1
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"checkpoint lacks {', '.join(missing[:3])}{more} of {type(root).__name__}")
    return count
