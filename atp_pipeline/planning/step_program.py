"""One rank's training step as a program of kernels and placed collectives (the style plan's
layout, chunked as §4.1's wavefront), built from the runtime cost model's terms, each placed exactly once."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from atp_pipeline.config.schema import CostModel
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.cost import CommTerm, comm_terms
from atp_pipeline.planning.kernels import (
    ATTN_BWD,
    ATTN_FWD,
    GEMM,
    LOSS_BWD,
    LOSS_FWD,
    NORM_BWD,
    NORM_FWD,
    OPTIMIZER,
    POINTWISE,
    Kernel,
)
from atp_pipeline.planning.shape import KV_GATHERED, KV_PICK, KV_SCATTER, ModelShape, kv_placement

Mesh = Tuple[int, int]


# ----------------------------------------------------------------------------- schedule
# An item of one rank's program: ("k", Kernel) computes; ("sync", Coll) blocks on a
# collective; ("async", Coll) launches one the chunk waits for at its next stage;
# ("linear", Coll) launches one the program waits for at the next ("join",) (§4.2).
Item = Tuple[Any, ...]


@dataclass(frozen=True)
class Coll:
    """A placed collective: ``share`` of a cost-model term, for ``tokens`` tokens; ``joined``:
    other placed terms' shares the runtime sends in the same call (the same collective on the
    same dimension: one call, its bytes theirs together)."""

    term: CommTerm
    share: Fraction
    tokens: int
    joined: Tuple["Coll", ...] = ()

    @cached_property
    def elements(self) -> Fraction:
        return (self.term.elements_per_token * (self.tokens if self.term.per_token else 1) * self.share
                + sum((c.elements for c in self.joined), Fraction(0)))


def one_call(*colls: Optional[Coll]) -> Optional[Coll]:
    """The placed ``colls`` sent as one call (None where none is placed)."""
    placed = [c for c in colls if c is not None]
    if not placed:
        return None
    first, rest = placed[0], tuple(placed[1:])
    if any((c.term.collective, c.term.dim) != (first.term.collective, first.term.dim) for c in rest):
        raise ValueError(f"step model: one call of different collectives: {[(c.term.op, c.term.dim) for c in placed]}")
    return Coll(first.term, first.share, first.tokens, first.joined + rest)


class Terms:
    """The cost model's terms, handed out by ``(op, phase)`` in order; every share of every
    term must be placed exactly once per block and chunk (:meth:`check_done`)."""

    def __init__(self, terms: Sequence[CommTerm]) -> None:
        self.terms = list(terms)
        self.placed: Dict[int, Fraction] = {i: Fraction(0) for i in range(len(self.terms))}

    def take(self, op: str, phase: str, tokens: int, share: Fraction = Fraction(1), nth: int = 0,
             count: Fraction = Fraction(1)) -> Optional[Coll]:
        """The ``nth`` term ``(op, phase)`` (None where the mesh has none: a size-1 dimension);
        ``count`` is the weight of this placement towards the term's total (1 per block
        placement; ``1/chunks`` per chunk)."""
        hits = [i for i, t in enumerate(self.terms) if t.op == op and t.phase == phase]
        if nth >= len(hits):
            return None
        i = hits[nth]
        self.placed[i] += share * count
        return Coll(self.terms[i], share, tokens)

    def check_done(self) -> None:
        wrong = [f"{t.op}/{t.phase}/d{t.dim} ({self.placed[i]} placed)" for i, t in enumerate(self.terms)
                 if self.placed[i] != 1]
        if wrong:
            raise ValueError(f"step model: cost-model terms not placed exactly once: {', '.join(wrong)}")


def _k(kind: str, *dims: int) -> Item:
    return ("k", Kernel(kind, tuple(int(d) for d in dims)))


def _c(mode: str, coll: Optional[Coll]) -> List[Item]:
    return [] if coll is None else [(mode, coll)]


def _linear_bwd(m: int, k: int, n: int, coll: Optional[Coll]) -> List[Item]:
    """A linear's backward (``mappings.LinearAllReduce``): input-gradient GEMM, its all-reduce
    launched, weight-gradient GEMM while it runs, then wait (§4.2)."""
    if coll is None:
        return [_k(GEMM, m, n, k), _k(GEMM, n, m, k)]
    return [_k(GEMM, m, n, k), ("linear", coll), _k(GEMM, n, m, k), ("join",)]


def _fan_in_bwd(m: int, k: int, widths: Sequence[int], coll: Optional[Coll]) -> List[Item]:
    """The backward of column-first linears reading one input (``k`` features, outputs of
    ``widths``, run in reverse): each adds its partial input gradient to the others', and the
    last to run all-reduces the sum while its weight gradient computes (§4.2; ``mappings.FanIn``)."""
    *first, last = list(reversed(widths))
    out: List[Item] = []
    for n in first:
        out += _linear_bwd(m, k, n, None)
    return out + [_k(POINTWISE, m * k)] * len(first) + _linear_bwd(m, k, last, coll)


@dataclass
class Program:
    """One rank's step: each block's items per chunk (run as the wavefront, :func:`stages`),
    the rest in order."""

    pre: List[Item]  # embeddings, before the blocks
    blocks_fwd: List[List[List[Item]]]  # [layer][chunk] -> forward items
    blocks_bwd: List[List[List[Item]]]  # [layer][chunk] -> backward items, in execution order (layers run reversed)
    post_fwd: List[Item]  # final norm, head, loss
    post_bwd: List[Item]  # their backward, in execution order
    pre_bwd: List[Item]  # embeddings' backward
    tail: List[Item]  # optimizer
    chunks: int
    reads: int = 0  # sharded parameters read a step (DTensor ``to_local``, each chunk's own): :func:`param_reads`


def stages(items: List[Item]) -> List[List[Item]]:
    """A chunk's items cut where it yields (the wavefront of :mod:`~atp_pipeline.parallel.overlap`):
    after a blocking collective's launch, and after a linear's weight-gradient GEMM with its
    input-gradient all-reduce in flight (§4.2); the chunk waits for what it launched when its
    next stage starts, while the other chunks compute."""
    out: List[List[Item]] = [[]]
    for item in items:
        if item[0] in ("sync", "linear"):
            out[-1].append(("async", item[1]))
            if item[0] == "sync":
                out.append([])
        elif item[0] == "join":
            out.append([])
        else:
            out[-1].append(item)
    return out


def _layer(shape: ModelShape, mesh: Mesh, T: int, batch: int, terms: Terms,
           count: Fraction) -> Tuple[List[Item], List[Item]]:
    """One block of one chunk (``T`` tokens, ``batch`` sequences) as the style plan lays it
    out: forward items in order, backward items in execution order (reverse of the forward's
    pieces, as autograd runs them). ``count`` weighs each placement towards its term."""
    d1, d2 = mesh
    h, f, s, hd = shape.hidden, shape.ffn, shape.seq_len, shape.head_dim
    q, kv = shape.q_width, shape.kv_width
    hs = h // d2
    heads_local = shape.heads // (d1 * d2)
    up = shape.ffn_matrices - 1
    layout = kv_placement(shape, d1, d2)
    rot = 2 if shape.position == "rotary" else 0

    def tk(op: str, phase: str, share: Fraction = Fraction(1), nth: int = 0) -> Optional[Coll]:
        return terms.take(op, phase, T, share=share, nth=nth, count=count)
    pieces: List[Tuple[List[Item], List[Item]]] = []

    def norm() -> None:
        g, gb = tk("norm", "fwd", Fraction(1, 2)), tk("norm", "bwd", Fraction(1, 2))
        if shape.norm_layout == "stats":  # sums over the split hidden all-reduced, then normalized
            pieces.append(([_k(NORM_FWD, T * hs), *_c("sync", g)], [_k(NORM_BWD, T * hs), *_c("sync", gb)]))
        else:  # gathered: the model's own norm on the whole hidden, sliced back
            pieces.append(([*_c("sync", g), _k(NORM_FWD, T * h), _k(POINTWISE, T * hs)],
                           [*_c("sync", gb), _k(NORM_BWD, T * h), _k(POINTWISE, T * hs)]))
    norm()
    qg = q + shape.gate_width  # an output gate's columns: with q's
    widths = [qg + 2 * kv] if shape.qkv_fused else [qg, kv, kv]
    pieces.append(([x for w in widths for x in (_k(GEMM, T, hs, w // d1),
                                                *_c("sync", tk("f1", "fwd", Fraction(w, qg + 2 * kv))),
                                                _k(POINTWISE, T * w // d1))],
                   _fan_in_bwd(T, hs, [w // d1 for w in widths], tk("f1", "bwd"))))
    # the calls as parallel/attention.py's HeadSharding.localize sends them: a multi-head core
    # scatters q, k and v in one call (one gather of their gradients), grouped-query heads each
    # of q, k and v in its own; keys and values each gathered, and their gradients each summed
    # over an axis, in a call of their own (a separate k and v projection: two calls a term)
    kv_each = Fraction(1) if shape.qkv_fused else Fraction(1, 2)
    kv_calls = 1 if shape.qkv_fused else 2
    kvf = [tk("kv", "fwd", kv_each) for _ in range(kv_calls)] if layout == KV_GATHERED else []
    kv_pick = ([tk("pick", "bwd", Fraction(1, 2), nth=i) for i in (1, 0) for _ in range(2)]
               if layout in (KV_PICK, KV_GATHERED) else [])
    scq, gaf = tk("scatter", "bwd"), tk("gather", "fwd")
    scatter: List[Optional[Coll]] = [scq]
    if layout == KV_SCATTER and shape.kv_heads == shape.heads:
        scatter = [one_call(scq, tk("scatter", "bwd", nth=1))]
    elif layout == KV_SCATTER:
        scatter = [tk("scatter", "bwd", Fraction(1, 2), nth=1) for _ in range(2)] + [scq]
    pieces.append(([*([_k(POINTWISE, T * (q + kv) // d1)] * rot), *[x for c in kvf for x in _c("sync", c)],
                    _k(ATTN_FWD, batch, heads_local, s, hd), *_c("sync", gaf)],
                   [_k(ATTN_BWD, batch, heads_local, s, hd), *[x for c in kv_pick for x in _c("sync", c)],
                    *[x for c in scatter for x in _c("sync", c)], *([_k(POINTWISE, T * (q + kv) // d1)] * rot)]))
    f2f, f2b = tk("f2", "fwd"), tk("f2", "bwd")
    pieces.append(([_k(GEMM, T, q // d1, hs), *_c("sync", f2f), _k(POINTWISE, T * hs)],
                   [*_linear_bwd(T, q // d1, hs, f2b), _k(POINTWISE, T * hs)]))
    norm()
    pieces.append(([x for _ in range(up) for x in (_k(GEMM, T, hs, f // d1),
                                                   *_c("sync", tk("f3", "fwd", Fraction(1, up))))],
                   _fan_in_bwd(T, hs, [f // d1] * up, tk("f3", "bwd"))))
    # the activation (``act_kernels``: its kernels as its code runs them) and, gated, the gate's product
    act_fwd, act_bwd = shape.act_kernels
    pieces.append(([_k(POINTWISE, T * f // d1)] * (up - 1 + act_fwd),
                   [_k(POINTWISE, T * f // d1)] * (up - 1 + act_bwd)))
    f4f, f4b = tk("f4", "fwd"), tk("f4", "bwd")
    pieces.append(([_k(GEMM, T, f // d1, hs), *_c("sync", f4f), _k(POINTWISE, T * hs)],
                   [*_linear_bwd(T, f // d1, hs, f4b), _k(POINTWISE, T * hs)]))
    fw = [x for a, _ in pieces for x in a]
    bw = [x for _, b in reversed(pieces) for x in b]
    return fw, bw


def _program(shape: ModelShape, mesh: Mesh, tokens: int, batch: int, chunks: int, terms: Terms) -> Program:
    """One rank's step of ``shape`` laid out by its style plan (the runtime's one layout for
    every family): each block's forward as ``chunks`` wavefront chunks cut at their
    collectives (§4.1), the backward with §4.2's overlap; embeddings before, the final norm,
    head and loss after."""
    d1, d2 = mesh
    h, V = shape.hidden, shape.vocab_size
    T, hs = tokens, h // d2
    L = shape.layers
    # every block is the same program (nothing in a block depends on its index): built once,
    # the one object listed L times (:func:`~atp_pipeline.planning.steptime.simulate` runs the
    # repeats as such), its shares counted for all L blocks
    per_chunk = [_layer(shape, mesh, T // chunks, batch // chunks, terms, Fraction(1, chunks))
                 for _ in range(chunks)]
    fwd, bwd = [fw for fw, _ in per_chunk], [bw for _, bw in per_chunk]
    blocks_fwd, blocks_bwd = [fwd] * L, [bwd] * L
    one = Fraction(1)

    def tm(op: str, phase: str, nth: int = 0) -> Optional[Coll]:
        return terms.take(op, phase, T, nth=nth, count=one)
    post_fwd: List[Item] = []
    post_bwd_norm: List[Item] = []
    if shape.final_norm:
        g, gb = tm("norm_f", "fwd"), tm("norm_f", "bwd")
        if shape.norm_layout == "stats":
            post_fwd += [_k(NORM_FWD, T * hs), *_c("sync", g)]
            post_bwd_norm = [_k(NORM_BWD, T * hs), *_c("sync", gb)]
        else:
            post_fwd += [*_c("sync", g), _k(NORM_FWD, T * h), _k(POINTWISE, T * hs)]
            post_bwd_norm = [*_c("sync", gb), _k(NORM_BWD, T * h), _k(POINTWISE, T * hs)]
    if shape.head_layout == "tied":
        post_fwd += [_k(GEMM, T, hs, V), *_c("sync", tm("head", "fwd"))]
        head_bwd = [_k(GEMM, T, V, hs), _k(GEMM, V, T, hs)]
        loss_fwd, loss_bwd = [_k(LOSS_FWD, T, V)], [_k(LOSS_BWD, T, V)]
    elif shape.head_layout == "gathered":
        Vl = V // d1
        post_fwd += [_k(GEMM, T, hs, Vl), *_c("sync", tm("head", "fwd", 0)), *_c("sync", tm("head", "fwd", 1))]
        head_bwd = [_k(POINTWISE, T * Vl), *_linear_bwd(T, hs, Vl, tm("head", "bwd"))]
        loss_fwd, loss_bwd = [_k(LOSS_FWD, T, V)], [_k(LOSS_BWD, T, V)]  # the model's own loss
    elif shape.head_layout == "vocab_split":  # logits [T/d2, V/d1] (parallel.vocab), the loss on the blocks
        Vl, Tl = V // d1, -(-T // d2)
        post_fwd += [_k(GEMM, T, hs, Vl), *_c("sync", tm("head", "fwd"))]
        gathered = tm("head", "bwd", 0) if d2 > 1 else None  # the logit gradients over d2 (none on d2 = 1)
        head_bwd = [*_c("sync", gathered), *_linear_bwd(T, hs, Vl, tm("head", "bwd", 1 if d2 > 1 else 0))]
        loss_fwd = [_k(POINTWISE, Tl * Vl), *_c("sync", tm("loss", "fwd", 0)), _k(POINTWISE, Tl * Vl),
                    _k(POINTWISE, Tl * Vl), _k(POINTWISE, Tl * Vl), *_c("sync", tm("loss", "fwd", 1)),
                    *_c("sync", tm("loss", "fwd", 2))]
        loss_bwd = [_k(POINTWISE, Tl * Vl)] * 3
    elif shape.head_layout == "whole":  # run whole on the hidden gathered over d2, the model's own loss
        post_fwd += [*_c("sync", tm("head", "fwd")), _k(GEMM, T, h, V)]
        head_bwd = [_k(GEMM, T, V, h), _k(GEMM, V, T, h)]
        loss_fwd, loss_bwd = [_k(LOSS_FWD, T, V)], [_k(LOSS_BWD, T, V)]
    else:  # vocab_parallel: max and sums of the split logits over d1
        Vl = V // d1
        post_fwd += [_k(GEMM, T, hs, Vl), *_c("sync", tm("head", "fwd"))]
        head_bwd = _linear_bwd(T, hs, Vl, tm("head", "bwd"))
        loss_fwd = [_k(POINTWISE, T * Vl), *_c("sync", tm("loss", "fwd", 0)), _k(POINTWISE, T * Vl),
                    _k(POINTWISE, T * Vl), _k(POINTWISE, T * Vl), *_c("sync", tm("loss", "fwd", 1))]
        loss_bwd = [_k(POINTWISE, T * Vl)] * 3
    post_fwd += loss_fwd
    post_bwd = loss_bwd + head_bwd + post_bwd_norm
    emb = tm("embed", "bwd") if shape.gathered_embeddings else None
    embeds = (2 if shape.position == "learned" else 1)
    pre = [_k(POINTWISE, T * hs)] * (embeds + shape.gathered_embeddings) + _c("sync", tm("embed", "fwd"))
    pre_bwd = [_k(POINTWISE, T * hs)] * embeds + _c("sync", emb)
    return Program(pre, blocks_fwd, blocks_bwd, post_fwd, post_bwd, pre_bwd, [], chunks)


def _block_modules(shape: ModelShape) -> Tuple[int, int]:
    """A block's linear modules (q|k|v fused or three, the output projection, the MLP's) and the
    parameter tensors of one of its norms (a LayerNorm's weight and bias, an RMSNorm's weight)."""
    return (1 if shape.qkv_fused else 3) + 1 + shape.ffn_matrices, 2 if shape.norm == "layernorm" else 1


def optimizer_kernel(shape: ModelShape, mesh: Mesh) -> Kernel:
    """The optimizer step over this rank's parameter tensors (elements per device of
    :func:`~atp_pipeline.planning.memory.per_device_memory`)."""
    from atp_pipeline.planning.memory import per_device_memory

    params = per_device_memory(shape, mesh).params
    linears, norm_tensors = _block_modules(shape)
    per_layer = linears * (2 if shape.bias else 1) + 2 * norm_tensors
    tensors = (shape.layers * per_layer + 1 + (1 if shape.position == "learned" else 0)
               + (norm_tensors if shape.final_norm else 0) + (0 if shape.tied_embeddings else 1))
    return Kernel(OPTIMIZER, (tensors, int(params)))


def param_reads(shape: ModelShape, chunks: int) -> int:
    """The sharded parameters one step reads (each a DTensor ``to_local`` in the forward and its
    backward): in every block and chunk, each linear's weight (and bias) and, with the norm
    statistics split over d2 (``norm_layout="stats"``), the norms' parameters; once a step the
    token (and learned position) embedding, the final statistics norm and the head (its own
    weight, or the tied table read again). Modules run whole keep plain parameters (gathered
    norms, ``gathered_embeddings``, a ``whole`` head). What the runtime reads, at 1 and 2 chunks,
    for layouts with and without biases, with statistics and with gathered norms, with an own
    and with a tied head."""
    linears, norm_tensors = _block_modules(shape)
    stats = shape.norm_layout == "stats"
    per_layer = linears * (2 if shape.bias else 1) + (2 * norm_tensors if stats else 0)
    once = (1 + (1 if shape.position == "learned" else 0) + (norm_tensors if stats and shape.final_norm else 0)
            + (0 if shape.head_layout == "whole" else 1))
    return shape.layers * chunks * per_layer + once


def build_program(shape: ModelShape, mesh: Mesh, batch: int, chunks: int,
                  terms: Optional[Sequence[CommTerm]] = None) -> Tuple[Program, Terms]:
    """One rank's program for ``batch`` sequences on ``mesh`` in ``chunks`` pieces, its
    collectives placed from the runtime cost model's terms (all of them, exactly once)."""
    if terms is None:
        terms = comm_terms(CostModel.runtime, shape, mesh)
    t = Terms(terms)
    tokens = batch * shape.seq_len
    if batch % chunks:
        raise ConfigError(f"step model: chunks={chunks} does not divide the local batch {batch}")
    prog = _program(shape, mesh, tokens, batch, chunks, t)
    prog.tail = [("k", optimizer_kernel(shape, mesh))]
    prog.reads = param_reads(shape, chunks)
    t.check_done()
    return prog, t


def placed_elements(prog: Program) -> Dict[Tuple[str, str], int]:
    """Elements per step by ``(collective, "d1"|"d2")`` of the program's collectives (to be
    equal to :func:`~atp_pipeline.planning.cost.predicted_elements` of the same terms)."""
    out: Dict[Tuple[str, str], Fraction] = {}
    for item in all_items(prog):
        if item[0] in ("sync", "async", "linear"):
            c: Coll = item[1]
            key = (c.term.collective, f"d{c.term.dim}")
            out[key] = out.get(key, Fraction(0)) + c.elements
    return {k: int(v) for k, v in out.items()}


def all_items(prog: Program) -> Iterable[Item]:
    yield from prog.pre
    for layer in prog.blocks_fwd:
        for chunk in layer:
            yield from chunk
    yield from prog.post_fwd
    yield from prog.post_bwd
    for layer in prog.blocks_bwd:
        for chunk in layer:
            yield from chunk
    yield from prog.pre_bwd
    yield from prog.tail
