"""Lightning integration: the ``"atp"`` strategy, a LightningModule for causal LMs, the
token data module and per-step metrics — for ``pytorch_lightning`` and ``lightning.pytorch``.

One implementation (the mixins in :mod:`.strategy`, :mod:`.module`, :mod:`.data`,
:mod:`.callbacks`) is joined with each Lightning package's base classes in
:mod:`.flavor`; :mod:`.pl` holds the ``pytorch_lightning`` classes and :mod:`.unified` the
``lightning.pytorch`` ones. Names imported from here come from the package the caller
uses: ``lightning.pytorch`` when only it is imported, else ``pytorch_lightning``.
Importing this package imports no Lightning; the first name looked up does.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from atp_pipeline.lightning.hook import FLAVORS, register_loaded

CLASSES = ("ATPStrategy", "LMModule", "TokenDataModule", "StepMetrics")
__all__ = [*CLASSES, "active", "register_loaded"]


def active() -> Any:
    """The flavor module (:mod:`.pl` or :mod:`.unified`) for the Lightning package in use."""
    unified_only = "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules
    return importlib.import_module(FLAVORS["lightning.pytorch" if unified_only else "pytorch_lightning"])


def __getattr__(name: str) -> Any:
    if name in CLASSES:
        return getattr(active(), name)
    raise AttributeError(f"module 'atp_pipeline.lightning' has no attribute {name!r}")
