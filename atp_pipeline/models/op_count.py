"""The kernels a parameter-free module runs, as its code runs them (for the step model's program).

An activation is one kernel forward and one backward where torch fuses it (``nn.GELU``,
``nn.SiLU``), and as many as its formula has operations where a family writes it in Python:
transformers' ``NewGELUActivation`` (GPT-2's tanh GELU) runs 8 forward and 11 backward on the
MLP's whole intermediate, each a pass over memory with the framework's per-kernel cost around it.
:func:`pointwise_kernels` counts them on a small tensor with a
dispatch mode: every ATen call but views and ``detach`` (no kernel) is one.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import nn

_NO_KERNEL = frozenset({"detach", "lift_fresh", "alias"})


def pointwise_kernels(module: nn.Module, dtype: Any = None) -> Optional[Tuple[int, int]]:
    """``(forward, backward)`` kernels ``module`` runs on a tensor of its input's shape, or None
    where it holds parameters or buffers (not an activation), does not map a tensor to one of its
    shape, or does not run on such a tensor here."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: List[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
                self.calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=gen, dtype=dtype or torch.float32).requires_grad_()
    grad = torch.randn(2, 3, 8, generator=gen, dtype=x.dtype)
    try:
        with _Count() as fwd:
            y = module(x)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return None
        if y is x or not y.requires_grad:
            return (len(fwd.calls), 0)
        with _Count() as bwd:
            torch.autograd.grad(y, x, grad)
    except Exception:  # noqa: BLE001 — it does not take such a tensor
        return None
    return (len(fwd.calls), len(bwd.calls))
