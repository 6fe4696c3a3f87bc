"""An HF attention module on ATP's (d1, d2) mesh (§3.2.1, Figure 6a), its own ``forward`` kept.

:class:`HFAttention` (style ``hf_attention``) replaces the module's q/k/v projections (or
its fused qkv projection) by column-first and its output projection by a row-first
:class:`~atp_pipeline.parallel.linear.ATPLinear` (hidden split over d2 in and out), so the
module's ``forward`` — reshaping by ``-1`` heads or by attributes made per-rank — sees
its d1 block of heads. The attention core is reached through transformers'
``AttentionInterface``: the module gets a copy of its config naming the implementation
``"atp"``, which scatters the heads over d2 and picks the key/value heads of grouped-query
attention (:class:`~atp_pipeline.parallel.attention.HeadSharding`), runs the module's own
implementation (eager, sdpa, ...) on the local heads and gathers the output back over d2.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.attention import HeadSharding
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.fsdp import GRAD_SUM
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear, linear_kinds
from atp_pipeline.parallel.mappings import gather_dim0, scatter_dim0
from atp_pipeline.parallel.rng import LOCAL, region
from atp_pipeline.parallel.styles import ParallelStyle, StyleContext

IMPLEMENTATION = "atp"


class _View:
    """The attention module as the core sees it: another key/value group size, its per-head
    parameters (attention sinks) cut to this rank's heads."""

    def __init__(self, module: nn.Module, **overrides: Any) -> None:
        self.__dict__.update(overrides)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner(module: nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(module.atp_inner_attention, eager)


def atp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Tuple[torch.Tensor, Any]:
    """transformers' attention-function signature: ``query`` ``[b, heads/d1, s, hd]`` ->
    output ``[b, s, heads/d1, hd]`` (the module's own implementation on this rank's heads)."""
    heads: HeadSharding = module.atp_heads
    if key.shape[1] != heads.kv_heads and getattr(module, "atp_whole", False):  # keys of another count
        heads = HeadSharding(heads.comm, heads.heads, key.shape[1])  # (multi-query, or expanded to every head)
    whole = query.shape[1] == heads.heads and heads.comm.size("d1") > 1  # q/k/v gathered (style whole=true)
    if whole:  # this rank's d1 block of heads, as a column-first projection would have given
        query = _d1_block(query, heads)
        if not heads.kv_gathered:
            key, value = _d1_block(key, heads), _d1_block(value, heads)
    q, k, v, groups = heads.localize(query, key, value)
    overrides: Dict[str, Any] = {} if groups is None else {"num_key_value_groups": groups}
    for name in getattr(module, "atp_head_params", ()):  # this rank's heads of a per-head parameter
        whole_param = getattr(module, name)
        overrides[name] = whole_param[heads.q_first:heads.q_first + heads.local_heads]
        kwargs = {k_: overrides[name] if v_ is whole_param else v_ for k_, v_ in kwargs.items()}  # (s_aux=sinks)
    target = _View(module, **overrides) if overrides else module
    with region(LOCAL):  # attention dropout: this rank's own heads draw their own masks
        out, weights = _inner(module)(target, q, k, v, attention_mask, **kwargs)
    out = heads.gather(out, 2)
    if whole:
        out = gather_dim0(out.movedim(2, 0).contiguous(), heads.comm, "d1").movedim(0, 2)
    return out.contiguous(), weights  # as transformers' own implementations return it (a caller may view it)


def _d1_block(t: torch.Tensor, heads: HeadSharding) -> torch.Tensor:
    """``t`` ``[b, all heads, s, hd]`` -> this rank's d1 block of heads (gradient: all-gathered)."""
    return scatter_dim0(t.transpose(0, 1).contiguous(), heads.comm, "d1").transpose(0, 1)


def _sum_grads(module: nn.Module, comm: Any, axis: str) -> None:
    """Keep ``module``'s parameters whole on every rank and sum their gradients over ``axis``
    (a per-head q/k norm whose heads are split over ``axis``: transformers'
    ``replicated_with_grad_allreduce``), through the counted Comm."""
    for p in module.parameters():
        p.register_hook(lambda g: _all_reduced(g, comm, axis))
    setattr(module, GRAD_SUM, axis)  # FSDP refuses it (its re-created parameters would lose the hooks)


def _all_reduced(g: torch.Tensor, comm: Any, axis: str) -> torch.Tensor:
    g = g.clone()
    comm.all_reduce(g, axis)
    return g


class _BiasSlice:
    """A forward pre-hook giving an attention module this rank's d1 block of the position
    biases it is passed for all heads (ALiBi)."""

    def __init__(self, names: Tuple[str, ...], heads: int, rank: int, d1: int) -> None:
        block = heads // d1
        self.names, self.heads, self.index = names, heads, torch.arange(rank * block, (rank + 1) * block)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        from atp_pipeline.models.hf.probe import slice_heads

        return args, {k: slice_heads(v, self.heads, self.index) if k in self.names and v is not None else v
                      for k, v in kwargs.items()}


class HFScalars(ParallelStyle):
    """A module with scalar parameters applied elementwise to activations split over ``axis``
    (an activation with learned scalars between a column-first and a row-first linear, e.g.
    xIELU): it runs on this rank's block as it is, its parameters whole on every rank, their
    gradients (each rank's block's share) summed over ``axis``."""

    name = "hf_scalars"

    def __init__(self, axis: str = "d1") -> None:
        if axis not in ("d1", "d2"):
            raise ConfigError(f"style '{self.name}': axis={axis!r} must be d1 or d2")
        self.axis = axis

    def options(self) -> Dict[str, str]:
        return {"axis": self.axis}

    def check(self, fqn: str, module: nn.Module) -> None:
        if any(p.numel() != 1 for p in module.parameters()):
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}): style '{self.name}' takes a module "
                              f"whose parameters are scalars")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        comm = comm_for(ctx.mesh)
        if comm.size(self.axis) > 1:
            _sum_grads(module, comm, self.axis)
        return module


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, atp_attention)


FUSED = ("concat", "heads")


class HFAttention(ParallelStyle):
    """A transformers attention module on the (d1, d2) mesh; activations in and out split by
    hidden over d2. Options name its projections: separate ``q``/``k``/``v`` (defaults
    ``q_proj``/``k_proj``/``v_proj``) or one fused ``qkv`` whose output is the queries, keys
    and values either concatenated (``fused=concat``, GPT-2's ``c_attn``) or interleaved
    per head (``fused=heads``, GPT-NeoX's ``query_key_value``), and the output ``o``.
    ``per_rank`` names module attributes counting the whole layer's heads or features that
    the module's ``forward`` reshapes by (OPT's ``num_heads``, GPT-2's ``split_size``): they
    become this rank's (divided by d1), so the family's own ``forward`` runs unchanged."""

    name = "hf_attention"

    def __init__(self, q: str = "q_proj", k: str = "k_proj", v: str = "v_proj", o: str = "o_proj",
                 qkv: str = "", fused: str = "concat", per_rank: str = "", whole: str = "false", heads: str = "0",
                 kv: str = "0", head_dim: str = "0", biases: str = "", head_params: str = "",
                 extra: str = "") -> None:
        if fused not in FUSED:
            raise ConfigError(f"style 'hf_attention': fused={fused!r} must be one of {', '.join(FUSED)}")
        if str(whole).lower() not in ("true", "false"):
            raise ConfigError(f"style 'hf_attention': whole={whole!r} must be true or false")
        self.q, self.k, self.v, self.o, self.qkv, self.fused = q, k, v, o, qkv, fused
        self.per_rank = tuple(a for a in per_rank.split("+") if a)
        self.whole = str(whole).lower() == "true"
        # head counts of a module without a transformers config (its own core runs on this
        # rank's d1 heads, replicated over d2)
        self.heads, self.kv, self.head_dim = int(heads), int(kv) or int(heads), int(head_dim)
        # keyword inputs holding position biases for all heads (ALiBi): sliced to this rank's d1 block
        self.biases = tuple(a for a in biases.split("+") if a)
        # the module's own parameters holding one value per query head, read by the core only
        # (attention sinks): whole on every rank, the core given its heads', gradients summed
        self.head_params = tuple(a for a in head_params.split("+") if a)
        # other projections of the hidden state per head (a gate of the output): split like the queries
        self.extra = tuple(a for a in extra.split("+") if a)

    def options(self) -> Dict[str, str]:
        opts = {"qkv": self.qkv, "fused": self.fused} if self.qkv else \
            {k: v for k, v in (("q", self.q), ("k", self.k), ("v", self.v)) if v != f"{k}_proj"}
        if self.o != "o_proj":
            opts["o"] = self.o
        if self.per_rank:
            opts["per_rank"] = "+".join(self.per_rank)
        if self.whole:
            opts["whole"] = "true"
        if self.heads:
            opts.update(heads=str(self.heads), kv=str(self.kv), head_dim=str(self.head_dim))
        if self.biases:
            opts["biases"] = "+".join(self.biases)
        if self.head_params:
            opts["head_params"] = "+".join(self.head_params)
        if self.extra:
            opts["extra"] = "+".join(self.extra)
        return opts

    def projections(self) -> Tuple[str, ...]:
        return ((self.qkv,) if self.qkv else (self.q, self.k, self.v)) + self.extra + (self.o,)

    def check(self, fqn: str, module: nn.Module) -> None:
        for p in self.projections():
            sub = getattr(module, p, None)
            if type(sub) not in linear_kinds():
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no linear '{p}' "
                                  f"(style '{self.describe()}')")
        if not hasattr(module, "config") and not self.heads:
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no transformers config; "
                              f"give its head counts (style '{self.name}(..., heads=, kv=, head_dim=)')")
        heads = self._counts(module)[0]
        for a in self.head_params:
            p = getattr(module, a, None)
            if not isinstance(p, nn.Parameter) or tuple(p.shape) != (heads,):
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no parameter '{a}' of one "
                                  f"value per head ({heads}) (style '{self.describe()}', head_params)")
        for a in self.per_rank:
            if not isinstance(getattr(module, a, None), int):
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no integer attribute "
                                  f"'{a}' (style '{self.describe()}', per_rank)")
        self._per_head(fqn, module)

    def _per_head(self, fqn: str, module: nn.Module) -> List[nn.Module]:
        """The attention's modules with parameters besides its projections: per-head ones (q/k
        norms: every parameter one ``head_dim`` vector) are kept whole, their gradients summed
        over d1; one spanning all heads needs whole q/k/v (``whole=true``); anything else is
        refused in one line."""
        hd = self._counts(module)[2]
        out = []
        for name, sub in module.named_children():
            params = list(sub.parameters())
            if name in self.projections() or not params:
                continue
            sizes = {p.numel() for p in params}
            if all(p.dim() == 1 for p in params) and (sizes == {hd} or self.whole):
                out.append(sub)
                continue
            raise ConfigError(f"parallel plan: '{fqn}.{name}' ({type(sub).__name__}) holds parameters of sizes "
                              f"{sorted(sizes)} inside the attention, neither per head ({hd}) nor under whole q/k/v; "
                              f"style '{self.describe()}' cannot place it")
        return out

    def _counts(self, module: nn.Module) -> Tuple[int, int, int]:
        """(query heads, key/value heads, head dim): the options', else the module's config's."""
        if self.heads:
            return self.heads, self.kv, self.head_dim
        cfg = module.config
        heads = int(cfg.num_attention_heads)
        return heads, int(getattr(cfg, "num_key_value_heads", None) or heads), \
            int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        _register()
        cfg = getattr(module, "config", None)
        heads, kv, _ = self._counts(module)
        sharding = HeadSharding(comm_for(ctx.mesh), heads, kv)
        per_head = self._per_head(fqn, module)
        if self.whole:
            # the family's code reads whole q/k/v (a norm over all heads, fixed offsets into a
            # fused q|k|v): the projections gather their output over d1, the core takes this
            # rank's heads of them (atp_attention), and the output projection its input block
            for p in (self.qkv,) if self.qkv else (self.q, self.k, self.v):
                setattr(module, p, ATPLinear.from_linear(getattr(module, p), ctx.mesh, COLUMN, gather_output=True,
                                                         shared_input=not self.qkv))
            setattr(module, self.o, ATPLinear.from_linear(getattr(module, self.o), ctx.mesh, ROW,
                                                          input_is_parallel=False))
        elif self.qkv:
            setattr(module, self.qkv, ATPLinear.from_linear(getattr(module, self.qkv), ctx.mesh, COLUMN,
                                                            parts=3 if self.fused == "concat" else 1))
        else:
            # q, k and v read the same hidden states: their input gradients are summed, then
            # all-reduced once (mappings.FanIn)
            setattr(module, self.q, ATPLinear.from_linear(getattr(module, self.q), ctx.mesh, COLUMN,
                                                          shared_input=True))
            for p in (self.k, self.v):
                setattr(module, p, ATPLinear.from_linear(getattr(module, p), ctx.mesh, COLUMN,
                                                         gather_output=sharding.kv_gathered, shared_input=True))
        for p in self.extra:  # read the same hidden states as q/k/v, split by heads like q
            setattr(module, p, ATPLinear.from_linear(getattr(module, p), ctx.mesh, COLUMN, gather_output=self.whole,
                                                     shared_input=not self.qkv))
        if not self.whole:
            setattr(module, self.o, ATPLinear.from_linear(getattr(module, self.o), ctx.mesh, ROW))
            if per_head and sharding.kv_gathered:
                raise ConfigError(f"parallel plan: '{fqn}': per-head norms with {kv} key/value heads, fewer than "
                                  f"d1 = {sharding.comm.size('d1')} (the key norm would run on all heads); use a "
                                  f"mesh with d1 <= {kv}")
            for sub in per_head:  # on this rank's d1 block of heads: gradients summed over d1
                if sharding.comm.size("d1") > 1:
                    _sum_grads(sub, sharding.comm, "d1")
        d1 = sharding.comm.size("d1")
        if self.biases and not self.whole and d1 > 1:
            module.register_forward_pre_hook(_BiasSlice(self.biases, heads, sharding.comm.rank("d1"), d1),
                                             with_kwargs=True)
        for a in self.per_rank:
            if getattr(module, a) == kv and sharding.kv_gathered:
                continue  # every rank holds all key/value heads
            setattr(module, a, getattr(module, a) // d1)
        module.atp_heads = sharding
        module.atp_whole = self.whole
        module.atp_head_params = self.head_params
        for a in self.head_params:  # each rank's core fills its heads' gradient: summed over the mesh
            for axis in ("d1", "d2"):
                if sharding.comm.size(axis) > 1:
                    getattr(module, a).register_hook(lambda g, axis=axis: _all_reduced(g, sharding.comm, axis))
            setattr(module, GRAD_SUM, "d1 and d2")
        if cfg is not None:  # the core through transformers' AttentionInterface: this rank's heads over d2
            module.atp_inner_attention = cfg._attn_implementation or "eager"
            module.config = copy.copy(cfg)
            module.config._attn_implementation_internal = IMPLEMENTATION
        return module


class HFLatentAttention(ParallelStyle):
    """A transformers multi-head latent attention (:mod:`atp_pipeline.models.hf.mla`) on the
    (d1, d2) mesh; activations in and out split by hidden over d2. ``latent``: the projections
    of the hidden into low-rank latents, run whole on the hidden gathered over d2 (their norms,
    on the whole latents, untouched); ``q`` and ``kv``: the per-head projections, column-first
    (``q`` reading the hidden unless ``q_latent``; a latent input sliced over d2); ``shared``:
    the latent projection whose trailing ``shared_width`` features every head reads (their
    gradient summed over d1); ``o`` row-first; the core on this rank's heads over d2."""

    name = "hf_mla"

    def __init__(self, q: str = "q_b_proj", kv: str = "kv_b_proj", o: str = "o_proj", latent: str = "",
                 shared: str = "", shared_width: str = "0", q_latent: str = "true", heads: str = "0") -> None:
        if str(q_latent).lower() not in ("true", "false"):
            raise ConfigError(f"style 'hf_mla': q_latent={q_latent!r} must be true or false")
        self.q, self.kv, self.o, self.shared = q, kv, o, shared
        self.latent = tuple(a for a in latent.split("+") if a)
        self.shared_width, self.heads = int(shared_width), int(heads)
        self.q_latent = str(q_latent).lower() == "true"

    def options(self) -> Dict[str, str]:
        return {"q": self.q, "kv": self.kv, "o": self.o, "latent": "+".join(self.latent), "shared": self.shared,
                "shared_width": str(self.shared_width), "q_latent": str(self.q_latent).lower(),
                "heads": str(self.heads)}

    def check(self, fqn: str, module: nn.Module) -> None:
        for p in (self.q, self.kv, self.o, *self.latent):
            if type(getattr(module, p, None)) not in linear_kinds():
                raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) has no linear '{p}' "
                                  f"(style '{self.describe()}')")
        if not hasattr(module, "config") or self.heads < 1 or (self.shared and self.shared not in self.latent):
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}): style '{self.describe()}' needs a "
                              f"transformers attention, its head count and a shared projection among the latent ones")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        from atp_pipeline.models.hf.mla import SumTail
        from atp_pipeline.parallel.layers import FULL, SPLIT, run_gathered

        _register()
        comm = comm_for(ctx.mesh)
        for p in self.latent:  # the latents: whole, from the hidden gathered over d2
            run_gathered(getattr(module, p), ctx.mesh, SPLIT, FULL)
        setattr(module, self.q, ATPLinear.from_linear(getattr(module, self.q), ctx.mesh, COLUMN,
                                                      input_is_parallel=not self.q_latent))
        setattr(module, self.kv, ATPLinear.from_linear(getattr(module, self.kv), ctx.mesh, COLUMN,
                                                       input_is_parallel=False))
        setattr(module, self.o, ATPLinear.from_linear(getattr(module, self.o), ctx.mesh, ROW))
        if self.shared and self.shared_width and comm.size("d1") > 1:
            width = self.shared_width
            getattr(module, self.shared).register_forward_hook(
                lambda m, a, out: SumTail.apply(out, comm, "d1", width))
        module.atp_heads = HeadSharding(comm, self.heads, self.heads)  # every head expanded: keys per query head
        module.atp_whole = False
        module.atp_head_params = ()
        module.atp_inner_attention = module.config._attn_implementation or "eager"
        module.config = copy.copy(module.config)
        module.config._attn_implementation_internal = IMPLEMENTATION
        return module
