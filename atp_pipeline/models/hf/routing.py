"""Where a mixture-of-experts block sends what its router returns.

Style ``hf_experts`` (:mod:`.experts`) completes the routing weights' gradient inside the
experts module: the weights multiply partial outputs there, so their gradient is summed over
d1 and d2 before it reaches the router. A block whose own code also multiplies the (split)
hidden state by the routing weights outside the experts module (an identity or "zero" expert
computed beside them) would leave that part of the gradient partial over d2: such a block is
not laid out expert by expert but runs whole (:mod:`.whole`), as on one process.

:func:`routing_only_to_experts` shows which case a block is on a forward on tokens, by
following the router's outputs op by op (a ``TorchFunctionMode``) outside the experts module.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from atp_pipeline.models.hf.experts import FLAGS
from atp_pipeline.models.hf.whole import token_forward


def _tensors(x: Any) -> List[torch.Tensor]:
    """The tensors in ``x`` (nested tuples, lists, dicts and model outputs)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):  # (a transformers ModelOutput is a dict too)
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


class _Sources(TorchFunctionMode):
    """Labels each tensor with the block children it was computed from (outside the experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: Dict[int, Set[int]] = {}
        self.keep: List[torch.Tensor] = []  # the labelled tensors stay alive: their ids are not reused
        self.inside = False  # within the experts module's forward: nothing is propagated

    def of(self, x: Any) -> Set[int]:
        return set().union(*(self.labels.get(id(t), set()) for t in _tensors(x)))

    def mark(self, x: Any, labels: Set[int]) -> None:
        for t in _tensors(x):
            self.labels[id(t)] = set(labels)
            self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside:
            came = self.of((args, kwargs))
            if came:
                for t in _tensors(out):
                    self.mark(t, self.labels.get(id(t), set()) | came)
        return out


def routing_only_to_experts(root: nn.Module, experts_name: str) -> Optional[bool]:
    """Whether the block holding the experts module ``experts_name`` (a module of ``root``)
    uses its router's outputs only through the experts module; None: not shown (the model is
    on the meta device or cannot run on tokens here)."""
    if any(p.is_meta for p in root.parameters()):
        return None
    experts = root.get_submodule(experts_name)
    block = root.get_submodule(experts_name.rpartition(".")[0])
    children = [c for _, c in block.named_children() if c is not experts]
    mode = _Sources()
    seen: Dict[str, Set[int]] = {}

    def child_hook(i: int):
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            mode.mark(out, mode.of(out) | {i})
        return hook

    def experts_in(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["routing"] = seen.get("routing", set()) | mode.of((args[1:], kwargs))
        mode.inside = True

    def experts_out(mod: nn.Module, args: tuple, out: Any) -> None:
        mode.inside = False
        mode.mark(out, set())

    def block_out(mod: nn.Module, args: tuple, out: Any) -> None:
        first = _tensors(out)[:1]
        seen["output"] = seen.get("output", set()) | mode.of(first)

    hooks = [c.register_forward_hook(child_hook(i)) for i, c in enumerate(children)]
    hooks += [experts.register_forward_pre_hook(experts_in, with_kwargs=True),
              experts.register_forward_hook(experts_out), block.register_forward_hook(block_out)]
    # no experts module's own computation is followed (nor needed: it may not run in every dtype here)
    stubbed = [m for m in root.modules() if all(hasattr(m, f) for f in FLAGS)]
    for m in stubbed:
        m.forward = lambda hidden_states, *a, **k: torch.zeros_like(hidden_states)  # type: ignore[method-assign]
    try:
        with mode:
            ran = token_forward(root, hooks)
    finally:
        for m in stubbed:
            del m.forward
    if not ran or "routing" not in seen:
        return None
    return not (seen["routing"] & seen.get("output", set()))
