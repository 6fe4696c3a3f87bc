"""transformers causal LMs through the model seam: shape from the model's config, ATP's layout
from what transformers already declares (``base_model_tp_plan``) plus a few lines per family
where it declares nothing (:data:`FAMILIES`).

ATP's layout for a decoder (§3.2): activations between blocks split by hidden over d2;
the attention's q/k/v (separate, or one fused projection: GPT-2's concatenated ``c_attn``,
GPT-NeoX's per-head interleaved ``query_key_value``) column-first and its output
projection row-first, with the core on local heads
(:class:`~atp_pipeline.models.hf.attention.HFAttention`); the MLP's ``colwise`` linears
(up/gate, fc1) column-first and its ``rowwise`` one (down, fc2) row-first, as transformers'
``base_model_tp_plan`` marks them (``nn.Linear`` or GPT-2's ``Conv1D``); every norm run
whole on the gathered hidden (style ``gathered``: the family's own norm runs, bit for
bit); the token embedding and plain learned positions split by hidden, a position
embedding whose ``forward`` derives the positions (OPT) run whole and sliced; the LM head
column-first with its logits gathered, or — tied to the token embedding — sharing its
split table (style ``tied``), so transformers' own loss runs on whole logits. The
family's own ``forward`` runs throughout (rotary and partial rotary, parallel residual,
learned positions), so nothing of the model is re-implemented.

A family not in :data:`FAMILIES`, or a configuration of one that the layout does not cover,
is refused with one line naming its ``model_type``. Every module holding parameters must be
covered by the plan: one that is not would see split activations, so the plan refuses it
by name. Dropout is refused (ranks holding different blocks of a tensor would draw the
same masks).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.adapter import ModelAdapter, register_adapter
from atp_pipeline.parallel.apply import match_plan
from atp_pipeline.models.hf.weights import export_pretrained, safetensors_reader
from atp_pipeline.parallel.linear import register_linear_kind
from atp_pipeline.parallel.materialize import parameters_on_meta
from atp_pipeline.parallel.styles import register_style
from atp_pipeline.planning.shape import ModelShape

_NORM = re.compile(r"(RMSNorm|LayerNorm)$")


@dataclass(frozen=True)
class Family:
    """What ATP's layout needs of a transformers family beyond its config and its declared
    ``base_model_tp_plan``: the attention style (projection names, a fused q|k|v's layout,
    attributes its ``forward`` reshapes by), the MLP's colwise/rowwise linears where
    transformers declares no plan (GPT-2, OPT), and how its config names the shape."""

    attention: str = "hf_attention"
    linears: Mapping[str, str] = field(default_factory=dict)  # only where base_model_tp_plan is absent
    ffn: Callable[[Any], int] = lambda c: int(c.intermediate_size)
    gated: bool = True
    norm: str = "rmsnorm"
    bias: Callable[[Any], bool] = lambda c: bool(getattr(c, "attention_bias", False))
    position: str = "rotary"
    qkv_fused: bool = False
    final_norm: Callable[[Any], bool] = lambda c: True
    gathered_positions: bool = False  # a position embedding whose forward derives the positions
    refuse: Callable[[Any], str] = lambda c: ""  # why a config of the family cannot be laid out


FAMILIES: Dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(bias=lambda c: True),
    "gpt_neox": Family(attention="hf_attention(qkv=query_key_value, fused=heads, o=dense)", gated=False,
                       norm="layernorm", bias=lambda c: bool(c.attention_bias), qkv_fused=True),
    "gpt2": Family(attention="hf_attention(qkv=c_attn, fused=concat, o=c_proj, per_rank=split_size)",
                   linears={"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
                   ffn=lambda c: int(c.n_inner or 4 * c.hidden_size), gated=False, norm="layernorm",
                   bias=lambda c: True, position="learned", qkv_fused=True,
                   refuse=lambda c: "cross-attention (add_cross_attention=True)" if c.add_cross_attention else ""),
    "opt": Family(attention="hf_attention(o=out_proj, per_rank=num_heads)",
                  linears={"decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise"},
                  ffn=lambda c: int(c.ffn_dim), gated=False, norm="layernorm", bias=lambda c: bool(c.enable_bias),
                  position="learned", gathered_positions=True,
                  final_norm=lambda c: bool(c.do_layer_norm_before and not c._remove_final_layer_norm),
                  refuse=lambda c: (f"word_embed_proj_dim={c.word_embed_proj_dim} differs from hidden_size="
                                    f"{c.hidden_size} (project_in/project_out)")
                  if c.word_embed_proj_dim != c.hidden_size else ""),
}
SUPPORTED = tuple(FAMILIES)


def is_hf_causal_lm(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith(("ForCausalLM", "LMHeadModel")) \
        and hasattr(module, "config")


def family_of(config: Any) -> Family:
    """The :class:`Family` of a transformers config, or one line saying why there is none."""
    kind = getattr(config, "model_type", "?")
    family = FAMILIES.get(kind)
    if family is None:
        raise ConfigError(f"transformers model_type '{kind}' has no ATP layout yet (supported: "
                          f"{', '.join(SUPPORTED)}); pass plan={{module pattern: style}} to ATPStrategy or set "
                          f"the LightningModule's parallel_plan")
    why = family.refuse(config)
    if why:
        raise ConfigError(f"transformers model_type '{kind}': {why} is not laid out by ATP yet; pass a plan")
    return family


def shape_of_config(config: Any, name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a transformers ``PretrainedConfig`` of a supported family."""
    family = family_of(config)
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelShape(
        name=name or str(config.model_type), hidden=hidden, heads=heads, layers=int(config.num_hidden_layers),
        seq_len=int(getattr(config, "max_position_embeddings", 2048)), vocab_size=int(config.vocab_size),
        ffn=family.ffn(config), kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads), gated=family.gated, norm=family.norm,
        bias=family.bias(config), position=family.position,
        tied_embeddings=tied, norm_layout="gathered", head_layout="tied" if tied else "gathered",
        qkv_fused=family.qkv_fused, final_norm=family.final_norm(config),
        gathered_embeddings=int(family.gathered_positions))


PRETRAINED = "atp_pretrained"  # attribute of a model built by load_pretrained: its checkpoint directory


def _pretrained(cfg: Any) -> Optional[str]:
    """``cfg.pretrained`` of a model config (DictConfig, dict or object)."""
    value = cfg.get("pretrained", None) if hasattr(cfg, "get") else getattr(cfg, "pretrained", None)
    return str(value) if value else None


def load_pretrained(path: str, config: Any = None) -> nn.Module:
    """A transformers causal LM of the local HF checkpoint ``path``, its parameters on the meta
    device: ``Trainer(strategy="atp")`` lays it out, allocates this rank's shards and reads
    only those from the checkpoint (a user's way to a model bigger than one device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = config if config is not None else AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    setattr(model, PRETRAINED, str(path))
    return model


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


_CONFIGS: Dict[tuple, Any] = {}


class NotGiven(Exception):
    """A config field the shape reads that a model config's ``hf`` block does not give."""


class GivenFields:
    """A model config's ``hf`` block read as a transformers config, with no defaults: a field
    it does not give raises :class:`NotGiven` (not ``AttributeError``, so a ``getattr``
    default cannot stand in for transformers' own)."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self._fields = dict(fields)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._fields[key]
        except KeyError:
            raise NotGiven(key) from None


def _hf_config(name: str, fields: Dict[str, Any], pretrained: Optional[str]) -> Any:
    """:meth:`HFCausalLMAdapter.hf_config`, uncached; refusals are one line."""
    from transformers import AutoConfig

    if pretrained and not (Path(pretrained) / "config.json").exists():
        raise ConfigError(f"model '{name}': model.pretrained={pretrained} has no config.json")
    kind = fields.pop("model_type", None)
    if not pretrained and kind is None:
        raise ConfigError(f"model '{name}': set model.pretrained=<a local HF checkpoint directory> or "
                          f"model.hf.model_type (supported: {', '.join(SUPPORTED)})")
    if not pretrained and kind not in SUPPORTED:
        raise ConfigError(f"model '{name}': model.hf.model_type={kind!r} has no ATP layout yet "
                          f"(supported: {', '.join(SUPPORTED)})")
    try:
        config = AutoConfig.from_pretrained(pretrained, **fields) if pretrained else \
            AutoConfig.for_model(kind, **fields)
    except (TypeError, ValueError, OSError) as exc:
        raise ConfigError(f"model '{name}': model.hf: {str(exc).splitlines()[0]}") from None
    family_of(config)
    return config


class HFCausalLMAdapter(ModelAdapter):
    """``*ForCausalLM`` of transformers (families in :data:`SUPPORTED`)."""

    family = "hf"

    def matches(self, module: nn.Module) -> bool:
        return is_hf_causal_lm(module)

    def shape(self, module: nn.Module) -> ModelShape:
        register_conv1d()
        return shape_of_config(module.config)

    @staticmethod
    def hf_config(cfg: Any) -> Any:
        """The transformers config of a model config: read from ``pretrained`` (a local HF
        checkpoint directory) if set, else from ``model_type``; the ``hf`` block's fields set
        on top. A copy of one cached per (name, checkpoint, fields): the run reads the shape
        and then builds from the same config."""
        get = (lambda k: cfg.get(k, None)) if hasattr(cfg, "get") else (lambda k: getattr(cfg, k, None))
        name = str(get("name") or "?")
        fields = dict(get("hf") or {})
        pretrained = _pretrained(cfg)
        stamp = (Path(pretrained) / "config.json").stat().st_mtime_ns if pretrained and \
            (Path(pretrained) / "config.json").exists() else None
        key = (name, pretrained, stamp, json.dumps(fields, sort_keys=True, default=str))
        if key not in _CONFIGS:
            _CONFIGS[key] = _hf_config(name, fields, pretrained)
        return copy.deepcopy(_CONFIGS[key])

    def shape_from_config(self, cfg: Any) -> ModelShape:
        """The shape of a model config. One whose ``hf`` block spells out every field the shape
        reads (the real-size presets) is read without transformers, which ``stage=plan`` then
        never imports; any other goes through :meth:`hf_config` (transformers' defaults)."""
        get = (lambda k, d: cfg.get(k, d)) if hasattr(cfg, "get") else (lambda k, d: getattr(cfg, k, d))
        dtype = get("dtype", "fp32")
        name = str(get("name", ""))
        fields = dict(get("hf", None) or {})
        shape = None
        if not _pretrained(cfg) and fields.get("model_type") in SUPPORTED:
            try:
                shape = shape_of_config(GivenFields(fields), name)
            except NotGiven:
                pass
        return (shape or shape_of_config(self.hf_config(cfg), name)).with_step(
            batch_size=int(get("batch_size", 1)), seq_len=int(get("seq_len", 0)) or None,
            dtype=str(getattr(dtype, "value", dtype)))

    def build(self, cfg: Any) -> nn.Module:
        """The model of ``cfg``; with ``pretrained``, its parameters on the meta device (each
        rank allocates and reads only its shards once laid out: :meth:`weights`)."""
        from transformers import AutoModelForCausalLM

        config = self.hf_config(cfg)
        pretrained = _pretrained(cfg)
        if not pretrained:
            return AutoModelForCausalLM.from_config(config)
        return load_pretrained(pretrained, config)

    def build_outline(self, cfg: Any) -> nn.Module:
        """:meth:`build` with at most two decoder layers (the family's plan is per layer)."""
        from transformers import AutoModelForCausalLM

        config = self.hf_config(cfg)
        config.num_hidden_layers = min(int(config.num_hidden_layers), 2)
        return AutoModelForCausalLM.from_config(config)

    def weights(self, module: nn.Module) -> Optional[Any]:
        path = getattr(module, PRETRAINED, None)
        return safetensors_reader(path, module) if path else None

    def export(self, module: nn.Module, out_dir: str) -> Optional[str]:
        out = export_pretrained(module, out_dir)
        return str(out) if out is not None else None

    def lm_loss(self, model: nn.Module, idx: Any, targets: Any) -> Any:
        """transformers' own loss on next-token targets already shifted (``shift_labels``)."""
        return model(input_ids=idx, labels=targets, shift_labels=targets).loss

    def parallel_plan(self, module: nn.Module) -> Mapping[str, Any]:
        """ATP's layout of ``module`` (§3.2) as a plan of styles, from the family's declared
        ``base_model_tp_plan`` (or :attr:`Family.linears`) and its attention style."""
        register_conv1d()
        config = module.config
        family = family_of(config)
        # training keeps no key/value cache: the blocks' chunks (§4.1) would share one and read each
        # other's keys (transformers turns it off itself only under gradient checkpointing)
        config.use_cache = False
        base = module.base_model_prefix
        names = dict(module.named_modules())
        declared = dict(family.linears or getattr(config, "base_model_tp_plan", None) or {})
        plan: Dict[str, Any] = {}
        colwise_under: Dict[str, int] = {}  # column-first linears per parent (gate and up read one input)
        for pattern, kind in declared.items():
            if kind == "colwise":
                parent = pattern.rpartition(".")[0]
                colwise_under[parent] = colwise_under.get(parent, 0) + 1
        attention = sorted({_pattern(n) for n, m in names.items() if type(m).__name__.endswith("Attention")})
        for pattern in attention:
            plan[pattern] = family.attention
        for pattern, kind in declared.items():
            full = f"{base}.{pattern}"
            if any(fnmatch.fnmatchcase(full, a + ".*") for a in attention):
                continue  # laid out by the attention style
            matched = [m for n, m in names.items() if fnmatch.fnmatchcase(n, full)]
            if kind.startswith("embedding") and matched and all(isinstance(m, nn.Embedding) for m in matched):
                continue  # an embedding (e.g. GPT-NeoX's 'embedding_rowwise' since transformers 5.24): below
            if kind not in ("colwise", "rowwise"):
                raise ConfigError(f"transformers model_type '{config.model_type}': '{pattern}' is declared "
                                  f"'{kind}', which ATP's layout does not cover; pass a plan")
            shared = kind == "colwise" and colwise_under[pattern.rpartition(".")[0]] > 1
            plan[full] = f"{'column' if kind == 'colwise' else 'row'}(input=split, output=split" + \
                (", shared=true)" if shared else ")")
        by_object = {id(m): n for n, m in names.items()}
        table = by_object[id(module.get_input_embeddings())]
        plan[table] = "embedding(output=split)"
        for n, m in names.items():  # other embeddings (learned positions)
            if isinstance(m, nn.Embedding) and n != table:
                whole = type(m).forward is not nn.Embedding.forward  # its forward derives the positions
                plan[n] = "gathered(input=full, output=split)" if whole else "embedding(output=split)"
        for name in sorted({_pattern(n) for n, m in names.items() if _NORM.search(type(m).__name__)}):
            plan[name] = "gathered(input=split, output=split)"
        head = by_object[id(module.get_output_embeddings())]
        tied = module.get_output_embeddings().weight is module.get_input_embeddings().weight
        plan[head] = f"tied(table={table}, input=split)" if tied else "column(input=split, output=full)"
        self._check_covered(module, plan)
        return plan

    def sbp_linears(self, module: nn.Module) -> Mapping[str, str]:
        """The SBP chain's matmuls, read from :meth:`parallel_plan` (:mod:`atp_pipeline.models.hf.sbp`)."""
        from atp_pipeline.models.hf.sbp import sbp_linears

        return sbp_linears(module, self.parallel_plan(module), self.shape(module))

    @staticmethod
    def _check_covered(module: nn.Module, plan: Mapping[str, Any]) -> None:
        """Every module that holds parameters is styled by ``plan`` or sits inside a styled one
        (matched by the rules :func:`~atp_pipeline.parallel.apply.match_plan` applies)."""
        styled = match_plan(module, plan, check=False)
        for name, sub in module.named_modules():
            if next(sub.parameters(recurse=False), None) is None:
                continue
            if not any(name == n or name.startswith(n + ".") for n in styled):
                raise ConfigError(f"transformers model '{type(module).__name__}': module '{name}' "
                                  f"({type(sub).__name__}) holds parameters but ATP's layout has no style for it; "
                                  f"pass a plan")


def _register_styles() -> None:
    from atp_pipeline.models.hf.attention import HFAttention

    register_style(HFAttention.name, HFAttention)


def register_conv1d() -> None:
    """GPT-2's ``Conv1D`` (``y = x W + b``, ``W`` stored in x out) as a linear kind of the
    ``column``/``row`` styles (called when a transformers model is laid out)."""
    from transformers.pytorch_utils import Conv1D

    register_linear_kind(Conv1D, transposed=True)


ADAPTER = register_adapter(HFCausalLMAdapter())
_register_styles()
