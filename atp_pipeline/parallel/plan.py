"""Declarative parallel plans: module-name patterns -> parallel styles, applied from outside.

A plan is data (it lives in the model config): ``{"blocks.*": "block", "head": "column",
...}``. :func:`apply_parallel_plan` walks the module tree, matches every pattern
(``fnmatch`` on dotted names) and replaces each matching module in place by its parallel
counterpart on the mesh — the model code never changes (torchtitan's approach). Styles:

=============  ===========================================================================
``column``     ``nn.Linear`` -> column-first :class:`ATPLinear` (out over d1, in over d2)
``row``        ``nn.Linear`` -> row-first :class:`ATPLinear` (in over d1, out over d2)
``block``      a pre-LN transformer block (``ln1, attn.qkv, attn.proj, ln2, mlp.fc1,
               mlp.fc2``) -> :class:`ParallelBlock`: ATP's layer with chunk overlap
``layernorm``  ``nn.LayerNorm`` over a hidden dimension split across d2
``embedding``  ``nn.Embedding`` split by hidden feature over d2
``vocab_loss`` a cross-entropy module -> vocabulary-parallel cross-entropy over d1
``replicated`` kept whole on every rank (stated explicitly; nothing changes)
=============  ===========================================================================

Every pattern must match at least one module and every match must have the style's type;
otherwise a :class:`ConfigError` names the pattern and what it found.
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.gpt import ParallelBlock, ParallelEmbedding, ParallelLayerNorm
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear
from atp_pipeline.parallel.mappings import vocab_parallel_cross_entropy

STYLES = ("column", "row", "block", "layernorm", "embedding", "vocab_loss", "replicated")


class VocabParallelLoss(nn.Module):
    """Mean cross-entropy of vocabulary-sharded logits ``[..., V/d1]`` (replaces a CE module)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.comm = comm_for(mesh)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.comm, "d1")


def _expect(name: str, module: nn.Module, kind: type, style: str) -> None:
    if not isinstance(module, kind):
        raise ConfigError(f"parallel plan: '{name}' is a {type(module).__name__}, not the "
                          f"{kind.__name__} that style '{style}' applies to")


def _convert(name: str, module: nn.Module, style: str, mesh: DeviceMesh, chunks: int) -> nn.Module:
    if style in (COLUMN, ROW):
        _expect(name, module, nn.Linear, style)
        return ATPLinear.from_linear(module, mesh, style)  # type: ignore[arg-type]
    if style == "layernorm":
        _expect(name, module, nn.LayerNorm, style)
        return ParallelLayerNorm(module, mesh)  # type: ignore[arg-type]
    if style == "embedding":
        _expect(name, module, nn.Embedding, style)
        return ParallelEmbedding(module, mesh)  # type: ignore[arg-type]
    if style == "vocab_loss":
        _expect(name, module, nn.CrossEntropyLoss, style)
        return VocabParallelLoss(mesh)
    if style == "block":
        missing = [p for p in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2")
                   if not _has(module, p)]
        if missing:
            raise ConfigError(f"parallel plan: '{name}' ({type(module).__name__}) lacks "
                              f"{', '.join(missing)} needed by style 'block'")
        return ParallelBlock(module, mesh, chunks)  # type: ignore[arg-type]
    if style == "replicated":
        return module
    raise ConfigError(f"parallel plan: unknown style '{style}' for '{name}' (styles: {', '.join(STYLES)})")


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def match_plan(root: nn.Module, plan: Mapping[str, str]) -> Dict[str, str]:
    """``{module name: style}`` for every module the plan reaches (first matching pattern
    wins; modules inside a replaced module are not matched again). Checks only names."""
    names = [n for n, _ in root.named_modules() if n]
    chosen: Dict[str, str] = {}
    for pattern, style in plan.items():
        style = getattr(style, "value", style)
        if style not in STYLES:
            raise ConfigError(f"parallel plan: unknown style '{style}' for pattern '{pattern}' "
                              f"(styles: {', '.join(STYLES)})")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            top = sorted({n.split(".")[0] for n in names})
            raise ConfigError(f"parallel plan: pattern '{pattern}' matches no module of "
                              f"{type(root).__name__} (top-level modules: {', '.join(top)})")
        for n in hits:
            if n not in chosen and not any(n.startswith(p + ".") for p in chosen if chosen[p] != "replicated"):
                chosen[n] = style
    return chosen


def apply_parallel_plan(root: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh,
                        chunks: int = 1) -> Dict[str, str]:
    """Replace the modules of ``root`` that ``plan`` matches, in place; returns what was applied."""
    chosen = match_plan(root, plan)
    for name, style in sorted(chosen.items(), key=lambda kv: kv[0].count(".")):
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, attr, _convert(name, getattr(parent, attr), style, mesh, chunks))
    return chosen
