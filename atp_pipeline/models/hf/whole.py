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
forward (:func:`~atp_pipeline.models.hf.probe.capture`) to take tensors over the hidden
state (every one is gathered) and to return the hidden state (a tensor, or a tuple's first
element; nothing else over the hidden). What cannot run whole keeps its refusal, one line:
a module outside the blocks, a block child whose input or output is not the hidden state
(an MLP's second half, state handed to the next block).

Beside the hidden state, read off a forward as well:

* modules no forward on tokens calls or reaches (a multimodal model's image or audio
  encoder): kept whole, no gradient reaching them (:func:`idle_units`, ``replicated(idle=true)``);
* parameters over the hidden held outside the blocks (an initial hidden state), shown used
  elementwise with it only: split over d2 as it is (:func:`hidden_vector_use`, ``split_params``);
* a stream over another width computed beside the hidden (per-layer inputs): whole on every
  rank, the linears between it and the hidden run whole (:func:`side_style`);
* a residual stream of k hidden states side by side (hyper-connections): split as k parts,
  each over d2; a block child mixing the states runs with its block whole, the stream gathered
  and sliced part by part (:func:`residual_stream`, ``gathered(..., stream=KxH)``).
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
IDLE = "it does not run in a forward of the model on tokens alone"
IDLE_STYLE = "replicated(idle=true)"  # a module no forward on tokens runs (:func:`idle_units`)


def whole_style(inputs: Sequence[str], outputs: Sequence[int] = (0,), stream: Tuple[int, int] = (1, 0)) -> str:
    """The style of a block child run whole, gathering ``inputs`` (positions or keywords) and
    slicing the ``outputs`` of a tuple it returns (``stream``: (k, hidden) of a residual stream
    of k hidden states side by side, gathered and sliced part by part)."""
    extra = f", inputs={'+'.join(inputs)}" if tuple(inputs) != ("0",) else ""
    extra += f", outputs={'+'.join(map(str, outputs))}" if tuple(outputs) != (0,) else ""
    extra += f", stream={stream[0]}x{stream[1]}" if stream[0] > 1 else ""
    return f"gathered(input=split, output=split{extra})"


def residual_stream(root: nn.Module, blocks: Sequence[str], hidden: int) -> int:
    """How many hidden states side by side the blocks hand each other (hyper-connections: a
    residual stream k times the hidden; 1: the hidden itself, or not shown), read off the
    first input of the blocks' calls on a forward on tokens."""
    import torch

    if not blocks or not hidden or any(p.is_meta for p in root.parameters()):
        return 1
    widths = {int(a[0].shape[-1]) if a and isinstance(a[0], torch.Tensor) else
              int(k["hidden_states"].shape[-1]) if isinstance(k.get("hidden_states"), torch.Tensor) else 0
              for a, k, _ in _calls(root, blocks[0])}
    k = next(iter(widths)) // hidden if len(widths) == 1 and next(iter(widths)) % hidden == 0 else 1
    return max(k, 1)


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


def idle_units(root: nn.Module, blocks: Sequence[str]) -> List[str]:
    """The largest modules holding parameters that a forward of ``root`` on tokens neither
    calls nor reaches (no gradient flows to any of their parameters: an image or audio
    encoder beside a text decoder), outside the ``blocks`` that run (a block's cross-attention
    keeps its refusal); [] where not shown (on the meta device, or the model cannot run here).
    They keep their parameters whole (style ``replicated(idle=true)``), no gradient reaching
    them, as on one process."""
    import torch

    params = [p for p in root.parameters() if p.requires_grad]
    if not params or any(p.is_meta for p in params):
        return []
    ran: set = set()
    hooks = [m.register_forward_pre_hook(lambda mod, a: ran.add(id(mod))) for m in root.modules()]
    training = root.training
    root.eval()
    try:
        with torch.enable_grad():
            out = root(input_ids=torch.zeros(1, 4, dtype=torch.long, device=params[0].device))
            first = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", None)
            reached = _leaves(first.grad_fn)  # the parameters its graph reaches (no gradient computed)
    except Exception:  # noqa: BLE001 — a model this call cannot run: no answer
        return []
    finally:
        for h in hooks:
            h.remove()
        root.train(training)
    names = dict(root.named_modules())
    running = [b for b in blocks if id(names[b]) in ran]
    out_: List[str] = []
    for name, m in names.items():
        if not name or any(name.startswith(u + ".") for u in out_ + running):
            continue
        mine = list(m.parameters())
        if mine and not any(id(p) in reached for p in mine) and not any(id(x) in ran for x in m.modules()):
            out_.append(name)
    return out_


def _leaves(fn: Any) -> set:
    """ids of the leaf tensors (parameters) an autograd graph from ``fn`` reaches."""
    seen, out, todo = set(), set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if hasattr(f, "variable"):  # AccumulateGrad: a leaf
            out.add(id(f.variable))
        todo += [g for g, _ in getattr(f, "next_functions", ())]
    return out


# how a parameter over the hidden (and what is made of it alone) may be used for its split over d2
# to be exact: moved, cast, viewed with its last dimension kept, broadcast, negated, scaled by a
# number, combined elementwise with another tensor (the hidden state: the result is one), or
# handed to a module as its hidden-state input
_VIEWS = {"to", "_to_copy", "type_as", "expand", "expand_as", "contiguous", "clone", "unsqueeze", "view", "reshape",
          "broadcast_to", "detach", "float", "double", "half", "bfloat16", "neg", "__neg__", "__getitem__"}
_ELEMENTWISE = {"add", "sub", "mul", "div", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                "__truediv__", "__rtruediv__", "add_", "mul_", "lerp", "where", "addcmul"}


def hidden_vector_use(root: nn.Module, name: str, params: Sequence[str], hidden: int) -> str:
    """Why the parameters ``params`` of module ``name`` (each over the hidden in its last
    dimension) cannot be split over d2 as the hidden state is ("" where they can; not shown on
    the meta device or where the model cannot run here: taken as they are): on a forward of
    ``root`` on tokens, what is made of them alone must meet only the uses of :data:`_VIEWS` and
    :data:`_ELEMENTWISE` (an initial hidden state, a bias added to the hidden), or enter a
    module as a hidden state."""
    import torch
    from torch.overrides import TorchFunctionMode

    module = root.get_submodule(name)
    watched = [getattr(module, p) for p in params]
    if any(t.is_meta for t in watched):
        return ""
    tracked: Dict[int, Any] = {id(t): t for t in watched}  # (kept alive: ids are not reused)
    why: List[str] = []
    is_t = lambda x: isinstance(x, torch.Tensor)  # noqa: E731

    def flat(args: Any) -> List[Any]:
        out: List[Any] = []
        for a in args:
            out += flat(a) if isinstance(a, (tuple, list)) else [a]
        return out

    class _Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            ins = [a for a in flat([*args, *kwargs.values()]) if is_t(a)]
            mine = [a for a in ins if id(a) in tracked]
            outs = [o for o in flat([out]) if is_t(o)]
            if not mine or not outs or why:
                return out
            fname = getattr(func, "__name__", str(func))
            if fname in _VIEWS and all(o.dim() >= 1 and o.shape[-1] == hidden for o in outs):
                tracked.update({id(o): o for o in outs})
            elif fname in _ELEMENTWISE and all(o.shape[-1] == hidden for o in outs):
                if len(mine) == len(ins):  # (with numbers only: still made of it alone)
                    tracked.update({id(o): o for o in outs})
            else:
                why.append(f"'{name}.{params[0]}' meets {fname}, not only elementwise with the hidden state")
            return out

    def entered(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        for a in flat([*args, *kwargs.values()]):
            if is_t(a) and id(a) in tracked and not (a.dim() >= 2 and a.shape[-1] == hidden) and not why:
                why.append(f"'{name}.{params[0]}' enters {type(mod).__name__} other than as a hidden state")

    hooks = [m.register_forward_pre_hook(entered, with_kwargs=True) for m in module.modules() if m is not module]
    with _Watch():
        ran = token_forward(root, hooks, batch=2)
    return why[0] if ran and why else ""


def _vector_params(m: nn.Module, hidden: int, plan: Mapping[str, str], name: str) -> List[str]:
    """The own parameters of module ``name`` no entry of ``plan`` reaches, where all are over
    the hidden in their last dimension ([] otherwise)."""
    if any(fnmatch.fnmatchcase(name, p) for p in plan):
        return []
    own = [(k, p) for k, p in m.named_parameters(recurse=False)]
    return [k for k, _ in own] if own and all(p.dim() >= 1 and p.shape[-1] == hidden for _, p in own) else []


def side_style(root: nn.Module, unit: str, names: Mapping[str, nn.Module], blocks: Sequence[str],
               hidden: int) -> Optional[Tuple[str, Tuple[int, int, int, int]]]:
    """The style (and sends, as :func:`hidden_io`'s) of the linears ``unit`` between the hidden
    state and a stream over another width computed beside it (per-layer inputs: a table and a
    projection outside the blocks, each block's slice of them gating a linear of its own): such
    a stream is whole on every rank, so the linear runs whole, reading the gathered hidden and
    writing the stream whole (``gathered(input=split, output=full)``), or reading the stream and
    writing the hidden sliced (``gathered(input=full, output=split)``). Inside a block, the
    stream's width must be that of an input the block is handed (each layer's slice of the
    stream) — shown on a forward; outside the blocks, only the linear writing the stream from
    the gathered hidden. None: ``unit`` is not such a linear."""
    import torch

    m = next((m for n, m in names.items() if is_unit(n, unit)), None)
    n_in, n_out = getattr(m, "in_features", None), getattr(m, "out_features", None)
    if not isinstance(n_in, int) or not isinstance(n_out, int) or (n_in == hidden) == (n_out == hidden):
        return None
    calls = _calls(root, unit)
    if not calls or any(not args or not isinstance(args[0], torch.Tensor) or args[0].shape[-1] != n_in
                        for args, _, _ in calls):
        return None
    first = next(n for n in names if is_unit(n, unit))
    block = _inside(first, blocks)
    if block is None and (n_in != hidden or not blocks):  # outside the blocks, what it reads may be split
        return None
    # the widths of the tensors the blocks are handed besides the hidden (a per-layer input among them)
    widths = {int(t.shape[-1]) for args, kwargs, _ in _calls(root, (block or blocks[0]).rpartition(".")[0] + ".*")
              for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.is_floating_point()
              and 2 <= t.dim() <= 3} - {hidden}
    side = n_out if n_in == hidden else n_in
    if block is not None and side not in widths or block is None and not any(side % w == 0 for w in widths):
        return None  # (outside the blocks: the stream of every layer's slices, side by side)
    n = len(calls)
    return ("gathered(input=split, output=full)", (n, n, 0, 0)) if n_in == hidden else \
        ("gathered(input=full, output=split)", (n, 0, n, 0))


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


def hidden_io(root: nn.Module, unit: str, hidden: int, stream: int = 1, child: bool = False
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
        return (), (), IDLE, (0, 0, 0, 0)
    widths = {hidden, stream * hidden}  # (a residual stream of ``stream`` hidden states side by side)
    over = lambda t: isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 \
        and t.shape[-1] in widths  # noqa: E731
    if stream > 1 and child and any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2
                                    and t.shape[-1] == stream * hidden
                                    for a, k, o in calls for t in [*a, *k.values(), *(o if isinstance(o, tuple)
                                                                                        else (o,))]):
        # a block child mixing the residual stream's hidden states (a hyper-connection): what it
        # hands on besides them (its weights of the states, whole) would meet the split hidden
        return (), (), f"it mixes the residual stream of {stream} hidden states side by side (hyper-connections)", \
            (0, 0, 0, 0)
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
        rows = {int(v.numel() // v.shape[-1]) for v in [*args, *kwargs.values()] if over(v) and v.dim() >= 2}
        if rows != {4} or any(t.shape[-1] != hidden for t in [*args, *kwargs.values(), *(out if isinstance(
                out, tuple) else (out,))] if over(t)):  # not run on every token (a pooler on the first), or
            sent[0] = -1  # on a residual stream wider than the hidden: its sends are not modelled
        sent[1] += len(mine)
        sent[2] += sum(t.dim() >= 2 for _, t in sliced)
        sent[3] += sum(t.dim() == 1 for _, t in sliced)
    return tuple(inputs), tuple(sorted(outputs)), "", tuple(sent)


def derive_with_whole(module: nn.Module, derive_once: Callable[..., Any], blocks: Sequence[str],
                      lists: Tuple[str, ...], hidden: int, probe: bool,
                      pattern: Callable[[str, Tuple[str, ...]], str], norm: "re.Pattern[str]",
                      idle: Sequence[str] = ()) -> Any:
    """``derive_once(whole)`` (a :class:`~atp_pipeline.models.hf.layout.Layout`), with the block
    children ``whole`` (pattern -> style) run whole and the modules ``idle`` (:func:`idle_units`)
    kept whole; each refusal naming a module inside a block,
    and each block child left with parameters no style reaches, is retried with that child run
    whole, where it can be (:func:`hidden_io`). The layout's ``whole`` notes what runs whole."""
    names = dict(module.named_modules())
    head = head_unit(module, names, blocks)  # run whole, its logits whole, whatever the blocks
    whole: Dict[str, str] = {head: "gathered(input=split, output=full)"} if head else {}
    why: Dict[str, str] = {}
    for unit in idle:  # (:func:`idle_units`) kept whole, left out of the layout
        whole[unit], why[unit] = IDLE_STYLE, IDLE
    vectors: Dict[str, str] = {}  # modules whose own parameters over the hidden are split as it is
    stream = residual_stream(module, blocks, hidden) if probe else 1
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
                     if u[0] not in whole and u[1] not in vectors]
            for unit, name in list(found):  # a module outside the blocks holding parameters over the hidden
                own = _vector_params(names[name], hidden, layout.plan, name) if unit == name and \
                    _inside(name, blocks) is None else []
                if own and not (hidden_vector_use(module, name, own, hidden) if probe else ""):
                    vectors[name] = f"split_params(params={'+'.join(own)})"
                    found.remove((unit, name))
            if not found:
                idle = _idle_attention(module, layout.plan) if probe else []
                if idle:
                    cls = type(next(m for n, m in names.items() if fnmatch.fnmatchcase(n, idle[0]))).__name__
                    raise ConfigError(f"attention '{idle[0]}' ({cls}) does not run in a forward on tokens alone (a "
                                      f"cross-attention over another model's states, e.g. an encoder's); ATP's "
                                      f"layout does not cover it; pass a plan")
                return _noted(layout, names, whole, why, head, sent, blocks, norm, vectors)
            units = [u for u, _ in found if not _within(u, whole)]
            if not units:  # (none: every one inside a block run whole, which the plan reaches)
                return _noted(layout, names, whole, why, head, sent, blocks, norm, vectors)
            reason = f"module '{found[0][1]}' ({type(names[found[0][1]]).__name__}) holds parameters no style reaches"
        for unit in units:
            if _within(unit, whole):  # (after its block, found in the same pass)
                continue
            child = _inside(next(n for n in names if fnmatch.fnmatchcase(n, unit)), blocks) is not None
            inputs, outputs, cannot, sent[unit] = hidden_io(module, unit, hidden, stream, child) if probe else \
                (("0",), (0,), "", (0, 0, 0, 0))
            side = side_style(module, unit, names, blocks, hidden) if cannot and probe else None
            if side is not None:  # a linear between the hidden and a per-layer input over another width
                whole[unit], why[unit] = side[0], "between the hidden and a stream over another width beside it " \
                    "(per-layer inputs), whole on every rank"
                sent[unit] = side[1]
                continue
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
                b_inputs, b_outputs, b_cannot, b_sent = hidden_io(module, block, hidden, stream)
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
            whole[unit], why[unit] = whole_style(inputs, outputs, (stream, hidden)), reason
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
           norm: "re.Pattern[str]", vectors: Mapping[str, str]) -> Any:
    """``layout`` noting what runs whole: the block children (``Layout.whole``), the head's module;
    its plan with the modules ``vectors`` (name -> style) splitting their parameters over the hidden."""
    layout.plan = {**layout.plan, **vectors}
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
    if reason == IDLE:
        return f"{'/'.join(classes)} kept whole ({IDLE}: no gradient reaches it)"
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
            instances += layout.plan.get(unit) != IDLE_STYLE  # (kept whole, idle: it sends nothing)
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
