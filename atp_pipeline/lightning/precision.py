"""Lightning's gradient clipping under strategy ``"atp"``: the global norm, not one process's.

Lightning clips in its precision plugin: ``Trainer(gradient_clip_val=...)`` reaches
``LightningModule.configure_gradient_clipping``, whose default (or a user's override calling
``self.clip_gradients``) calls ``trainer.precision_plugin.clip_gradients`` and from there
``clip_grad_by_norm`` / ``clip_grad_by_value`` — ``torch.nn.utils.clip_grad_norm_`` on this
process's tensors, which refuses DTensors beside plain tensors and would not see the other
ranks' shards. Both Lightning packages route it the same way (``pytorch_lightning`` and
``lightning.pytorch`` share the code, not the classes).

:func:`with_global_clipping` gives the strategy's plugin — whatever precision it implements
(``32-true``, ``bf16-mixed``, ``bf16-true``) — those two methods from
:class:`GlobalClipMixin`: the plugin's class is swapped for a subclass that puts the mixin
first (``isinstance`` checks and every other method are the plugin's own), and the methods
call :mod:`atp_pipeline.parallel.clip` on the strategy's mesh. The norm clipped by is kept on
the strategy (``grad_norm``) and logged as ``grad_norm`` where Lightning allows logging.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict

from atp_pipeline.parallel.clip import clip_grad_norm_, clip_grad_value_


class GlobalClipMixin:
    """``clip_grad_by_norm`` / ``clip_grad_by_value`` over the whole laid-out model (module
    docstring); mixed into a Lightning precision plugin by :func:`with_global_clipping`."""

    _atp_strategy: "weakref.ReferenceType[Any]"

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Scale the gradients so that their global 2-norm is at most ``clip_val``."""
        strategy = self._atp_strategy()
        params = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        norm = clip_grad_norm_(params, clip_val, strategy.comm)
        strategy.record_grad_norm(norm)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]``."""
        clip_grad_value_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the plugin it was (the strategy's reference dropped): the strategy that
        holds it mixes the clipping in again when it is next asked for its plugin."""
        state = {k: v for k, v in self.__dict__.items() if k != "_atp_strategy"}
        return _rebuild, (type(self).__bases__[1], state)


def _rebuild(cls: type, state: Dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


_CLASSES: Dict[type, type] = {}


def with_global_clipping(plugin: Any, strategy: Any) -> Any:
    """``plugin`` (a Lightning precision plugin) clipping over ``strategy``'s mesh (module
    docstring); the same object, its class swapped once."""
    cls = type(plugin)
    if not issubclass(cls, GlobalClipMixin):
        sub = _CLASSES.get(cls)
        if sub is None:
            sub = _CLASSES[cls] = type(cls.__name__, (GlobalClipMixin, cls),
                                       {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                        "__doc__": cls.__doc__})
        plugin.__class__ = sub
    plugin._atp_strategy = weakref.ref(strategy)
    return plugin
