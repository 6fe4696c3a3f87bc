"""ATP's layout of any transformers causal LM, read from what transformers declares and what
the modules show (§3.2, Figure 6), as a plan of styles.

Sources, in order:

1. **transformers' declaration** — ``base_model_tp_plan`` (transformers' own 1-D tensor
   parallelism): which linears are ``colwise`` and which ``rowwise``, which need the whole
   output (``colwise_gather_output``/``rowwise_split_input``), packed projections, per-head
   norms (``replicated_with_grad_allreduce``). ATP maps each to its 2-D counterpart:
   column-first (output over d1, input over d2) and row-first;
2. **a family entry** (:data:`~atp_pipeline.models.hf.adapter.FAMILIES`) only for families
   that declare nothing and whose modules cannot show their layout (GPT-2's fused
   ``Conv1D`` q|k|v, OPT's per-rank head count);
3. **the modules themselves** — otherwise: in each repeated block, the attention module's
   linears (those reading the hidden state are the q/k/v projections, the one writing it the
   output projection) and the other linears (reading the hidden: column-first; writing it:
   row-first).

Everything else follows from the modules: every norm outside the attention runs whole on
the gathered hidden (style ``gathered``: the family's own norm, bit for bit); per-head norms
inside the attention keep their weights whole, their gradients summed over d1 (the ranks
holding other heads); embeddings split by hidden (one with its own ``forward``, e.g. a
scaled embedding, runs whole and is sliced); the LM head column-first (or tied to the
embedding's split table). The family's own ``forward`` runs throughout.

A multi-head latent attention (low-rank projections of the hidden, then per-head ones) is
read by :mod:`.mla` (style ``hf_mla``). What the layout cannot split inside a repeated block
(undeclared mixture-of-experts layouts, a fused q|k|v or packed projection whose layout nothing
declares, an attention module holding its own parameters, a state-space mixer, a module with
parameters no style reaches) runs whole where a forward shows it reads and returns the hidden
state (:mod:`.whole`: replicated on the gathered hidden, named in ``Layout.whole`` and the
plan's notes); the rest is refused with one line naming it (and, by the adapter, any module
with parameters the plan does not reach).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.fsdp import block_units
from atp_pipeline.parallel.linear import _transposed, as_linear, linear_kinds, register_linear_kind
from atp_pipeline.models.hf import mla
from atp_pipeline.models.op_count import pointwise_kernels
from atp_pipeline.models.hf.whole import derive_with_whole, hidden_io, idle_units, is_unit, token_forward
from atp_pipeline.planning.shape import LatentShape, MoEShape

# transformers' declared styles -> ATP's (column-first / row-first); ``*_gather_output`` /
# ``*_split_input``: the code around reads the whole output
# (``unit_colwise``/``unit_rowwise``: q/k/v split by whole heads, heads repeated where fewer than
# ranks — what ATP's attention layout does with every head count: column-/row-first as well)
COLUMN_KINDS = ("colwise", "colwise_gather_output", "packed_colwise", "unit_colwise")
ROW_KINDS = ("rowwise", "rowwise_split_input", "packed_rowwise", "unit_rowwise")
WHOLE_KINDS = ("colwise_gather_output", "rowwise_split_input")
PER_HEAD = "replicated_with_grad_allreduce"
LOCAL = "local_params"
EMBEDDING_KINDS = ("embedding_rowwise", "embedding_colwise")
EXPERTS = "moe_tp_experts"  # transformers' experts module (style hf_experts)
# how transformers' own tensor parallelism combines a module's outputs by hand (a module kept
# replicated, an all-reduce after a module, identity experts beside the routed ones): ATP reads
# such a module off the modules instead (laid out by the rules below, or run whole: .whole)
BY_HAND = ("replicate", "all_reduce", "moe_identity_expert")
NORM = re.compile(r"(Norm|LayerNorm|RMSNorm)\d*P?$")  # Nemotron's LayerNorm1P too
ATTENTION = re.compile(r"(Attention|Attn|MLA$)", re.IGNORECASE)  # (MLA: a latent attention, LongcatFlashMLA)
OUTPUT_NAME = re.compile(r"^(o|out|dense|c_proj|proj|wo|o_proj|out_proj|out_lin)$", re.IGNORECASE)
ROLE = {"q": re.compile(r"(^|_)(q|query)(_|$)|^wq$", re.IGNORECASE),
        "k": re.compile(r"(^|_)(k|key)(_|$)|^wk$", re.IGNORECASE),
        "v": re.compile(r"(^|_)(v|value)(_|$)|^wv$", re.IGNORECASE)}
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
BIAS_KWARGS = re.compile(r"alibi|position_bias", re.IGNORECASE)
WIDTH_ATTRS = ("split_size", "embed_dim", "all_head_size")
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


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
    head_gates: bool = False  # per-head projections beside q/k/v (an output gate): not in the cost model
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


def pattern(name: str, lists: Tuple[str, ...] = ()) -> str:
    """``layers.3.mlp`` -> ``layers.*.mlp``: a module name as a pattern over the repeated
    blocks — the index into one of ``lists`` (the blocks' ``nn.ModuleList``s; every numbered
    component when none are given). Other numbered components (an ``nn.Sequential``'s) stay."""
    if not lists:
        return re.sub(r"\.\d+(?=\.|$)", ".*", name)
    for ml in sorted(lists, key=len, reverse=True):
        m = re.match(re.escape(ml) + r"\.\d+(?=\.|$)", name)
        if m:
            return ml + ".*" + name[m.end():]
    return name


def declared_plan(config: Any) -> Dict[str, str]:
    """transformers' ``base_model_tp_plan`` of ``config`` (or of its text config)."""
    for c in (config, _text_config(config)):
        plan = getattr(c, "base_model_tp_plan", None) if c is not None else None
        if plan:
            return dict(plan)
    return {}


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 — not every config has one
        return None


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, linear_kinds())


def _resolve(names: Mapping[str, nn.Module], base: str, pat: str) -> Tuple[str, List[str]]:
    """A declared pattern (relative to the text model) as a full pattern and its matches: the
    shortest prefix under which it matches a module (the base model, or its language model; a
    top-level child where the model's ``base_model_prefix`` names no module, as Llama 4's text
    model under ``model``)."""
    prefixes = sorted({base} | {n for n in names if n.startswith(base + ".") and n.count(".") <= 2}, key=len)
    if base not in names:
        prefixes += sorted(n for n in names if n and "." not in n)
    for pre in prefixes:
        full = f"{pre}.{pat}" if pre else pat
        hits = [n for n in names if fnmatch.fnmatchcase(n, full)]
        if hits:
            return full, hits
    return f"{base}.{pat}", []


def _heads(config: Any) -> Tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of ``config``; refused in one line where the
    config has none (a state-space or recurrent model) or they vary by layer."""
    c = _text_config(config) or config
    kind = getattr(config, "model_type", "?")
    try:
        heads = int(c.num_attention_heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads)
        hd = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    except AttributeError:
        raise ConfigError(f"transformers model_type '{kind}': its config has no attention heads (a state-space "
                          f"or recurrent model); ATP lays out attention blocks; pass a plan") from None
    except Exception as exc:  # noqa: BLE001 — e.g. transformers' per-layer attribute errors
        raise ConfigError(f"transformers model_type '{kind}': head counts not read from its config "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); pass a plan") from None
    return heads, kv, hd


def derive(module: nn.Module, family: Any = None, probe: bool = True) -> Layout:
    """ATP's layout of the transformers causal LM ``module`` (see the module docstring);
    ``family``: its :class:`~atp_pipeline.models.hf.adapter.Family` entry, if it has one.
    ``probe=False``: what the shape needs only — no module is run (a model on the meta
    device, planned before it is built), a fused q|k|v of undeclared layout is taken as is.
    A block's mixer the layout cannot split runs whole (:mod:`.whole`; ``Layout.whole``)."""

    register_conv1d()
    register_plain_linears(module)
    blocks = [n for n, _ in block_units(module)]
    idle = idle_units(module, blocks) if probe else []  # modules no forward on tokens reaches: kept whole
    blocks = [n for n in blocks if not any(n.startswith(u + ".") for u in idle)]
    lists = tuple(sorted({b.rpartition(".")[0] for b in blocks}))
    hidden = int(getattr(_text_config(module.config) or module.config, "hidden_size", 0) or 0)  # (none: refused below)
    layout = derive_with_whole(module, lambda units: _derive(module, family, probe, units), blocks, lists, hidden,
                               probe, pattern, NORM, idle)
    if probe:
        _probe_calls(module, layout, hidden)
    return layout


def _probe_calls(root: nn.Module, layout: "Layout", hidden: int) -> None:
    """What a forward on tokens shows of ``layout`` that its modules' names do not (nothing on
    the meta device, or where the model cannot run here): ``outside_norm_calls`` — the calls
    beyond the first of each norm outside the blocks run on the gathered hidden (a norm applied
    before the layers and again after them: each call gathers and sends its gradient); and
    ``parallel_block`` — the MLP's shared column-first linears read the very tensor the
    attention's separate q/k/v read (a block running attention and MLP on one normed input),
    so their partial input gradients join one fan-in: one all-reduce over d1 for both; and
    ``probe_unmodelled`` — embeddings run whole whose output the batch's sequences share (its
    gradient gathered per position, while the cost model counts per token); ``hidden``: the
    config's hidden size."""
    if any(p.is_meta for p in root.parameters()):
        return
    names = dict(root.named_modules())
    outside = [p for p, s in layout.plan.items() if "*" not in p and s.startswith("gathered(input=split")
               and p != layout.whole_head and p not in layout.whole and p in names
               and not any(p.startswith(n + ".") for n, m in names.items() if isinstance(m, nn.Embedding))]
    attention = [p for p, s in layout.plan.items() if s.startswith("hf_attention")]
    shared = [p for p, s in layout.plan.items() if s.startswith("column(") and "shared=true" in s]
    first = lambda pat: next((n for n in names if fnmatch.fnmatchcase(n, pat)), None)  # noqa: E731
    calls: Dict[str, int] = {p: 0 for p in outside}
    inputs: Dict[str, List[Any]] = {}  # module name -> the tensors its calls read first (kept: compared by identity)

    def watch(name: str, count: bool):
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if count:
                calls[name] += 1
            x = args[0] if args else next(iter(kwargs.values()), None)
            inputs.setdefault(name, []).append(x)
        return hook

    watched = {p: True for p in outside}
    att = [first(p) for p in attention]
    for a in att:
        if a is not None:
            watched.update({f"{a}.{c}": False for c, _ in names[a].named_children()})
    watched.update({n: False for n in (first(p) for p in shared) if n is not None})
    hooks = [names[n].register_forward_pre_hook(watch(n, c), with_kwargs=True) for n, c in watched.items()
             if n in names]
    rows: Dict[str, int] = {}  # embeddings run whole (gathered): rows of their output, 2 sequences of 4 tokens
    for n, m in names.items():
        if isinstance(m, nn.Embedding) and type(m).forward is not nn.Embedding.forward:
            hooks.append(m.register_forward_hook(
                lambda mod, a, out, n=n: rows.__setitem__(n, int(out.numel()) // hidden)
                if hasattr(out, "numel") and hidden and out.shape[-1] == hidden else None))
    if not token_forward(root, hooks, batch=2):
        return
    shared_rows = [n for n, r in rows.items() if r < 2 * 4]
    if shared_rows:  # e.g. learned positions looked up once, broadcast over the batch
        layout.probe_unmodelled = (f"embeddings run whole whose output the batch's sequences share "
                                   f"({', '.join(shared_rows)}): their gradient is gathered per position, "
                                   f"counted per token")
    layout.outside_norm_calls = sum(max(n - 1, 0) for n in calls.values())
    read = [x for a in att if a is not None for c, _ in names[a].named_children()
            for x in inputs.get(f"{a}.{c}", [])]
    mlp = [x for p in shared for n in [first(p)] if n is not None and not any(
        n.startswith(a + ".") for a in att if a is not None) for x in inputs.get(n, [])]
    layout.parallel_block = not layout.qkv_fused and not layout.whole_attention and any(
        x is y for x in mlp for y in read if x is not None)


def _derive(module: nn.Module, family: Any, probe: bool, run_whole: Mapping[str, str]) -> Layout:
    """:func:`derive` with the block children ``run_whole`` (pattern -> style) run whole: their
    modules left out of the layout, their styles in its plan."""
    config = module.config
    kind = getattr(config, "model_type", "?")
    names = {n: m for n, m in module.named_modules()
             if not any(fnmatch.fnmatchcase(n, w + ".*") for w in run_whole)}
    base = module.base_model_prefix
    try:
        heads, kv, hd = _heads(config)
    except ConfigError as exc:  # no head counts (a state-space model; counts per layer): every mixer runs whole
        if not getattr(_text_config(config) or config, "hidden_size", None):
            raise
        heads = kv = hd = 0
        no_heads = str(exc).removesuffix("; pass a plan")
    hidden = int((_text_config(config) or config).hidden_size)
    declared = declared_plan(config)
    declared = {pat: style for pat, style in declared.items() if style not in BY_HAND}
    layout = Layout(source="declared" if declared else "modules")
    # the linears of each repeated block, by full pattern: declared kind, or read off the modules
    blocks = [n for n, _ in block_units(module) if not any(n.startswith(w + ".") for w in run_whole)]
    lists = tuple(sorted({b.rpartition(".")[0] for b in blocks}))
    kinds: Dict[str, str] = {}
    per_head: List[str] = []
    local: List[str] = []
    experts: List[str] = []
    for pat, style in declared.items():
        full, hits = _resolve(names, base, pat)
        if not hits:
            continue  # a module this configuration does not build
        if style == EXPERTS:
            experts.append(full)
            continue
        if style in EMBEDDING_KINDS:
            if all(isinstance(names[h], nn.Embedding) for h in hits) and not any(
                    h.startswith(b + ".") for h in hits for b in blocks):
                continue  # an embedding outside the blocks: laid out below
            raise ConfigError(f"transformers model_type '{kind}': '{pat}' is declared '{style}' inside the "
                              f"blocks, which ATP's layout does not cover; pass a plan")
        if style == PER_HEAD:
            per_head.append(full)
            continue
        if style == LOCAL:  # an attention module's own per-head parameters (sinks): see _attention_spec
            local.append(full)
            continue
        if style == mla.MLA_A:  # a latent projection: read with its attention (mla.read_latent)
            style = "colwise"
        if style not in COLUMN_KINDS + ROW_KINDS:
            raise ConfigError(f"transformers model_type '{kind}': '{pat}' is declared '{style}', which ATP's "
                              f"layout does not cover; pass a plan")
        if not all(_is_linear(names[h]) for h in hits):
            raise ConfigError(f"transformers model_type '{kind}': '{pat}' is declared '{style}' but is a "
                              f"{type(names[hits[0]]).__name__}, not a linear; pass a plan")
        n_in, n_out, _, _ = as_linear(names[hits[0]])
        if not any(h.startswith(b + ".") for h in hits for b in blocks) and \
                hidden not in ((n_out,) if style in ROW_KINDS else (n_in,)):
            continue  # outside the blocks, not beside the hidden as declared: a module around it may run whole
        kinds[full] = style
    if not experts:  # experts the declaration does not name: read off the modules (their class's flags)
        experts = _experts_shown(names, blocks, lists, module if probe else None)
    if not kinds:  # nothing declared, or only embeddings: read the blocks' linears off the modules
        declared = {}
        layout.source = "modules"
        kinds = _inspect_linears(names, blocks, hidden, lists, [e.rpartition(".")[0] for e in experts])
    if not kinds and not experts and not run_whole:  # (a block of whole mixers and experts has none of its own)
        raise ConfigError(f"transformers model_type '{kind}': no repeated block with linear projections "
                          f"(ATP lays out transformer blocks); pass a plan")
    attention_declared = bool(declared)
    if declared and not _attention_modules(names, kinds):  # a declaration of the MLP only: the attention's
        try:  # projections read off its modules (and shown to run on blocks of heads, below)
            shown = _inspect_linears(names, blocks, hidden, lists, [e.rpartition(".")[0] for e in experts])
        except ConfigError:
            shown = {}
        found = _attention_modules(names, shown)
        kinds.update({n: k for n, k in shown.items() if n.rpartition(".")[0] in found})
        attention_declared = not found

    spec_given = family.attention_spec if family is not None else None
    attention = _attention_modules(names, kinds) if spec_given is None else sorted(
        {pattern(n, lists) for n, m in names.items() if ATTENTION.search(type(m).__name__)
         and all(_is_linear(getattr(m, p, None)) for p in (spec_given.qkv, spec_given.o))})
    plan: Dict[str, str] = {}
    for att in attention:
        if not heads:  # nothing to split it by: it may run whole (models/hf/whole.py)
            raise ConfigError(f"{no_heads}: attention '{att}' ({type(_first(names, att)).__name__}) is not split "
                              f"by heads; pass a plan")
        if spec_given is None and _latent_attention(module, att, names, kinds, layout, plan, hidden, heads, kind,
                                                    probe):
            continue
        spec = spec_given or _attention_spec(module, att, names, kinds, hidden, heads, kv, hd,
                                             declared=attention_declared, kind=kind, probe=probe)
        if not hasattr(_first(names, att), "config"):
            spec = dataclasses.replace(spec, counts=(heads, kv, hd))
        if probe and spec_given is None and not attention_declared:  # read off the modules: shown to run on blocks
            if not spec.whole:
                spec = dataclasses.replace(spec, biases=head_biases(module, att, heads))
            why = runs_on_head_blocks(module, att, spec, heads, kv, hd, hidden)
            if why and not spec.whole:  # its code mixes the heads: it may still run whole (q/k/v gathered)
                whole = as_whole(spec)
                if not runs_on_head_blocks(module, att, whole, heads, kv, hd, hidden):
                    spec, why = whole, None
            if why:
                raise ConfigError(f"transformers model_type '{kind}': attention '{att}' "
                                  f"({type(_first(names, att)).__name__}): {why}; pass a plan")
        plan[att] = spec.style()
        layout.qkv_fused = bool(spec.qkv)
        layout.whole_attention = spec.whole
        module_ = _first(names, att)
        projections = {spec.q, spec.k, spec.v, spec.qkv, spec.o, *spec.extra}
        layout.head_norm_params = 0 if spec.whole else sum(
            p.numel() for n, sub in module_.named_children() if n not in projections for p in sub.parameters())
        layout.heads_over_d2 = not spec.counts[0] and _calls_attention_interface(module_)
        layout.sink_params = sum(getattr(module_, a).numel() for a in spec.head_params)
        layout.head_gates = layout.head_gates or bool(spec.extra)
        layout.bias = layout.bias or any(getattr(_first(names, f"{att}.{p}"), "bias", None) is not None
                                         for p in (spec.q, spec.qkv, spec.o) if p)
    inside = lambda n: any(fnmatch.fnmatchcase(n, a + ".*") for a in attention)  # noqa: E731
    for full in local:
        if full not in attention and full not in run_whole:  # (a module run whole keeps its parameters whole)
            raise ConfigError(f"transformers model_type '{kind}': '{full}' is declared '{LOCAL}' (parameters kept "
                              f"local to each rank) on a module other than an attention; ATP's layout does not "
                              f"cover it; pass a plan")
    for full in per_head:
        if not inside(full):
            raise ConfigError(f"transformers model_type '{kind}': '{full}' is declared '{PER_HEAD}' outside "
                              f"the attention, which ATP's layout does not cover; pass a plan")
    # the other linears (the MLP): column-first reading the hidden, row-first writing it
    rest = {n: k for n, k in kinds.items() if not inside(n)}
    moe_blocks = [e.rpartition(".")[0] for e in experts]
    shared_ffn = 0  # a shared expert laid out column-/row-first beside the routed ones
    by_parent: Dict[str, List[str]] = {}
    for n in rest:
        by_parent.setdefault(n.rpartition(".")[0], []).append(n)
    for parent, members in by_parent.items():
        cols = [n for n in members if rest[n] in COLUMN_KINDS]
        rows = [n for n in members if rest[n] in ROW_KINDS]
        inner = {as_linear(_first(names, n))[0] for n in rows}
        if len(inner) > 1:
            raise ConfigError(f"transformers model_type '{kind}': '{parent}' has row-first linears of different "
                              f"widths {sorted(inner)}; pass a plan")
        width = next(iter(inner), None) if rows else _sibling_width(rest, names, parent, lists)
        for n in cols:
            n_in, n_out, _, _ = as_linear(_first(names, n))
            parts = n_out // width if width and n_out % width == 0 else 0
            if parts == 2 and not declared:  # [gate | up] or interleaved? only a declaration says
                raise ConfigError(f"transformers model_type '{kind}': linear '{n}' ({n_in} -> {n_out}) packs two "
                                  f"projections in a layout nothing declares; pass a plan")
            if n_in != hidden or parts not in (1, 2):
                raise ConfigError(f"transformers model_type '{kind}': linear '{n}' ({n_in} -> {n_out}) does not "
                                  f"read the hidden state into the width its row-first partner reads "
                                  f"({width}); ATP's layout does not cover it; pass a plan")
            opts = ["input=split", "output=split"] + (["parts=2"] if parts == 2 else []) + \
                (["shared=true"] if len(cols) > 1 else [])
            plan[n] = f"column({', '.join(opts)})"
            layout.gated = layout.gated or parts == 2 or len(cols) > 1
        for n in rows:
            n_in, n_out, _, _ = as_linear(_first(names, n))
            if n_out != hidden:
                raise ConfigError(f"transformers model_type '{kind}': linear '{n}' ({n_in} -> {n_out}) does not "
                                  f"write the hidden state; pass a plan")
            plan[n] = "row(input=split, output=split)"
            if any(parent.startswith(b + ".") for b in moe_blocks):  # a shared expert beside the routed ones
                shared_ffn = shared_ffn or n_in
            else:
                layout.ffn = layout.ffn or n_in
    for parent in by_parent:  # an activation with learned scalars on the MLP's split intermediate
        for child, sub in _first(names, parent).named_children():
            params = list(sub.parameters())
            if params and all(p.numel() == 1 for p in params) and not any(_is_linear(x) for x in sub.modules()) \
                    and f"{parent}.{child}" not in plan and _elementwise(sub) \
                    and not any("output=full" in plan.get(n, "") for n in by_parent[parent]):
                plan[f"{parent}.{child}"] = "hf_scalars(axis=d1)"
                layout.scalar_params = layout.scalar_params or sum(p.numel() for p in params)
    for parent, members in by_parent.items():  # the dense MLP's activation, as its code runs it
        if any(rest[n] in ROW_KINDS for n in members) and not any(parent.startswith(b + ".") for b in moe_blocks):
            counts = [pointwise_kernels(sub) for child, sub in _first(names, parent).named_children()
                      if f"{parent}.{child}" not in plan and not _is_linear(sub)]
            fwd, bwd = (sum(c[i] for c in counts if c) for i in (0, 1))
            if fwd:  # (none: a functional activation in the MLP's forward, priced as one kernel)
                layout.act_kernels = (fwd, bwd)
                break
    for full in experts:
        layout.moe = _lay_out_experts(plan, names, full, hidden, kind, module.config, shared_ffn,
                                      module if probe else None)
    if layout.moe is not None and not layout.ffn:
        layout.ffn = layout.moe.ffn  # every layer's MLP is routed
    # norms outside the attention: the family's own norm on the gathered hidden
    for name in sorted({pattern(n, lists) for n, m in names.items() if NORM.search(type(m).__name__)}):
        if not inside(name) and not any(fnmatch.fnmatchcase(name, p + ".*") for p in plan):
            inner = any(p.startswith(name + ".") for p in plan)  # (a gate's linears inside a gated norm, laid
            # out by none: aside, it runs whole on the gathered hidden like any norm)
            widths = {int(q.numel()) for q in _first(names, name).parameters() if inner or q.dim() <= 1}
            parent = name.rpartition(".")[0]
            if len(widths) == 1 and widths - {hidden} and \
                    _whole_between(plan, names, by_parent.get(parent, []), next(iter(widths))):
                # a norm over the whole intermediate of its MLP (BitNet's ffn_sub_norm): that MLP's
                # column-first outputs gathered, the norm run whole, its row-first input whole
                plan[name] = "gathered"
                layout.whole_mlp = True
                continue
            table = getattr(module.get_input_embeddings(), "embedding_dim", hidden)
            if widths - {hidden, table} and "*" not in name and not any(name.startswith(b + ".") for b in blocks):
                # outside the blocks, over a width neither the hidden's nor the (split) token table's (a per-layer
                # input computed beside the hidden): whole, as the modules writing it (.whole.side_style)
                plan[name] = "gathered"
                continue
            if widths - {hidden}:
                raise ConfigError(f"transformers model_type '{kind}': norm '{name}' ({type(_first(names, name)).__name__}) "
                                  f"is over a width {sorted(widths - {hidden})} other than the hidden state ({hidden}), "
                                  f"between split linears; ATP's layout does not cover it; pass a plan")
            plan[name] = "gathered(input=split, output=split)"
            low = type(_first(names, name)).__name__.lower()
            layout.norm = "layernorm" if "layernorm" in low and "rms" not in low else "rmsnorm"
    layout.plan = {**run_whole, **plan}  # first: the plan's patterns then reach nothing inside them
    return layout


def _latent_attention(root: nn.Module, att: str, names: Mapping[str, nn.Module], kinds: Mapping[str, str],
                      layout: Layout, plan: Dict[str, str], hidden: int, heads: int, kind: str, probe: bool) -> bool:
    """Lay out the attention ``att`` as a multi-head latent attention (:mod:`.mla`), shown to
    run on blocks of its heads where it can be run (``probe``); False: it is not one."""
    module = _first(names, att)
    what = f"transformers model_type '{kind}': attention '{att}' ({type(module).__name__})"
    rows = [n.rpartition(".")[2] for n, k in kinds.items() if n.rpartition(".")[0] == att and k in ROW_KINDS]
    spec = mla.read_latent(module, hidden, heads, rows, what)
    if spec is None:
        return False
    got = _capture(root, att) if probe else None
    if got is not None:
        why = mla.latent_infeasibility(*got, spec, _run, _cut, calls_interface)
        if why:
            raise ConfigError(f"{what}: {why}; pass a plan")
    plan[att] = spec.style()
    layout.latent = spec.shape
    layout.bias = layout.bias or any(getattr(module, p).bias is not None for p in (spec.q, spec.o))
    return True


def _sibling_width(rest: Mapping[str, str], names: Mapping[str, nn.Module], parent: str,
                   lists: Tuple[str, ...]) -> Optional[int]:
    """The input width of the row-first linears in ``parent``'s block outside it (an MLP whose
    two halves are sibling modules: an encoder-style block's intermediate and output), if one."""
    block = next((f"{ml}.*" for ml in lists if parent.startswith(f"{ml}.*.")), None)
    widths = {as_linear(_first(names, n))[0] for n, k in rest.items() if k in ROW_KINDS and block
              and n.startswith(block + ".") and n.rpartition(".")[0] != parent}
    return next(iter(widths)) if len(widths) == 1 else None


def _calls_attention_interface(module: nn.Module) -> bool:
    """Whether the attention's ``forward`` runs its core through transformers' attention
    interface (where the layout scatters the heads over d2); its own core (GPT-Neo's) runs on
    the rank's d1 heads, replicated over d2. True where the source cannot be read."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _elementwise(module: nn.Module) -> bool:
    """Whether ``module`` maps a tensor elementwise (shown on a random one: its two halves run
    apart give the same as the whole; not shown on the meta device)."""
    import torch

    p = next(module.parameters())
    if p.is_meta:
        return False
    x = torch.randn(2, 3, 8, dtype=p.dtype, generator=torch.Generator().manual_seed(0)).to(p.device)
    with torch.no_grad():
        try:
            whole = module(x)
            halves = torch.cat([module(x[..., :4]), module(x[..., 4:])], dim=-1)
        except Exception:  # noqa: BLE001 — it does not take such a tensor
            return False
    return isinstance(whole, torch.Tensor) and whole.shape == x.shape and torch.allclose(whole, halves)


def _whole_between(plan: Dict[str, str], names: Mapping[str, nn.Module], members: List[str], width: int) -> bool:
    """Lay out the linears ``members`` of one MLP around a module over its whole intermediate
    ``width``: the column-first ones with their outputs gathered, the row-first ones reading a
    whole input. False (nothing changed): they are not column-first linears writing ``width``
    and row-first ones reading it."""
    cols = [n for n in members if plan.get(n, "").startswith("column(")]
    rows = [n for n in members if plan.get(n, "").startswith("row(")]
    if not cols or not rows or len(cols) + len(rows) != len(members) or \
            {as_linear(_first(names, n))[0] for n in rows} != {width}:
        return False
    for n in cols:
        plan[n] = plan[n].replace("output=split", "output=full")
    for n in rows:
        plan[n] = plan[n].replace("input=split", "input=full")
    return True


def _lay_out_experts(plan: Dict[str, str], names: Mapping[str, nn.Module], full: str, hidden: int, kind: str,
                     config: Any, shared_ffn: int, root: Optional[nn.Module] = None) -> MoEShape:
    """A declared experts module: every expert tensor-parallel (style ``hf_experts``); the other
    modules with parameters in its mixture-of-experts block that nothing lays out (the router, a
    shared expert's gate, an undeclared shared expert) run whole on the gathered hidden, their
    output whole unless it is a hidden state (then split again). Returns the routed layers'
    numbers, as the planners read them."""
    from atp_pipeline.models.hf.experts import experts_infeasibility

    m = _first(names, full)
    why = experts_infeasibility(m)
    if why:
        raise ConfigError(f"transformers model_type '{kind}': experts '{full}' ({type(m).__name__}): "
                          f"{why}; ATP's layout does not cover it; pass a plan")
    experts = int(getattr(m, "num_experts", 0) or m.down_proj.shape[0])
    parent = full.rpartition(".")[0]
    block = names[next(n for n in names if fnmatch.fnmatchcase(n, full)).rpartition(".")[0]]  # one holding experts
    # the block's code reshaping by a width it keeps (GraniteMoE's input_size): this rank's width
    widths = sorted(k for k, v in vars(block).items() if type(v) is int and v == hidden)
    plan[full] = f"hf_experts(per_rank={'+'.join(widths)})" if widths else "hf_experts"
    gathered = split_outputs = partial_width = 0
    for child_name, child in block.named_children():
        child_pat = f"{parent}.{child_name}"
        if child_pat == full or next(child.parameters(), None) is None or \
                any(p == child_pat or p.startswith(child_pat + ".") for p in plan):
            continue
        gathered += 1
        if any(_is_linear(x) and as_linear(x)[1] == hidden for x in child.modules()) or \
                _writes_hidden(root, child_pat, hidden):  # writes a hidden state (a shared expert of 3-D weights)
            plan[child_pat] = "gathered(input=split, output=split)"
            split_outputs += 1
        elif any(p.dim() == 2 and p.shape[0] == experts for p in child.parameters()):  # the router: its
            plan[child_pat] = "gathered(input=split, output=full)"  # weights' gradients the experts complete
        else:  # e.g. a shared expert's gate, scaling the split hidden: its gradient partial over d2
            plan[child_pat] = "gathered(input=split, output=full, partial_grad=true)"
            partial_width += sum(as_linear(x)[1] for x in child.modules() if _is_linear(x))
    return MoEShape(experts=experts, top_k=_top_k(config, experts),
                    layers=sum(fnmatch.fnmatchcase(n, full) for n in names),
                    ffn=int(m.down_proj.shape[1 if m.is_transposed else 2]),  # an expert's intermediate
                    gated=bool(m.has_gate), shared_ffn=shared_ffn, gathered=gathered, split_outputs=split_outputs,
                    partial_width=partial_width)


def _experts_shown(names: Mapping[str, nn.Module], blocks: List[str], lists: Tuple[str, ...],
                   root: Optional[nn.Module] = None) -> List[str]:
    """Patterns of the modules inside the repeated blocks that carry transformers' experts
    declaration (``use_experts_implementation``'s flags on the class), where the config's
    ``base_model_tp_plan`` names none (transformers 5.25 dropped Qwen2-MoE's ``moe_tp_experts``).
    With ``root`` (a model that runs here), a block whose code uses the routing weights outside
    its experts module (:func:`~.routing.routing_only_to_experts`) is left to run whole."""
    from atp_pipeline.models.hf.experts import FLAGS
    from atp_pipeline.models.hf.routing import routing_only_to_experts

    found: Dict[str, str] = {}
    for n, m in names.items():
        if any(n.startswith(b + ".") for b in blocks) and all(hasattr(m, f) for f in FLAGS):
            found.setdefault(pattern(n, lists), n)
    return sorted(p for p, n in found.items() if root is None or routing_only_to_experts(root, n) is not False)


def _writes_hidden(root: Optional[nn.Module], unit: str, hidden: int) -> bool:
    """Whether the modules ``unit`` return a hidden state (a tensor, or a tuple's first, over
    the hidden) on a forward of ``root`` on tokens (:func:`~.whole.hidden_io`; False: not run,
    ``root`` None)."""
    if root is None:
        return False
    _, outputs, cannot, _ = hidden_io(root, unit, hidden)
    return not cannot and 0 in outputs


def _top_k(config: Any, experts: int) -> int:
    """Experts per token, from the config (the names transformers' MoE configs use)."""
    text = _text_config(config) or config
    for key in ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_experts_per_token"):
        v = getattr(text, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= experts:
            return v
    raise ConfigError(f"transformers model_type '{getattr(config, 'model_type', '?')}': experts per token not "
                      f"found in its config; pass a plan")


def _first(names: Mapping[str, nn.Module], pat: str) -> nn.Module:
    return next(m for n, m in names.items() if fnmatch.fnmatchcase(n, pat))


def _inspect_linears(names: Mapping[str, nn.Module], blocks: List[str], hidden: int,
                     lists: Tuple[str, ...], moe_blocks: List[str] = ()) -> Dict[str, str]:
    """The linears of the repeated blocks, read off their shapes (no declaration): those
    reading the hidden state column-first, those writing it row-first; inside an attention
    module all of them (its projections are sorted out by :func:`_attention_spec`). Those in
    ``moe_blocks`` (the patterns of blocks holding declared experts: routers, shared experts)
    are left to :func:`_lay_out_experts`."""
    out: Dict[str, str] = {}
    for name, m in names.items():
        if not _is_linear(m) or not any(name.startswith(b + ".") for b in blocks):
            continue
        n_in, n_out, _, _ = as_linear(m)
        full = pattern(name, lists)
        if any(full.startswith(b + ".") for b in moe_blocks):
            continue
        parent = names[name.rpartition(".")[0]]
        if ATTENTION.search(type(parent).__name__):
            out[full] = "rowwise" if n_out == hidden and n_in != hidden or (
                n_out == hidden and OUTPUT_NAME.search(name.rpartition(".")[2])) else "colwise"
        elif n_in == hidden and n_out != hidden:
            out[full] = "colwise"
        elif n_out == hidden and n_in != hidden:
            out[full] = "rowwise"
        else:
            raise_name = name
            raise ConfigError(f"linear '{raise_name}' ({n_in} -> {n_out}) neither reads nor writes the hidden "
                              f"state ({hidden}); ATP's layout does not cover it; pass a plan")
    return out


def _attention_modules(names: Mapping[str, nn.Module], kinds: Mapping[str, str]) -> List[str]:
    """Patterns of the attention modules: parents of laid-out linears whose class says so."""
    out = set()
    for n in kinds:
        parent = n.rpartition(".")[0]
        m = _first(names, n.rpartition(".")[0]) if parent else None
        if m is not None and ATTENTION.search(type(m).__name__):
            out.add(parent)
    return sorted(out)


def _attention_spec(root: nn.Module, att: str, names: Mapping[str, nn.Module], kinds: Mapping[str, str],
                    hidden: int, heads: int, kv: int, hd: int, declared: bool, kind: str,
                    probe: bool = True) -> AttentionSpec:
    """The projections of the attention modules ``att`` (a pattern), from their linears' kinds
    and shapes; refused in one line where they do not add up to q/k/v and an output."""
    module = _first(names, att)
    mine = {n.rpartition(".")[2]: k for n, k in kinds.items() if n.rpartition(".")[0] == att}
    cols = [p for p, k in mine.items() if k in COLUMN_KINDS]
    rows = [p for p, k in mine.items() if k in ROW_KINDS]
    what = f"transformers model_type '{kind}': attention '{att}' ({type(module).__name__})"
    if len(rows) != 1:
        raise ConfigError(f"{what} has {len(rows)} output projections ({', '.join(rows) or 'none'}); "
                          f"ATP's layout needs one; pass a plan")
    own = sorted({n for name, m in names.items() if is_unit(name, att)
                  for n, _ in m.named_parameters(recurse=False)})  # in any of the blocks
    head_params = tuple(own)
    if own and not _read_by_core(root, att, own, heads, probe):
        raise ConfigError(f"{what} holds parameters of its own ({', '.join(own)}), which ATP's layout does not "
                          f"place (only ones of a value per head that the attention core alone reads); pass a plan")
    spec = _projections_spec(root, module, att, mine, cols, rows, what, hidden, heads, kv, hd, declared, probe)
    return dataclasses.replace(spec, head_params=head_params) if head_params else spec


def _projections_spec(root: nn.Module, module: nn.Module, att: str, mine: Mapping[str, str], cols: List[str],
                      rows: List[str], what: str, hidden: int, heads: int, kv: int, hd: int, declared: bool,
                      probe: bool) -> AttentionSpec:
    """:func:`_attention_spec`'s projections: separate q/k/v or one fused q|k|v, and the output."""
    whole = any(mine[p] in WHOLE_KINDS for p in cols)
    width = {p: as_linear(getattr(module, p))[1] for p in cols}
    if len(cols) == 4:  # q, k, v and a per-head gate of the output (its width: heads x head dim, or heads)
        named = {r: next((p for p in cols if ROLE[r].search(p)), None) for r in ROLE}
        gate = [p for p in cols if p not in named.values()]
        if len(gate) == 1 and width[gate[0]] in (heads * hd, heads) and not whole:
            spec = _projections_spec(root, module, att, mine, [p for p in cols if p != gate[0]], rows, what, hidden,
                                     heads, kv, hd, declared, probe)
            if not spec.whole:
                return dataclasses.replace(spec, extra=(gate[0],))
        raise ConfigError(f"{what}: projections {cols} do not add up to queries ({heads}x{hd}), keys/values "
                          f"({kv}x{hd}) and one per-head gate; pass a plan")
    if len(cols) == 3:
        named = {r: next((p for p in cols if ROLE[r].search(p)), None) for r in ROLE}
        q = named["q"] or next((p for p in cols if width[p] == heads * hd and p not in (named["k"], named["v"])), None)
        k = named["k"] if named["k"] != q else None
        v = named["v"] if named["v"] not in (q, k) else next((p for p in cols if p not in (q, k)), None)
        if not declared and None not in (q, k, v) and len({q, k, v}) == 3 and \
                (width[q] != heads * hd or width[k] != width[v]):
            # named q, k and v of widths other than the config's heads: their code runs whole
            return AttentionSpec(q=q, k=k, v=v, o=rows[0], whole=True)
        if q is None or k is None or v is None or width[k] != kv * hd or width[v] != kv * hd:
            raise ConfigError(f"{what}: projections {cols} are not q ({heads}x{hd}), k and v ({kv}x{hd}); "
                              f"pass a plan")
        return AttentionSpec(q=q, k=k, v=v, o=rows[0], whole=whole,
                             per_rank=() if declared or whole else _per_rank(module, heads, kv, hd))
    if len(cols) == 1 and width[cols[0]] == (heads + 2 * kv) * hd:
        if whole:
            return AttentionSpec(qkv=cols[0], fused="concat", o=rows[0], whole=True)
        if declared:  # declared colwise: transformers' own contiguous split is whole heads
            return AttentionSpec(qkv=cols[0], fused="heads", o=rows[0])
        fused = (probe_fused(root, att, cols[0], rows[0], heads, hd) if probe else "concat") if kv == heads else None
        if fused is None:  # grouped, or a layout no probe tells: the projection's output gathered whole
            return AttentionSpec(qkv=cols[0], fused="concat", o=rows[0], whole=True)
        return AttentionSpec(qkv=cols[0], fused=fused, o=rows[0], per_rank=_per_rank(module, heads, kv, hd))
    if len(cols) == 1 and not declared:  # a fused q|k|v of another width (multi-query): gathered whole
        return AttentionSpec(qkv=cols[0], fused="concat", o=rows[0], whole=True)
    raise ConfigError(f"{what}: projections {cols} do not add up to queries ({heads}x{hd}) and keys/values "
                      f"({kv}x{hd}); pass a plan")


def _per_rank(module: nn.Module, heads: int, kv: int, hd: int) -> Tuple[str, ...]:
    """Integer attributes of an attention module counting the whole layer's heads, or the
    features of all of them (its code may reshape or split by them): made per-rank by the style."""
    out = [a for a in HEAD_COUNT_ATTRS if getattr(module, a, None) == heads]
    out += [a for a in KV_COUNT_ATTRS if getattr(module, a, None) == kv and a not in out]
    out += [a for a in WIDTH_ATTRS if getattr(module, a, None) == heads * hd]
    return tuple(out)


class _Captured(Exception):
    pass


def as_whole(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with whole q/k/v: the projections' outputs gathered over d1, the module's own
    code run on all heads (its core on this rank's, where it calls transformers' interface)."""
    return AttentionSpec(q=spec.q, k=spec.k, v=spec.v, o=spec.o, qkv=spec.qkv, fused=spec.fused or "",
                         whole=True, counts=spec.counts, head_params=spec.head_params, extra=spec.extra)


def _read_by_core(root: nn.Module, att: str, own: List[str], heads: int, probe: bool) -> bool:
    """Whether the attention ``att``'s own parameters ``own`` each hold one value per query
    head and are read by its core alone (transformers' attention interface: an attribute of the
    module or a keyword input), as attention sinks are, shown on a forward (``probe``; not
    shown on the meta device)."""
    modules = [m for name, m in root.named_modules() if is_unit(name, att)]  # every block's: the same
    # parameters, one value per head
    if any(not isinstance(getattr(m, n, None), nn.Parameter) or tuple(getattr(m, n).shape) != (heads,)
           for m in modules for n in own):
        return False
    if not probe:
        return True
    got = _capture(root, att)
    read = core_reads(*got) if got is not None else None
    return read is not None and set(own) <= read


def head_biases(root: nn.Module, att: str, heads: int) -> Tuple[str, ...]:
    """The keyword inputs of the attention ``att`` holding position biases for all heads
    (ALiBi), whose first dimension is ``heads`` or batch x ``heads``: the style slices them
    to the rank's heads. Refused in one line for one of another shape."""
    got = _capture(root, att)
    if got is None:
        return ()
    target, _, kwargs = got
    names = tuple(k for k, v in kwargs.items() if BIAS_KWARGS.search(k) and v is not None)
    odd = [k for k in names if not hasattr(kwargs[k], "shape") or kwargs[k].dim() < 1
           or kwargs[k].shape[0] % heads]
    if odd:
        raise ConfigError(f"attention '{att}' ({type(target).__name__}) is passed position biases for all heads "
                          f"({', '.join(odd)}) whose first dimension is not per head; ATP's layout does not slice "
                          f"them per rank; pass a plan")
    return names


def slice_heads(t: Any, heads: int, index: Any) -> Any:
    """The heads ``index`` of a position bias whose first dimension is ``heads`` or batch x
    ``heads`` (batch major)."""
    rest = t.shape[1:]
    return t.view(-1, heads, *rest).index_select(1, index.to(t.device)).reshape(-1, *rest)


def _capture(root: nn.Module, att: str) -> Optional[Tuple[nn.Module, tuple, dict]]:
    """The first ``att`` module of ``root`` and the inputs a forward of ``root`` on 4 tokens
    gives it (None: no parameters to run — meta device — or a model this call cannot run)."""
    import torch

    if any(p.is_meta for p in root.parameters()):
        return None
    target = _first(dict(root.named_modules()), att)
    captured: Dict[str, Any] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    training = root.training
    root.eval()
    try:
        with torch.no_grad():
            root(input_ids=torch.zeros(1, 4, dtype=torch.long, device=next(root.parameters()).device))
    except _Captured:
        pass
    except Exception:  # noqa: BLE001 — a model this call cannot run: no answer
        return None
    finally:
        handle.remove()
        root.train(training)
    if "args" not in captured:
        return None
    return target, captured["args"], captured["kwargs"]


def _call(m: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``m`` on captured inputs in evaluation mode (no dropout: a probe compares outputs)."""
    training = m.training
    m.eval()
    try:
        kwargs = copy.deepcopy(kwargs)  # a cache among them must not grow from one call to the next
    except Exception:  # noqa: BLE001 — inputs that cannot be copied: as captured
        pass
    try:
        return m(*args, **kwargs)
    finally:
        m.train(training)


def _run(m: nn.Module, args: tuple, kwargs: dict) -> Any:
    out = _call(m, args, kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def probe_fused(root: nn.Module, att: str, qkv: str, o: str, heads: int, hd: int) -> Optional[str]:
    """Which layout a fused multi-head q|k|v projection has — ``"concat"`` (all queries, then
    keys, then values) or ``"heads"`` (each head's q, k and v together) — read off the module
    itself (:func:`_capture`): run again with heads 0 and 1 swapped under each hypothesis (in
    the projection's outputs and in the output projection's inputs), only the true layout
    leaves the module's output unchanged. None: it cannot run here, or no single answer."""
    import torch

    got = _capture(root, att) if heads >= 2 else None
    if got is None:
        return None
    target, args, kwargs = got
    biases = head_biases(root, att, heads)
    with torch.no_grad():
        reference = _run(target, args, kwargs)
        swapped_heads = torch.arange(heads)
        swapped_heads[[0, 1]] = swapped_heads[[1, 0]].clone()
        kwargs = {k: slice_heads(v, heads, swapped_heads) if k in biases else v for k, v in kwargs.items()}
        answers = []
        for layout in ("concat", "heads"):
            order = torch.arange(3 * heads * hd).view(*((3, heads, hd) if layout == "concat" else (heads, 3, hd)))
            swapped = order.clone()
            if layout == "concat":
                swapped[:, [0, 1]] = order[:, [1, 0]]
            else:
                swapped[[0, 1]] = order[[1, 0]]
            heads_order = torch.arange(heads * hd).view(heads, hd)
            heads_order[[0, 1]] = heads_order[[1, 0]].clone()
            probe = copy.deepcopy(target)
            _permute(getattr(probe, qkv), swapped.reshape(-1), output=True)
            _permute(getattr(probe, o), heads_order.reshape(-1), output=False)
            if torch.allclose(_run(probe, args, kwargs), reference, rtol=1e-4, atol=1e-6):
                answers.append(layout)
    return answers[0] if len(answers) == 1 else None


def runs_on_head_blocks(root: nn.Module, att: str, spec: AttentionSpec, heads: int, kv: int, hd: int,
                        hidden: int, blocks: int = 2) -> Optional[str]:
    """Why the attention ``att`` does not run on blocks of its heads (None: it does, or it
    cannot be run here). Its inputs captured (:func:`_capture`), the module is run once per
    block of ``heads/blocks`` query heads — the projections cut to the block's rows under
    ``spec``, the output projection to its input columns, ``spec.per_rank`` attributes divided
    — and the blocks' outputs (partial sums of the output projection, as on the ranks of d1)
    must add up to the module's own output."""
    import torch

    if heads % blocks or kv % blocks:
        return None
    got = _capture(root, att)
    if got is None:
        return None
    target, args, kwargs = got
    total = None
    with torch.no_grad():
        try:
            whole = _call(target, args, kwargs)
        except Exception:  # noqa: BLE001 — the module fails on its own inputs here: no answer
            return None
        extra = [t for t in (whole[1:] if isinstance(whole, (tuple, list)) else ())
                 if isinstance(t, torch.Tensor) and t.shape[-1:] == (hidden,)]
        if extra:
            return "it returns a tensor over the hidden state besides its output (added outside it, whole)"
        why = _split_hidden_fails(target, args, kwargs, spec, hidden)
        if why:
            return why
        if spec.whole and not calls_interface(target, args, kwargs):
            return "its code reads whole q/k/v and computes the attention itself, not through transformers' " \
                   "attention interface"
        reference = _run(target, args, kwargs)
        base = copy.deepcopy(target)  # what the module adds besides its output projection's product
        _zero_weight(getattr(base, spec.o), torch.arange(0))
        base = _run(base, args, kwargs)
        for b in range(blocks):
            probe = copy.deepcopy(target)
            w = heads * hd // blocks
            block = torch.arange(b * w, (b + 1) * w)
            if spec.whole:  # the projections whole; the output projection reads the block's features
                _zero_weight(getattr(probe, spec.o), block)
                part = _run(probe, args, kwargs)
                total = base + (part - base) if total is None else total + (part - base)
                continue
            if spec.qkv:
                width = 3 * heads * hd // blocks
                rows = torch.arange(3 * heads * hd).view(3, blocks, -1)[:, b].reshape(-1) if spec.fused == "concat" \
                    else torch.arange(b * width, (b + 1) * width)
                _cut(getattr(probe, spec.qkv), rows, output=True)
            else:
                for name, n in ((spec.q, heads), (spec.k, kv), (spec.v, kv)):
                    w = n * hd // blocks
                    _cut(getattr(probe, name), torch.arange(b * w, (b + 1) * w), output=True)
            for name in spec.extra:
                w = as_linear(getattr(probe, name))[1] // blocks
                _cut(getattr(probe, name), torch.arange(b * w, (b + 1) * w), output=True)
            _cut(getattr(probe, spec.o), block, output=False)
            for a in spec.per_rank:
                setattr(probe, a, getattr(probe, a) // blocks)
            sliced = {k: slice_heads(v, heads, torch.arange(b * heads // blocks, (b + 1) * heads // blocks))
                      if k in spec.biases else v for k, v in kwargs.items()}
            try:
                part = _run(probe, args, sliced)
            except Exception as exc:  # noqa: BLE001 — the module's own code refuses a block
                return f"its code does not run on a block of its heads ({type(exc).__name__}: " \
                       f"{str(exc).splitlines()[0][:100]})"
            total = base + (part - base) if total is None else total + (part - base)
    if total is None or total.shape != reference.shape or not torch.allclose(total, reference, rtol=1e-4,
                                                                            atol=1e-5 * float(reference.abs().max())):
        return "its output is not the sum over blocks of its heads (its code mixes heads)"
    return None


def _zero_weight(linear: nn.Module, keep: Any) -> None:
    """Zero a linear's weight but for the input features ``keep`` (its bias kept)."""
    import torch

    mask = torch.zeros_like(linear.weight)
    mask.index_fill_(_feature_dim(linear, output=False), keep.to(mask.device), 1.0)
    linear.weight.mul_(mask)


def calls_interface(target: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the attention ``target`` computes its core through transformers' attention
    interface (a spy implementation, delegating to the model's own, is called)."""
    return core_reads(target, args, kwargs) is not None


class _Reads:
    """A module that records the names of the attributes read from it."""

    def __init__(self, module: nn.Module, seen: set) -> None:
        self._module, self._seen = module, seen

    def __getattr__(self, name: str) -> Any:
        self._seen.add(name)
        return getattr(self._module, name)


def core_reads(target: nn.Module, args: tuple, kwargs: dict) -> Optional[set]:
    """The names of ``target``'s own parameters that its attention core reads (an attribute of
    the module, or passed as a keyword input) when run through a spy implementation delegating
    to the model's own; None: its core is not reached through transformers' attention interface."""
    import sys

    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = getattr(target, "config", None)
    if cfg is None:
        return None
    called: List[bool] = []
    seen: set = set()
    eager = getattr(sys.modules[type(target).__module__], "eager_attention_forward", None)
    own = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation or "eager", eager)
    params = dict(target.named_parameters(recurse=False))

    def spy(module: nn.Module, *a: Any, **k: Any) -> Any:
        called.append(True)
        seen.update(n for n, p in params.items() if any(v is p for v in k.values()))
        return own(_Reads(module, seen), *a, **k)

    AttentionInterface.register(SPY, spy)
    probe = copy.copy(target)  # the same parameters, another config
    probe.config = copy.copy(cfg)
    probe.config._attn_implementation_internal = SPY
    try:
        _run(probe, args, kwargs)
    except Exception:  # noqa: BLE001
        return None
    return {n for n in seen if n in params} if called else None


SPY = "atp_spy"


def _split_hidden_fails(target: nn.Module, args: tuple, kwargs: dict, spec: AttentionSpec, hidden: int
                        ) -> Optional[str]:
    """Why the attention ``target`` does not run on the hidden state split in two (as over d2:
    its projections read, and its output projection writes, half the features; every input
    over the hidden halved), e.g. its code reading a width off its input (None: it runs)."""
    import torch

    probe = copy.deepcopy(target)
    half = torch.arange(hidden // 2)
    for p in ((spec.qkv,) if spec.qkv else (spec.q, spec.k, spec.v)) + spec.extra:
        _cut(getattr(probe, p), half, output=False)
    _cut(getattr(probe, spec.o), half, output=True)
    cut = lambda t: t[..., :hidden // 2] if isinstance(t, torch.Tensor) and t.shape[-1:] == (hidden,) else t  # noqa: E731
    try:
        out = _run(probe, tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()})
    except Exception as exc:  # noqa: BLE001 — the module's own code refuses the split hidden
        return f"its code does not run on the hidden state split over d2 ({type(exc).__name__}: " \
               f"{str(exc).splitlines()[0][:100]})"
    if out.shape[-1:] != (hidden // 2,):
        return "its code does not run on the hidden state split over d2 (an output of another width)"
    return None


def _feature_dim(linear: nn.Module, output: bool) -> int:
    """The weight dimension holding a linear's output (or input) features, by its registered
    kind (:func:`~atp_pipeline.parallel.linear.register_linear_kind`: Conv1D stores W in x out)."""
    transposed = _transposed(type(linear))
    return (1 if transposed else 0) if output else (0 if transposed else 1)


def _cut(linear: nn.Module, index: Any, output: bool) -> None:
    """Keep only the output features (and bias) or input features ``index`` of a linear."""
    dim = _feature_dim(linear, output)
    linear.weight = nn.Parameter(linear.weight.index_select(dim, index.to(linear.weight.device)))
    if output and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.index_select(0, index.to(linear.weight.device)))
    if isinstance(linear, nn.Linear):
        linear.out_features, linear.in_features = linear.weight.shape
    elif hasattr(linear, "nf"):
        linear.nf = linear.weight.shape[1]


def _permute(linear: nn.Module, index: Any, output: bool) -> None:
    """Reorder a linear's output features (and bias) or input features by ``index``."""
    w = linear.weight
    w.copy_(w.index_select(_feature_dim(linear, output), index.to(w.device)))
    if output and linear.bias is not None:
        linear.bias.copy_(linear.bias.index_select(0, index.to(w.device)))


def register_plain_linears(root: nn.Module) -> None:
    """Register as linear kinds the subclasses of a linear kind in ``root`` whose own ``forward``
    is shown, on a random input, to compute the plain ``x W^T + b`` (Falcon's ``FalconLinear``),
    so the styles may replace them; any other stays refused by the styles. Nothing is shown on
    the meta device."""
    import torch
    import torch.nn.functional as F

    seen = set(linear_kinds())
    for m in root.modules():
        cls = type(m)
        if cls in seen or not isinstance(m, linear_kinds()) or m.weight.is_meta:
            continue
        seen.add(cls)
        base = next(t for t in cls.__mro__ if t in linear_kinds())
        if cls.forward is base.forward:
            continue
        n_in, _, w, b = as_linear(m)
        x = torch.randn(2, 3, n_in, dtype=w.dtype, device=w.device, generator=torch.Generator().manual_seed(0)
                        ) if w.device.type == "cpu" else torch.randn(2, 3, n_in, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            try:
                same = torch.allclose(m(x), F.linear(x, w, b), rtol=1e-6, atol=1e-7)
            except Exception:  # noqa: BLE001 — its forward does something else
                same = False
        if same:
            register_linear_kind(cls, transposed=_transposed(base))


def register_conv1d() -> None:
    """GPT-2's ``Conv1D`` (``y = x W + b``, ``W`` stored in x out) as a linear kind of the
    ``column``/``row`` styles (called when a transformers model is laid out)."""
    from transformers.pytorch_utils import Conv1D

    register_linear_kind(Conv1D, transposed=True)
