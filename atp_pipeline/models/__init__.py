"""Plain model definitions; parallelism is applied from outside (atp_pipeline.parallel)."""

from atp_pipeline.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
