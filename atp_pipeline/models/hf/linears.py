"""The linears an HF model's layout reads and the probes cut: which module classes are linears
(GPT-2's ``Conv1D``; a subclass shown to compute the plain ``x W^T + b``), and keeping or
reordering a linear's input or output features by index."""

from __future__ import annotations

from typing import Any

from torch import nn

from atp_pipeline.parallel.linear import _transposed, as_linear, linear_kinds, register_linear_kind


def is_linear(m: nn.Module) -> bool:
    """Whether ``m`` is of a registered linear kind."""
    return isinstance(m, linear_kinds())


def register_conv1d() -> None:
    """GPT-2's ``Conv1D`` (``y = x W + b``, ``W`` stored in x out) as a linear kind of the
    ``column``/``row`` styles (called when a transformers model is laid out)."""
    from transformers.pytorch_utils import Conv1D

    register_linear_kind(Conv1D, transposed=True)


def register_plain_linears(root: nn.Module) -> None:
    """Register as linear kinds the subclasses of a linear kind in ``root`` whose own ``forward``
    is shown, on a random input, to compute the plain ``x W^T + b`` (Falcon's ``FalconLinear``),
    so the styles may replace them; any other stays refused by the styles. Nothing is shown on
    the meta device."""
    import torch
    import torch.nn.functional as F

    seen = set(linear_kinds())
    for m in root.modules():
        cls = type(m)
        if cls in seen or not isinstance(m, linear_kinds()) or m.weight.is_meta:
            continue
        seen.add(cls)
        base = next(t for t in cls.__mro__ if t in linear_kinds())
        if cls.forward is base.forward:
            continue
        n_in, _, w, b = as_linear(m)
        x = torch.randn(2, 3, n_in, dtype=w.dtype, device=w.device, generator=torch.Generator().manual_seed(0)
                        ) if w.device.type == "cpu" else torch.randn(2, 3, n_in, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            try:
                same = torch.allclose(m(x), F.linear(x, w, b), rtol=1e-6, atol=1e-7)
            except Exception:  # noqa: BLE001 — its forward does something else
                same = False
        if same:
            register_linear_kind(cls, transposed=_transposed(base))


def feature_dim(linear: nn.Module, output: bool) -> int:
    """The weight dimension holding a linear's output (or input) features, by its registered
    kind (:func:`~atp_pipeline.parallel.linear.register_linear_kind`: Conv1D stores W in x out)."""
    transposed = _transposed(type(linear))
    return (1 if transposed else 0) if output else (0 if transposed else 1)


def cut_features(linear: nn.Module, index: Any, output: bool) -> None:
    """Keep only the output features (and bias) or input features ``index`` of a linear."""
    dim = feature_dim(linear, output)
    linear.weight = nn.Parameter(linear.weight.index_select(dim, index.to(linear.weight.device)))
    if output and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.index_select(0, index.to(linear.weight.device)))
    if isinstance(linear, nn.Linear):
        linear.out_features, linear.in_features = linear.weight.shape
    elif hasattr(linear, "nf"):
        linear.nf = linear.weight.shape[1]


def permute_features(linear: nn.Module, index: Any, output: bool) -> None:
    """Reorder a linear's output features (and bias) or input features by ``index``."""
    w = linear.weight
    w.copy_(w.index_select(feature_dim(linear, output), index.to(w.device)))
    if output and linear.bias is not None:
        linear.bias.copy_(linear.bias.index_select(0, index.to(w.device)))
