"""Autocast (mixed precision) across the runtime's own autograd functions and threads.

``torch.autocast`` (Lightning's ``precision="bf16-mixed"``) is a thread-local state that
casts the inputs of listed ops (``linear``, ``matmul``, ...) as they run in the forward. Two
places of the runtime step outside it:

* a custom autograd function's **backward** runs with autocast off (the engine runs it after
  the forward's context has closed): one that does its own matmuls on saved inputs meets a
  bf16 activation beside an fp32 weight ("expected m1 and m2 to have the same dtype"). The
  forward records the state of its input's device (:func:`record`) and the backward casts its
  operands as autocast would have (:func:`cast`) — ``torch.amp.custom_fwd``/``custom_bwd``'s
  contract, but for the device of the tensors at hand rather than one fixed when the function
  is defined (the runtime runs on CPU and GPU alike), and explicit, so in-place kernels
  (``addmm_``, which autocast leaves alone) see one dtype too. The gradients come out in the
  compute dtype; autograd casts each to its input's dtype (an fp32 weight gets an fp32
  gradient), as for an autocast ``linear``;
* an op autocast runs in float32 (``cross_entropy``) but done by hand on split tensors
  (the vocabulary-parallel loss) takes its input in float32 too (:func:`autocast_fp32`);
* a **thread** starts with autocast off: the chunk coroutines of
  :mod:`~atp_pipeline.parallel.overlap` take the caller's state (:func:`state`,
  :func:`entered`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Tuple

import torch

#: the device types whose autocast state is carried
DEVICE_TYPES = ("cpu", "cuda")

AutocastState = Tuple[Tuple[str, torch.dtype], ...]  # (device type, dtype) of each enabled autocast


def state() -> AutocastState:
    """The autocast contexts enabled in this thread."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in DEVICE_TYPES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def entered(saved: AutocastState) -> Iterator[None]:
    """Run under the autocast contexts of ``saved`` (another thread's :func:`state`)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in saved:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
        yield


def record(ctx: Any, x: torch.Tensor) -> None:
    """In a custom function's forward: the autocast dtype of ``x``'s device (None: autocast off)."""
    device = x.device.type
    ctx.autocast_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def cast(ctx: Any, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """In its backward: the floating-point ``tensors`` in the forward's autocast dtype (unchanged
    when the forward ran without autocast)."""
    dtype = getattr(ctx, "autocast_dtype", None)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def autocast_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 where autocast is on for its device (the input of an op autocast runs in
    float32, computed by hand); else unchanged."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return x.float()
    return x
