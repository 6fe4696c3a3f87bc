"""Modules built on the meta device for their structure alone (the launcher's plan check).

:func:`outline_device` is ``with torch.device("meta")`` in which ``torch.nn.init``'s
initializers return their tensor untouched: a meta tensor holds no values to initialize, and
the meta kernels of some initializers (``normal_``, ``trunc_normal_``) are Python references
whose first call imports TorchDynamo — ~1.5 s of CPU in a launcher that only reads the module
tree (the ranks build and initialize for real)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.nn import init

#: ``torch.nn.init``'s in-place initializers (those present in this torch)
INITIALIZERS = [n for n in ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                            "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                            "orthogonal_", "sparse_") if hasattr(init, n)]


def _untouched(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@contextmanager
def outline_device() -> Iterator[None]:
    """Build modules on the meta device without running ``torch.nn.init``'s initializers
    (not thread-safe: the launcher's resolve only)."""
    saved = {n: getattr(init, n) for n in INITIALIZERS}
    try:
        for n in saved:
            setattr(init, n, _untouched)
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)
