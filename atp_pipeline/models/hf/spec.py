"""What an HF model's layout is made of: :class:`Layout` (the plan of styles and what the shape
reads off it) and :class:`AttentionSpec` (how one attention module's projections are named and
laid out, style ``hf_attention``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from atp_pipeline.planning.shape import LatentShape, MoEShape


@dataclass(frozen=True)
class AttentionSpec:
    """How one attention module's projections are named and laid out."""

    q: str = ""
    k: str = ""
    v: str = ""
    o: str = ""
    qkv: str = ""  # one fused projection instead of q/k/v
    fused: str = ""  # its layout: "concat" (q|k|v) or "heads" (per head q, k, v)
    whole: bool = False  # the code around needs whole q/k/v (transformers gathers them)
    per_rank: Tuple[str, ...] = ()  # attributes counting the whole layer's heads, made per-rank
    counts: Tuple[int, int, int] = (0, 0, 0)  # heads, kv heads, head dim: for a module without a config
    biases: Tuple[str, ...] = ()  # keyword inputs holding position biases for all heads (ALiBi): sliced per rank
    head_params: Tuple[str, ...] = ()  # its own parameters of one value per head read by the core (sinks)
    extra: Tuple[str, ...] = ()  # other projections of the hidden, per head (an output gate): split like q

    def style(self) -> str:
        opts: List[str] = []
        if self.qkv:
            opts += [f"qkv={self.qkv}", f"fused={self.fused}"]
        else:
            opts += [f"q={self.q}", f"k={self.k}", f"v={self.v}"]
        opts.append(f"o={self.o}")
        if self.extra:
            opts.append("extra=" + "+".join(self.extra))
        if self.whole:
            opts.append("whole=true")
        if self.per_rank:
            opts.append("per_rank=" + "+".join(self.per_rank))
        if self.counts[0]:
            opts += [f"heads={self.counts[0]}", f"kv={self.counts[1]}", f"head_dim={self.counts[2]}"]
        if self.biases:
            opts.append("biases=" + "+".join(self.biases))
        if self.head_params:
            opts.append("head_params=" + "+".join(self.head_params))
        return f"hf_attention({', '.join(opts)})"


@dataclass
class Layout:
    """A model's plan and what the shape reads off it."""

    plan: Dict[str, str] = field(default_factory=dict)
    ffn: int = 0
    gated: bool = False
    qkv_fused: bool = False
    bias: bool = False
    norm: str = "rmsnorm"
    gathered_embeddings: int = 0
    whole_attention: bool = False  # the attention reads whole q/k/v (style hf_attention whole=true)
    head_norm_params: int = 0  # per layer: per-head q/k norm parameters (gradients summed over d1)
    heads_over_d2: bool = True  # the core's heads scattered over d2 (False: its own core on the d1 heads)
    whole_mlp: bool = False  # the MLP's intermediate gathered over d1 around a module over all of it
    sink_params: int = 0  # per layer: per-head parameters the core reads (gradients summed over d1 and d2)
    scalar_params: int = 0  # per layer: an activation's learned scalars (gradients summed over d1)
    act_kernels: Tuple[int, int] = (1, 1)  # the MLP's activation: kernels forward, backward as its code runs them
    gate_width: int = 0  # per layer: columns of per-head output gates beside q (fused with q or their own)
    moe: Optional[MoEShape] = None  # the routed layers (style hf_experts), if any
    latent: Optional[LatentShape] = None  # a multi-head latent attention (style hf_mla), if any
    source: str = ""  # "declared" or "modules" (where the blocks' linears were read)
    whole: Dict[str, str] = field(default_factory=dict)  # block children run whole (pattern -> what and why)
    whole_head: str = ""  # a module around the LM head run whole, its logits whole (an encoder-style head)
    whole_sent: Tuple[int, int, int, int] = (0, 0, 0, 0)  # whole modules' calls, inputs, outputs, vector outputs
    whole_unmodelled: str = ""  # what of the whole modules' sends the cost model does not count
    outside_norm_calls: int = 0  # calls of the norms outside the blocks beyond one each (shown on a forward)
    parallel_block: bool = False  # the MLP's shared column-first linears read the attention's q/k/v input
    probe_unmodelled: str = ""  # what a forward shows the cost model does not count ("": nothing)
