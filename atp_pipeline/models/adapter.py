"""The model seam: what the machinery needs from a model family, behind one small protocol.

A :class:`ModelAdapter` (one per family, torchtitan's ``ModelSpec``) tells the planners and
the strategy, for a module of its family:

* :meth:`~ModelAdapter.shape` — the :class:`~atp_pipeline.planning.shape.ModelShape` the
  planners, the memory estimate, the FLOPs and the cost models read (and
  :meth:`~ModelAdapter.shape_from_config` for ``train.py``'s model configs);
* :meth:`~ModelAdapter.parallel_plan` — how its modules map to parallel styles on a
  (d1, d2) mesh (names relative to the family's root module);
* :meth:`~ModelAdapter.build` — the module from a model config;
* :meth:`~ModelAdapter.sbp_linears` — which of its modules are the matmuls of its SBP layer
  chain (AutoDDL; keys of :func:`~atp_pipeline.planning.sbp.chain.model_chain`), and
  :meth:`~ModelAdapter.apply_sbp` — the module laid out by an SBP plan (by default the
  generic executor :func:`~atp_pipeline.parallel.sbp_exec.apply_sbp_layout` on those);
* :meth:`~ModelAdapter.weights` / :meth:`~ModelAdapter.export` — the family's checkpoint
  format in (each rank reading its shards) and out.

Families register with :func:`register_adapter`; :func:`find_adapters` locates every
module of a known family inside a user's module tree. The built-in GPT
(:mod:`atp_pipeline.models.gpt`) is the first adapter and is found exactly like a user's.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Mapping, Optional, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.shape import ModelShape

if TYPE_CHECKING:
    from torch import nn

# the built-in families' modules, imported when a family is first asked for (planning the built-in
# GPT from its config imports neither torch nor transformers)
BUILTIN = {"gpt": "atp_pipeline.models.gpt.adapter", "hf": "atp_pipeline.models.hf.adapter"}


class ModelAdapter(ABC):
    """One model family's answers to the machinery (see the module docstring)."""

    family: ClassVar[str] = ""

    @abstractmethod
    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is the root of a model of this family."""

    @abstractmethod
    def shape(self, module: nn.Module) -> ModelShape:
        """The module's shape (batch 1; the run sets the step's batch and dtype)."""

    @abstractmethod
    def shape_from_config(self, cfg: Any) -> ModelShape:
        """The shape of the model ``cfg`` (a ``ModelConfig`` or its DictConfig) describes."""

    @abstractmethod
    def build(self, cfg: Any) -> nn.Module:
        """The dense model of ``cfg``, built on the current default device."""

    def build_outline(self, cfg: Any) -> nn.Module:
        """A model of ``cfg`` with the same modules per block but possibly fewer repeated
        blocks, for checking the family's own plan before launch (built on the meta device;
        default: :meth:`build`)."""
        return self.build(cfg)

    @abstractmethod
    def parallel_plan(self, module: nn.Module) -> Mapping[str, Any]:
        """``{relative module-name pattern: style}`` laying the module out on a (d1, d2) mesh."""

    def lm_loss(self, model: nn.Module, idx: Any, targets: Any) -> Any:
        """Mean next-token cross-entropy of ``model`` on ``idx`` against ``targets`` (the
        family's calling convention; default ``model(idx, targets)``)."""
        out = model(idx, targets)
        return getattr(out, "loss", out)

    def weights(self, module: nn.Module) -> Optional[Any]:
        """Where the laid-out ``module``'s weights come from once its shards are allocated: a
        reader for :func:`~atp_pipeline.parallel.dense.load_dense` (``name -> stored tensor``),
        or None (keep the initialization)."""
        return None

    def export(self, module: nn.Module, out_dir: str) -> Optional[str]:
        """Write the laid-out ``module`` in the family's own format (collective: every rank
        calls it); None if the family has no such format."""
        return None

    def sbp_linears(self, module: nn.Module) -> Mapping[str, str]:
        """``{module name: SBP layer key}`` of the module's matmuls (relative names; keys of
        :func:`~atp_pipeline.planning.sbp.chain.model_chain`: ``qkv`` or ``q``/``k``/``v``,
        ``proj``, ``gate``/``up``/``down`` or ``fc1``/``fc2``); families that have none say so."""
        raise ConfigError(f"model family '{self.family}' has no SBP layer chain; use planner=atp")

    def apply_sbp(self, module: nn.Module, layout: Any, mesh: Any) -> nn.Module:
        """The module laid out in place by an SBP layout (AutoDDL §4.2–§4.4): its
        :meth:`sbp_linears` run their planned strategies, the family's own code runs between
        them (:func:`~atp_pipeline.parallel.sbp_exec.apply_sbp_layout`)."""
        from atp_pipeline.parallel.sbp_exec import apply_sbp_layout

        return apply_sbp_layout(module, self.sbp_linears(module), layout, mesh)


_ADAPTERS: Dict[str, ModelAdapter] = {}
_LOADED = False


def register_adapter(adapter: ModelAdapter, override: bool = False) -> ModelAdapter:
    """Add a family; a user's adapter is registered exactly like the built-in ones."""
    if not adapter.family:
        raise ValueError("a model adapter needs a family name")
    if adapter.family in _ADAPTERS and not override and type(_ADAPTERS[adapter.family]) is not type(adapter):
        raise ValueError(f"model family '{adapter.family}' is already registered")
    _ADAPTERS[adapter.family] = adapter
    return adapter


def _load_builtin() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for name in BUILTIN.values():
            importlib.import_module(name)


def adapters() -> Dict[str, ModelAdapter]:
    _load_builtin()
    return dict(_ADAPTERS)


def get_adapter(family: str) -> ModelAdapter:
    if family not in _ADAPTERS and family in BUILTIN:
        importlib.import_module(BUILTIN[family])
    found = _ADAPTERS.get(family) or adapters().get(family)
    if found is None:
        raise ConfigError(f"unknown model family '{family}' (families: {', '.join(sorted(adapters()))})")
    return found


def find_adapters(root: nn.Module) -> List[Tuple[str, ModelAdapter, nn.Module]]:
    """``(name, adapter, module)`` of every outermost module of a known family in ``root``."""
    known = list(adapters().values())
    out: List[Tuple[str, ModelAdapter, nn.Module]] = []
    for name, module in root.named_modules():
        if any(name.startswith(n + ".") or (not n and name) for n, _, _ in out):
            continue
        for adapter in known:
            if adapter.matches(module):
                out.append((name, adapter, module))
                break
    return out


def prefixed(name: str, plan: Mapping[str, Any]) -> Dict[str, Any]:
    """A family's relative plan placed at ``name`` inside the user's module."""
    return {(f"{name}.{k}" if name else k): v for k, v in plan.items()}
