"""Tensor-parallel communication of a transformer step, term by term (ATP Eq. 2 and ours).

**Eq. 2 (``cost_model=eq2``, the paper's).** On ``DeviceMesh(d1, d2)`` a layer has four
conjugate operators (Figure 6): ``f1`` around the column-first QKV linear, ``f2`` around
the row-first output projection, ``f3``/``f4`` around the column- and row-first MLP
linears. Eq. 2 charges them::

    T_comm = 2*L*b*s * (3h/(d1*B2) + h/(d2*B1) + 4h/(d1*B2) + h/(d2*B1))
           = 2*L*b*s * (7h/(d1*B2) + 2h/(d2*B1))

(times the bytes per element, with B in bytes/s): a forward and a backward all-reduce per
operator, each charged the operator's forward size. So a column-first operator (f1, f3)
all-reduces its output, partial over dimension 2, with ``B2``; a row-first one (f2, f4)
its output, partial over dimension 1, with ``B1``. The paper's prose (§3.2.1) says f1/f3
reduce over the *first* dimension in the forward pass; its equations, which we follow, put
them on the second. A dimension of size 1 has no collective, so its terms vanish: on
``(N, 1)`` this is Megatron-LM's ``4*L*b*s*h / B1`` (§2.3).

**The runtime (``cost_model=runtime``).** Exactly the collectives the runtime sends for
the model's style plan (:func:`runtime_terms`, one program for every family), each with
its own size: the backward all-reduce of
an operator carries its *input*'s gradient (``h/d2`` for f1 and f3 on dimension 1,
``h/d1`` for f2 and ``4h/d1`` for f4 on dimension 2), so Eq. 2 over-counts dimension 2 by
``2h/d1`` per token and layer; and Eq. 2 omits the attention scatter/gather over d2
(all-gathers of ``3h/d1`` in backward and ``h/d1`` in forward), the LayerNorm statistics
over d2 (2 values per token each way), the LM head (column-first) and the
vocabulary-parallel loss (max and sums over d1). The collective counter of the runtime
(:class:`~atp_pipeline.parallel.comm.Comm`) is compared with these terms element for
element.

Times use the bandwidths of Eq. 3-4: an all-reduce of ``n`` bytes takes ``n / B``; an
all-gather producing ``n`` bytes takes ``n (d-1)/d / B'`` (a ring moves (d-1)/d of the
output over each link).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Dict, List, Mapping, Optional, Tuple

from atp_pipeline.config.schema import CostModel
from atp_pipeline.planning.shape import KV_GATHERED, KV_PICK, KV_SCATTER, ModelShape, kv_placement

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class CommTerm:
    """One collective: ``elements_per_token`` elements per token of the local batch,
    ``passes`` times per step, in every layer (``per_layer``) or once per model."""

    op: str  # "f1".."f4", "scatter", "gather", "ln1", "head", "loss", ...
    where: str  # the model part it sits in
    collective: str  # "all_reduce" | "all_gather" | "reduce_scatter"
    dim: int  # mesh dimension (1 or 2) it runs on
    elements_per_token: Fraction  # exact
    passes: int  # times per training step
    phase: str = "fwd+bwd"  # "fwd", "bwd" or "fwd+bwd" (Eq. 2 charges both alike)
    per_layer: bool = True
    per_token: bool = True  # False: ``elements_per_token`` elements per step, whatever the tokens (a loss total)
    per_chunk: bool = False  # sent by each chunk (§4.1) whole: elements multiply with the chunks


def eq2_terms(hidden: int, mesh: Tuple[int, int], ffn: Optional[int] = None,
              qkv: Optional[int] = None) -> List[CommTerm]:
    """The four conjugate operators of Eq. 2; terms on a size-1 dimension are dropped.
    ``qkv`` (default ``3h``) and ``ffn`` (default ``4h``) are the column-first widths."""
    d1, d2 = mesh
    h = hidden
    qkv = 3 * h if qkv is None else qkv
    ffn = 4 * h if ffn is None else ffn
    terms = [
        CommTerm("f1", "attention QKV linear (column-first)", ALL_REDUCE, 2, Fraction(qkv, d1), 2),
        CommTerm("f2", "attention output linear (row-first)", ALL_REDUCE, 1, Fraction(h, d2), 2),
        CommTerm("f3", "MLP first linear (column-first)", ALL_REDUCE, 2, Fraction(ffn, d1), 2),
        CommTerm("f4", "MLP second linear (row-first)", ALL_REDUCE, 1, Fraction(h, d2), 2),
    ]
    return [t for t in terms if (d1 if t.dim == 1 else d2) > 1]


def runtime_terms(shape: ModelShape, mesh: Tuple[int, int]) -> List[CommTerm]:
    """Every collective the runtime sends in one training step of ``shape`` laid out by its
    style plan (:mod:`atp_pipeline.parallel.styles`; Figure 6), whatever the family. Per
    layer: two norms (``norm_layout``: ``stats`` — LayerNorm sums of x and x² all-reduced over
    d2 each way; ``gathered`` — the model's own norm on the hidden gathered over d2, its
    output gradient gathered back); q/k/v column-first (three linears, or one fused: one
    input-gradient all-reduce either way, the readers of one input sum theirs first) and o
    row-first, the query heads scattered over d2 and gathered back, the key/value heads as
    :func:`~atp_pipeline.planning.shape.kv_layout` places them; the MLP's ``2`` (``3`` gated)
    linears. Per model: the final norm; the LM head (``head_layout``: ``vocab_parallel`` —
    column-first with the vocabulary-parallel loss's max and sums over d1; ``gathered`` —
    logits gathered over d1 for the model's own loss; ``tied`` — sharing the embedding's
    table, partial logits over the whole vocabulary all-reduced over d2, no backward
    communication; ``vocab_split`` — :class:`~atp_pipeline.parallel.vocab.VocabSplitHead`:
    logits reduce-scattered over d2 along the tokens (their gradient all-gathered back), the
    loss's max and sums over d1 for this rank's ``1/d2`` of the tokens and its total over d2,
    and — tied — the vocabulary-split embedding's rows all-reduced over d1); embeddings run
    whole and sliced over d2 (their gradient gathered). What the HF layout reads off the modules
    (:class:`~atp_pipeline.planning.shape.ModelShape`): ``layer_norms`` norms a layer and
    ``extra_norms`` beside the final one (or calls of it beyond one); an MLP reading the
    attention's input (``shared_mlp_input``, a parallel block: the readers of one input sum their
    partial gradients, so q/k/v and the MLP's column-first linears send one input-gradient
    all-reduce over d1 a layer, counted with f1); a core on the d1 heads replicated over d2
    (``heads_over_d2=False``, a core the attention runs itself, e.g. with position biases for
    all heads: no scatter, gather or pick over d2); a whole MLP,
    attention sinks and activation scalars (:func:`_layout_variants`).
    Chunks (§4.1) multiply calls, not elements."""
    d1, d2 = mesh
    h, q, kv, f, V = shape.hidden, shape.q_width, shape.kv_width, shape.ffn, shape.vocab_size
    g = shape.gate_width
    F_, t = Fraction, CommTerm
    up = shape.ffn_matrices - 1  # column-first MLP linears (up, and gate if gated)
    layout = kv_placement(shape, d1, d2)
    if shape.norm_layout == "stats":
        n = shape.layer_norms
        norms = [t("norm", "norm statistics (sum, sum of squares) over d2", ALL_REDUCE, 2, F_(2 * n), 1, "fwd"),
                 t("norm", "norm statistics gradient over d2", ALL_REDUCE, 2, F_(2 * n), 1, "bwd")]
        final = [t("norm_f", "final norm statistics over d2", ALL_REDUCE, 2, F_(2), 1, "fwd", False),
                 t("norm_f", "final norm statistics gradient over d2", ALL_REDUCE, 2, F_(2), 1, "bwd", False)]
    else:
        n = shape.layer_norms
        norms = [t("norm", "norms: hidden gathered over d2", ALL_GATHER, 2, F_(n * h), 1, "fwd"),
                 t("norm", "norms: output gradient gathered over d2", ALL_GATHER, 2, F_(n * h), 1, "bwd")]
        final = [t("norm_f", "final norm: hidden gathered over d2", ALL_GATHER, 2, F_(h), 1, "fwd", False),
                 t("norm_f", "final norm: output gradient gathered over d2", ALL_GATHER, 2, F_(h), 1, "bwd",
                   False)]
    terms = norms + [
        t("f1", "q/k/v linears and an output gate (column-first)", ALL_REDUCE, 2, F_(q + g + 2 * kv, d1), 1, "fwd"),
        t("f1", "q/k/v linears: input gradient (one for the readers of the input)", ALL_REDUCE, 1, F_(h, d2), 1,
          "bwd"),
        t("scatter", "query heads scattered over d2: gradient", ALL_GATHER, 2, F_(q, d1), 1, "bwd"),
        t("gather", "attention output gathered over d2", ALL_GATHER, 2, F_(q, d1), 1, "fwd"),
        t("f2", "output linear (row-first)", ALL_REDUCE, 1, F_(h, d2), 1, "fwd"),
        t("f2", "output linear: input gradient", ALL_REDUCE, 2, F_(q, d1), 1, "bwd"),
        t("f3", "MLP column-first linears", ALL_REDUCE, 2, F_(up * f, d1), 1, "fwd"),
    ] + ([] if shape.shared_mlp_input else [
        t("f3", "MLP column-first linears: input gradient (one for gate and up)", ALL_REDUCE, 1, F_(h, d2), 1,
          "bwd")]) + [
        t("f4", "MLP row-first linear", ALL_REDUCE, 1, F_(h, d2), 1, "fwd"),
        t("f4", "MLP row-first linear: input gradient", ALL_REDUCE, 2, F_(f, d1), 1, "bwd"),
    ]
    if shape.moe is not None:
        terms = _routed_mlps(terms, shape, mesh)
    if shape.final_norm:
        terms += final * (1 + shape.extra_norms)  # (an embedding's norm: alike)
    if shape.head_layout == "tied":
        terms.append(t("head", "LM head tied to the embedding: logits all-reduced over d2", ALL_REDUCE, 2,
                       F_(V), 1, "fwd", False))
    elif shape.head_layout == "vocab_split":
        terms += vocab_split_terms(shape, mesh)
    elif shape.head_layout == "whole":  # the head run whole on the hidden gathered over d2
        terms.append(t("head", "LM head run whole: hidden gathered over d2", ALL_GATHER, 2, F_(h), 1, "fwd", False))
    else:
        terms.append(t("head", "LM head (column-first)", ALL_REDUCE, 2, F_(V, d1), 1, "fwd", False))
        if shape.head_layout == "gathered":
            terms.append(t("head", "LM head: logits gathered over d1", ALL_GATHER, 1, F_(V), 1, "fwd", False))
        terms.append(t("head", "LM head: input gradient", ALL_REDUCE, 1, F_(h, d2), 1, "bwd", False))
        if shape.head_layout == "vocab_parallel":
            terms += [t("loss", "vocab-parallel cross-entropy: max", ALL_REDUCE, 1, F_(1), 1, "fwd", False),
                      t("loss", "vocab-parallel cross-entropy: sum-exp, target logit", ALL_REDUCE, 1, F_(2), 1,
                        "fwd", False)]
    if shape.gathered_embeddings:
        terms.append(t("embed", "embeddings run whole: gradient gathered over d2", ALL_GATHER, 2,
                       F_(shape.gathered_embeddings * h), 1, "bwd", False))
    if shape.attention_layout == "whole":
        # the family's code reads whole q/k/v: the projections gather their output over d1, the
        # core takes this rank's d1 block of heads (gradient all-gathered back) and gathers its
        # output over d1, and the output projection slices its input block (gradient gathered)
        kv_d1 = layout != KV_GATHERED  # key/value heads split over d1 at the core
        terms += [t("whole", "q/k/v linears: output gathered over d1", ALL_GATHER, 1, F_(q + 2 * kv), 1, "fwd"),
                  t("whole", "core: this rank's d1 heads, gradient gathered over d1", ALL_GATHER, 1,
                    F_(q + (2 * kv if kv_d1 else 0)), 1, "bwd"),
                  t("whole", "core output gathered over d1", ALL_GATHER, 1, F_(q), 1, "fwd"),
                  t("whole", "output linear: input block, gradient gathered over d1", ALL_GATHER, 1, F_(q), 1,
                    "bwd")]
    if shape.head_norm_params:
        terms.append(t("qk_norm", "per-head q/k norms: weight gradient summed over d1", ALL_REDUCE, 1,
                       F_(shape.head_norm_params), 1, "bwd", True, False, True))
    if layout == KV_SCATTER:
        terms.append(t("scatter", "key/value heads scattered over d2: gradient", ALL_GATHER, 2,
                       F_(2 * kv, d1), 1, "bwd"))
    elif layout == KV_PICK:
        terms.append(t("pick", "key/value heads picked per rank: gradient summed over d2", ALL_REDUCE, 2,
                       F_(2 * kv, d1), 1, "bwd"))
    else:
        if shape.attention_layout != "whole":  # (whole: gathered with the queries above)
            terms.append(t("kv", "key/value linears: output gathered over d1", ALL_GATHER, 1, F_(2 * kv), 1, "fwd"))
        terms += [t("pick", "key/value heads picked per rank: gradient summed over d1", ALL_REDUCE, 1,
                    F_(2 * kv), 1, "bwd"),
                  t("pick", "key/value heads picked per rank: gradient summed over d2", ALL_REDUCE, 2,
                    F_(2 * kv), 1, "bwd")]
    terms += _layout_variants(shape)
    if shape.latent is not None:
        terms = _latent_attention(terms, shape, mesh)
    terms = _whole_modules(terms, shape)
    if not shape.heads_over_d2:  # the core on the d1 heads, replicated over d2: no scatter, gather, pick
        terms = [x for x in terms if not (x.dim == 2 and x.op in ("scatter", "gather", "pick"))]
    return [x for x in terms if (d1 if x.dim == 1 else d2) > 1]


def _layout_variants(shape: ModelShape) -> List[CommTerm]:
    """A whole MLP (its column-first outputs gathered over d1, the row-first input block's
    gradient gathered back), attention sinks (gradients summed over d1 and d2) and an
    activation's scalars (gradients summed over d1)."""
    F_, t = Fraction, CommTerm
    terms = []
    if shape.mlp_layout == "whole":
        dense = shape.dense_mlp_layers
        terms += [t("mlp", "whole MLP: column-first outputs gathered over d1", ALL_GATHER, 1,
                    F_((shape.ffn_matrices - 1) * shape.ffn), dense, "fwd", False),
                  t("mlp", "whole MLP: row-first input block, gradient gathered over d1", ALL_GATHER, 1,
                    F_(shape.ffn), dense, "bwd", False)]
    for dim in (1, 2):
        if shape.sink_params:
            terms.append(t("sinks", f"attention sinks: gradient summed over d{dim}", ALL_REDUCE, dim,
                           F_(shape.sink_params), 1, "bwd", True, False))
    if shape.scalar_params:
        terms.append(t("scalars", "activation scalars: gradient summed over d1", ALL_REDUCE, 1,
                       F_(shape.scalar_params), 1, "bwd", True, False))
    return terms


ATTENTION_OPS = ("f1", "scatter", "gather", "f2", "whole", "qk_norm", "kv", "pick", "sinks")
MLP_OPS = ("f3", "f4", "scalars")


def _whole_modules(terms: List[CommTerm], shape: ModelShape) -> List[CommTerm]:
    """``terms`` for a model some of whose modules run whole (replicated) on the hidden gathered
    over d2, their output sliced back (:func:`~atp_pipeline.parallel.layers.run_gathered`): each
    gathers its hidden inputs over d2 in the forward and its output's gradient over d2 in the
    backward; the attention's and the dense MLP's per-layer terms count only the layers that
    split them (``attention_layers``, ``mlp_layers``)."""
    F_, t = Fraction, CommTerm
    counts = {op: shape.split_attention_layers for op in ATTENTION_OPS}
    counts.update({op: shape.dense_mlp_layers for op in MLP_OPS})
    out = []
    for x in terms:
        n = counts.get(x.op, shape.layers) if x.per_layer else shape.layers
        if n == shape.layers:
            out.append(x)
        elif n:
            out.append(replace(x, per_layer=False, passes=x.passes * n))
    if shape.whole_modules:
        out += [t("mixer", "modules run whole: hidden inputs gathered over d2", ALL_GATHER, 2, F_(shape.hidden),
                  shape.whole_inputs, "fwd", False),
                t("mixer", "modules run whole: output gradient gathered over d2", ALL_GATHER, 2, F_(shape.hidden),
                  shape.whole_modules, "bwd", False)]
    if shape.whole_vectors:  # e.g. a bias the block adds to the output: one hidden vector a step
        out.append(t("mixer", "modules run whole: a vector output's gradient gathered over d2", ALL_GATHER, 2,
                     F_(shape.hidden), shape.whole_vectors, "bwd", False, False))
    return out


def _latent_attention(terms: List[CommTerm], shape: ModelShape, mesh: Tuple[int, int]) -> List[CommTerm]:
    """``terms`` with the attention's replaced by a multi-head latent attention's (style
    ``hf_mla``): the latent projections run whole on the hidden gathered over d2; the per-head
    projections column-first (a latent input sliced over d2: its gradient all-reduced over d1,
    then gathered over d2; queries from the hidden: the hidden's gradient over d1); the
    features every head shares (the rotary key) with their gradient summed over d1; the heads
    (query and key ``qk_head_dim``, value ``v_head_dim`` features) scattered over d2 and the
    output gathered back; the output projection row-first."""
    lat = shape.latent
    assert lat is not None
    d1, d2 = mesh
    F_, t = Fraction, CommTerm
    h, n = shape.hidden, shape.heads
    q, o = n * lat.qk_head_dim, n * lat.v_head_dim
    kv = n * (lat.qk_head_dim - lat.shared + lat.v_head_dim)
    latents = lat.q_latent + lat.kv_latent  # what the per-head projections read, whole
    attention = ("f1", "f2", "scatter", "gather", "pick", "kv", "whole", "qk_norm")
    return [x for x in terms if x.op not in attention] + [
        t("f1", "latent projections: hidden gathered over d2", ALL_GATHER, 2, F_(lat.projections * h), 1, "fwd"),
        t("f1", "per-head projections (column-first)", ALL_REDUCE, 2, F_(q + kv, d1), 1, "fwd"),
        t("f1", "per-head projections: input gradients", ALL_REDUCE, 1,
          F_(latents if lat.q_latent else h + latents, d2), 1, "bwd"),
        t("f1", "latents sliced over d2: gradient gathered", ALL_GATHER, 2, F_(latents), 1, "bwd"),
        t("f1", "features every head shares: gradient summed over d1", ALL_REDUCE, 1, F_(lat.shared), 1, "bwd"),
        t("scatter", "query, key and value heads scattered over d2: gradient", ALL_GATHER, 2, F_(2 * q + o, d1), 1,
          "bwd"),
        t("gather", "attention output gathered over d2", ALL_GATHER, 2, F_(o, d1), 1, "fwd"),
        t("f2", "output linear (row-first)", ALL_REDUCE, 1, F_(h, d2), 1, "fwd"),
        t("f2", "output linear: input gradient", ALL_REDUCE, 2, F_(o, d1), 1, "bwd")]


def _mlp_terms(width: int, up: int, hidden: int, mesh: Tuple[int, int], passes: int, what: str) -> List[CommTerm]:
    """f3/f4 of an MLP of ``width`` with ``up`` column-first linears, ``passes`` times a step."""
    d1, d2 = mesh
    F_, t = Fraction, CommTerm
    return [t("f3", f"{what} column-first linears", ALL_REDUCE, 2, F_(up * width, d1), passes, "fwd", False),
            t("f3", f"{what} column-first linears: input gradient", ALL_REDUCE, 1, F_(hidden, d2), passes, "bwd",
              False),
            t("f4", f"{what} row-first linear", ALL_REDUCE, 1, F_(hidden, d2), passes, "fwd", False),
            t("f4", f"{what} row-first linear: input gradient", ALL_REDUCE, 2, F_(width, d1), passes, "bwd", False)]


def _routed_mlps(terms: List[CommTerm], shape: ModelShape, mesh: Tuple[int, int]) -> List[CommTerm]:
    """``terms`` with the MLPs of the ``moe.layers`` routed layers replaced by their experts
    (style ``hf_experts``: each expert an ATP MLP on the rows routed to it, the collectives
    batched over the experts — ``top_k`` rows a token in the up projection and the
    intermediate's gradient; the routing weights' gradient over d1 and d2), a shared expert
    laid out column-/row-first, and the modules run whole on the gathered hidden (the router:
    the hidden gathered over d2; an output split again: its gradient gathered; a gate scaling
    the split hidden: its gradient summed over d2)."""
    moe = shape.moe
    assert moe is not None
    d1, d2 = mesh
    h, k, f = shape.hidden, moe.top_k, moe.ffn
    F_, t, n = Fraction, CommTerm, moe.layers
    dense = shape.dense_mlp_layers
    out = [x for x in terms if x.op not in ("f3", "f4")]
    if dense:
        out += _mlp_terms(shape.ffn, shape.ffn_matrices - 1, h, mesh, dense, "dense layers' MLP")
    if moe.shared_ffn:
        out += _mlp_terms(moe.shared_ffn, shape.ffn_matrices - 1, h, mesh, n, "shared expert")
    out += [t("experts", "experts' up projections (column-first), routed rows", ALL_REDUCE, 2,
              F_(k * (moe.matrices - 1) * f, d1), n, "fwd", False),
            t("experts", "experts' down projections (row-first), summed over the routed rows", ALL_REDUCE, 1,
              F_(h, d2), n, "fwd", False),
            t("experts", "experts' intermediate gradient, routed rows", ALL_REDUCE, 2, F_(k * f, d1), n, "bwd", False),
            t("experts", "experts' input gradient", ALL_REDUCE, 1, F_(h, d2), n, "bwd", False),
            t("experts", "routing weights' gradient over d1", ALL_REDUCE, 1, F_(k), n, "bwd", False),
            t("experts", "routing weights' gradient over d2", ALL_REDUCE, 2, F_(k), n, "bwd", False)]
    if moe.gathered:
        out.append(t("router", "router (and the block's other whole modules): hidden gathered over d2", ALL_GATHER,
                     2, F_(moe.gathered * h), n, "fwd", False))
    if moe.split_outputs:
        out.append(t("router", "whole modules' split outputs: gradient gathered over d2", ALL_GATHER, 2,
                     F_(moe.split_outputs * h), n, "bwd", False))
    if moe.partial_width:
        out.append(t("router", "gates scaling the split hidden: gradient summed over d2", ALL_REDUCE, 2,
                     F_(moe.partial_width), n, "bwd", False))
    return out


def vocab_split_terms(shape: ModelShape, mesh: Tuple[int, int]) -> List[CommTerm]:
    """The head and loss of ``head_layout="vocab_split"`` (:mod:`atp_pipeline.parallel.vocab`):
    per token of the batch ``V/d1`` elements reduce-scattered over d2 in the forward and
    all-gathered in the backward (the tokens padded to a multiple of ``d2*d2``: exact when they
    divide), the input gradient all-reduced over d1, the cross-entropy's max and (sum-exp,
    target logit) over d1 for ``1/d2`` of the tokens, one loss total over d2 per step; a head
    tied to the embedding adds the embedding's lookup all-reduced over d1 (forward only)."""
    d1, d2 = mesh
    h, V = shape.hidden, shape.vocab_size
    F_, t = Fraction, CommTerm
    terms = [t("head", "LM head: partial logits reduce-scattered over d2 along the tokens", REDUCE_SCATTER, 2,
               F_(V, d1), 1, "fwd", False),
             t("head", "LM head: logit gradients all-gathered over d2", ALL_GATHER, 2, F_(V, d1), 1, "bwd", False),
             t("head", "LM head: input gradient", ALL_REDUCE, 1, F_(h, d2), 1, "bwd", False),
             t("loss", "vocab-parallel cross-entropy: max", ALL_REDUCE, 1, F_(1, d2), 1, "fwd", False),
             t("loss", "vocab-parallel cross-entropy: sum-exp, target logit", ALL_REDUCE, 1, F_(2, d2), 1, "fwd",
               False),
             t("loss", "vocab-parallel cross-entropy: token total over d2", ALL_REDUCE, 2, F_(1), 1, "fwd", False,
               False)]
    if shape.tied_embeddings:
        terms.append(t("embed", "vocabulary-split embedding: rows all-reduced over d1", ALL_REDUCE, 1, F_(h, d2), 1,
                       "fwd", False))
    return terms


def comm_terms(cost_model: CostModel, shape: ModelShape, mesh: Tuple[int, int]) -> List[CommTerm]:
    if cost_model == CostModel.eq2:
        return eq2_terms(shape.hidden, mesh, ffn=shape.ffn, qkv=shape.q_width + 2 * shape.kv_width)
    if cost_model == CostModel.runtime:
        return runtime_terms(shape, mesh)
    raise ValueError(f"unknown cost model {cost_model}")


def term_elements(term: CommTerm, tokens: int, layers: int, chunks: int = 1) -> Fraction:
    """Elements the term moves per step and rank (input of an all-reduce, output of an all-gather)."""
    return term.elements_per_token * (tokens if term.per_token else 1) * term.passes * \
        (layers if term.per_layer else 1) * (chunks if term.per_chunk else 1)


def predicted_elements(terms: List[CommTerm], tokens: int, layers: int,
                       chunks: int = 1) -> Dict[Tuple[str, str], int]:
    """Elements per step by ``(collective, "d1"|"d2")`` — what the runtime's counter reports."""
    out: Dict[Tuple[str, str], Fraction] = defaultdict(Fraction)
    for term in terms:
        out[(term.collective, f"d{term.dim}")] += term_elements(term, tokens, layers, chunks)
    for key, value in out.items():
        if value.denominator != 1:
            raise ValueError(f"{key}: {value} elements is not whole; the mesh does not divide the model")
    return {k: int(v) for k, v in out.items()}


def predicted_counts(shape: Mapping[str, object], mesh: Tuple[int, int], tokens: int,
                     chunks: int = 1) -> Dict[str, int]:
    """:func:`predicted_elements` of the runtime cost model for a shape given as a dict
    (``ModelShape.to_dict()``, its derived entries ignored), keyed ``"collective/dN"`` as the
    runtime's counter is reported by the tests and benchmarks that compare the two."""
    s = ModelShape(**{k: v for k, v in shape.items() if k in ModelShape.__dataclass_fields__})  # type: ignore[arg-type]
    got = predicted_elements(runtime_terms(s, mesh), tokens, s.layers, chunks)
    return {f"{k}/{a}": n for (k, a), n in got.items()}


def collective_seconds(collective: str, size: int, nbytes: float, B_GBps: Optional[float],
                       B_prime_GBps: Optional[float]) -> float:
    """Modeled time of one collective over a mesh dimension of ``size`` ranks.

    All-reduce: ``nbytes / B`` (Eq. 4's algorithm bandwidth); all-gather producing
    ``nbytes``, or reduce-scatter reducing ``nbytes``: ``nbytes * (size-1)/size / B'`` (a ring
    moves (size-1)/size of the whole over each link either way). Shared by the planner and the
    emulator.
    """
    if size == 1:
        return 0.0
    if collective == ALL_REDUCE:
        assert B_GBps is not None
        return nbytes / (B_GBps * 1e9)
    if collective in (ALL_GATHER, REDUCE_SCATTER):
        assert B_prime_GBps is not None
        return nbytes * (size - 1) / size / (B_prime_GBps * 1e9)
    raise ValueError(f"unknown collective {collective}")


@dataclass(frozen=True)
class TermCost:
    term: CommTerm
    bytes_per_step: float  # per rank, all layers
    seconds: float

    def to_dict(self) -> dict:
        t = self.term
        return {"op": t.op, "where": t.where, "collective": t.collective, "dim": t.dim,
                "phase": t.phase, "elements_per_token": float(t.elements_per_token),
                "passes": t.passes, "per_layer": t.per_layer,
                "bytes_per_step": self.bytes_per_step, "seconds": self.seconds}


def step_comm_time(terms: List[CommTerm], layers: int, batch: int, seq: int, bytes_per_element: int,
                   sizes: Mapping[int, int], B: Mapping[int, Optional[float]],
                   B_prime: Mapping[int, Optional[float]]) -> Tuple[float, List[TermCost]]:
    """Seconds of tensor-parallel communication per step, and each term's share."""
    costs = []
    for t in terms:
        if B[t.dim] is None:
            raise ValueError(f"term {t.op} on mesh dimension {t.dim} has no bandwidth")
        volume = float(term_elements(t, batch * seq, layers)) * bytes_per_element
        costs.append(TermCost(t, volume, collective_seconds(t.collective, sizes[t.dim], volume,
                                                            B[t.dim], B_prime[t.dim])))
    return sum(c.seconds for c in costs), costs
