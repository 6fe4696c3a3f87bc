"""What the planners read of a model: its shape and the step it runs (the model seam's data).

A :class:`ModelShape` is produced by a model family's adapter
(:mod:`atp_pipeline.models.adapter`) from a module or from a model config, and read by
every planner and estimate: ATP's mesh search and its cost models (Eq. 2-4), the memory
estimate, the FLOPs of §5 (Megatron-LM's formula) and the SBP layer chain (AutoDDL §4.5).
Nothing here knows a model family: a decoder-only transformer is described by numbers.

FLOPs per layer and step, forward only, for hidden ``h``, ``a`` query heads of ``d``
features, ``k`` key/value heads, FFN width ``f`` (gated: three FFN matrices) and ``b·s``
tokens: ``2·b·s·W + 4·b·s²·a·d`` with ``W`` the layer's matrix weights; training counts
forward + backward (``×3``, no recomputation, as ATP §5 does). For the GPT of Table 2
(``a·d = h``, ``k = a``, ``f = 4h``) this is ``72·b·s·h² + 12·b·s²·h``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Tuple

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary", "none")
# How the style plan places the parts that differ between layouts (the linears, heads and
# embeddings are placed alike for every model): a norm's ``norm_layout`` is "stats" (style
# ``layernorm``: its sums all-reduced over d2) or "gathered" (style ``gathered``: the model's
# own norm on the hidden gathered over d2); the LM head's ``head_layout`` is
# "vocab_parallel" (column-first, logits split over d1, vocabulary-parallel loss),
# "gathered" (column-first, logits gathered over d1 for the model's own loss), "tied"
# (sharing the embedding's table, partial logits all-reduced over d2) or "vocab_split" (logits
# split over d1 by vocabulary and over d2 by token, vocabulary-parallel loss; tied or not — tied,
# the embedding's table is split by vocabulary over d1 too: parallel/vocab.py).
NORM_LAYOUTS = ("stats", "gathered")
HEAD_LAYOUTS = ("vocab_parallel", "gathered", "tied", "vocab_split", "whole")
KV_SCATTER, KV_PICK, KV_GATHERED = "scatter", "pick", "gathered"
TFLOP_TABLE2 = 2**40  # Table 2 quotes "TFLOPs" in units of 2^40 FLOPs


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts layers of a model, as numbers (their layout: every expert
    tensor-parallel like an MLP, the router and the block's other unsplit modules run whole on
    the gathered hidden; :mod:`atp_pipeline.models.hf.experts`)."""

    experts: int
    top_k: int
    layers: int  # layers whose MLP is routed (the model's others have its dense MLP)
    ffn: int  # an expert's intermediate width
    gated: bool = True
    shared_ffn: int = 0  # a shared expert laid out column-/row-first (0: none, or run whole)
    gathered: int = 1  # modules run whole on the gathered hidden per layer (the router, ...)
    split_outputs: int = 0  # of those, outputs split again over d2
    partial_width: int = 0  # of those, output widths whose gradient is summed over d2

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2

    def weights(self, hidden: int, shared_matrices: int, active: bool) -> int:
        """Matrix weights of one routed layer's MLP: every expert's (``active``: the ``top_k`` a
        token runs), a shared expert's and the router's."""
        n = self.top_k if active else self.experts
        return hidden * (n * self.matrices * self.ffn + shared_matrices * self.shared_ffn + self.experts)


@dataclass(frozen=True)
class LatentShape:
    """A multi-head latent attention, as numbers (its layout: the low-rank projections of the
    hidden run whole on the hidden gathered over d2, the per-head projections of the latents
    column-first, the features every head shares summed over d1 in backward)."""

    q_latent: int  # the queries' latent width (0: queries projected from the hidden, column-first)
    kv_latent: int  # the keys'/values' latent width (what the per-head expansion reads)
    shared: int  # features of the key/value latent projection every head reads (the rotary key)
    qk_head_dim: int  # query/key features a head
    v_head_dim: int  # value features a head
    projections: int = 2  # projections of the hidden run whole (the latents')

    def weights(self, hidden: int, heads: int) -> int:
        """Matrix weights of the attention: the projections of the hidden into the latents (and
        the shared features), the per-head expansions, the output projection."""
        q, kv = heads * self.qk_head_dim, heads * (self.qk_head_dim - self.shared + self.v_head_dim)
        queries = self.q_latent * (hidden + q) if self.q_latent else hidden * q
        return (queries + hidden * (self.kv_latent + self.shared) + self.kv_latent * kv
                + heads * self.v_head_dim * hidden)

    def whole_weights(self, hidden: int) -> int:
        """Of :meth:`weights`, the projections of the hidden into the latents: run whole, on
        every rank."""
        return hidden * (self.q_latent + self.kv_latent + self.shared)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as numbers, plus the step (batch, dtype) it is planned for."""

    name: str
    hidden: int
    heads: int
    layers: int
    seq_len: int
    vocab_size: int
    ffn: int  # FFN (intermediate) width
    kv_heads: int = 0  # 0: as many as ``heads`` (multi-head attention)
    head_dim: int = 0  # 0: hidden // heads
    gated: bool = False  # SwiGLU-style MLP (gate, up, down)
    norm: str = "layernorm"
    bias: bool = True
    position: str = "learned"
    tied_embeddings: bool = False
    batch_size: int = 1
    dtype: str = "fp32"
    qkv_fused: bool = True  # one q|k|v projection (one input-gradient all-reduce, not three)
    norm_layout: str = "stats"
    head_layout: str = ""  # "" -> "tied" if tied_embeddings else "vocab_parallel"
    final_norm: bool = True  # a norm after the last layer
    gathered_embeddings: int = 0  # embeddings run whole and sliced over d2 (e.g. OPT's positions)
    attention_layout: str = "split"  # "whole": the family's code reads whole q/k/v (gathered over d1)
    head_norm_params: int = 0  # per layer: parameters of per-head q/k norms (gradients summed over d1)
    gate_width: int = 0  # per layer: columns of per-head output gates beside q (fused with q or their own)
    moe: Optional[MoEShape] = None  # routed MLPs (mixture of experts) on ``moe.layers`` of the layers
    latent: Optional[LatentShape] = None  # a multi-head latent attention in every layer (else q/k/v)
    layer_norms: int = 2  # norms a layer outside its attention (before attention and MLP; 4: outputs normed too)
    extra_norms: int = 0  # norms outside the layers besides the final one (an embedding's; one called again)
    shared_mlp_input: bool = False  # the MLP reads the attention's input (a parallel block): one d1 input gradient
    heads_over_d2: bool = True  # False: the core runs on the d1 block of heads, replicated over d2
    mlp_layout: str = "split"  # "whole": the MLP's intermediate gathered over d1 (a norm over all of it)
    sink_params: int = 0  # per layer: per-head parameters read by the core (gradients summed over d1 and d2)
    scalar_params: int = 0  # per layer: an activation's learned scalars (gradients summed over d1)
    unmodelled: str = ""  # what the layout sends that the runtime cost model does not count ("": nothing)
    # modules run whole (replicated) on the hidden gathered over d2, their output sliced back: a
    # block's mixer the layout cannot split (and a head's transform); counted over the whole model
    whole_modules: int = 0  # per-token outputs they slice (each: its gradient gathered over d2)
    whole_inputs: int = 0  # hidden-state inputs they gather over d2 (forward), all instances
    whole_vectors: int = 0  # outputs of one hidden vector they slice (a bias the block adds; gradient gathered)
    whole_params: int = 0  # their parameters (whole on every rank; their FLOPs on every rank)
    whole_note: str = ""  # which modules run whole, in words (the plan's note)
    attention_layers: int = -1  # layers whose attention is split (-1: every layer)
    mlp_layers: int = -1  # layers with a split dense MLP (-1: every layer not routed)
    # the MLP's activation as its code runs: elementwise kernels forward, backward (a composite
    # activation, e.g. a tanh GELU written in Python, takes 8 kernels and 11 where a fused one takes 1 and 1)
    act_kernels: Tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        optional = {"heads": self.attention_layers == 0, "ffn": self.mlp_layers == 0}  # none split
        for key in ("hidden", "heads", "layers", "seq_len", "vocab_size", "ffn", "batch_size"):
            if getattr(self, key) < 1 and not (optional.get(key) and getattr(self, key) == 0):
                raise ValueError(f"model '{self.name}': {key} must be >= 1, got {getattr(self, key)}")
        object.__setattr__(self, "act_kernels", tuple(int(k) for k in self.act_kernels))  # (a list read back)
        if len(self.act_kernels) != 2 or min(self.act_kernels) < 0:
            raise ValueError(f"model '{self.name}': act_kernels must be two counts >= 0 (forward, backward), "
                             f"got {list(self.act_kernels)}")
        if isinstance(self.moe, dict):  # read back from to_dict()
            object.__setattr__(self, "moe", MoEShape(**self.moe))
        if isinstance(self.latent, dict):
            object.__setattr__(self, "latent", LatentShape(**self.latent))
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.head_dim and self.heads:
            if self.hidden % self.heads:
                raise ValueError(f"model '{self.name}': hidden {self.hidden} is not divisible by heads {self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.norm not in NORMS:
            raise ValueError(f"model '{self.name}': norm must be one of {NORMS}, got {self.norm!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"model '{self.name}': position must be one of {POSITIONS}, got {self.position!r}")
        if not self.head_layout:
            object.__setattr__(self, "head_layout", "tied" if self.tied_embeddings else "vocab_parallel")
        if self.attention_layout not in ("split", "whole"):
            raise ValueError(f"model '{self.name}': attention_layout must be split or whole, "
                             f"got {self.attention_layout!r}")
        if self.mlp_layout not in ("split", "whole"):
            raise ValueError(f"model '{self.name}': mlp_layout must be split or whole, got {self.mlp_layout!r}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"model '{self.name}': norm_layout must be one of {NORM_LAYOUTS}, "
                             f"got {self.norm_layout!r}")
        if self.head_layout not in HEAD_LAYOUTS or (self.head_layout not in ("vocab_split", "whole")
                                                     and (self.head_layout == "tied") != self.tied_embeddings):
            raise ValueError(f"model '{self.name}': head_layout must be one of {HEAD_LAYOUTS} ('tied' exactly when "
                             f"the embeddings are tied, 'vocab_split' either way), got {self.head_layout!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model '{self.name}': dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @classmethod
    def of(cls, m: Any) -> "ModelShape":
        """From a model config (``ModelConfig`` or its DictConfig): the fields it has."""
        get = (lambda k, d: m.get(k, d)) if hasattr(m, "get") else (lambda k, d: getattr(m, k, d))
        dtype = get("dtype", "fp32")
        return cls(name=str(get("name", "model")), hidden=int(m.hidden), heads=int(m.heads),
                   layers=int(m.layers), seq_len=int(get("seq_len", 2048)),
                   vocab_size=int(get("vocab_size", 50304)),
                   ffn=int(get("ffn", 0) or int(get("ffn_mult", 4)) * int(m.hidden)),
                   kv_heads=int(get("kv_heads", 0) or 0), gated=bool(get("gated", False)),
                   norm=str(getattr(get("norm", "layernorm"), "value", get("norm", "layernorm"))),
                   bias=bool(get("bias", True)), batch_size=int(get("batch_size", 1)),
                   dtype=str(getattr(dtype, "value", dtype)))

    def with_step(self, batch_size: Optional[int] = None, seq_len: Optional[int] = None,
                  dtype: Optional[str] = None) -> "ModelShape":
        return replace(self, batch_size=batch_size or self.batch_size, seq_len=seq_len or self.seq_len,
                       dtype=dtype or self.dtype)

    # ---------------------------------------------------------------- derived sizes
    @property
    def split_attention_layers(self) -> int:
        """Layers whose attention is split (the others' mixer runs whole)."""
        return self.layers if self.attention_layers < 0 else self.attention_layers

    @property
    def dense_mlp_layers(self) -> int:
        """Layers with a split dense MLP (neither routed nor run whole)."""
        if self.mlp_layers >= 0:
            return self.mlp_layers
        return self.layers - (self.moe.layers if self.moe is not None else 0)

    @property
    def ffn_mult(self) -> float:
        """``ffn / hidden`` (an int for the GPTs of Table 2)."""
        q = self.ffn / self.hidden
        return int(q) if q == int(q) else q

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def weights_per_layer(self) -> int:
        """Matrix weights of one layer: q, k, v, o and the MLP's matrices (with experts: the
        average over the layers, every expert counted)."""
        return self._weights(active=False)

    @property
    def split_weights(self) -> int:
        """Matrix weights of the whole model the layout splits over d1*d2: every layer's
        (:attr:`weights_per_layer`) less the attention of layers whose mixer runs whole and the
        dense MLP of layers that neither route nor split it (those modules are in
        :attr:`whole_params`, whole on every rank), and a latent attention's projections of
        the hidden (:attr:`latent_whole_weights`)."""
        routed = self.moe.layers if self.moe is not None else 0
        unsplit_mlps = max(self.layers - routed - self.dense_mlp_layers, 0)
        return (self.layers * self.weights_per_layer
                - (self.layers - self.split_attention_layers) * self.attention_weights
                - unsplit_mlps * self.ffn_matrices * self.hidden * self.ffn - self.latent_whole_weights)

    @property
    def latent_whole_weights(self) -> int:
        """A latent attention's projections of the hidden (run whole, on every rank), over the
        layers that split the attention."""
        return self.split_attention_layers * self.latent.whole_weights(self.hidden) if self.latent else 0

    @property
    def attention_weights(self) -> int:
        """Matrix weights of one layer's attention: q, k, v, o and an output gate (or the latent attention's)."""
        h = self.hidden
        if self.latent is not None:
            return self.latent.weights(h, self.heads)
        return h * (2 * self.q_width + self.gate_width + 2 * self.kv_width)

    def _weights(self, active: bool) -> int:
        h = self.hidden
        attention = self.attention_weights
        dense = self.ffn_matrices * h * self.ffn
        if self.moe is None:
            return attention + dense
        routed = self.moe.weights(h, self.ffn_matrices, active)
        return attention + ((self.layers - self.moe.layers) * dense + self.moe.layers * routed) // self.layers

    @property
    def column_bias_per_layer(self) -> int:
        """Biases of the column-first linears (q, k, v, an output gate, up/gate): split over d1 under ATP."""
        if not self.bias:
            return 0
        return self.q_width + self.gate_width + 2 * self.kv_width + (self.ffn_matrices - 1) * self.ffn

    @property
    def row_bias_per_layer(self) -> int:
        """Biases of the row-first linears (o, down): split over d2 under ATP."""
        return 2 * self.hidden if self.bias else 0

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * (2 if self.norm == "layernorm" else 1) * self.hidden

    @property
    def params_per_layer(self) -> int:
        return (self.weights_per_layer + self.column_bias_per_layer + self.row_bias_per_layer
                + self.norm_params_per_layer)

    @property
    def flops_per_layer(self) -> int:
        b, s = self.batch_size, self.seq_len
        core = 2 * self.q_width if self.latent is None else \
            self.heads * (self.latent.qk_head_dim + self.latent.v_head_dim)  # q.k and attention.v per token pair
        forward = 2 * b * s * self._weights(active=True) + 2 * b * s * s * core  # routed: top_k experts
        return 3 * forward

    @property
    def flops_lm_head(self) -> int:
        return 3 * 2 * self.batch_size * self.seq_len * self.hidden * self.vocab_size

    @property
    def flops_per_step(self) -> int:
        return self.layers * self.flops_per_layer + self.flops_lm_head

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ffn_mult=self.ffn_mult, bytes_per_element=self.bytes_per_element,
                 weights_per_layer=self.weights_per_layer, params_per_layer=self.params_per_layer,
                 flops_per_layer=self.flops_per_layer, flops_lm_head=self.flops_lm_head,
                 flops_per_layer_TFLOPs_2_40=self.flops_per_layer / TFLOP_TABLE2)
        return d


def kv_layout(kv_heads: int, d1: int, d2: int) -> str:
    """How grouped-query attention's key/value heads sit on DeviceMesh(d1, d2) (§3.2.1):
    ``scatter`` — split over d1 and scattered over d2 like the query heads; ``pick`` — split
    over d1, each rank of d2 picks the heads its queries read; ``gathered`` — fewer heads
    than d1: gathered over d1, each rank picks its heads."""
    if kv_heads % (d1 * d2) == 0:
        return KV_SCATTER
    if kv_heads % d1 == 0:
        return KV_PICK
    if d1 % kv_heads == 0:
        return KV_GATHERED
    raise ValueError(f"{kv_heads} key/value heads neither split over nor replicate evenly across d1={d1}")


def kv_placement(shape: ModelShape, d1: int, d2: int) -> str:
    """:func:`kv_layout` of ``shape``'s key/value heads; multi-head attention (as many key/value
    heads as query heads) is always ``scatter``: its heads are placed like the queries, also in
    the cost of a mesh that does not divide them (planned with ``require_divisible=false``)."""
    return KV_SCATTER if shape.kv_heads == shape.heads else kv_layout(shape.kv_heads, d1, d2)


def layout_infeasibility(shape: ModelShape, d1: int, d2: int) -> Optional[str]:
    """Why ATP's layout (§3.2) cannot run ``shape`` on ``DeviceMesh(d1, d2)``, or None.

    Attention heads are column-first over d1 and scattered over d2, so they split over
    ``d1·d2``; activations between blocks split the hidden size over d2; the FFN and the
    attention widths are column-first over d1; the LM head splits the vocabulary over d1
    (a head tied to the embedding does not).
    """
    if shape.heads % (d1 * d2):
        return (f"{shape.heads} heads of model '{shape.name}' do not split over d1*d2 = "
                f"{d1}x{d2} = {d1 * d2} devices")
    if shape.hidden % d2 or shape.hidden % d1 or shape.ffn % d1:
        return (f"hidden {shape.hidden} (FFN {shape.ffn}) of model '{shape.name}' does not split over "
                f"d1={d1} and d2={d2}")
    if shape.moe is not None and shape.moe.ffn % d1:
        return f"experts' intermediate {shape.moe.ffn} of model '{shape.name}' does not split over d1={d1}"
    if shape.kv_heads % d1 and d1 % shape.kv_heads:
        return (f"{shape.kv_heads} key/value heads of model '{shape.name}' neither split over nor "
                f"replicate evenly across d1={d1}")
    if shape.vocab_size % d1 and shape.head_layout != "tied":
        return (f"vocabulary {shape.vocab_size} of model '{shape.name}' is not divisible by d1={d1} "
                "(vocab-parallel head)")
    return None
