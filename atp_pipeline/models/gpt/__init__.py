"""The built-in GPT: the plain model (:mod:`.model`), ATP's parallel layer for it
(:mod:`.parallel`), its SBP execution (:mod:`.sbp`), PyTorch-native comparators
(:mod:`.native`) and its adapter (:mod:`.adapter`).

The model's names are imported on first use, so planning the GPT from its config (its
adapter's ``shape_from_config``) does not import torch."""

from typing import Any

__all__ = ["GPT", "Attention", "Block", "GPTConfig", "MLP", "attention_core"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from atp_pipeline.models.gpt import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
