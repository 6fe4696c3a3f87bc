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

The steps live by idea: :mod:`.declared` reads the blocks' linears (declared, or off the
modules), :mod:`.attention_spec` lays out the attention (shown to run on blocks of heads by
:mod:`.probe`), :mod:`.mlp` the MLP and the experts, :mod:`.linears` registers the linear
kinds; this module runs them in order and places the norms.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Dict, List, Mapping, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.hf.attention_spec import lay_out_attentions
from atp_pipeline.models.hf.declared import (
    BY_HAND,
    LOCAL,
    NORM,
    PER_HEAD,
    Linears,
    Scope,
    attention_modules,
    declared_plan,
    first,
    head_counts,
    inspect_linears,
    pattern,
    read_declared,
    text_config,
)
from atp_pipeline.models.hf.linears import register_conv1d, register_plain_linears
from atp_pipeline.models.hf.mlp import experts_shown, lay_out_experts, lay_out_mlps, whole_between
from atp_pipeline.models.hf.spec import Layout
from atp_pipeline.models.hf.whole import derive_with_whole, idle_units, token_forward
from atp_pipeline.parallel.fsdp import block_units


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
    hidden = int(getattr(text_config(module.config) or module.config, "hidden_size", 0) or 0)  # (none: refused below)
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
    names = {n: m for n, m in module.named_modules()
             if not any(fnmatch.fnmatchcase(n, w + ".*") for w in run_whole)}
    counts, no_heads = _head_counts(config)
    hidden = int((text_config(config) or config).hidden_size)
    declared = {pat: style for pat, style in declared_plan(config).items() if style not in BY_HAND}
    layout = Layout(source="declared" if declared else "modules")
    blocks = [n for n, _ in block_units(module) if not any(n.startswith(w + ".") for w in run_whole)]
    lists = tuple(sorted({b.rpartition(".")[0] for b in blocks}))
    scope = Scope(module=module, names=names, blocks=blocks, lists=lists, hidden=hidden,
                  kind=getattr(config, "model_type", "?"), probe=probe)
    linears = _block_linears(scope, declared, run_whole, layout)
    plan: Dict[str, str] = {}
    attention = lay_out_attentions(scope, linears, family.attention_spec if family is not None else None, counts,
                                   no_heads, layout, plan)
    _check_attention_params(linears, attention, run_whole, scope.kind)
    # the other linears (the MLP): column-first reading the hidden, row-first writing it
    moe_blocks = [e.rpartition(".")[0] for e in linears.experts]
    by_parent, shared_ffn = lay_out_mlps(scope, {n: k for n, k in linears.kinds.items() if not _inside(n, attention)},
                                         linears.declared, moe_blocks, plan, layout)
    for full in linears.experts:
        layout.moe = lay_out_experts(plan, names, full, hidden, scope.kind, config, shared_ffn,
                                     module if probe else None)
    if layout.moe is not None and not layout.ffn:
        layout.ffn = layout.moe.ffn  # every layer's MLP is routed
    _lay_out_norms(scope, attention, by_parent, plan, layout)
    layout.plan = {**run_whole, **plan}  # first: the plan's patterns then reach nothing inside them
    return layout


def _head_counts(config: Any) -> Tuple[Tuple[int, int, int], str]:
    """The config's (query heads, key/value heads, head dim) (:func:`~.declared.head_counts`),
    or, where it has none but a hidden size (a state-space model; counts per layer: every mixer
    runs whole), zeros and why there are none."""
    try:
        return head_counts(config), ""
    except ConfigError as exc:
        if not getattr(text_config(config) or config, "hidden_size", None):
            raise
        return (0, 0, 0), str(exc).removesuffix("; pass a plan")


def _block_linears(scope: Scope, declared: Mapping[str, str], run_whole: Mapping[str, str],
                   layout: Layout) -> Linears:
    """The repeated blocks' linears and what else ``declared`` names (:func:`~.declared.read_declared`);
    where it declares no linear, read off the modules (``layout.source``: ``"modules"``), as
    are experts it does not name and the attention's projections where it declares the MLP's
    only (those then shown to run on blocks of heads)."""
    names, blocks, hidden, lists = scope.names, scope.blocks, scope.hidden, scope.lists
    found = read_declared(scope, declared)
    if not found.experts:  # experts the declaration does not name: read off the modules (their class's flags)
        found.experts = experts_shown(names, blocks, lists, scope.module if scope.probe else None)
    moe_blocks = [e.rpartition(".")[0] for e in found.experts]
    if not found.kinds:  # nothing declared, or only embeddings: read the blocks' linears off the modules
        found.declared = False
        layout.source = "modules"
        found.kinds = inspect_linears(names, blocks, hidden, lists, moe_blocks)
    if not found.kinds and not found.experts and not run_whole:  # (a block of whole mixers and experts: none)
        raise ConfigError(f"transformers model_type '{scope.kind}': no repeated block with linear projections "
                          f"(ATP lays out transformer blocks); pass a plan")
    found.attention_declared = found.declared
    if found.declared and not attention_modules(names, found.kinds):  # a declaration of the MLP only: the
        try:  # attention's projections read off its modules (and shown to run on blocks of heads)
            shown = inspect_linears(names, blocks, hidden, lists, moe_blocks)
        except ConfigError:
            shown = {}
        attention = attention_modules(names, shown)
        found.kinds.update({n: k for n, k in shown.items() if n.rpartition(".")[0] in attention})
        found.attention_declared = not attention
    return found


def _inside(name: str, attention: List[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, a + ".*") for a in attention)


def _check_attention_params(linears: Linears, attention: List[str], run_whole: Mapping[str, str], kind: str) -> None:
    """Refuse in one line local parameters declared on a module other than an attention (or one
    run whole), and per-head norms declared outside the attention."""
    for full in linears.local:
        if full not in attention and full not in run_whole:  # (a module run whole keeps its parameters whole)
            raise ConfigError(f"transformers model_type '{kind}': '{full}' is declared '{LOCAL}' (parameters kept "
                              f"local to each rank) on a module other than an attention; ATP's layout does not "
                              f"cover it; pass a plan")
    for full in linears.per_head:
        if not _inside(full, attention):
            raise ConfigError(f"transformers model_type '{kind}': '{full}' is declared '{PER_HEAD}' outside "
                              f"the attention, which ATP's layout does not cover; pass a plan")


def _lay_out_norms(scope: Scope, attention: List[str], by_parent: Mapping[str, List[str]], plan: Dict[str, str],
                   layout: Layout) -> None:
    """The norms outside the attention: the family's own norm on the gathered hidden (a norm
    over the whole intermediate of its MLP between gathered linears; one outside the blocks over
    another width run whole); ``layout.norm`` the kind of the last."""
    names, hidden, blocks, kind = scope.names, scope.hidden, scope.blocks, scope.kind
    for name in sorted({pattern(n, scope.lists) for n, m in names.items() if NORM.search(type(m).__name__)}):
        if not _inside(name, attention) and not any(fnmatch.fnmatchcase(name, p + ".*") for p in plan):
            inner = any(p.startswith(name + ".") for p in plan)  # (a gate's linears inside a gated norm, laid
            # out by none: aside, it runs whole on the gathered hidden like any norm)
            widths = {int(q.numel()) for q in first(names, name).parameters() if inner or q.dim() <= 1}
            parent = name.rpartition(".")[0]
            if len(widths) == 1 and widths - {hidden} and \
                    whole_between(plan, names, by_parent.get(parent, []), next(iter(widths))):
                # a norm over the whole intermediate of its MLP (BitNet's ffn_sub_norm): that MLP's
                # column-first outputs gathered, the norm run whole, its row-first input whole
                plan[name] = "gathered"
                layout.whole_mlp = True
                continue
            table = getattr(scope.module.get_input_embeddings(), "embedding_dim", hidden)
            if widths - {hidden, table} and "*" not in name and not any(name.startswith(b + ".") for b in blocks):
                # outside the blocks, over a width neither the hidden's nor the (split) token table's (a per-layer
                # input computed beside the hidden): whole, as the modules writing it (.whole.side_style)
                plan[name] = "gathered"
                continue
            if widths - {hidden}:
                raise ConfigError(f"transformers model_type '{kind}': norm '{name}' "
                                  f"({type(first(names, name)).__name__}) is over a width "
                                  f"{sorted(widths - {hidden})} other than the hidden state ({hidden}), between split "
                                  f"linears; ATP's layout does not cover it; pass a plan")
            plan[name] = "gathered(input=split, output=split)"
            low = type(first(names, name)).__name__.lower()
            layout.norm = "layernorm" if "layernorm" in low and "rms" not in low else "rmsnorm"
