"""Lightning integration: the ``"atp"`` strategy (registered on import), the built-in GPT
module, data modules and per-step metrics."""

from atp_pipeline.lightning.callbacks import StepMetrics
from atp_pipeline.lightning.data import TokenDataModule
from atp_pipeline.lightning.module import GPTModule
from atp_pipeline.lightning.strategy import ATPStrategy, register

register()

__all__ = ["ATPStrategy", "GPTModule", "StepMetrics", "TokenDataModule", "register"]
