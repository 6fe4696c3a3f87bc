"""Which linears of an HF model's repeated blocks are column-first and which row-first, read
from transformers' declaration (``base_model_tp_plan``) or, where it declares none, off the
modules' names and shapes; and the names the layout matches modules by."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.hf import mla
from atp_pipeline.models.hf.linears import is_linear
from atp_pipeline.parallel.linear import as_linear

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


@dataclass(frozen=True)
class Scope:
    """The model as each step of the layout reads it."""

    module: nn.Module
    names: Dict[str, nn.Module]  # its modules by name (but those inside the modules run whole)
    blocks: List[str]  # its repeated blocks, by name
    lists: Tuple[str, ...]  # the module lists holding them
    hidden: int  # the config's hidden size
    kind: str  # its model_type
    probe: bool  # whether modules may be run on tokens to show what their names do not


@dataclass
class Linears:
    """The repeated blocks' linears by full pattern (transformers' kind: ``colwise``,
    ``rowwise``, ...) and the other modules a declaration names."""

    kinds: Dict[str, str] = field(default_factory=dict)
    per_head: List[str] = field(default_factory=list)  # per-head norms (gradients summed over d1)
    local: List[str] = field(default_factory=list)  # attention modules' own per-head parameters
    experts: List[str] = field(default_factory=list)  # experts modules (style hf_experts)
    declared: bool = False  # the kinds are transformers' declaration (not read off the modules)
    attention_declared: bool = False  # the attention's projections among them are declared


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
    for c in (config, text_config(config)):
        plan = getattr(c, "base_model_tp_plan", None) if c is not None else None
        if plan:
            return dict(plan)
    return {}


def text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 — not every config has one
        return None


def first(names: Mapping[str, nn.Module], pat: str) -> nn.Module:
    return next(m for n, m in names.items() if fnmatch.fnmatchcase(n, pat))


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


def head_counts(config: Any) -> Tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of ``config``; refused in one line where the
    config has none (a state-space or recurrent model) or they vary by layer."""
    c = text_config(config) or config
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


def read_declared(scope: Scope, declared: Mapping[str, str]) -> Linears:
    """The declaration ``declared`` (pattern relative to the text model -> transformers' style,
    the styles transformers combines by hand left out) matched against the modules: each
    linear's kind, the per-head norms, modules of local parameters and experts; refused in one
    line for a style ATP's layout does not cover where it matches."""
    names, blocks, hidden, kind = scope.names, scope.blocks, scope.hidden, scope.kind
    out = Linears(declared=bool(declared))
    for pat, style in declared.items():
        full, hits = _resolve(names, scope.module.base_model_prefix, pat)
        if not hits:
            continue  # a module this configuration does not build
        if style == EXPERTS:
            out.experts.append(full)
            continue
        if style in EMBEDDING_KINDS:
            if all(isinstance(names[h], nn.Embedding) for h in hits) and not any(
                    h.startswith(b + ".") for h in hits for b in blocks):
                continue  # an embedding outside the blocks: laid out by the layout's last steps
            raise ConfigError(f"transformers model_type '{kind}': '{pat}' is declared '{style}' inside the "
                              f"blocks, which ATP's layout does not cover; pass a plan")
        if style == PER_HEAD:
            out.per_head.append(full)
            continue
        if style == LOCAL:  # an attention module's own per-head parameters (sinks): see attention_spec
            out.local.append(full)
            continue
        if style == mla.MLA_A:  # a latent projection: read with its attention (mla.read_latent)
            style = "colwise"
        if style not in COLUMN_KINDS + ROW_KINDS:
            raise ConfigError(f"transformers model_type '{kind}': '{pat}' is declared '{style}', which ATP's "
                              f"layout does not cover; pass a plan")
        if not all(is_linear(names[h]) for h in hits):
            raise ConfigError(f"transformers model_type '{kind}': '{pat}' is declared '{style}' but is a "
                              f"{type(names[hits[0]]).__name__}, not a linear; pass a plan")
        n_in, n_out, _, _ = as_linear(names[hits[0]])
        if not any(h.startswith(b + ".") for h in hits for b in blocks) and \
                hidden not in ((n_out,) if style in ROW_KINDS else (n_in,)):
            continue  # outside the blocks, not beside the hidden as declared: a module around it may run whole
        out.kinds[full] = style
    return out


def inspect_linears(names: Mapping[str, nn.Module], blocks: List[str], hidden: int,
                     lists: Tuple[str, ...], moe_blocks: List[str] = ()) -> Dict[str, str]:
    """The linears of the repeated blocks, read off their shapes (no declaration): those
    reading the hidden state column-first, those writing it row-first; inside an attention
    module all of them (its projections are sorted out by :func:`_attention_spec`). Those in
    ``moe_blocks`` (the patterns of blocks holding declared experts: routers, shared experts)
    are left to :func:`lay_out_experts`."""
    out: Dict[str, str] = {}
    for name, m in names.items():
        if not is_linear(m) or not any(name.startswith(b + ".") for b in blocks):
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


def attention_modules(names: Mapping[str, nn.Module], kinds: Mapping[str, str]) -> List[str]:
    """Patterns of the attention modules: parents of laid-out linears whose class says so."""
    out = set()
    for n in kinds:
        parent = n.rpartition(".")[0]
        m = first(names, n.rpartition(".")[0]) if parent else None
        if m is not None and ATTENTION.search(type(m).__name__):
            out.add(parent)
    return sorted(out)
