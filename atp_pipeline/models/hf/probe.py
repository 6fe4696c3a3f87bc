"""What the layout shows by running an attention module of an HF model on the inputs a forward
on tokens gives it (:func:`capture`): the layout of a fused q|k|v, that its code runs on blocks
of its heads and on the hidden state split over d2, which of its own parameters its core reads
through transformers' attention interface, and the position biases it is passed for all heads.
Nothing is shown on the meta device or where the model cannot run here."""

from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.hf.declared import first
from atp_pipeline.models.hf.linears import cut_features, feature_dim, permute_features
from atp_pipeline.models.hf.spec import AttentionSpec
from atp_pipeline.models.hf.whole import is_unit
from atp_pipeline.parallel.linear import as_linear

BIAS_KWARGS = re.compile(r"alibi|position_bias", re.IGNORECASE)


class _Captured(Exception):
    pass


def capture(root: nn.Module, att: str) -> Optional[Tuple[nn.Module, tuple, dict]]:
    """The first ``att`` module of ``root`` and the inputs a forward of ``root`` on 4 tokens
    gives it (None: no parameters to run — meta device — or a model this call cannot run)."""
    import torch

    if any(p.is_meta for p in root.parameters()):
        return None
    target = first(dict(root.named_modules()), att)
    captured: Dict[str, Any] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    training = root.training
    root.eval()
    try:
        with torch.no_grad():
            root(input_ids=torch.zeros(1, 4, dtype=torch.long, device=next(root.parameters()).device))
    except _Captured:
        pass
    except Exception:  # noqa: BLE001 — a model this call cannot run: no answer
        return None
    finally:
        handle.remove()
        root.train(training)
    if "args" not in captured:
        return None
    return target, captured["args"], captured["kwargs"]


def call_eval(m: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``m`` on captured inputs in evaluation mode (no dropout: a probe compares outputs)."""
    training = m.training
    m.eval()
    try:
        kwargs = copy.deepcopy(kwargs)  # a cache among them must not grow from one call to the next
    except Exception:  # noqa: BLE001 — inputs that cannot be copied: as captured
        pass
    try:
        return m(*args, **kwargs)
    finally:
        m.train(training)


def run_eval(m: nn.Module, args: tuple, kwargs: dict) -> Any:
    out = call_eval(m, args, kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def read_by_core(root: nn.Module, att: str, own: List[str], heads: int, probe: bool) -> bool:
    """Whether the attention ``att``'s own parameters ``own`` each hold one value per query
    head and are read by its core alone (transformers' attention interface: an attribute of the
    module or a keyword input), as attention sinks are, shown on a forward (``probe``; not
    shown on the meta device)."""
    modules = [m for name, m in root.named_modules() if is_unit(name, att)]  # every block's: the same
    # parameters, one value per head
    if any(not isinstance(getattr(m, n, None), nn.Parameter) or tuple(getattr(m, n).shape) != (heads,)
           for m in modules for n in own):
        return False
    if not probe:
        return True
    got = capture(root, att)
    read = core_reads(*got) if got is not None else None
    return read is not None and set(own) <= read


def head_biases(root: nn.Module, att: str, heads: int) -> Tuple[str, ...]:
    """The keyword inputs of the attention ``att`` holding position biases for all heads
    (ALiBi), whose first dimension is ``heads`` or batch x ``heads``: the style slices them
    to the rank's heads. Refused in one line for one of another shape."""
    got = capture(root, att)
    if got is None:
        return ()
    target, _, kwargs = got
    names = tuple(k for k, v in kwargs.items() if BIAS_KWARGS.search(k) and v is not None)
    odd = [k for k in names if not hasattr(kwargs[k], "shape") or kwargs[k].dim() < 1
           or kwargs[k].shape[0] % heads]
    if odd:
        raise ConfigError(f"attention '{att}' ({type(target).__name__}) is passed position biases for all heads "
                          f"({', '.join(odd)}) whose first dimension is not per head; ATP's layout does not slice "
                          f"them per rank; pass a plan")
    return names


def slice_heads(t: Any, heads: int, index: Any) -> Any:
    """The heads ``index`` of a position bias whose first dimension is ``heads`` or batch x
    ``heads`` (batch major)."""
    rest = t.shape[1:]
    return t.view(-1, heads, *rest).index_select(1, index.to(t.device)).reshape(-1, *rest)


def probe_fused(root: nn.Module, att: str, qkv: str, o: str, heads: int, hd: int) -> Optional[str]:
    """Which layout a fused multi-head q|k|v projection has — ``"concat"`` (all queries, then
    keys, then values) or ``"heads"`` (each head's q, k and v together) — read off the module
    itself (:func:`capture`): run again with heads 0 and 1 swapped under each hypothesis (in
    the projection's outputs and in the output projection's inputs), only the true layout
    leaves the module's output unchanged. None: it cannot run here, or no single answer."""
    import torch

    got = capture(root, att) if heads >= 2 else None
    if got is None:
        return None
    target, args, kwargs = got
    biases = head_biases(root, att, heads)
    with torch.no_grad():
        reference = run_eval(target, args, kwargs)
        swapped_heads = torch.arange(heads)
        swapped_heads[[0, 1]] = swapped_heads[[1, 0]].clone()
        kwargs = {k: slice_heads(v, heads, swapped_heads) if k in biases else v for k, v in kwargs.items()}
        answers = []
        for layout in ("concat", "heads"):
            order = torch.arange(3 * heads * hd).view(*((3, heads, hd) if layout == "concat" else (heads, 3, hd)))
            swapped = order.clone()
            if layout == "concat":
                swapped[:, [0, 1]] = order[:, [1, 0]]
            else:
                swapped[[0, 1]] = order[[1, 0]]
            heads_order = torch.arange(heads * hd).view(heads, hd)
            heads_order[[0, 1]] = heads_order[[1, 0]].clone()
            probe = copy.deepcopy(target)
            permute_features(getattr(probe, qkv), swapped.reshape(-1), output=True)
            permute_features(getattr(probe, o), heads_order.reshape(-1), output=False)
            if torch.allclose(run_eval(probe, args, kwargs), reference, rtol=1e-4, atol=1e-6):
                answers.append(layout)
    return answers[0] if len(answers) == 1 else None


def runs_on_head_blocks(root: nn.Module, att: str, spec: AttentionSpec, heads: int, kv: int, hd: int,
                        hidden: int, blocks: int = 2) -> Optional[str]:
    """Why the attention ``att`` does not run on blocks of its heads (None: it does, or it
    cannot be run here). Its inputs captured (:func:`capture`), the module is run once per
    block of ``heads/blocks`` query heads — the projections cut to the block's rows under
    ``spec``, the output projection to its input columns, ``spec.per_rank`` attributes divided
    — and the blocks' outputs (partial sums of the output projection, as on the ranks of d1)
    must add up to the module's own output."""
    import torch

    if heads % blocks or kv % blocks:
        return None
    got = capture(root, att)
    if got is None:
        return None
    target, args, kwargs = got
    total = None
    with torch.no_grad():
        try:
            whole = call_eval(target, args, kwargs)
        except Exception:  # noqa: BLE001 — the module fails on its own inputs here: no answer
            return None
        extra = [t for t in (whole[1:] if isinstance(whole, (tuple, list)) else ())
                 if isinstance(t, torch.Tensor) and t.shape[-1:] == (hidden,)]
        if extra:
            return "it returns a tensor over the hidden state besides its output (added outside it, whole)"
        why = _split_hidden_fails(target, args, kwargs, spec, hidden)
        if why:
            return why
        if spec.whole and not calls_interface(target, args, kwargs):
            return "its code reads whole q/k/v and computes the attention itself, not through transformers' " \
                   "attention interface"
        reference = run_eval(target, args, kwargs)
        base = copy.deepcopy(target)  # what the module adds besides its output projection's product
        _zero_weight(getattr(base, spec.o), torch.arange(0))
        base = run_eval(base, args, kwargs)
        for b in range(blocks):
            probe = copy.deepcopy(target)
            w = heads * hd // blocks
            block = torch.arange(b * w, (b + 1) * w)
            if spec.whole:  # the projections whole; the output projection reads the block's features
                _zero_weight(getattr(probe, spec.o), block)
                part = run_eval(probe, args, kwargs)
                total = base + (part - base) if total is None else total + (part - base)
                continue
            if spec.qkv:
                width = 3 * heads * hd // blocks
                rows = torch.arange(3 * heads * hd).view(3, blocks, -1)[:, b].reshape(-1) if spec.fused == "concat" \
                    else torch.arange(b * width, (b + 1) * width)
                cut_features(getattr(probe, spec.qkv), rows, output=True)
            else:
                for name, n in ((spec.q, heads), (spec.k, kv), (spec.v, kv)):
                    w = n * hd // blocks
                    cut_features(getattr(probe, name), torch.arange(b * w, (b + 1) * w), output=True)
            for name in spec.extra:
                w = as_linear(getattr(probe, name))[1] // blocks
                cut_features(getattr(probe, name), torch.arange(b * w, (b + 1) * w), output=True)
            cut_features(getattr(probe, spec.o), block, output=False)
            for a in spec.per_rank:
                setattr(probe, a, getattr(probe, a) // blocks)
            sliced = {k: slice_heads(v, heads, torch.arange(b * heads // blocks, (b + 1) * heads // blocks))
                      if k in spec.biases else v for k, v in kwargs.items()}
            try:
                part = run_eval(probe, args, sliced)
            except Exception as exc:  # noqa: BLE001 — the module's own code refuses a block
                return f"its code does not run on a block of its heads ({type(exc).__name__}: " \
                       f"{str(exc).splitlines()[0][:100]})"
            total = base + (part - base) if total is None else total + (part - base)
    if total is None or total.shape != reference.shape or not torch.allclose(total, reference, rtol=1e-4,
                                                                            atol=1e-5 * float(reference.abs().max())):
        return "its output is not the sum over blocks of its heads (its code mixes heads)"
    return None


def _zero_weight(linear: nn.Module, keep: Any) -> None:
    """Zero a linear's weight but for the input features ``keep`` (its bias kept)."""
    import torch

    mask = torch.zeros_like(linear.weight)
    mask.index_fill_(feature_dim(linear, output=False), keep.to(mask.device), 1.0)
    linear.weight.mul_(mask)


def calls_interface(target: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the attention ``target`` computes its core through transformers' attention
    interface (a spy implementation, delegating to the model's own, is called)."""
    return core_reads(target, args, kwargs) is not None


class _Reads:
    """A module that records the names of the attributes read from it."""

    def __init__(self, module: nn.Module, seen: set) -> None:
        self._module, self._seen = module, seen

    def __getattr__(self, name: str) -> Any:
        self._seen.add(name)
        return getattr(self._module, name)


def core_reads(target: nn.Module, args: tuple, kwargs: dict) -> Optional[set]:
    """The names of ``target``'s own parameters that its attention core reads (an attribute of
    the module, or passed as a keyword input) when run through a spy implementation delegating
    to the model's own; None: its core is not reached through transformers' attention interface."""
    import sys

    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = getattr(target, "config", None)
    if cfg is None:
        return None
    called: List[bool] = []
    seen: set = set()
    eager = getattr(sys.modules[type(target).__module__], "eager_attention_forward", None)
    own = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation or "eager", eager)
    params = dict(target.named_parameters(recurse=False))

    def spy(module: nn.Module, *a: Any, **k: Any) -> Any:
        called.append(True)
        seen.update(n for n, p in params.items() if any(v is p for v in k.values()))
        return own(_Reads(module, seen), *a, **k)

    AttentionInterface.register(SPY, spy)
    probe = copy.copy(target)  # the same parameters, another config
    probe.config = copy.copy(cfg)
    probe.config._attn_implementation_internal = SPY
    try:
        run_eval(probe, args, kwargs)
    except Exception:  # noqa: BLE001
        return None
    return {n for n in seen if n in params} if called else None


SPY = "atp_spy"


def _split_hidden_fails(target: nn.Module, args: tuple, kwargs: dict, spec: AttentionSpec, hidden: int
                        ) -> Optional[str]:
    """Why the attention ``target`` does not run on the hidden state split in two (as over d2:
    its projections read, and its output projection writes, half the features; every input
    over the hidden halved), e.g. its code reading a width off its input (None: it runs)."""
    import torch

    probe = copy.deepcopy(target)
    half = torch.arange(hidden // 2)
    for p in ((spec.qkv,) if spec.qkv else (spec.q, spec.k, spec.v)) + spec.extra:
        cut_features(getattr(probe, p), half, output=False)
    cut_features(getattr(probe, spec.o), half, output=True)
    cut = lambda t: t[..., :hidden // 2] if isinstance(t, torch.Tensor) and t.shape[-1:] == (hidden,) else t  # noqa: E731
    try:
        out = run_eval(probe, tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()})
    except Exception as exc:  # noqa: BLE001 — the module's own code refuses the split hidden
        return f"its code does not run on the hidden state split over d2 ({type(exc).__name__}: " \
               f"{str(exc).splitlines()[0][:100]})"
    if out.shape[-1:] != (hidden // 2,):
        return "its code does not run on the hidden state split over d2 (an output of another width)"
    return None
