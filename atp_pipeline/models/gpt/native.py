"""Comparators on the same model and ranks: PyTorch-native tensor parallelism and DDP.

* :func:`native_tensor_parallel` applies ``parallelize_module`` with ``ColwiseParallel``
  (QKV, MLP first linear) and ``RowwiseParallel`` (output projection, MLP second linear)
  on a 1D mesh of all ranks — PyTorch's Megatron-style TP; embeddings, LayerNorms and the
  head stay replicated.
* :func:`data_parallel` wraps the dense model in ``DistributedDataParallel``; each rank
  takes ``1/N`` of the batch.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from atp_pipeline.models.gpt.model import GPT


def native_tensor_parallel(model: GPT, world: int, device_type: str = "cpu") -> nn.Module:
    """A copy of ``model`` with PyTorch's own tensor parallelism over ``world`` ranks."""
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
    return parallelize_module(copy.deepcopy(model), mesh, plan)


def data_parallel(model: GPT) -> nn.Module:
    return DistributedDataParallel(copy.deepcopy(model))
