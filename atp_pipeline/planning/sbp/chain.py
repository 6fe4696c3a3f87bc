"""A model's SBP layer chain from its :class:`~atp_pipeline.planning.shape.ModelShape`
(AutoDDL §4.2, §4.5.1), whatever the family.

Every decoder block contributes its matmuls, tied over the blocks (§4.5.1: one decision
variable per key, however many blocks):

=====================  =========================================  ======================
key                    matmul (``n -> m``)                          when
=====================  =========================================  ======================
``qkv``                hidden -> q_width + 2·kv_width               fused q|k|v projection
``q``, ``k``, ``v``    hidden -> q_width, kv_width, kv_width        separate projections (GQA widths)
``proj``               q_width -> hidden                            attention output
``gate_up``            hidden -> ffn (twice: gate and up, tied)     gated MLP (SwiGLU)
``down``               ffn -> hidden                                gated MLP
``fc1``, ``fc2``       hidden -> ffn, ffn -> hidden                 two-matrix MLP
=====================  =========================================  ======================

Each matmul's rows are the step's tokens ``b = batch·seq`` in ``batch`` indivisible
sequences. The MLP's first matmuls (``gate_up``; ``fc1``) reach the last one through the
activation alone (elementwise), so their output may skip the row layout
(``MatmulLayer.into``, :func:`~atp_pipeline.planning.sbp.space.direct`); gate and up are
tied to one strategy because their product is taken element by element. A shape with a
fused q|k|v, multi-head attention and an fc1/fc2 MLP (the paper's transformer) gives the
same layers, keys and sizes as :func:`~atp_pipeline.planning.sbp.space.transformer`.

The executor (:mod:`atp_pipeline.parallel.sbp_exec`) keeps the activations between matmuls
in the *row layout* (whole sequences split over the devices, features whole), so the
family's own code between the matmuls runs unchanged; the chain is therefore compiled with
``io="rows"`` (:func:`~atp_pipeline.planning.sbp.space.row_io_terms`). What that layout
cannot run is named by :func:`sbp_infeasibility`. Pure: numpy only, no torch.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from atp_pipeline.planning.sbp.space import MatmulLayer
from atp_pipeline.planning.shape import ModelShape

ATTENTION_KEYS = ("qkv", "q", "k", "v", "proj")
MLP_KEYS = ("gate_up", "down", "fc1", "fc2")
INTO = {"gate_up": "down", "fc1": "fc2"}  # elementwise code only between these
KEYS = ATTENTION_KEYS + MLP_KEYS


def block_matmuls(shape: ModelShape) -> List[Tuple[str, int, int]]:
    """``(key, n, m)`` of one block's matmuls in execution order (module docstring)."""
    h, qw, kw, f = shape.hidden, shape.q_width, shape.kv_width, shape.ffn
    attn = [("qkv", h, qw + 2 * kw)] if shape.qkv_fused else [("q", h, qw), ("k", h, kw), ("v", h, kw)]
    mlp = [("gate_up", h, f), ("gate_up", h, f), ("down", f, h)] if shape.gated else [("fc1", h, f), ("fc2", f, h)]
    return attn + [("proj", qw, h)] + mlp


def chain_keys(shape: ModelShape) -> Tuple[str, ...]:
    """The layer keys (tie groups) of ``shape``'s chain, in execution order."""
    return tuple(dict.fromkeys(k for k, _, _ in block_matmuls(shape)))


def model_chain(shape: ModelShape) -> List[MatmulLayer]:
    """Every block's matmuls (``block{i}.{key}``; a gated MLP's ``block{i}.gate`` and
    ``block{i}.up`` both key ``gate_up``), tied by key over the blocks (§4.5.1)."""
    b = shape.batch_size * shape.seq_len
    out: List[MatmulLayer] = []
    for i in range(shape.layers):
        names = iter(("gate", "up"))
        for key, n, m in block_matmuls(shape):
            name = next(names) if key == "gate_up" else key
            out.append(MatmulLayer(f"block{i}.{name}", b, n, m, tie=key, batch_units=shape.batch_size,
                                   into=INTO.get(key)))
    return out


def sbp_infeasibility(shape: ModelShape, devices: int) -> Optional[str]:
    """Why the SBP executor cannot run ``shape``'s step on ``devices`` devices, or None.

    Between matmuls the row layout holds whole sequences (the family's attention runs on
    them), split over as many row groups as divide both the sequences and the devices
    (:func:`~atp_pipeline.planning.sbp.space.row_split`); each matmul splits the step's
    token rows over all devices. Every matmul has at least the data-parallel strategy
    (``pb = devices``), so the search space is never empty otherwise; a plan's mesh is
    checked after the search (:func:`~atp_pipeline.planning.sbp.layout.plan_mesh_shape`)."""
    if devices < 1:
        return f"device count must be >= 1, got {devices}"
    tokens = shape.batch_size * shape.seq_len
    if tokens % devices:
        return (f"the {tokens} tokens of a step of model '{shape.name}' (batch {shape.batch_size} x seq "
                f"{shape.seq_len}) do not split over {devices} devices (every SBP matmul splits the token rows "
                f"over all devices)")
    return None
