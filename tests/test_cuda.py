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
    """The HF families' exactness on CUDA tensors: every HF family, float64, one forward + backward,
    loss and every full gradient against the single-process model on the same GPU, counted
    collectives = the runtime cost model. NCCL with a GPU per rank where there are enough,
    else the ranks share the GPUs over gloo (which carries CUDA tensors; NCCL refuses two
    ranks on one GPU)."""
    pytest.importorskip("transformers", reason="pip install transformers")
    from .hf_workers import TINY, exactness, predicted

    meshes = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)]}
    for world, mesh_list in meshes.items():
        backend = "nccl" if GPUS >= world else "gloo"
        # §4.1 overlap: the blocks in 2 chunks (coroutines on CUDA streams' host side)
        chunked = (((2, 2), 2),) if world == 4 else ()
        per_rank = spawn(exactness, world, sorted(TINY), mesh_list, "", "cuda", chunked, backend=backend,
                         timeout=900)
        rows = per_rank[0]
        assert {(r["family"], r["mesh"], r["chunks"]) for r in rows} == (
            {(f, m, 1) for f in TINY for m in mesh_list} | {(f, m, c) for f in TINY for m, c in chunked})
        for r in rows:
            where = f"{r['family']} on {r['mesh']}, {r['chunks']} chunks ({backend}, cuda)"
            assert r["same_params"], where
            assert r["loss_rel"] <= 1e-9 and r["grad_rel"] <= 1e-9, (where, r["loss_rel"], r["worst"], r["grad_rel"])
            assert predicted(r["shape"], r["mesh"], r["chunks"]) == r["counted"], where


@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA GPU for dropout's CUDA generator streams, found {GPUS}")
def test_dropout_streams_on_cuda():
    """Dropout on CUDA tensors: the per-rank streams live in the CUDA generator
    (:class:`atp_pipeline.parallel.rng.RNGTracker` with ``cuda=True``). 4 ranks on the GPU(s)
    (gloo where they share one): equal masks where a region is replicated, independent ones
    where it is split, the keep rate within bounds, the caller's CUDA generator untouched."""
    from .dropout_workers import TOY_MESHES, toy_cases
    from .test_dropout import P_TOY, within
    from .test_dropout import (
        test_each_region_draws_equal_masks_where_replicated_and_independent_ones_where_split as masks_follow_regions,
    )
    from .test_dropout import test_the_callers_generator_is_left_as_it_was as caller_untouched

    backend = "nccl" if GPUS >= 4 else "gloo"
    ranks = spawn(toy_cases, 4, "cuda", backend=backend, timeout=600)
    masks_follow_regions(ranks)
    caller_untouched(ranks)
    for m, shape in enumerate(TOY_MESHES):
        masks = [t for ms in ranks[0]["toy"][m]["masks"].values() for t in ms]
        ok, text = within(sum(int(t.sum()) for t in masks), sum(t.numel() for t in masks), 1 - P_TOY)
        assert ok, f"toy on {shape} (cuda): keep rate {text}"
