"""Number formatting shared by the plan reports and the run's messages."""

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


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units a reader takes in at a glance: ``812 B``, ``3.4 kB``, ``1.2 MB``, ``80.0 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
