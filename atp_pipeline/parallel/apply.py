"""Apply a parallel plan — module-name patterns -> styles — to a module tree, from outside.

A plan is data: ``{"blocks.*.mlp.fc1": "column", "head": "column(input=split, output=split)", ...}``
(patterns are ``fnmatch`` on dotted module names; the first pattern that matches a module
wins, and modules inside a replaced module are not matched again). :func:`match_plan`
checks the patterns against a module tree — every pattern must match a module and every
match must pass its style's check — without touching it (a model on the meta device will
do), so a bad plan fails before any process starts. :func:`apply_plan` then replaces the
matches in place, parents first (a style sharing another module's parameters, ``order = 1``,
after all others); the model code never changes (torchtitan's approach).
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Mapping, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel import rng
from atp_pipeline.parallel.layers import FULL
from atp_pipeline.parallel.overlap import chunk_blocks
from atp_pipeline.parallel.styles import (
    AttentionHeads,
    ColumnFirst,
    ParallelStyle,
    StyleContext,
    StyleSpec,
    Tied,
    VocabLoss,
    parse_style,
)


def match_plan(root: nn.Module, plan: Mapping[str, StyleSpec], check: bool = True) -> Dict[str, ParallelStyle]:
    """``{module name: style}`` for every module the plan reaches, each checked by its style."""
    names = [n for n, _ in root.named_modules() if n]
    chosen: Dict[str, ParallelStyle] = {}
    for pattern, spec in plan.items():
        style = parse_style(spec)
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            top = sorted({n.split(".")[0] for n in names})
            raise ConfigError(f"parallel plan: pattern '{pattern}' matches no module of "
                              f"{type(root).__name__} (top-level modules: {', '.join(top)})")
        for n in hits:
            inside = any(n.startswith(p + ".") for p, s in chosen.items() if not s.transparent)
            if n not in chosen and not inside:
                chosen[n] = style
    if check:
        for name, style in chosen.items():
            style.check(name, root.get_submodule(name))
    return chosen


def _region_after(style: ParallelStyle) -> str:
    """The random stream of the code after ``style``'s module: its output's layout
    (:mod:`~atp_pipeline.parallel.rng`); a style may declare it as ``output_region``."""
    if getattr(style, "output_region", None):
        return style.output_region  # type: ignore[attr-defined]
    if getattr(style, "output", FULL if type(style) in (Tied, VocabLoss) else "") == FULL:
        return rng.REPLICATED  # whole on every rank (gathered logits, a loss)
    return rng.SPLIT_D1 if isinstance(style, (ColumnFirst, AttentionHeads)) else rng.SPLIT_D2


def apply_plan(root: nn.Module, plan: Mapping[str, StyleSpec], mesh: DeviceMesh,
               chunks: int = 1, seed: Optional[int] = None) -> Dict[str, str]:
    """Replace the modules of ``root`` that ``plan`` matches, in place, and run its blocks in
    ``chunks`` (§4.1, :func:`~atp_pipeline.parallel.overlap.chunk_blocks`); returns
    ``{module name: style description}`` of what was applied. Dropout draws per-rank streams
    seeded from ``seed`` (default ``torch.initial_seed()``; :func:`~atp_pipeline.parallel.rng.install`)."""
    chosen = match_plan(root, plan)
    ctx = StyleContext(mesh, root)
    for name, style in sorted(chosen.items(), key=lambda kv: (kv[1].order, kv[0].count("."))):
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, attr, style.apply(name, getattr(parent, attr), ctx))
    rng.install(root, {n: _region_after(s) for n, s in chosen.items() if not s.transparent}, mesh, seed)
    chunk_blocks(root, chunks)
    return {n: s.describe() for n, s in chosen.items()}
