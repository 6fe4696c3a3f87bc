"""The built-in GPT: the plain model (:mod:`.model`), ATP's parallel layer for it
(:mod:`.parallel`), its SBP execution (:mod:`.sbp`), PyTorch-native comparators
(:mod:`.native`) and its adapter (:mod:`.adapter`)."""

from atp_pipeline.models.gpt.model import GPT, MLP, Attention, Block, GPTConfig, attention_core

__all__ = ["GPT", "Attention", "Block", "GPTConfig", "MLP", "attention_core"]
