"""Join the integration's mixins with one Lightning package's base classes.

Each class is a plain subclass ``class ATPStrategy(ATPStrategyMixin, ModelParallelStrategy)``
with its ``__module__``/``__qualname__`` set to the flavor module, so zero-argument
``super()`` in the mixins resolves through the package's own hierarchy and instances
pickle by reference. Nothing is copied between classes.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict


def build(package: str, module_name: str) -> Dict[str, Any]:
    """The four classes for ``package`` (``pytorch_lightning`` | ``lightning.pytorch``),
    with ``"atp"`` registered in that package's strategy registry."""
    from atp_pipeline.lightning.callbacks import StepMetricsMixin
    from atp_pipeline.lightning.data import TokenDataMixin
    from atp_pipeline.lightning.module import LMModuleMixin
    from atp_pipeline.lightning.strategy import ATPStrategyMixin

    pl = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")
    bases = {"ATPStrategy": (ATPStrategyMixin, strategies.ModelParallelStrategy),
             "LMModule": (LMModuleMixin, pl.LightningModule),
             "TokenDataModule": (TokenDataMixin, pl.LightningDataModule),
             "StepMetrics": (StepMetricsMixin, pl.Callback)}
    out: Dict[str, Any] = {}
    for name, (mixin, base) in bases.items():
        out[name] = type(name, (mixin, base), {"__module__": module_name, "__qualname__": name,
                                               "__doc__": mixin.__doc__, "lightning_package": package})
    strategies.StrategyRegistry.register("atp", out["ATPStrategy"], override=True,
                                         description="ATP adaptive tensor parallelism (atp_pipeline)")
    return out
