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


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU for the HF families on CUDA tensors, found {GPUS}")
def test_hf_families_on_cuda():
    """Issue 14's exactness on CUDA tensors: every HF family, float64, one forward + backward,
    loss and every full gradient against the single-process model on the same GPU, counted
    collectives = the runtime cost model. NCCL with a GPU per rank where there are enough,
    else the ranks share the GPUs over gloo (which carries CUDA tensors; NCCL refuses two
    ranks on one GPU)."""
    pytest.importorskip("transformers", reason="pip install transformers")
    from .hf_workers import TINY, exactness, predicted

    meshes = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)]}
    for world, mesh_list in meshes.items():
        backend = "nccl" if GPUS >= world else "gloo"
        per_rank = spawn(exactness, world, sorted(TINY), mesh_list, "", "cuda", backend=backend, timeout=900)
        rows = per_rank[0]
        assert {(r["family"], r["mesh"]) for r in rows} == {(f, m) for f in TINY for m in mesh_list}
        for r in rows:
            where = f"{r['family']} on {r['mesh']} ({backend}, cuda)"
            assert r["same_params"], where
            assert r["loss_rel"] <= 1e-9 and r["grad_rel"] <= 1e-9, (where, r["loss_rel"], r["worst"], r["grad_rel"])
            assert predicted(r["shape"], r["mesh"]) == r["counted"], where
