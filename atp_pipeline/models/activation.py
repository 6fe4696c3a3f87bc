"""The elementwise operators an MLP's activation dispatches: what the step model lists as its
kernels (:attr:`~atp_pipeline.planning.shape.ModelShape.act_ops`).

An activation written as several tensor operations — GPT-2's tanh approximation of GELU is
eight in forward and eleven in backward — costs that many kernels' dispatch and memory passes
over the MLP's intermediate, where a fused one (``silu``, ``gelu``) costs one each way
(``docs/step_validation/diagnosis/e21.log``). Counted, not tabled: the activation runs once
on a meta tensor (no memory, no arithmetic) under a dispatch mode that records every aten
operator of its forward and of its backward."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

#: aten operators that move no element (views, aliases, autograd's detaches, allocation)
NO_COMPUTE = frozenset({"detach", "alias", "view", "_unsafe_view", "reshape", "expand", "t", "transpose",
                        "permute", "as_strided", "squeeze", "unsqueeze", "slice", "select", "empty",
                        "empty_like", "empty_strided", "lift_fresh"})


def activation_ops(fn: Callable[[Any], Any]) -> Tuple[int, int]:
    """``(forward, backward)``: the aten operators that compute elements when ``fn`` maps a
    tensor and when its gradient flows back (:data:`NO_COMPUTE` not counted). ``(1, 1)``
    where ``fn`` does not map a meta tensor to one of its shape (the step model's one kernel
    each way)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: List[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.empty(2, 8, device="meta", requires_grad=True)
    try:
        with _Count() as fwd:
            y = fn(x)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.requires_grad:
            return 1, 1
        grad = torch.empty_like(y)
        with _Count() as bwd:
            torch.autograd.backward(y, grad)
    except Exception:  # noqa: BLE001 — an activation that does not take a meta tensor: one kernel each way
        return 1, 1

    def computing(ops: List[str]) -> int:
        return sum(op not in NO_COMPUTE for op in ops)
    return max(computing(fwd.ops), 1), max(computing(bwd.ops), 1)
