"""The integration's classes for ``lightning.pytorch`` (``pip install lightning``);
importing this module registers ``"atp"`` there."""

from atp_pipeline.lightning.flavor import build

globals().update(build("lightning.pytorch", __name__))
