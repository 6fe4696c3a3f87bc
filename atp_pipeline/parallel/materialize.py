"""Materialize a model built on the meta device, shard by shard (Lightning's
``configure_model`` + meta device, as ``ModelParallelStrategy`` does).

After the styles have replaced the layers of a meta model, each rank allocates only its
own blocks: a parallel layer's parameters are DTensors whose local tensors are this rank's
shards, allocated empty and filled by the layer's ``reset_shards(seed, name)`` — a
generator seeded per shard, so data-parallel replicas agree and no rank ever holds a whole
weight of a sharded layer. Modules left whole get ``reset_parameters()`` and are then
broadcast from global rank 0, so every rank holds the same replicated values.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from atp_pipeline.errors import ConfigError


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real (as
    accelerate's ``init_empty_weights(include_buffers=False)``): buffers computed at
    construction (rotary frequencies) stay valid, and no weight is allocated until
    :func:`materialize` allocates this rank's shards."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: "nn.Parameter | None") -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            kwargs = dict(requires_grad=param.requires_grad)
            self._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _is_meta(t: torch.Tensor) -> bool:
    return (t.to_local() if isinstance(t, DTensor) else t).is_meta


def has_meta(module: nn.Module) -> bool:
    return any(_is_meta(t) for t in (*module.parameters(), *module.buffers()))


def shared_seed(device: torch.device) -> int:
    """Global rank 0's initial seed, the same on every rank."""
    t = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return int(t.item())


def broadcast_replicated(module: nn.Module, device: torch.device) -> None:
    """Make every plain (non-DTensor) parameter and buffer equal to global rank 0's, as DDP
    does at construction: replicas start identical whatever each rank's RNG did."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if not isinstance(t, DTensor) and not t.is_meta:
                buf = t.data.to(device)
                dist.broadcast(buf, src=0)
                if buf.data_ptr() != t.data.data_ptr():
                    t.data.copy_(buf)


def materialize(root: nn.Module, device: torch.device, loaded: Sequence[nn.Module] = ()) -> List[str]:
    """Allocate and initialize every module with meta tensors; returns their names. Modules
    inside ``loaded`` (whose tensors a checkpoint fills next) are allocated only."""
    seed = shared_seed(device)
    skip = {id(m) for sub in loaded for m in sub.modules()}
    done: List[str] = []
    for name, module in root.named_modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(_is_meta(t) for t in own):
            continue
        module.to_empty(device=device, recurse=False)
        if id(module) in skip:
            pass
        elif hasattr(module, "reset_shards"):
            module.reset_shards(seed, name)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        else:
            raise ConfigError(f"'{name}' ({type(module).__name__}) was created on the meta device but has no "
                              f"reset_parameters() to initialize it")
        done.append(name)
    broadcast_replicated(root, device)
    return done
