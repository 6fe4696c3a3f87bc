"""transformers causal LMs through the model seam: shape and ATP's layout read from what
transformers declares (``base_model_tp_plan``) and what the model's modules show
(:mod:`atp_pipeline.models.hf.layout`), plus a table (:data:`FAMILIES`) only for what neither
tells (GPT-2's fused ``Conv1D`` q|k|v).

ATP's layout for a decoder (§3.2): activations between blocks split by hidden over d2;
the attention's q/k/v column-first and its output projection row-first, with the core on
local heads (:class:`~atp_pipeline.models.hf.attention.HFAttention`); the MLP's linears
column-first and row-first; every norm run whole on the gathered hidden (style
``gathered``: the family's own norm, bit for bit); per-head q/k norms kept whole with their
gradients summed over d1; the token embedding and plain learned positions split by hidden,
an embedding with a ``forward`` of its own (positions derived in it, a scaled embedding) run
whole and sliced; the LM head column-first with its logits gathered, or — tied to the token
embedding — sharing its split table (style ``tied``), so transformers' own loss runs on
whole logits. The family's own ``forward`` runs throughout (rotary and partial rotary,
parallel residual, learned positions, multipliers), so nothing of the model is
re-implemented.

What the layout cannot reproduce exactly is refused with one line naming it (undeclared
mixture-of-experts layouts, a fused q|k|v of unknown layout, a module with parameters no style
reaches); a multi-head latent attention is laid out by :mod:`atp_pipeline.models.hf.mla`.
Dropout draws per-rank masks (:mod:`atp_pipeline.parallel.rng`).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.adapter import ModelAdapter, register_adapter
from atp_pipeline.models.hf.declared import NORM
from atp_pipeline.models.hf.layout import derive
from atp_pipeline.models.hf.linears import register_conv1d
from atp_pipeline.models.hf.spec import AttentionSpec, Layout
from atp_pipeline.models.hf.weights import export_pretrained, safetensors_reader
from atp_pipeline.models.hf.whole import is_unit, whole_fields
from atp_pipeline.parallel.apply import match_plan
from atp_pipeline.parallel.fsdp import block_units
from atp_pipeline.parallel.materialize import parameters_on_meta
from atp_pipeline.parallel.vocab import VocabParallelCausalLMLoss
from atp_pipeline.planning.shape import ModelShape


@dataclass(frozen=True)
class Family:
    """What ATP's layout needs of a family that transformers gives no tensor-parallel plan for
    and whose modules cannot show it: its attention's projections (a fused q|k|v's layout)."""

    attention_spec: Optional[AttentionSpec] = None
    refuse: Callable[[Any], str] = lambda c: ""  # why a config of the family cannot be laid out


FAMILIES: Dict[str, Family] = {
    # GPT-2's c_attn is one Conv1D whose output is q|k|v concatenated; its forward splits by split_size
    "gpt2": Family(attention_spec=AttentionSpec(qkv="c_attn", fused="concat", o="c_proj", per_rank=("split_size",)),
                   refuse=lambda c: "cross-attention (add_cross_attention=True)" if c.add_cross_attention else ""),
}
FAMILIES["gpt-sw3"] = FAMILIES["gpt2"]  # GPT-2's classes under another model_type


@dataclass(frozen=True)
class ShapeHints:
    """How a config names what the shape reads, for the model types whose presets are planned
    without importing transformers (``stage=plan`` on ``conf/model``): the shape read from a
    built model must agree (tests/test_hf_models.py)."""

    ffn: Callable[[Any], int] = lambda c: int(c.intermediate_size)
    gated: bool = True
    norm: str = "rmsnorm"
    bias: Callable[[Any], bool] = lambda c: bool(getattr(c, "attention_bias", False))
    position: str = "rotary"
    qkv_fused: bool = False


PRESET_SHAPES: Dict[str, ShapeHints] = {
    "llama": ShapeHints(), "mistral": ShapeHints(), "qwen2": ShapeHints(bias=lambda c: True),
    "gpt2": ShapeHints(ffn=lambda c: int(c.n_inner or 4 * c.hidden_size), gated=False, norm="layernorm",
                       bias=lambda c: True, position="learned", qkv_fused=True),
}


def is_hf_causal_lm(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith(("ForCausalLM", "LMHeadModel")) \
        and hasattr(module, "config")


def not_a_causal_lm(module: nn.Module) -> str:
    """Why the HF adapter does not take the transformers model ``module`` (one line), for a
    model ``AutoModelForCausalLM`` builds but :func:`is_hf_causal_lm` declines."""
    cls = type(module).__name__
    if cls.endswith("ForConditionalGeneration"):
        what = "a multimodal model (a text decoder beside other encoders)"
    else:
        what = "not a *ForCausalLM / *LMHeadModel class (an encoder-style model used as a decoder)"
    return f"transformers model '{cls}' is {what}; ATP's HF adapter lays out decoder-only causal LMs; pass a plan"


def family_of(config: Any) -> Optional[Family]:
    """The :class:`Family` entry of a transformers config (None: its layout is read from
    transformers' declaration and its modules), or one line saying why it is refused."""
    kind = getattr(config, "model_type", "?")
    family = FAMILIES.get(kind)
    why = family.refuse(config) if family is not None else ""
    layerdrop = getattr(config, "layerdrop", 0.0)
    if isinstance(layerdrop, (int, float)) and layerdrop > 0:  # a draw between blocks, on split activations
        why = f"random layer skipping (layerdrop={layerdrop:g}: ranks would skip different layers)"
    if why:
        raise ConfigError(f"transformers model_type '{kind}': {why} is not laid out by ATP yet; pass a plan")
    return family


def _decoder_only(config: Any) -> None:
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"transformers model_type '{kind}' is an encoder-decoder; ATP lays out decoder-only "
                          f"causal LMs")


SHAPE_ATTR = "_atp_hf_shape"


def shape_of_model(module: nn.Module, name: str = "", layout: Optional[Layout] = None) -> ModelShape:
    """A :class:`ModelShape` read off a transformers causal LM (built, or on the meta device):
    its config's sizes and its layout's (:func:`~atp_pipeline.models.hf.layout.derive`). A model
    already laid out answers with the shape read before (:meth:`HFCausalLMAdapter.parallel_plan`,
    which passes the ``layout`` it derived, so it is not derived twice)."""
    known = module.__dict__.get(SHAPE_ATTR)
    if known is not None:
        return known if not name else dataclasses.replace(known, name=name)
    config = module.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layout = layout or derive(module, family_of(config), probe=False)
    hidden = int(text.hidden_size)
    try:
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    except Exception:  # noqa: BLE001 — none (a state-space model) or per layer: every mixer runs whole (layout.whole)
        heads = kv_heads = head_dim = 0
    inp, out = module.get_input_embeddings(), module.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding) and m is not inp]
    # norms outside the blocks (the final one, an embedding's): each on the hidden gathered over d2 —
    # but not one inside an embedding run whole (a forward of its own): it runs on the whole output
    whole_tables = [n for n, m in module.named_modules() if isinstance(m, nn.Embedding)
                    and (type(m).forward is not nn.Embedding.forward
                         or (m is inp and tied and bool(layout.whole_head)))]
    outside = sum(any(fnmatch.fnmatchcase(n, p) for n, _ in module.named_modules())
                  for p, s in layout.plan.items() if s.startswith("gathered(input=split") and "*" not in p
                  and p != layout.whole_head and p not in layout.whole
                  and not any(p.startswith(t + ".") for t in whole_tables))
    return ModelShape(
        name=name or str(config.model_type), hidden=hidden, heads=heads, layers=int(text.num_hidden_layers),
        seq_len=max(int(getattr(text, "max_position_embeddings", None) or 2048), 1), vocab_size=int(text.vocab_size),
        ffn=layout.ffn, kv_heads=kv_heads, head_dim=head_dim, gated=layout.gated, norm=layout.norm,
        act_kernels=layout.act_kernels,
        bias=layout.bias, position="learned" if embeddings else "rotary",
        tied_embeddings=tied, norm_layout="gathered",
        head_layout="whole" if layout.whole_head else _head_layout(module, tied),
        layer_norms=_layer_norms(module, layout.plan, int(text.num_hidden_layers)),
        qkv_fused=layout.qkv_fused, final_norm=outside > 0,
        extra_norms=max(outside - 1, 0) + (layout.outside_norm_calls if outside else 0),
        shared_mlp_input=layout.parallel_block,
        gathered_embeddings=sum(type(m).forward is not nn.Embedding.forward for m in embeddings)
        + int(type(inp).forward is not nn.Embedding.forward or (tied and bool(layout.whole_head))),
        attention_layout="whole" if layout.whole_attention else "split", head_norm_params=layout.head_norm_params,
        heads_over_d2=layout.heads_over_d2, mlp_layout="whole" if layout.whole_mlp else "split",
        sink_params=layout.sink_params, scalar_params=layout.scalar_params,
        gate_width=layout.gate_width,
        unmodelled=", ".join(x for x in (layout.whole_unmodelled, layout.probe_unmodelled) if x),
        moe=layout.moe, latent=layout.latent,
        **whole_fields(module, layout))


def _layer_norms(module: nn.Module, plan: Dict[str, str], layers: int = 0) -> int:
    """Norms a block runs on the hidden gathered over d2 (style ``gathered(input=split,
    output=split)`` on a norm module; the two before attention and MLP, Gemma-2's four). A norm
    inside a routed block (beside style ``hf_experts``) is not one: the block's modules run on
    the gathered hidden are counted with the experts (``MoEShape.gathered``). Blocks that hold
    several of the config's ``layers`` (sub-layers in a block, each with its norms: the shape's
    layer is the config's) count their norms' instances over ``layers``."""
    names = dict(module.named_modules())
    routed = tuple(p.rpartition(".")[0] + "." for p, s in plan.items() if s.startswith("hf_experts"))
    count = spread = spread_patterns = 0
    for p, s in plan.items():
        if "*" in p and s.startswith("gathered(input=split") and "output=split" in s and not p.startswith(routed):
            hit = next((m for n, m in names.items() if fnmatch.fnmatchcase(n, p)), None)
            if hit is None or not NORM.search(type(hit).__name__):
                continue
            blocks = names.get(p.split(".*.")[0])
            if layers and isinstance(blocks, nn.ModuleList) and len(blocks) != layers:
                spread_patterns += 1
                spread += sum(is_unit(n, p) for n in names)
            else:
                count += 1
    return count + ((spread // layers if spread % layers == 0 else spread_patterns) if spread_patterns else 0)


VOCAB_SPLIT_ATTR = "_atp_vocab_parallel_loss"


def vocab_parallel_loss(model: nn.Module, on: bool = True) -> nn.Module:
    """Mark a transformers causal LM so that ATP's layout keeps its LM head's logits split over
    d1 x d2 (``vocab_head``, or ``vocab_tied`` with a ``vocab_embedding`` table) and runs
    transformers' causal-LM loss on the blocks (:mod:`atp_pipeline.parallel.vocab`, Megatron's
    vocabulary-parallel cross-entropy). ``model.vocab_parallel_loss=true`` sets it for
    ``train.py``; a user's own ``Trainer(strategy="atp")`` calls it on the model it builds.
    ``outputs.logits`` is then this rank's block, not the whole vocabulary. Returns ``model``."""
    model.__dict__[VOCAB_SPLIT_ATTR] = bool(on)
    return model


def _vocab_split_plan(module: nn.Module, table: str, head: str, tied: bool) -> Dict[str, str]:
    """The head (and a tied head's table) of :func:`vocab_parallel_loss`, or one line why not."""
    inp, out = module.get_input_embeddings(), module.get_output_embeddings()
    cls = type(module).__name__
    if tied:
        if type(inp).forward is not nn.Embedding.forward:
            raise ConfigError(f"model.vocab_parallel_loss: {cls}'s head is tied to '{table}' "
                              f"({type(inp).__name__}), an embedding with a forward of its own: its table "
                              f"cannot be split by vocabulary")
        return {table: "vocab_embedding(output=split)", head: f"vocab_tied(table={table}, input=split)"}
    if not (isinstance(out, nn.Linear) and type(out).forward is nn.Linear.forward) or out.bias is not None:
        raise ConfigError(f"model.vocab_parallel_loss: {cls}'s head '{head}' ({type(out).__name__}"
                          f"{', with a bias' if getattr(out, 'bias', None) is not None else ''}) is not a plain "
                          f"linear without bias: it cannot be split by vocabulary")
    return {head: "vocab_head(input=split)"}


def _head_layout(module: nn.Module, tied: bool) -> str:
    """How :meth:`HFCausalLMAdapter.parallel_plan` places the head: split by vocabulary over
    d1 x d2 (``vocab_split``: :func:`vocab_parallel_loss`), sharing the split table (``tied``),
    column-first with gathered logits (``gathered``) or run whole (``whole``: an embedding or
    head with a ``forward`` of its own)."""
    if module.__dict__.get(VOCAB_SPLIT_ATTR):
        return "vocab_split"
    inp, out = module.get_input_embeddings(), module.get_output_embeddings()
    if tied:
        return "tied" if type(inp).forward is nn.Embedding.forward else "whole"
    return "gathered" if isinstance(out, nn.Linear) and type(out).forward is nn.Linear.forward else "whole"


def shape_of_config(config: Any, name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a transformers ``PretrainedConfig``: a model of it built on the
    meta device (no memory) and read by :func:`shape_of_model`; a preset's fields alone
    (:class:`GivenFields`, no transformers import) through :data:`PRESET_SHAPES`."""
    if isinstance(config, GivenFields):
        return _preset_shape(config, name)
    from transformers import AutoModelForCausalLM

    _decoder_only(config)
    config = copy.deepcopy(config)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    return shape_of_model(model, name)


def _preset_shape(config: "GivenFields", name: str) -> ModelShape:
    hints = PRESET_SHAPES.get(config.model_type)
    if hints is None:
        raise NotGiven("model_type")
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    tied = bool(config.tie_word_embeddings)
    return ModelShape(
        name=name or str(config.model_type), hidden=hidden, heads=heads, layers=int(config.num_hidden_layers),
        seq_len=int(config.max_position_embeddings), vocab_size=int(config.vocab_size), ffn=hints.ffn(config),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        gated=hints.gated, norm=hints.norm, bias=hints.bias(config), position=hints.position,
        tied_embeddings=tied, norm_layout="gathered", head_layout="tied" if tied else "gathered",
        qkv_fused=hints.qkv_fused, final_norm=True, gathered_embeddings=0)


PRETRAINED = "atp_pretrained"  # attribute of a model built by load_pretrained: its checkpoint directory


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.<key>`` of a model config (DictConfig, dict or object)."""
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def _pretrained(cfg: Any) -> Optional[str]:
    """``cfg.pretrained`` of a model config (DictConfig, dict or object)."""
    value = _get(cfg, "pretrained")
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
    """:meth:`HFCausalLMAdapter.hf_config`, uncached; refusals are one line (a bad path before
    transformers is imported)."""
    if pretrained and not Path(pretrained).exists() and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", pretrained):
        raise ConfigError(f"model '{name}': model.pretrained={pretrained} is not a local directory, and hub ids "
                          f"are not fetched: download it first (hf download {pretrained} --local-dir <dir>) and "
                          f"give model.pretrained=<dir>")
    if pretrained and not (Path(pretrained) / "config.json").exists():
        what = "has no config.json" if Path(pretrained).is_dir() else "does not exist"
        raise ConfigError(f"model '{name}': model.pretrained={pretrained} {what} (a local HF checkpoint "
                          f"directory, as save_pretrained writes it)")
    kind = fields.pop("model_type", None)
    if not pretrained and kind is None:
        raise ConfigError(f"model '{name}': set model.pretrained=<a local HF checkpoint directory> or "
                          f"model.hf.model_type (a transformers model type, e.g. llama)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(pretrained, **fields) if pretrained else \
            AutoConfig.for_model(kind, **fields)
    except Exception as exc:  # noqa: BLE001 - transformers' validation (huggingface_hub's strict dataclasses)
        raise ConfigError(f"model '{name}': {_rejected(exc, fields)}") from None
    family_of(config)
    _decoder_only(config)
    return config


def _rejected(exc: BaseException, fields: Mapping[str, Any]) -> str:
    """One line for a config transformers rejects: the ``model.hf`` keys its message speaks of
    (every word of the key's name in it: "hidden size" for ``hidden_size``) and the innermost
    cause's first line (a validator's ``ValueError`` under huggingface_hub's
    ``StrictDataclassClassValidationError``)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = lines[0] if lines else type(exc).__name__
    text = why.lower().replace("_", " ")
    named = [f"model.hf.{k}={v}" for k, v in fields.items()
             if all(w in text for w in k.lower().split("_") if w not in ("num", "n", "of"))]
    return f"transformers rejects {', '.join(named) if named else 'model.hf'}: {why}"


class HFCausalLMAdapter(ModelAdapter):
    """``*ForCausalLM`` of transformers (any decoder-only family the layout covers)."""

    family = "hf"

    def matches(self, module: nn.Module) -> bool:
        return is_hf_causal_lm(module)

    def shape(self, module: nn.Module) -> ModelShape:
        register_conv1d()
        return shape_of_model(module)

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
        if not _pretrained(cfg) and fields.get("model_type") in PRESET_SHAPES:
            try:
                shape = shape_of_config(GivenFields(fields), name)
            except NotGiven:
                pass
        shape = (shape or shape_of_config(self.hf_config(cfg), name)).with_step(
            batch_size=int(get("batch_size", 1)), seq_len=int(get("seq_len", 0)) or None,
            dtype=str(getattr(dtype, "value", dtype)))
        return dataclasses.replace(shape, head_layout="vocab_split") if get("vocab_parallel_loss", False) else shape

    def build(self, cfg: Any) -> nn.Module:
        """The model of ``cfg``; with ``pretrained``, its parameters on the meta device (each
        rank allocates and reads only its shards once laid out: :meth:`weights`)."""
        from transformers import AutoModelForCausalLM

        config = self.hf_config(cfg)
        pretrained = _pretrained(cfg)
        model = load_pretrained(pretrained, config) if pretrained else AutoModelForCausalLM.from_config(config)
        return vocab_parallel_loss(model, _get(cfg, "vocab_parallel_loss", False))

    def build_outline(self, cfg: Any) -> nn.Module:
        """:meth:`build` with at most two decoder layers (the family's plan is per layer)."""
        from transformers import AutoModelForCausalLM

        config = self.hf_config(cfg)
        config.num_hidden_layers = min(int(config.num_hidden_layers), 2)
        return vocab_parallel_loss(AutoModelForCausalLM.from_config(config), _get(cfg, "vocab_parallel_loss", False))

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
        """ATP's layout of ``module`` (§3.2) as a plan of styles: the blocks from transformers'
        declared ``base_model_tp_plan`` or the modules themselves
        (:func:`~atp_pipeline.models.hf.layout.derive`), then the embeddings and the head."""
        register_conv1d()
        config = module.config
        _decoder_only(config)
        # training keeps no key/value cache: the blocks' chunks (§4.1) would share one and read each
        # other's keys (transformers turns it off itself only under gradient checkpointing)
        config.use_cache = False
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text is not config:
            text.use_cache = False
        layout = derive(module, family_of(config))
        hidden = int(getattr(text, "hidden_size", 0) or 0)
        plan: Dict[str, Any] = dict(layout.plan)
        names = dict(module.named_modules())
        by_object = {id(m): n for n, m in names.items()}
        inp, out = module.get_input_embeddings(), module.get_output_embeddings()
        table = by_object[id(inp)]
        split_table = type(inp).forward is nn.Embedding.forward  # one with a forward of its own runs whole
        tied = out is not None and out.weight is inp.weight
        split_table = split_table and not (tied and layout.whole_head)  # a tied head run whole: its table too
        plan[table] = "embedding(output=split)" if split_table else "gathered(input=full, output=split)"
        blocks = [b for b, _ in block_units(module)]
        for n, m in names.items():  # other embeddings outside the blocks (learned positions)
            if isinstance(m, nn.Embedding) and n != table and not any(n.startswith(b + ".") for b in blocks):
                whole = type(m).forward is not nn.Embedding.forward  # its forward derives the positions
                plan[n] = "gathered(input=full, output=split)" if whole else "embedding(output=split)"
                if m.embedding_dim not in (inp.embedding_dim, hidden):  # over a width beside the token
                    plan[n] = "gathered"  # table's (per-layer inputs): whole, as every such tensor outside the blocks
        if out is None:
            raise ConfigError(f"transformers model '{type(module).__name__}' has no output embeddings (LM head)")
        head = by_object[id(out)]
        tied = out.weight is inp.weight
        if layout.whole_head:  # the head runs whole inside the module around it (Layout.whole_head)
            if module.__dict__.get(VOCAB_SPLIT_ATTR):
                raise ConfigError(f"model.vocab_parallel_loss: {type(module).__name__}'s head runs whole inside "
                                  f"'{layout.whole_head}' (parameters of its own around it): its logits cannot be "
                                  f"split by vocabulary")
        elif module.__dict__.get(VOCAB_SPLIT_ATTR):
            plan.update(_vocab_split_plan(module, table, head, tied))
            module.loss_function = VocabParallelCausalLMLoss(model=module)  # its mesh: the head's, once laid out
        elif tied:
            plan[head] = f"tied(table={table}, input=split)" if split_table else "gathered(input=split, output=full)"
        else:
            plan[head] = "column(input=split, output=full)" if isinstance(out, nn.Linear) and \
                type(out).forward is nn.Linear.forward else "gathered(input=split, output=full)"
        # a module run whole (style gathered: an embedding with a norm of its own inside) runs its own
        # forward on whole tensors: nothing inside it is laid out again
        runs_whole = [p for p, s in plan.items() if str(s).startswith(("gathered", "replicated"))]
        plan = {p: s for p, s in plan.items() if not any(p.startswith(g + ".") for g in runs_whole)}
        self._check_covered(module, plan)
        module.__dict__[SHAPE_ATTR] = shape_of_model(module, layout=layout)  # adapter.shape, once laid out
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
        text = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
        hidden = int(getattr(text, "hidden_size", 0) or 0)
        for name, sub in module.named_modules():
            if any(name == n or name.startswith(n + ".") and not st.own_only for n, st in styled.items()):
                continue
            if next(sub.parameters(recurse=False), None) is not None:
                raise ConfigError(f"transformers model '{type(module).__name__}': module '{name}' "
                                  f"({type(sub).__name__}) holds parameters but ATP's layout has no style for it; "
                                  f"pass a plan")
            for b, t in sub.named_buffers(recurse=False):  # e.g. a sinusoidal table added to the split hidden
                if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == hidden:
                    raise ConfigError(f"transformers model '{type(module).__name__}': module '{name}' "
                                      f"({type(sub).__name__}) holds a buffer '{b}' {list(t.shape)} over the hidden "
                                      f"state, which ATP's layout does not split; pass a plan")


ADAPTER = register_adapter(HFCausalLMAdapter())
