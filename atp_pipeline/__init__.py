"""atp-pipeline: declarative, topology-aware distributed training.

Importing the package is light: it imports neither Lightning nor Hydra and registers
nothing heavy. Public names load on first use. Lightning's strategy ``"atp"`` is
registered in whichever Lightning package (``pytorch_lightning``, ``lightning.pytorch``)
is imported — already, or later (a post-import hook) — so user code reads::

    import pytorch_lightning as pl        # or: import lightning.pytorch as L
    import atp_pipeline
    trainer = pl.Trainer(strategy="atp", devices=4)

``train.py`` registers the Hydra config schemas itself.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ConfigError": "atp_pipeline.errors",
    "Topology": "atp_pipeline.topology.model",
    "ModelShape": "atp_pipeline.planning.shape",
    "MeshPlan": "atp_pipeline.planning.mesh_plan",
    "make_plan": "atp_pipeline.planning.search",
    "ATPLinear": "atp_pipeline.parallel.linear",
    "init_mesh": "atp_pipeline.parallel.mesh",
    "ATPStrategy": "atp_pipeline.lightning",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'atp_pipeline' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def _install_lightning_hook() -> None:
    from atp_pipeline.lightning.hook import install

    install()


_install_lightning_hook()
