"""How the MLP of an HF model's blocks is laid out (§3.2.1, Figure 6b): the linears reading the
hidden state column-first and those writing it row-first (a packed gate|up in two parts where
declared), an activation's learned scalars on the split intermediate, a norm over the whole
intermediate between gathered linears; and the routed experts of a mixture of experts (style
``hf_experts``), the modules beside them run whole on the gathered hidden."""

from __future__ import annotations

import fnmatch
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.hf.declared import COLUMN_KINDS, ROW_KINDS, Scope, first, pattern, text_config
from atp_pipeline.models.hf.linears import is_linear
from atp_pipeline.models.hf.spec import Layout
from atp_pipeline.models.hf.whole import hidden_io
from atp_pipeline.models.op_count import pointwise_kernels
from atp_pipeline.parallel.linear import as_linear
from atp_pipeline.planning.shape import MoEShape


def lay_out_mlps(scope: Scope, rest: Mapping[str, str], declared: bool, moe_blocks: List[str],
                 plan: Dict[str, str], layout: Layout) -> Tuple[Dict[str, List[str]], int]:
    """Lay out the block linears outside the attention, ``rest`` (pattern -> kind), into
    ``plan``: column-first those reading the hidden, row-first those writing it, by parent
    module (an MLP); then an activation's learned scalars and the dense MLP's activation
    kernels. ``declared``: the kinds are transformers' declaration (only it tells a packed
    gate|up). Returns the linears by parent and the width of a shared expert's intermediate
    beside the routed ones in ``moe_blocks`` (0: none)."""
    names, hidden, kind = scope.names, scope.hidden, scope.kind
    shared_ffn = 0  # a shared expert laid out column-/row-first beside the routed ones
    by_parent: Dict[str, List[str]] = {}
    for n in rest:
        by_parent.setdefault(n.rpartition(".")[0], []).append(n)
    for parent, members in by_parent.items():
        cols = [n for n in members if rest[n] in COLUMN_KINDS]
        rows = [n for n in members if rest[n] in ROW_KINDS]
        inner = {as_linear(first(names, n))[0] for n in rows}
        if len(inner) > 1:
            raise ConfigError(f"transformers model_type '{kind}': '{parent}' has row-first linears of different "
                              f"widths {sorted(inner)}; pass a plan")
        width = next(iter(inner), None) if rows else _sibling_width(rest, names, parent, scope.lists)
        for n in cols:
            n_in, n_out, _, _ = as_linear(first(names, n))
            parts = n_out // width if width and n_out % width == 0 else 0
            if parts == 2 and not declared:  # [gate | up] or interleaved? only a declaration says
                raise ConfigError(f"transformers model_type '{kind}': linear '{n}' ({n_in} -> {n_out}) packs two "
                                  f"projections in a layout nothing declares; pass a plan")
            if n_in != hidden or parts not in (1, 2):
                raise ConfigError(f"transformers model_type '{kind}': linear '{n}' ({n_in} -> {n_out}) does not "
                                  f"read the hidden state into the width its row-first partner reads "
                                  f"({width}); ATP's layout does not cover it; pass a plan")
            opts = ["input=split", "output=split"] + (["parts=2"] if parts == 2 else []) + \
                (["shared=true"] if len(cols) > 1 else [])
            plan[n] = f"column({', '.join(opts)})"
            layout.gated = layout.gated or parts == 2 or len(cols) > 1
        for n in rows:
            n_in, n_out, _, _ = as_linear(first(names, n))
            if n_out != hidden:
                raise ConfigError(f"transformers model_type '{kind}': linear '{n}' ({n_in} -> {n_out}) does not "
                                  f"write the hidden state; pass a plan")
            plan[n] = "row(input=split, output=split)"
            if any(parent.startswith(b + ".") for b in moe_blocks):  # a shared expert beside the routed ones
                shared_ffn = shared_ffn or n_in
            else:
                layout.ffn = layout.ffn or n_in
    _lay_out_scalars(names, by_parent, plan, layout)
    _activation_kernels(names, rest, by_parent, moe_blocks, plan, layout)
    return by_parent, shared_ffn


def _lay_out_scalars(names: Mapping[str, nn.Module], by_parent: Mapping[str, List[str]], plan: Dict[str, str],
                     layout: Layout) -> None:
    """An activation with learned scalars on an MLP's split intermediate (style ``hf_scalars``:
    gradients summed over d1)."""
    for parent in by_parent:
        for child, sub in first(names, parent).named_children():
            params = list(sub.parameters())
            if params and all(p.numel() == 1 for p in params) and not any(is_linear(x) for x in sub.modules()) \
                    and f"{parent}.{child}" not in plan and _elementwise(sub) \
                    and not any("output=full" in plan.get(n, "") for n in by_parent[parent]):
                plan[f"{parent}.{child}"] = "hf_scalars(axis=d1)"
                layout.scalar_params = layout.scalar_params or sum(p.numel() for p in params)


def _activation_kernels(names: Mapping[str, nn.Module], rest: Mapping[str, str],
                        by_parent: Mapping[str, List[str]], moe_blocks: List[str], plan: Mapping[str, str],
                        layout: Layout) -> None:
    """The dense MLP's activation, as its code runs it: its kernels forward and backward
    (``layout.act_kernels``; a functional activation in the MLP's forward: one kernel)."""
    for parent, members in by_parent.items():
        if any(rest[n] in ROW_KINDS for n in members) and not any(parent.startswith(b + ".") for b in moe_blocks):
            counts = [pointwise_kernels(sub) for child, sub in first(names, parent).named_children()
                      if f"{parent}.{child}" not in plan and not is_linear(sub)]
            fwd, bwd = (sum(c[i] for c in counts if c) for i in (0, 1))
            if fwd:  # (none: a functional activation in the MLP's forward, priced as one kernel)
                layout.act_kernels = (fwd, bwd)
                break


def _sibling_width(rest: Mapping[str, str], names: Mapping[str, nn.Module], parent: str,
                   lists: Tuple[str, ...]) -> Optional[int]:
    """The input width of the row-first linears in ``parent``'s block outside it (an MLP whose
    two halves are sibling modules: an encoder-style block's intermediate and output), if one."""
    block = next((f"{ml}.*" for ml in lists if parent.startswith(f"{ml}.*.")), None)
    widths = {as_linear(first(names, n))[0] for n, k in rest.items() if k in ROW_KINDS and block
              and n.startswith(block + ".") and n.rpartition(".")[0] != parent}
    return next(iter(widths)) if len(widths) == 1 else None


def _elementwise(module: nn.Module) -> bool:
    """Whether ``module`` maps a tensor elementwise (shown on a random one: its two halves run
    apart give the same as the whole; not shown on the meta device)."""
    import torch

    p = next(module.parameters())
    if p.is_meta:
        return False
    x = torch.randn(2, 3, 8, dtype=p.dtype, generator=torch.Generator().manual_seed(0)).to(p.device)
    with torch.no_grad():
        try:
            whole = module(x)
            halves = torch.cat([module(x[..., :4]), module(x[..., 4:])], dim=-1)
        except Exception:  # noqa: BLE001 — it does not take such a tensor
            return False
    return isinstance(whole, torch.Tensor) and whole.shape == x.shape and torch.allclose(whole, halves)


def whole_between(plan: Dict[str, str], names: Mapping[str, nn.Module], members: List[str], width: int) -> bool:
    """Lay out the linears ``members`` of one MLP around a module over its whole intermediate
    ``width``: the column-first ones with their outputs gathered, the row-first ones reading a
    whole input. False (nothing changed): they are not column-first linears writing ``width``
    and row-first ones reading it."""
    cols = [n for n in members if plan.get(n, "").startswith("column(")]
    rows = [n for n in members if plan.get(n, "").startswith("row(")]
    if not cols or not rows or len(cols) + len(rows) != len(members) or \
            {as_linear(first(names, n))[0] for n in rows} != {width}:
        return False
    for n in cols:
        plan[n] = plan[n].replace("output=split", "output=full")
    for n in rows:
        plan[n] = plan[n].replace("input=split", "input=full")
    return True


def lay_out_experts(plan: Dict[str, str], names: Mapping[str, nn.Module], full: str, hidden: int, kind: str,
                     config: Any, shared_ffn: int, root: Optional[nn.Module] = None) -> MoEShape:
    """A declared experts module: every expert tensor-parallel (style ``hf_experts``); the other
    modules with parameters in its mixture-of-experts block that nothing lays out (the router, a
    shared expert's gate, an undeclared shared expert) run whole on the gathered hidden, their
    output whole unless it is a hidden state (then split again). Returns the routed layers'
    numbers, as the planners read them."""
    from atp_pipeline.models.hf.experts import experts_infeasibility

    m = first(names, full)
    why = experts_infeasibility(m)
    if why:
        raise ConfigError(f"transformers model_type '{kind}': experts '{full}' ({type(m).__name__}): "
                          f"{why}; ATP's layout does not cover it; pass a plan")
    experts = int(getattr(m, "num_experts", 0) or m.down_proj.shape[0])
    parent = full.rpartition(".")[0]
    block = names[next(n for n in names if fnmatch.fnmatchcase(n, full)).rpartition(".")[0]]  # one holding experts
    # the block's code reshaping by a width it keeps (GraniteMoE's input_size): this rank's width
    widths = sorted(k for k, v in vars(block).items() if type(v) is int and v == hidden)
    plan[full] = f"hf_experts(per_rank={'+'.join(widths)})" if widths else "hf_experts"
    gathered = split_outputs = partial_width = 0
    for child_name, child in block.named_children():
        child_pat = f"{parent}.{child_name}"
        if child_pat == full or next(child.parameters(), None) is None or \
                any(p == child_pat or p.startswith(child_pat + ".") for p in plan):
            continue
        gathered += 1
        if any(is_linear(x) and as_linear(x)[1] == hidden for x in child.modules()) or \
                _writes_hidden(root, child_pat, hidden):  # writes a hidden state (a shared expert of 3-D weights)
            plan[child_pat] = "gathered(input=split, output=split)"
            split_outputs += 1
        elif any(p.dim() == 2 and p.shape[0] == experts for p in child.parameters()):  # the router: its
            plan[child_pat] = "gathered(input=split, output=full)"  # weights' gradients the experts complete
        else:  # e.g. a shared expert's gate, scaling the split hidden: its gradient partial over d2
            plan[child_pat] = "gathered(input=split, output=full, partial_grad=true)"
            partial_width += sum(as_linear(x)[1] for x in child.modules() if is_linear(x))
    return MoEShape(experts=experts, top_k=_top_k(config, experts),
                    layers=sum(fnmatch.fnmatchcase(n, full) for n in names),
                    ffn=int(m.down_proj.shape[1 if m.is_transposed else 2]),  # an expert's intermediate
                    gated=bool(m.has_gate), shared_ffn=shared_ffn, gathered=gathered, split_outputs=split_outputs,
                    partial_width=partial_width)


def experts_shown(names: Mapping[str, nn.Module], blocks: List[str], lists: Tuple[str, ...],
                  root: Optional[nn.Module] = None) -> List[str]:
    """Patterns of the modules inside the repeated blocks that carry transformers' experts
    declaration (``use_experts_implementation``'s flags on the class), where the config's
    ``base_model_tp_plan`` names none (transformers 5.25 dropped Qwen2-MoE's ``moe_tp_experts``).
    With ``root`` (a model that runs here), a block whose code uses the routing weights outside
    its experts module (:func:`~.routing.routing_only_to_experts`) is left to run whole."""
    from atp_pipeline.models.hf.experts import FLAGS
    from atp_pipeline.models.hf.routing import routing_only_to_experts

    found: Dict[str, str] = {}
    for n, m in names.items():
        if any(n.startswith(b + ".") for b in blocks) and all(hasattr(m, f) for f in FLAGS):
            found.setdefault(pattern(n, lists), n)
    return sorted(p for p, n in found.items() if root is None or routing_only_to_experts(root, n) is not False)


def _writes_hidden(root: Optional[nn.Module], unit: str, hidden: int) -> bool:
    """Whether the modules ``unit`` return a hidden state (a tensor, or a tuple's first, over
    the hidden) on a forward of ``root`` on tokens (:func:`~.whole.hidden_io`; False: not run,
    ``root`` None)."""
    if root is None:
        return False
    _, outputs, cannot, _ = hidden_io(root, unit, hidden)
    return not cannot and 0 in outputs


def _top_k(config: Any, experts: int) -> int:
    """Experts per token, from the config (the names transformers' MoE configs use)."""
    text = text_config(config) or config
    for key in ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_experts_per_token"):
        v = getattr(text, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= experts:
            return v
    raise ConfigError(f"transformers model_type '{getattr(config, 'model_type', '?')}': experts per token not "
                      f"found in its config; pass a plan")
