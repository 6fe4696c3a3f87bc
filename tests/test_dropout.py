"""Dropout on ATP's mesh: per-rank random streams after Megatron's
model-parallel RNG tracker (:mod:`atp_pipeline.parallel.rng`), on 4 real gloo processes, one
launch (tests/dropout_workers.py).

* Masks, read directly from a laid-out toy model's probes on 2x2, 1x4 and dp=2 x 1x2: a region
  replicated over some ranks draws equal masks there, and independent ones (agreement
  p² + (1-p)² within 5 sigma) wherever the tensor is split, and across data-parallel replicas;
  the stream advances between forwards; the caller's generator is left as it was, also when
  the forward raises.
* transformers GPT-2 (``resid_pdrop = attn_pdrop = embd_pdrop = 0.1``, eager attention, its
  every draw recorded) and OPT (``dropout = attention_dropout = 0.1``, sdpa) train 8 SGD steps on
  2x2, two batches in turn: GPT-2's masks are equal across d1 and independent across d2
  between blocks, independent on every rank in the attention core; the keep rate is within 5
  binomial sigma of 0.9; the loss is the same on every rank, every parameter and gradient
  replicated over an axis is equal across it, the same seed reproduces the losses and
  parameters bit for bit (GPT-2 also with its blocks in 2 chunks, §4.1), another seed gives
  other losses, the loss falls, and dropout is on (the first loss is not the evaluation one).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List, Tuple

import pytest
import torch

pytest.importorskip("transformers", reason="pip install transformers")

from atp_pipeline.launch import spawn  # noqa: E402
from atp_pipeline.parallel.rng import REGION_AXES  # noqa: E402

from .dropout_workers import HF_RUNS, P_HF, P_TOY, TOY_MESHES, TOY_REGIONS, dropout_case  # noqa: E402

SIGMAS = 5.0


@pytest.fixture(scope="module")
def ranks() -> List[Dict[str, Any]]:
    return spawn(dropout_case, 4)


def within(k: float, n: int, p: float) -> Tuple[bool, str]:
    """Whether ``k`` successes of ``n`` are within :data:`SIGMAS` binomial sigma of ``n p``."""
    bound = SIGMAS * math.sqrt(p * (1 - p) / n)
    return abs(k / n - p) <= bound, f"{k / n:.4f} vs {p:.4f} +- {bound:.4f} (n={n})"


def agreement(a: List[torch.Tensor], b: List[torch.Tensor], valid: List[torch.Tensor] = None) -> Tuple[int, int]:
    """How many positions two ranks' masks agree on, of how many (valid on both)."""
    same = n = 0
    for i, (x, y) in enumerate(zip(a, b)):
        v = torch.ones_like(x) if valid is None else valid[i]
        same += int(((x == y) & v).sum())
        n += int(v.sum())
    return same, n


def check_pair(a, b, shared: bool, p: float, where: str, valid=None) -> None:
    same, n = agreement(a, b, valid)
    if shared:
        assert same == n, f"{where}: masks differ on ranks that hold the same block ({same}/{n})"
    else:
        ok, text = within(same, n, p * p + (1 - p) ** 2)
        assert ok, f"{where}: masks of ranks holding different blocks are not independent: agreement {text}"


def test_each_region_draws_equal_masks_where_replicated_and_independent_ones_where_split(ranks):
    for m, shape in enumerate(TOY_MESHES):
        rows = [r["toy"][m] for r in ranks]
        assert all(r["mesh"] == shape for r in rows)
        for probe, region in TOY_REGIONS.items():
            axes = ("dp", *REGION_AXES[region])
            for a, b in itertools.combinations(rows, 2):
                shared = all(a["coord"][x] == b["coord"][x] for x in axes)
                check_pair(a["masks"][probe], b["masks"][probe], shared, P_TOY,
                           f"mesh {shape}, {probe} ({region}), ranks {a['coord']} / {b['coord']}")
            for r in rows:  # the stream advances: the second forward's mask is another draw
                check_pair(r["masks"][probe][:1], r["masks"][probe][1:], False, P_TOY, f"{probe}: two forwards")


def test_keep_rate_is_within_binomial_bounds(ranks):
    for m, shape in enumerate(TOY_MESHES):
        masks = [t for ms in ranks[0]["toy"][m]["masks"].values() for t in ms]
        ok, text = within(sum(int(t.sum()) for t in masks), sum(t.numel() for t in masks), 1 - P_TOY)
        assert ok, f"toy on {shape}: keep rate {text}"
    draws = ranks[0]["runs"][0]["draws"]
    kept, n = sum(int((k & v).sum()) for v, k in draws), sum(int(v.sum()) for v, _ in draws)
    ok, text = within(kept, n, 1 - P_HF)
    assert ok, f"GPT-2 on 2x2: keep rate {text}"


def test_the_callers_generator_is_left_as_it_was(ranks):
    for r in ranks:
        for row in r["toy"]:
            assert row["untouched"], f"{row['mesh']}: the model's forward moved the caller's generator"
            assert row["restored"], f"{row['mesh']}: a forward that raised left the streams in place"


def test_gpt2_masks_follow_the_layout(ranks):
    """Between blocks (3-D draws: embeddings, residual and MLP dropout) hidden is split over d2:
    equal masks on d1 replicas, independent across d2; the attention core's probabilities
    (4-D) are this rank's own heads: independent on every rank."""
    runs = [r["runs"][0] for r in ranks]
    assert runs[0]["family"] == "gpt2" and len(runs[0]["draws"]) == 8 * (1 + 3 * 2)
    for a, b in itertools.combinations(runs, 2):
        for dims, axes in ((3, ("d2",)), (4, ("d1", "d2"))):
            pairs = [(x, y) for x, y in zip(a["draws"], b["draws"]) if x[0].dim() == dims]
            assert pairs
            shared = all(a["coord"][x] == b["coord"][x] for x in axes)
            valid = [x[0] & y[0] for x, y in pairs]
            check_pair([x[1] for x, _ in pairs], [y[1] for _, y in pairs], shared, P_HF,
                       f"GPT-2 {dims}-D draws, ranks {a['coord']} / {b['coord']}", valid)


def _equal_where_replicated(rows: List[Dict[str, Any]], key: str, where: str) -> None:
    for a, b in itertools.combinations(rows, 2):
        for name, (t, axes) in a[key].items():
            if all(a["coord"][x] == b["coord"][x] for x in axes):
                assert torch.equal(t, b[key][name][0]), f"{where}: {key} '{name}' differs on ranks {a['coord']} / " \
                                                        f"{b['coord']} (replicated over the axes that differ)"


def test_hf_models_train_with_dropout_and_replicas_stay_identical(ranks):
    for i, (family, seed, chunks) in enumerate(HF_RUNS):
        rows = [r["runs"][i] for r in ranks]
        where = f"{family} seed {seed}, {chunks} chunk(s)"
        losses = rows[0]["losses"]
        assert all(r["losses"] == losses for r in rows), (where, [r["losses"] for r in rows])
        assert all(math.isfinite(x) for x in losses), where
        assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, (where, losses)  # both batches, 8 steps apart
        # dropout is on: the first step's loss differs from the same batch's in evaluation
        assert losses[0] != rows[0]["eval_loss"], where
        _equal_where_replicated(rows, "params", where)
        _equal_where_replicated(rows, "grads", where)


def test_the_same_seed_reproduces_the_losses_bit_for_bit(ranks):
    runs = ranks[0]["runs"]
    by_key: Dict[Tuple[str, int, int], List[Dict[str, Any]]] = {}
    for key, run in zip(HF_RUNS, runs):
        by_key.setdefault(key, []).append(run)
    repeated = [k for k, v in by_key.items() if len(v) > 1]
    assert {("gpt2", 1, 1), ("gpt2", 1, 2), ("opt", 1, 1)} <= set(repeated)
    for key in repeated:
        first, *others = by_key[key]
        for other in others:
            assert other["losses"] == first["losses"], (key, first["losses"], other["losses"])
            assert all(torch.equal(t, other["params"][n][0]) for n, (t, _) in first["params"].items()), key
    assert by_key[("gpt2", 2, 1)][0]["losses"] != by_key[("gpt2", 1, 1)][0]["losses"]
