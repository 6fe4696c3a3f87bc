"""Chunk-based overlap (ATP §4.1), one runtime for every model: the presets ``tiny`` (the
built-in GPT), ``llama_tiny`` with 2 key/value heads (fewer than the ranks) and ``gpt2_tiny``
(Conv1D, fused q|k|v, tied head), each laid out by its adapter's plan with its blocks run in 2
and 4 chunks on 2x2 and 1x4 (4 gloo processes, one launch): one float64 step's every gradient
within 1e-9 of one process (relative to the gradient's magnitude), and at 4 chunks (one sample
a chunk) on 2x2 8 float32 SGD losses within 1e-5. (Every HF family's chunked gradients, Llama with 4
key/value heads among them: tests/test_hf_models.py.) Unit tests of the wavefront: results, turn
order, errors, and the chunked backward."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch

from atp_pipeline.errors import ConfigError
from atp_pipeline.launch import spawn
from atp_pipeline.parallel.overlap import Wavefront, chunk_blocks, chunked_call

pytest.importorskip("transformers", reason="pip install transformers")

from . import overlap_workers  # noqa: E402

MODELS = ["tiny", "llama_tiny_kv2", "gpt2_tiny"]
MESHES = [(2, 2), (1, 4)]
CHUNKS = [2, 4]


@pytest.fixture(scope="module")
def runs() -> List[Dict[str, Any]]:
    return spawn(overlap_workers.chunked_training, 4, MODELS, MESHES, CHUNKS, timeout=900)[0]


def test_every_family_chunked_matches_one_process(runs):
    runs = [r for r in runs if r["model"] in MODELS]
    assert {(r["model"], r["mesh"], r["chunks"]) for r in runs} == {
        (m, mesh, c) for m in MODELS for mesh in MESHES for c in CHUNKS}
    for r in runs:
        where = (r["model"], r["mesh"], r["chunks"])
        assert r["same_params"], where
        assert r["grad_rel"] <= 1e-9, (where, r["worst"], r["grad_rel"])
        if r["chunks"] == max(CHUNKS) and tuple(r["mesh"]) == MESHES[0]:
            assert r["steps"] == overlap_workers.STEPS and r["loss_err"] <= 1e-5, (where, r["loss_err"])
        else:
            assert "steps" not in r, where


def test_readers_sharing_an_input_reduce_its_gradient_once_even_if_one_never_runs(runs):
    """q/k/v-style fan-in (``column(shared=true)``): the last reader to run reduces the sum of
    the partial input gradients; a reader outside the loss leaves nothing behind."""
    fan = [r for r in runs if r["model"] == "fan_in_unused_reader"]
    assert {tuple(r["mesh"]) for r in fan} == {(2, 2), (1, 4), (4, 1)}
    for r in fan:
        assert r["grad_rel"] <= 1e-12, r


def test_wavefront_passes_the_baton_round_robin_at_each_yield():
    """Chunks take turns stage by stage (the order the step model simulates)."""
    order: List[str] = []

    def chunk(name: str):
        def run():
            for stage in range(3):
                order.append(f"{name}{stage}")
                yield_fn = _current_yield()
                if yield_fn is not None:
                    yield_fn()
            return name
        return run

    assert Wavefront([chunk("a"), chunk("b")]).run() == ["a", "b"]
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def _current_yield():
    from atp_pipeline.parallel import comm

    return getattr(comm._YIELD, "fn", None)


def test_wavefront_keeps_grad_mode_and_reraises():
    with torch.no_grad():
        modes = Wavefront([torch.is_grad_enabled, torch.is_grad_enabled]).run()
    assert modes == [False, False]

    def boom():
        raise ValueError("chunk failed")
    with pytest.raises(ValueError, match="chunk failed"):
        Wavefront([lambda: 1, boom]).run()
    assert threading.active_count() < 50


def test_chunked_call_splits_batch_arguments_only():
    seen = []

    def forward(x, mask=None, table=None, pos=None):
        seen.append((tuple(x.shape), tuple(mask.shape), tuple(table.shape), tuple(pos.shape)))
        return x * 2, table.sum()

    x = torch.arange(24.0).view(4, 3, 2)
    out, s = chunked_call(forward, 2, (x,), {"mask": torch.ones(4, 1, 3, 3), "table": torch.ones(1, 3, 2),
                                              "pos": torch.arange(3)})
    assert torch.equal(out, x * 2) and float(s) == 6.0
    assert seen == [((2, 3, 2), (2, 1, 3, 3), (1, 3, 2), (3,))] * 2
    with pytest.raises(ConfigError, match="chunks=3 .* does not divide the local batch 4"):
        chunked_call(forward, 3, (x,), {"mask": torch.ones(4, 1, 3, 3), "table": torch.ones(1, 3, 2),
                                        "pos": torch.arange(3)})


def test_chunks_need_repeated_blocks():
    with pytest.raises(ConfigError, match=r"runs each repeated block .* Linear has none, use chunks=1"):
        chunk_blocks(torch.nn.Linear(2, 2), 2)
    blocks = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    assert chunk_blocks(blocks, 2) == ["0.0"]
    x = torch.randn(4, 2)
    assert torch.allclose(blocks[0][0](x), x @ blocks[0][0].weight.t() + blocks[0][0].bias)


def test_chunked_backward_equals_the_whole_batchs():
    """The block's backward as a wavefront over the chunks' own graphs: the gradients of a
    split input (joined), of a whole input every chunk reads (summed) and of the parameters
    (accumulated) are the whole batch's."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()

    def block(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(x) + bias)

    x = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    block(x, bias).pow(2).sum().backward()
    want = [t.grad.clone() for t in (x, bias, lin.weight, lin.bias)]
    for t in (x, bias, lin.weight, lin.bias):
        t.grad = None
    out = chunked_call(block, 3, (x, bias), {})
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("_ChunkedBlock")
    out.pow(2).sum().backward()
    for got, w in zip((x.grad, bias.grad, lin.weight.grad, lin.bias.grad), want):
        assert torch.allclose(got, w, rtol=1e-12, atol=1e-14)
