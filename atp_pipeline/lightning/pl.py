"""The integration's classes for ``pytorch_lightning`` (``ATPStrategy``, ``LMModule``,
``TokenDataModule``, ``StepMetrics``); importing this module registers ``"atp"`` there."""

from atp_pipeline.lightning.flavor import build

globals().update(build("pytorch_lightning", __name__))
