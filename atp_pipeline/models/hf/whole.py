"""The layout's fallback for a block's mixer it cannot split: run it whole.

A repeated block's sub-module (its direct child: a state-space or linear-attention mixer, an
attention with parameters or a core of its own, an encoder-style attention with its residual
and norm inside) that reads the hidden state and writes the hidden state, but whose linears
the layout cannot place (:func:`~atp_pipeline.models.hf.layout.derive` refuses one of its
modules, or leaves parameters of it unreached), runs WHOLE — replicated on every rank, on the
hidden gathered over d2, its output sliced back (style ``gathered(input=split, output=split)``,
:func:`~atp_pipeline.parallel.layers.run_gathered`): the model's own ``forward``, bit for bit,
its parameters' gradients complete on every rank. transformers' own tensor parallelism
likewise leaves the modules its plan does not name replicated.

The rule is read off the modules, for any family: the refused module's block child, shown on a
forward (:func:`~atp_pipeline.models.hf.layout._capture`) to take tensors over the hidden
state (every one is gathered) and to return the hidden state (a tensor, or a tuple's first
element; nothing else over the hidden). What cannot run whole keeps its refusal, one line:
a module outside the blocks, a block child whose input or output is not the hidden state
(an MLP's second half, state handed to the next block).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.apply import match_plan

QUOTED = re.compile(r"'([A-Za-z0-9_.*]+)'")
MAX_UNITS = 8  # distinct mixers a model may run whole (a guard against a loop that never ends)


def whole_style(inputs: Sequence[str], outputs: Sequence[int] = (0,)) -> str:
    """The style of a block child run whole, gathering ``inputs`` (positions or keywords) and
    slicing the ``outputs`` of a tuple it returns."""
    extra = f", inputs={'+'.join(inputs)}" if tuple(inputs) != ("0",) else ""
    extra += f", outputs={'+'.join(map(str, outputs))}" if tuple(outputs) != (0,) else ""
    return f"gathered(input=split, output=split{extra})"


def is_unit(name: str, unit: str) -> bool:
    """Whether the module ``name`` is one of the units ``unit`` (a pattern; its ``*`` one
    component: a block's, not a module inside it)."""
    return fnmatch.fnmatchcase(name, unit) and name.count(".") == unit.count(".")


def _first_is(names: Mapping[str, nn.Module], unit: str) -> nn.Module:
    return next(m for n, m in names.items() if is_unit(n, unit))


def _within(unit: str, whole: Mapping[str, str]) -> bool:
    """Whether the unit ``unit`` lies inside one of the units ``whole`` (a block run whole)."""
    return any(unit.startswith(u + ".") for u in whole)


def _inside(name: str, blocks: Sequence[str]) -> Optional[str]:
    """The block ``name`` lies strictly inside, if any."""
    return next((b for b in blocks if name.startswith(b + ".")), None)


def _child_unit(names: Mapping[str, nn.Module], block: str, name: str, lists: Tuple[str, ...],
                pattern: Callable[[str, Tuple[str, ...]], str]) -> str:
    """The block child holding the module ``name``, as a pattern over the blocks; a child that
    is a list of modules (two attentions per block) gives its elements (``...self_attn.*``)."""
    parts = name[len(block) + 1:].split(".")
    child = f"{block}.{parts[0]}"
    if isinstance(names.get(child), (nn.ModuleList, nn.ModuleDict)) and len(parts) > 1:
        return pattern(child, lists) + ".*"
    return pattern(child, lists)


def unit_of(message: str, names: Mapping[str, nn.Module], blocks: Sequence[str],
            lists: Tuple[str, ...], pattern: Callable[[str, Tuple[str, ...]], str]) -> Optional[str]:
    """The block child (as a pattern over the blocks) holding the first module a refusal names
    (a module name or pattern in quotes), or None: it names none inside a block."""
    for token in QUOTED.findall(message):
        hit = token if token in names else next((n for n in names if fnmatch.fnmatchcase(n, token)), None)
        block = _inside(hit, blocks) if hit else None
        if block:
            return _child_unit(names, block, hit, lists, pattern)
    return None


def uncovered_units(root: nn.Module, names: Mapping[str, nn.Module], plan: Mapping[str, str],
                    blocks: Sequence[str], lists: Tuple[str, ...],
                    pattern: Callable[[str, Tuple[str, ...]], str]) -> List[Tuple[str, str]]:
    """(unit, module) for the modules holding parameters of their own that no entry of ``plan`` reaches, as the units
    that would run whole: inside a block, its child (a pattern over the blocks); outside, the
    largest module around it holding no block, embedding or LM head (styled by the adapter),
    e.g. a head's transform before its projection."""
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    shared = {id(p) for p in (head.parameters() if head is not None else ())}
    kept = [n for n, m in names.items() if m is head or isinstance(m, nn.Embedding)] + list(blocks)
    out: List[Tuple[str, str]] = []
    for name, m in names.items():
        own = [p for p in m.parameters(recurse=False) if id(p) not in shared]
        if not own or any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in plan):
            continue
        block = _inside(name, blocks)
        if block is not None:
            unit = _child_unit(names, block, name, lists, pattern)
        elif name in blocks:  # the block itself holds parameters (a learned residual rate): it runs whole
            unit = pattern(name, lists)
        elif any(name == k or name.startswith(k + ".") for k in kept):
            continue
        else:
            parts = name.split(".")
            unit = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                         if not any(k == ".".join(parts[:i]) or k.startswith(".".join(parts[:i]) + ".") for k in kept)),
                        name)
        if unit not in [u for u, _ in out]:
            out.append((unit, name))
    return out


def head_unit(root: nn.Module, names: Mapping[str, nn.Module], blocks: Sequence[str]) -> Optional[str]:
    """The largest module around the LM head, outside the blocks and holding no embedding,
    that holds parameters besides the head's (an encoder-style head's transform and norm, a
    bias of its own): it runs whole, its logits whole (None: the head stands alone)."""
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    name = next((n for n, m in names.items() if m is head), None)
    if not name or "." not in name:
        return None
    mine = {id(p) for p in head.parameters()}
    parts = name.split(".")
    for i in range(1, len(parts)):
        unit = ".".join(parts[:i])
        inner = [m for n, m in names.items() if n == unit or n.startswith(unit + ".")]
        if any(b == unit or b.startswith(unit + ".") for b in blocks) or \
                any(isinstance(m, nn.Embedding) for m in inner):
            continue
        if any(id(p) not in mine for p in names[unit].parameters()):
            return unit
    return None


def token_forward(root: nn.Module, hooks: List[Any], batch: int = 1) -> bool:
    """Run ``root`` on ``batch`` sequences of 4 tokens in evaluation mode, without gradients,
    then remove ``hooks`` (handles of the hooks that watch it); False: it cannot run here."""
    import torch

    training = root.training
    root.eval()
    try:
        with torch.no_grad():
            root(input_ids=torch.zeros(batch, 4, dtype=torch.long, device=next(root.parameters()).device))
        return True
    except Exception:  # noqa: BLE001 — a model this call cannot run: no answer
        return False
    finally:
        for h in hooks:
            h.remove()
        root.train(training)


def _calls(root: nn.Module, unit: str) -> List[Tuple[tuple, dict, Any]]:
    """(args, kwargs, output) of every call of the modules ``unit`` (a pattern) in a forward of
    ``root`` on 4 tokens (:func:`token_forward`; []: it cannot run here)."""
    seen: List[Tuple[tuple, dict, Any]] = []
    hooks = [m.register_forward_hook(lambda mod, a, k, out: seen.append((a, k, out)), with_kwargs=True)
             for n, m in root.named_modules() if is_unit(n, unit)]
    return seen if token_forward(root, hooks) else []


def _idle_attention(root: nn.Module, plan: Mapping[str, str]) -> List[str]:
    """The attention patterns of ``plan`` none of whose modules runs in a forward on tokens."""
    patterns = [p for p, s in plan.items() if s.startswith("hf_attention")]
    if not patterns or any(p.is_meta for p in root.parameters()):
        return []
    ran: set = set()
    hooks = [m.register_forward_pre_hook(lambda mod, a, p=p: ran.add(p))
             for n, m in root.named_modules() for p in patterns if fnmatch.fnmatchcase(n, p)]
    return [p for p in patterns if p not in ran] if token_forward(root, hooks) else []


def hidden_io(root: nn.Module, unit: str, hidden: int
              ) -> Tuple[Tuple[str, ...], Tuple[int, ...], str, Tuple[int, int, int, int]]:
    """The inputs of the block children ``unit`` over the hidden state (positions as digits,
    keyword names) and the elements of their tuple outputs over it (the output and, e.g., a
    bias the block adds to it: sliced alike), shown on a forward (every instance: the union),
    why they cannot run whole ("" where they can), and what they send in a step: (calls,
    hidden inputs gathered, per-token outputs sliced, outputs of one hidden vector sliced)."""
    import torch

    if any(p.is_meta for p in root.parameters()):
        return ("0",), (0,), "", (0, 0, 0, 0)  # not shown (meta device): taken as is
    calls = _calls(root, unit)
    if not calls:
        return (), (), "it does not run in a forward of the model on tokens alone", (0, 0, 0, 0)
    over = lambda t: isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 \
        and t.shape[-1] == hidden  # noqa: E731
    inputs: List[str] = []
    outputs: List[int] = []
    sent = [len(calls), 0, 0, 0]
    for args, kwargs, out in calls:
        mine = [str(i) for i, a in enumerate(args) if over(a) and a.dim() >= 2] + \
            [k for k, v in kwargs.items() if over(v) and v.dim() >= 2]
        if not mine:
            seen = sorted({int(t.shape[-1]) for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)
                           and t.is_floating_point() and t.dim() >= 2})
            over_what = f" (its tensors' last widths {seen}, the hidden {hidden})" if seen else ""
            return (), (), f"its input is not the hidden state{over_what}", (0, 0, 0, 0)
        main = out[0] if isinstance(out, tuple) and out else out
        if not isinstance(out, (tuple, torch.Tensor)) or not over(main) or main.dim() < 2:
            return (), (), "its output is not the hidden state", (0, 0, 0, 0)
        # a tuple's other tensors over the hidden (a bias the block adds to the output): sliced alike
        inputs += [x for x in mine if x not in inputs]
        sliced = [(i, t) for i, t in enumerate(out if isinstance(out, tuple) else (out,)) if over(t)]
        outputs += [i for i, _ in sliced if i not in outputs]
        rows = {int(v.numel() // hidden) for v in [*args, *kwargs.values()] if over(v) and v.dim() >= 2}
        if rows != {4}:  # not run on every token (a pooler on the first): its sends are not modelled
            sent[0] = -1
        sent[1] += len(mine)
        sent[2] += sum(t.dim() >= 2 for _, t in sliced)
        sent[3] += sum(t.dim() == 1 for _, t in sliced)
    return tuple(inputs), tuple(sorted(outputs)), "", tuple(sent)


def derive_with_whole(module: nn.Module, derive_once: Callable[..., Any], blocks: Sequence[str],
                      lists: Tuple[str, ...], hidden: int, probe: bool,
                      pattern: Callable[[str, Tuple[str, ...]], str], norm: "re.Pattern[str]") -> Any:
    """``derive_once(whole)`` (a :class:`~atp_pipeline.models.hf.layout.Layout`), with the block
    children ``whole`` (pattern -> style) run whole; each refusal naming a module inside a block,
    and each block child left with parameters no style reaches, is retried with that child run
    whole, where it can be (:func:`hidden_io`). The layout's ``whole`` notes what runs whole."""
    names = dict(module.named_modules())
    head = head_unit(module, names, blocks)  # run whole, its logits whole, whatever the blocks
    whole: Dict[str, str] = {head: "gathered(input=split, output=full)"} if head else {}
    why: Dict[str, str] = {}
    sent: Dict[str, Tuple[int, int, int, int]] = {}
    while True:
        try:
            layout = derive_once(whole)
            match_plan(module, layout.plan, check=True)  # every module a pattern reaches takes its style
        except ConfigError as exc:
            message = str(exc).splitlines()[0]
            unit = unit_of(message, names, blocks, lists, pattern)
            if unit is None or unit in whole or _within(unit, whole) or len(whole) >= MAX_UNITS:
                raise
            units, reason = [unit], message
        else:
            found = [u for u in uncovered_units(module, names, layout.plan, blocks, lists, pattern)
                     if u[0] not in whole]
            if not found:
                idle = _idle_attention(module, layout.plan) if probe else []
                if idle:
                    cls = type(next(m for n, m in names.items() if fnmatch.fnmatchcase(n, idle[0]))).__name__
                    raise ConfigError(f"attention '{idle[0]}' ({cls}) does not run in a forward on tokens alone (a "
                                      f"cross-attention over another model's states, e.g. an encoder's); ATP's "
                                      f"layout does not cover it; pass a plan")
                return _noted(layout, names, whole, why, head, sent, blocks, norm)
            units = [u for u, _ in found if not _within(u, whole)]
            if not units:  # (none: every one inside a block run whole, which the plan reaches)
                return _noted(layout, names, whole, why, head, sent, blocks, norm)
            reason = f"module '{found[0][1]}' ({type(names[found[0][1]]).__name__}) holds parameters no style reaches"
        for unit in units:
            if _within(unit, whole):  # (after its block, found in the same pass)
                continue
            inputs, outputs, cannot, sent[unit] = hidden_io(module, unit, hidden) if probe else \
                (("0",), (0,), "", (0, 0, 0, 0))
            if cannot and _inside(next(n for n in names if fnmatch.fnmatchcase(n, unit)), blocks) is None:
                m = next(m for n, m in names.items() if fnmatch.fnmatchcase(n, unit))  # outside the blocks
                own = ", ".join(n for n, _ in m.named_parameters(recurse=False)) or "in its modules"
                raise ConfigError(f"transformers model '{type(module).__name__}': module '{unit}' "
                                  f"({type(m).__name__}) holds parameters no style reaches ({own}), nor can it run "
                                  f"whole: {cannot}; pass a plan") from None
            if cannot:  # the block holding it runs whole instead, where it can (its residual stream wider
                # than the hidden: hyper-connections mixing several hidden states)
                first = next(n for n in names if is_unit(n, unit))
                m, block = names[first], pattern(_inside(first, blocks), lists)
                b_inputs, b_outputs, b_cannot, b_sent = hidden_io(module, block, hidden)
                if b_cannot:
                    what = f"'{unit}' ({type(m).__name__})"
                    of_block = f"its block '{block}' ({type(_first_is(names, block)).__name__})"
                    raise ConfigError(f"{reason.rstrip('.')}; nor can {what} or {of_block} run whole: {cannot}"
                                      if b_cannot == cannot else
                                      f"{reason.rstrip('.')}; nor can {what} run whole: {cannot}; nor {of_block}: "
                                      f"{b_cannot}") from None
                sent.pop(unit, None)
                reason = f"{reason.rstrip('.')}; '{unit}' ({type(m).__name__}) cannot run whole alone: {cannot}"
                unit, inputs, outputs, sent[block] = block, b_inputs, b_outputs, b_sent
            whole[unit], why[unit] = whole_style(inputs, outputs), reason
            for inner in [u for u in whole if u.startswith(unit + ".")]:  # inside a whole block: whole with it
                del whole[inner]
                why.pop(inner, None)
                sent.pop(inner, None)


def _differs(names: Mapping[str, nn.Module], pat: str, blocks: Sequence[str], norm: "re.Pattern[str]") -> bool:
    """Whether the norms of a pattern over the blocks (as the shape counts them, per layer)
    differ by layer: of other classes (a norm in some, nothing in others), or in some blocks only."""
    hits = [m for n, m in names.items() if is_unit(n, pat)]
    if not any(norm.search(type(m).__name__) for m in hits):
        return False
    list_ = pat.split(".*.")[0]
    blocks_ = [b for b in blocks if b.rpartition(".")[0] == list_]
    return len({type(m) for m in hits}) > 1 or (bool(blocks_) and len(hits) != len(blocks_))


def _noted(layout: Any, names: Mapping[str, nn.Module], whole: Mapping[str, str], why: Mapping[str, str],
           head: Optional[str], sent: Mapping[str, Tuple[int, int, int, int]], blocks: Sequence[str],
           norm: "re.Pattern[str]") -> Any:
    """``layout`` noting what runs whole: the block children (``Layout.whole``), the head's module."""
    layout.whole = {u: _what(names, u, why[u]) for u in whole if u != head}
    layout.whole_head = head or ""
    partial = [u for u in layout.whole if sent.get(u, (0,))[0] < 0]
    layout.whole_sent = tuple(map(sum, zip((0, 0, 0, 0), *(sent.get(u, (0, 0, 0, 0)) for u in layout.whole
                                                          if u not in partial))))
    # a pattern over the blocks whose modules differ by layer (a norm in some layers, nothing in others)
    routed = [p.rpartition(".")[0] + "." for p, st in layout.plan.items() if st.startswith("hf_experts")]
    mixed = [p for p, st in layout.plan.items() if "*" in p and st == "gathered(input=split, output=split)"
             and p not in whole and not p.startswith(tuple(routed)) and _differs(names, p, blocks, norm)]
    layout.whole_unmodelled = "; ".join(
        ([f"collectives of modules run whole on other than every token ({', '.join(partial)})"] if partial else []) +
        ([f"modules that differ by layer ({', '.join(mixed)}), counted as in the first"] if mixed else []))
    return layout


def _what(names: Mapping[str, nn.Module], unit: str, reason: str) -> str:
    """One line on a block child run whole: its class, and what the layout could not split."""
    classes = dict.fromkeys(type(m).__name__ for n, m in names.items() if is_unit(n, unit))
    short = reason.split(": ", 1)[-1] if reason.startswith("transformers model") else reason
    return f"{'/'.join(classes)} run whole ({short[:160]})"


def whole_fields(module: nn.Module, layout: Any) -> Dict[str, Any]:
    """The :class:`~atp_pipeline.planning.shape.ModelShape` fields of ``layout``'s modules run
    whole: their instances, the hidden inputs they gather, their parameters (the LM head's
    weight aside: the shape's head), a note naming
    them, and the layers whose attention and dense MLP are still split ({} where none runs
    whole: every layer splits both)."""
    if not layout.whole and not layout.whole_head:
        return {}
    names = dict(module.named_modules())
    units = [n for n in names if any(fnmatch.fnmatchcase(n, u) for u in layout.whole)]
    hits = lambda pat: [n for n in names if fnmatch.fnmatchcase(n, pat)  # noqa: E731
                        and not any(n.startswith(u + ".") for u in units)]
    params: Dict[int, int] = {}
    instances = 0
    for unit in [*layout.whole, *([layout.whole_head] if layout.whole_head else [])]:
        for n in hits(unit):
            instances += 1
            params.update({id(p): p.numel() for p in names[n].parameters()})
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is not None:  # the LM head's weight is the shape's head (head_layout 'whole'), not counted twice
        params.pop(id(head.weight), None)
    calls, inputs, token_outputs, vector_outputs = layout.whole_sent
    if not calls:  # not shown (meta device): one hidden input and output each
        inputs = token_outputs = instances - bool(layout.whole_head)
    attention = [p for p, s in layout.plan.items() if s.startswith(("hf_attention", "hf_mla"))]
    routed = [n.rpartition(".")[0] for p, s in layout.plan.items() if s.startswith("hf_experts") for n in hits(p)]
    rows = [n for p, s in layout.plan.items() if s.startswith("row(") for n in hits(p)
            if not any(n.startswith(r + ".") for r in routed)]  # a dense MLP's (not a shared expert's)
    return dict(whole_modules=token_outputs, whole_inputs=inputs, whole_vectors=vector_outputs,
                whole_params=sum(params.values()),
                whole_note="; ".join([f"'{u}': {what}" for u, what in layout.whole.items()] + (
                    [f"'{layout.whole_head}': the LM head with the module around it (its logits whole)"]
                    if layout.whole_head else [])),
                attention_layers=sum(len([n for n in hits(p) if is_unit(n, p)]) for p in attention),
                mlp_layers=len(rows))
