"""Model size and FLOPs of a GPT layer, by Megatron-LM's formula (ATP §5, Table 2).

Per layer and step, forward only, a transformer with hidden size h, FFN width f*h, batch b
and sequence s does ``2*b*s*h^2*(4 + 2f)`` FLOPs in its linears (QKV 3h^2, output h^2,
MLP 2f*h^2, two FLOPs per multiply-add) and ``4*b*s^2*h`` in attention (QK^T and AV).
Backward costs twice the forward. ATP counts forward + backward without activation
recomputation (so it does not add a second forward as Megatron-LM does)::

    flops_per_layer = 3 * (2*b*s*h^2*(4 + 2f) + 4*b*s^2*h)      # f = 4: 72bsh^2 + 12bs^2h

Table 2 quotes it in units of 2^40 FLOPs ("TFLOPs"): 2.625, 9.75, 37.5, 83.25 for M1..M4,
and the weights per layer in units of 1000*2^20 parameters (0.048 ... 1.728 "billion").
The LM head adds ``3 * 2*b*s*h*V`` per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from atp_pipeline.config.schema import DTYPE_BYTES, ModelConfig

TFLOP_TABLE2 = 2**40


@dataclass(frozen=True)
class ModelSummary:
    name: str
    hidden: int
    heads: int
    layers: int
    seq_len: int
    batch_size: int
    vocab_size: int
    ffn_mult: int
    dtype: str
    bytes_per_element: int
    weights_per_layer: int  # matrices only, (4 + 2f) h^2
    params_per_layer: int  # with biases and the two LayerNorms
    flops_per_layer: int
    flops_lm_head: int

    @classmethod
    def of(cls, m: ModelConfig) -> "ModelSummary":
        h, f, b, s = m.hidden, m.ffn_mult, m.batch_size, m.seq_len
        weights = (4 + 2 * f) * h * h
        params = weights + (3 * h + h + f * h + h) + 4 * h
        forward = 2 * b * s * h * h * (4 + 2 * f) + 4 * b * s * s * h
        return cls(name=m.name, hidden=h, heads=m.heads, layers=m.layers, seq_len=s,
                   batch_size=b, vocab_size=m.vocab_size, ffn_mult=f, dtype=m.dtype.value,
                   bytes_per_element=DTYPE_BYTES[m.dtype], weights_per_layer=weights,
                   params_per_layer=params, flops_per_layer=3 * forward,
                   flops_lm_head=3 * 2 * b * s * h * m.vocab_size)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["flops_per_layer_TFLOPs_2_40"] = self.flops_per_layer / TFLOP_TABLE2
        return d
