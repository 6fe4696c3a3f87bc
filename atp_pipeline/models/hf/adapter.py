"""transformers causal LMs through the model seam: shape from the model's config, ATP's layout
from what transformers already declares (``base_model_tp_plan``), no table per family.

ATP's layout for a decoder (§3.2): activations between blocks split by hidden over d2;
the attention's q/k/v column-first and o row-first with the core on local heads
(:class:`~atp_pipeline.models.hf.attention.HFAttention`); the MLP's ``colwise`` linears
(up/gate) column-first and its ``rowwise`` one (down) row-first, as transformers' own
``base_model_tp_plan`` marks them; every norm run whole on the gathered hidden (style
``gathered``: the family's own norm runs, bit for bit); the token embedding split by
hidden; the LM head column-first with its logits gathered, so transformers' own loss
runs on them.

Families whose attention reshapes with ``-1`` heads and whose plan names separate
``q_proj``/``k_proj``/``v_proj``/``o_proj`` fit this layout; the others are refused with
one line naming their ``model_type``. Every module holding parameters must be covered by
the plan: one that is not would see split activations, so the plan refuses it by name.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.adapter import ModelAdapter, register_adapter
from atp_pipeline.parallel.apply import match_plan
from atp_pipeline.parallel.styles import register_style
from atp_pipeline.planning.shape import ModelShape

SUPPORTED = ("llama", "mistral", "qwen2")
_NORM = re.compile(r"(RMSNorm|LayerNorm)$")


def is_hf_causal_lm(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("ForCausalLM") \
        and hasattr(module, "config")


def shape_of_config(config: Any, name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a transformers ``PretrainedConfig`` of a supported family."""
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    return ModelShape(
        name=name or str(config.model_type), hidden=hidden, heads=heads, layers=int(config.num_hidden_layers),
        seq_len=int(getattr(config, "max_position_embeddings", 2048)), vocab_size=int(config.vocab_size),
        ffn=int(config.intermediate_size), kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads), gated=True, norm="rmsnorm",
        bias=bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2"),
        position="rotary", tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        comm_layout="module_styles")


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


class HFCausalLMAdapter(ModelAdapter):
    """``*ForCausalLM`` of transformers (families in :data:`SUPPORTED`)."""

    family = "hf"

    def matches(self, module: nn.Module) -> bool:
        return is_hf_causal_lm(module)

    def _supported(self, module: nn.Module) -> Any:
        config = module.config
        kind = getattr(config, "model_type", "?")
        if kind not in SUPPORTED:
            raise ConfigError(f"transformers model_type '{kind}' ({type(module).__name__}) has no ATP layout yet "
                              f"(supported: {', '.join(SUPPORTED)}); pass plan={{module pattern: style}} to "
                              f"ATPStrategy or set the LightningModule's parallel_plan")
        return config

    def shape(self, module: nn.Module) -> ModelShape:
        return shape_of_config(self._supported(module))

    @staticmethod
    def hf_config(cfg: Any) -> Any:
        """The transformers config of a model config's ``hf`` block (``model_type`` + fields)."""
        from transformers import AutoConfig

        fields = dict(getattr(cfg, "hf", None) or {})
        kind = fields.pop("model_type", None)
        if kind not in SUPPORTED:
            raise ConfigError(f"model '{getattr(cfg, 'name', '?')}': model.hf.model_type={kind!r} has no ATP layout "
                              f"yet (supported: {', '.join(SUPPORTED)})")
        try:
            return AutoConfig.for_model(kind, **fields)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model '{getattr(cfg, 'name', '?')}': model.hf: {exc}") from None

    def shape_from_config(self, cfg: Any) -> ModelShape:
        get = (lambda k, d: cfg.get(k, d)) if hasattr(cfg, "get") else (lambda k, d: getattr(cfg, k, d))
        dtype = get("dtype", "fp32")
        return shape_of_config(self.hf_config(cfg), str(get("name", ""))).with_step(
            batch_size=int(get("batch_size", 1)), seq_len=int(get("seq_len", 0)) or None,
            dtype=str(getattr(dtype, "value", dtype)))

    def build(self, cfg: Any) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.hf_config(cfg))

    def lm_loss(self, model: nn.Module, idx: Any, targets: Any) -> Any:
        """transformers' own loss on next-token targets already shifted (``shift_labels``)."""
        return model(input_ids=idx, labels=targets, shift_labels=targets).loss

    def parallel_plan(self, module: nn.Module) -> Mapping[str, Any]:
        config = self._supported(module)
        if getattr(config, "tie_word_embeddings", False):
            raise ConfigError(f"transformers model_type '{config.model_type}': tied input and output embeddings "
                              f"are not laid out yet (tie_word_embeddings=True); untie them or pass a plan")
        base = module.base_model_prefix
        declared: Dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or {})
        plan: Dict[str, Any] = {}
        attention = sorted({k.rsplit(".", 1)[0] for k in declared if k.endswith(".q_proj")})
        for pattern in attention:
            plan[f"{base}.{pattern}"] = "hf_attention"
        for pattern, kind in declared.items():
            if any(pattern.startswith(a + ".") for a in attention):
                continue
            if kind not in ("colwise", "rowwise"):
                raise ConfigError(f"transformers model_type '{config.model_type}': '{pattern}' is declared "
                                  f"'{kind}', which ATP's layout does not cover; pass a plan")
            first = "column" if kind == "colwise" else "row"
            plan[f"{base}.{pattern}"] = f"{first}(input=split, output=split)"
        names = dict(module.named_modules())
        by_object = {id(m): n for n, m in names.items()}
        plan[by_object[id(module.get_input_embeddings())]] = "embedding(output=split)"
        for name in sorted({_pattern(n) for n, m in names.items() if _NORM.search(type(m).__name__)}):
            plan[name] = "gathered(input=split, output=split)"
        plan[by_object[id(module.get_output_embeddings())]] = "column(input=split, output=full)"
        self._check_covered(module, plan)
        return plan

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


ADAPTER = register_adapter(HFCausalLMAdapter())
_register_styles()
