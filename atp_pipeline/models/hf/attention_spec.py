"""How each attention module of an HF model is laid out (§3.2.1, Figure 6a): its q/k/v (or
fused q|k|v) and output projections read off their declared kinds and shapes
(:class:`AttentionSpec`, style ``hf_attention``), or a multi-head latent attention
(:mod:`.mla`, style ``hf_mla``); where nothing declares them, shown to run on blocks of its
heads (:mod:`.probe`), or run on whole q/k/v where only that holds."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Dict, List, Mapping, Optional, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.hf import mla
from atp_pipeline.models.hf.declared import (
    ATTENTION,
    COLUMN_KINDS,
    ROW_KINDS,
    WHOLE_KINDS,
    Linears,
    Scope,
    attention_modules,
    first,
    pattern,
)
from atp_pipeline.models.hf.linears import cut_features, is_linear
from atp_pipeline.models.hf.probe import (
    calls_interface,
    capture,
    head_biases,
    probe_fused,
    read_by_core,
    run_eval,
    runs_on_head_blocks,
)
from atp_pipeline.models.hf.spec import AttentionSpec, Layout
from atp_pipeline.models.hf.whole import is_unit
from atp_pipeline.parallel.linear import as_linear

ROLE = {"q": re.compile(r"(^|_)(q|query)(_|$)|^wq$", re.IGNORECASE),
        "k": re.compile(r"(^|_)(k|key)(_|$)|^wk$", re.IGNORECASE),
        "v": re.compile(r"(^|_)(v|value)(_|$)|^wv$", re.IGNORECASE)}
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
WIDTH_ATTRS = ("split_size", "embed_dim", "all_head_size")
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def as_whole(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with whole q/k/v: the projections' outputs gathered over d1, the module's own
    code run on all heads (its core on this rank's, where it calls transformers' interface)."""
    return AttentionSpec(q=spec.q, k=spec.k, v=spec.v, o=spec.o, qkv=spec.qkv, fused=spec.fused or "",
                         whole=True, counts=spec.counts, head_params=spec.head_params, extra=spec.extra)


def lay_out_attentions(scope: Scope, linears: Linears, spec_given: Optional[AttentionSpec],
                       counts: Tuple[int, int, int], no_heads: str, layout: Layout, plan: Dict[str, str]) -> List[str]:
    """Lay out the attention modules of the repeated blocks into ``plan`` (and what the shape
    reads of them into ``layout``); their patterns. ``spec_given``: the family entry's (its
    attention modules are those with the named projections); ``counts``: the config's heads,
    key/value heads and head dim (none: ``no_heads`` says why, and an attention is refused)."""
    module, names, kinds, hidden, kind, probe = (scope.module, scope.names, linears.kinds, scope.hidden,
                                                 scope.kind, scope.probe)
    heads, kv, hd = counts
    attention_declared = linears.attention_declared
    attention = attention_modules(names, kinds) if spec_given is None else sorted(
        {pattern(n, scope.lists) for n, m in names.items() if ATTENTION.search(type(m).__name__)
         and all(is_linear(getattr(m, p, None)) for p in (spec_given.qkv, spec_given.o))})
    for att in attention:
        if not heads:  # nothing to split it by: it may run whole (models/hf/whole.py)
            raise ConfigError(f"{no_heads}: attention '{att}' ({type(first(names, att)).__name__}) is not split "
                              f"by heads; pass a plan")
        if spec_given is None and _latent_attention(module, att, names, kinds, layout, plan, hidden, heads, kind,
                                                    probe):
            continue
        spec = spec_given or _attention_spec(module, att, names, kinds, hidden, heads, kv, hd,
                                             declared=attention_declared, kind=kind, probe=probe)
        if not hasattr(first(names, att), "config"):
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
                                  f"({type(first(names, att)).__name__}): {why}; pass a plan")
        plan[att] = spec.style()
        layout.qkv_fused = bool(spec.qkv)
        layout.whole_attention = spec.whole
        module_ = first(names, att)
        projections = {spec.q, spec.k, spec.v, spec.qkv, spec.o, *spec.extra}
        layout.head_norm_params = 0 if spec.whole else sum(
            p.numel() for n, sub in module_.named_children() if n not in projections for p in sub.parameters())
        layout.heads_over_d2 = not spec.counts[0] and _calls_attention_interface(module_)
        layout.sink_params = sum(getattr(module_, a).numel() for a in spec.head_params)
        layout.gate_width = max(layout.gate_width, 0 if spec.whole else _gate_width(module_, spec, heads, hd))
        layout.bias = layout.bias or any(getattr(first(names, f"{att}.{p}"), "bias", None) is not None
                                         for p in (spec.q, spec.qkv, spec.o) if p)
    return attention


def _gate_width(module: nn.Module, spec: AttentionSpec, heads: int, hd: int) -> int:
    """Columns of the attention's per-head output gates: its own projections beside q/k/v
    (``extra``) and a q projection wider than its heads (a gate fused per head with q, as
    MiniCPM5-MoE's ``q_gate_proj``); split over d1 with q, in the f1 all-reduce."""
    heads, _, hd = spec.counts if spec.counts[0] else (heads, 0, hd)
    gates = sum(as_linear(getattr(module, p))[1] for p in spec.extra)
    if spec.q:
        gates += max(as_linear(getattr(module, spec.q))[1] - heads * hd, 0)
    return gates


def _latent_attention(root: nn.Module, att: str, names: Mapping[str, nn.Module], kinds: Mapping[str, str],
                      layout: Layout, plan: Dict[str, str], hidden: int, heads: int, kind: str, probe: bool) -> bool:
    """Lay out the attention ``att`` as a multi-head latent attention (:mod:`.mla`), shown to
    run on blocks of its heads where it can be run (``probe``); False: it is not one."""
    module = first(names, att)
    what = f"transformers model_type '{kind}': attention '{att}' ({type(module).__name__})"
    rows = [n.rpartition(".")[2] for n, k in kinds.items() if n.rpartition(".")[0] == att and k in ROW_KINDS]
    spec = mla.read_latent(module, hidden, heads, rows, what)
    if spec is None:
        return False
    got = capture(root, att) if probe else None
    if got is not None:
        why = mla.latent_infeasibility(*got, spec, run_eval, cut_features, calls_interface)
        if why:
            raise ConfigError(f"{what}: {why}; pass a plan")
    plan[att] = spec.style()
    layout.latent = spec.shape
    layout.bias = layout.bias or any(getattr(module, p).bias is not None for p in (spec.q, spec.o))
    return True


def _calls_attention_interface(module: nn.Module) -> bool:
    """Whether the attention's ``forward`` runs its core through transformers' attention
    interface (where the layout scatters the heads over d2); its own core (GPT-Neo's) runs on
    the rank's d1 heads, replicated over d2. True where the source cannot be read."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _attention_spec(root: nn.Module, att: str, names: Mapping[str, nn.Module], kinds: Mapping[str, str],
                    hidden: int, heads: int, kv: int, hd: int, declared: bool, kind: str,
                    probe: bool = True) -> AttentionSpec:
    """The projections of the attention modules ``att`` (a pattern), from their linears' kinds
    and shapes; refused in one line where they do not add up to q/k/v and an output."""
    module = first(names, att)
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
    if own and not read_by_core(root, att, own, heads, probe):
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
