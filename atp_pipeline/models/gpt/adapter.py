"""The built-in GPT's adapter: the first family plugged in through the model seam."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from atp_pipeline.models.adapter import ModelAdapter, register_adapter
from atp_pipeline.planning.shape import ModelShape

if TYPE_CHECKING:  # the model's modules import torch: only when a model is built or laid out
    from torch import nn

    from atp_pipeline.models.gpt.model import GPTConfig


class GPTAdapter(ModelAdapter):
    """:class:`~atp_pipeline.models.gpt.model.GPT`: pre-LN decoder, learned positions, GeLU MLP."""

    family = "gpt"

    def matches(self, module: nn.Module) -> bool:
        from atp_pipeline.models.gpt.model import GPT

        return isinstance(module, GPT)

    def shape(self, module: nn.Module) -> ModelShape:
        c: GPTConfig = module.cfg  # type: ignore[assignment]
        return ModelShape(name="gpt", hidden=c.hidden, heads=c.heads, layers=c.layers, seq_len=c.seq_len,
                          vocab_size=c.vocab_size, ffn=c.ffn_mult * c.hidden)

    def shape_from_config(self, cfg: Any) -> ModelShape:
        return ModelShape.of(cfg)

    def build(self, cfg: Any) -> nn.Module:
        from atp_pipeline.models.gpt.model import GPT, GPTConfig

        return GPT(GPTConfig.from_model_config(cfg))

    def parallel_plan(self, module: nn.Module) -> Mapping[str, Any]:
        from atp_pipeline.models.gpt.parallel import gpt_plan

        return gpt_plan(module)

    def sbp_linears(self, module: nn.Module) -> Mapping[str, str]:
        """The SBP chain's matmuls (:func:`atp_pipeline.models.gpt.sbp.sbp_linears`)."""
        from atp_pipeline.models.gpt.sbp import sbp_linears

        return sbp_linears(module)


ADAPTER = register_adapter(GPTAdapter())
