"""The built-in GPT's SBP layer chain (AutoDDL §4.2, §4.5.1): which of its modules are the
chain's matmuls (:func:`sbp_linears`). The GPT is then laid out by the same executor as every
other family (:func:`~atp_pipeline.parallel.sbp_exec.apply_sbp_layout`, reached through
:meth:`~atp_pipeline.models.adapter.ModelAdapter.apply_sbp`): per block ``attn.qkv`` (key
``qkv``: one fused q|k|v), ``attn.proj`` (``proj``), ``mlp.fc1`` and ``mlp.fc2``, tied over
the blocks — the keys and sizes of
:func:`~atp_pipeline.planning.sbp.chain.model_chain` for the GPT's shape. Its own
``forward`` (LayerNorms, attention core, GeLU, residuals, embeddings, head, loss) runs
unchanged between them on whole sequences.
"""

from __future__ import annotations

from typing import Dict

from torch import nn

from atp_pipeline.errors import ConfigError

__all__ = ["sbp_linears"]

BLOCK_LINEARS = {"attn.qkv": "qkv", "attn.proj": "proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


def sbp_linears(model: nn.Module) -> Dict[str, str]:
    """``{module name: layer key}`` of every block's matmuls of a built-in GPT."""
    from atp_pipeline.models.gpt.model import GPT

    if not isinstance(model, GPT):
        raise ConfigError(f"sbp: {type(model).__name__} is not the built-in GPT")
    names = dict(model.named_modules())
    out: Dict[str, str] = {}
    for i in range(len(model.blocks)):
        for rel, key in BLOCK_LINEARS.items():
            name = f"blocks.{i}.{rel}"
            if not isinstance(names.get(name), nn.Linear):
                raise ConfigError(f"sbp: GPT module '{name}' is {type(names.get(name)).__name__}, not the "
                                  f"nn.Linear of the GPT's SBP chain")
            out[name] = key
    return out
