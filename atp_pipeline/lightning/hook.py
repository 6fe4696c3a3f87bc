"""Register strategy ``"atp"`` in every Lightning package that is (or gets) imported.

Lightning resolves ``Trainer(strategy="atp")`` from a registry filled at import time, one
registry per package (``pytorch_lightning`` and ``lightning.pytorch`` are separate class
hierarchies, with no entry points for strategies). :func:`install` registers ``"atp"`` in the packages
already imported and adds a post-import hook (a ``sys.meta_path`` finder that wraps the
package's loader) that registers it when one is imported later — so
``import atp_pipeline`` stays light and the order of imports does not matter.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from typing import Any, Optional, Sequence

FLAVORS = {"pytorch_lightning": "atp_pipeline.lightning.pl", "lightning.pytorch": "atp_pipeline.lightning.unified"}


def register_loaded() -> None:
    """Register ``"atp"`` in each Lightning package already in ``sys.modules``."""
    for package, module in FLAVORS.items():
        if package in sys.modules and getattr(sys.modules[package], "__spec__", None) is not None:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - never break the user's own import
                warnings.warn(f"atp_pipeline: could not register strategy 'atp' in {package}: {exc!r}")


class _Loader(importlib.abc.Loader):
    """The package's own loader; once it has executed the package, register ``"atp"``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        register_loaded()

    def __getattr__(self, name: str) -> Any:  # resources, get_filename, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname not in FLAVORS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register in loaded packages now, and in the others when they are imported."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    register_loaded()
