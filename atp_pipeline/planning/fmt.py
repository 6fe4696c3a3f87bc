"""Number formatting shared by the plan reports."""

from __future__ import annotations


def fmt_seconds(t: float) -> str:
    """``0``, ``1.234 s``, ``12.345 ms`` or ``3.456 us``."""
    if t == 0:
        return "0"
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.3f} us"
