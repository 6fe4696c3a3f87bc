"""CUDA/NCCL paths: run where GPUs exist, skipped with the reason elsewhere (CI has none)."""

from __future__ import annotations

import pytest
import torch

from atp_pipeline.launch import spawn

from . import workers

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ CUDA GPUs for NCCL tensor parallelism, found {GPUS}")
def test_nccl_equivalence_on_gpus():
    world = 4 if GPUS >= 4 else 2
    meshes = [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])
    for rank_runs in spawn(workers.equivalence, world, meshes, [1, 2], "cuda", backend="nccl", timeout=900):
        for r in rank_runs:
            assert r["loss_rel"] <= 1e-9 and r["grad_rel"] <= 1e-9, r
