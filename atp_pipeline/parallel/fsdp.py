"""Sharded data parallelism on the ``dp`` axis: FSDP2 (``fully_shard``) composed with 2D TP.

With ``fsdp`` on, parameters, gradients and optimizer state are sharded over the
data-parallel sub-mesh of ATP's ``(dp, d1, d2)`` mesh (torchtitan's FSDP2 x TP pattern, here
with ATP's 2D placements): a tensor-parallel DTensor parameter on ``(d1, d2)`` becomes a
DTensor on ``(dp, d1, d2)`` whose local block is split again over ``dp``; a plain
(replicated) parameter becomes a DTensor sharded over ``dp``. Forward all-gathers each unit's
parameters before it runs and frees them after it; backward reduce-scatters the gradients
to their shards, averaged over the replicas — so the strategy's own gradient sync is off.

Units, chosen from the module tree alone (no model family is known here): every element of
every ``nn.ModuleList`` (a model's repeated blocks) is one unit, and the ``root`` — in a
Lightning run the LightningModule, whose ``training_step`` (not ``forward``) is what runs —
owns the rest (embeddings, final norm, the head; a tied head and embedding stay one
parameter). The root's step methods are registered as FSDP forward methods, so its
parameters are gathered when the step starts, whatever submodule or method uses them.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import Comm
from atp_pipeline.parallel.linear import GROUPED
from atp_pipeline.parallel.mesh import Axis

ROOT_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def block_units(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The FSDP units below ``root``: each element of each ``nn.ModuleList`` that holds
    parameters (outermost lists only: a block's own lists stay inside its unit)."""
    units: List[Tuple[str, nn.Module]] = []
    taken: List[str] = []
    for name, module in root.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        for i, child in enumerate(module):
            if any(True for _ in child.parameters()):
                units.append((f"{name}.{i}" if name else str(i), child))
        taken.append(name)
    return units


GRAD_SUM = "atp_grad_sum"  # attribute of a module whose parameters' gradients hooks sum over a mesh axis


def fsdp_infeasibility(root: nn.Module, mesh: Optional[DeviceMesh] = None) -> Optional[str]:
    """Why FSDP cannot shard ``root`` over ``mesh``'s dp axis (None if it can); without a
    mesh (a model built on the meta device, before any process starts), what its
    parameters alone tell."""
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else (Axis.d1.value, Axis.d2.value)
    if mesh is not None and Axis.dp.value not in names:
        return f"the mesh has no '{Axis.dp.value}' dimension (dims {names})"
    if mesh is not None and mesh[Axis.dp.value].size() < 2:
        return "one data-parallel replica: there is nothing to shard over (dp = 1)"
    tp = {Axis.d1.value, Axis.d2.value} & set(names)
    for name, module in root.named_modules():
        axis = getattr(module, GRAD_SUM, None)
        if axis:  # FSDP re-creates the parameters: the hooks summing their gradients would be lost
            return (f"'{name}' keeps its parameters whole with their gradients summed over {axis} by hooks "
                    f"(per-head norms), which FSDP's sharded parameters would drop")
        if getattr(module, GROUPED, None):  # FSDP re-creates the parameters in its own layout
            return (f"'{name}' stores parameters with rows grouped by rank (packed experts), a layout FSDP's "
                    f"sharded parameters would drop")
    for name, p in root.named_parameters():
        if isinstance(p, DTensor):
            pnames = set(p.device_mesh.mesh_dim_names or ())
            if not pnames or not pnames <= tp:
                return (f"parameter '{name}' is a DTensor on mesh dims {sorted(pnames)}, not on the (d1, d2) "
                        f"tensor-parallel sub-mesh (an SBP plan lays out data parallelism itself)")
        elif not p.is_contiguous():
            return f"parameter '{name}' is not contiguous (FSDP2 shards contiguous parameters only)"
    return None


def shard_data_parallel(root: nn.Module, mesh: DeviceMesh, *, comm: Optional[Comm] = None,
                        reshard_after_forward: bool = True, methods: Sequence[str] = ROOT_METHODS) -> List[str]:
    """Apply FSDP2 over ``mesh['dp']``: one unit per block (:func:`block_units`), then the
    root; ``methods`` of the root that exist run FSDP's forward hooks; with ``comm`` (the
    mesh's counted :class:`~atp_pipeline.parallel.comm.Comm`) FSDP's all-gathers and
    reduce-scatters pass through it and are counted on the ``dp`` axis like every other
    collective. Returns the units' names (``""`` is the root). Refuses
    (:class:`ConfigError`) what FSDP cannot shard."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    why = fsdp_infeasibility(root, mesh)
    if why:
        raise ConfigError(f"strategy 'atp': fsdp=True: {why}")
    dp_mesh = mesh[Axis.dp.value]
    units = block_units(root)
    modules = [unit for _, unit in units] + [root]
    for module in modules:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if comm is not None:
        gather, scatter = counted_collectives(comm, Axis.dp.value)
        for module in modules:
            module.set_custom_all_gather(gather)  # type: ignore[operator]
            module.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
    for method in methods:
        if callable(getattr(root, method, None)):
            register_fsdp_forward_method(root, method)
    return [name for name, _ in units] + [""]


def counted_collectives(comm: Comm, axis: str) -> Tuple[Any, Any]:
    """FSDP2's all-gather and reduce-scatter as calls of ``comm`` on ``axis`` (its
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` seam). Each completes before
    it returns: FSDP waits only on c10d ``Work`` objects, and on CPU it has no side stream to
    overlap with anyway; on CUDA a wait only orders the streams."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def same_group(group: Any) -> None:
        if group is not None and group.size() != comm.size(axis):
            raise RuntimeError(f"FSDP collective on a group of {group.size()} ranks, not the '{axis}' axis "
                               f"({comm.size(axis)})")

    class CountedAllGather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> None:
            same_group(group)
            comm.all_gather_into(output_tensor, input_tensor, axis)

    class CountedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> None:
            same_group(group)
            comm.reduce_scatter(output_tensor, input_tensor, axis, op=op)

    return CountedAllGather(), CountedReduceScatter()


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 manages ``module`` (or a submodule)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def local_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local block only)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` bytes held by this rank: what FSDP shards."""
    params = list(module.parameters())
    opt = 0
    if optimizer is not None:
        opt = local_bytes(v for state in optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
    return local_bytes(params), local_bytes(p.grad for p in params), opt
