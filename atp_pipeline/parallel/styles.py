"""Parallel styles: objects that turn one module into its tensor-parallel counterpart.

A style is a :class:`ParallelStyle` (as PyTorch's ``ParallelStyle``): :meth:`~ParallelStyle.check`
refuses, with one line naming the module, anything it cannot reproduce exactly, and
:meth:`~ParallelStyle.apply` returns the replacement on the (dp, d1, d2) mesh. Styles are
found by name in a registry; a model family's adapter or a user adds one with
:func:`register_style` without editing this package. Plans name styles as strings —
``"column"`` or with options ``"column(output=split)"`` — or give style objects.

Built-in styles (``input``/``output``: the activation layout at the module's boundary,
``full`` = the whole tensor on every rank, ``split`` = ATP's layout: features split over
the axis the style reads or writes):

=============  ============================================================================
``column``     ``nn.Linear`` (or a registered linear kind) -> column-first
               :class:`~.linear.ATPLinear` (out over d1, in over d2); ``split`` input is
               split over d2, ``split`` output over d1; ``parts=3``: the output is three
               concatenated segments (a fused q|k|v), each split over d1; ``shared=true``
               (``split`` input): other layers read the same input (gate and up), and the
               input gradients of all of them are summed and all-reduced once
``row``        ``nn.Linear`` -> row-first (in over d1, out over d2); ``split`` input over
               d1, ``split`` output over d2
``layernorm``  ``nn.LayerNorm`` over a hidden dimension split across d2
``gathered``   any module run whole on its input gathered over d2 (its own ``forward``
               runs: exact for any norm, e.g. an RMSNorm upcasting to float32);
               ``partial_grad=true`` (``output=full``): the output's gradient is summed over
               d2 (code combines it with hidden-split tensors, e.g. a gate scaling them);
               ``inputs=0+hidden_states``: the inputs gathered (positions or keyword names;
               default the first); ``outputs=0+2``: of a tuple output, the elements sliced
               (default the first); ``stream=4x64``: those of width 4*64 are 4 hidden states
               side by side (hyper-connections' residual stream), each split over d2
``embedding``  ``nn.Embedding`` split by hidden feature over d2 (``output`` only)
``tied``       an LM head ``nn.Linear`` whose weight is the table of the ``embedding``
               named by ``table=`` (tied embeddings): logits all-reduced over d2
``vocab_loss`` a cross-entropy module -> vocabulary-parallel cross-entropy over d1
``vocab_head`` an LM head ``nn.Linear`` (no bias) whose logits stay split over both dimensions:
               ``[tokens/d2, vocab/d1]`` (:class:`~.vocab.VocabSplitHead`; the model's loss
               then is :func:`~.vocab.install_vocab_parallel_loss`'s)
``vocab_embedding`` ``nn.Embedding`` split by vocabulary over d1 and hidden over d2 (masked
               lookup, all-reduced over d1; ``output`` only) — the table of a ``vocab_tied`` head
``vocab_tied`` ``vocab_head`` tied to the ``vocab_embedding`` named by ``table=``
``heads``      an attention core module ``forward(q, k, v)`` on ``[b, heads, s, d]`` tensors
               whose heads arrive split over d1 (column-first q/k/v): run on this rank's
               heads (scattered over d2), output gathered back over d2 (§3.2.1)
``replicated`` kept whole on every rank (stated explicitly; nothing changes); ``idle=true``: a
               module no forward runs (its parameters get no gradient), refusing in one line if it runs
``split_params`` the module's own parameters ``params=a+b`` over the hidden (last dimension) split
               over d2 as the hidden state, its code seeing this rank's slice; its modules keep
               their own styles
=============  ============================================================================

Defaults are ``full`` in and out: a style dropped into any user model is exact on every
mesh, whatever the code between layers does. ``split`` boundaries save the gather and the
slice between two styled modules (``{"fc1": "column(output=split)", "fc2": "row(input=split)"}``
is Megatron's MLP): use them only where the code in between is elementwise.

A style replaces a module only if that module computes what the style's parallel version
computes: its type must be one the style knows and its ``forward`` must be that type's own
(a subclass overriding ``forward`` — LoRA, a custom norm — is refused, never silently
replaced).
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.attention import HeadSharding
from atp_pipeline.parallel.comm import comm_for
from atp_pipeline.parallel.layers import (
    FULL,
    SPLIT,
    ParallelEmbedding,
    ParallelLayerNorm,
    TiedHead,
    VocabParallelLoss,
    run_gathered,
)
from atp_pipeline.parallel.linear import COLUMN, ROW, ATPLinear, linear_kinds, sharded_parameter
from atp_pipeline.parallel.rng import LOCAL, REPLICATED, fork_module
from atp_pipeline.parallel.vocab import VocabSplitEmbedding, VocabSplitHead

LAYOUTS = (FULL, SPLIT)


@dataclass(frozen=True)
class StyleContext:
    """What a style needs besides the module: the mesh and the root module (for a style that
    shares another module's parameters)."""

    mesh: DeviceMesh
    root: Optional[nn.Module] = None


class ParallelStyle(ABC):
    """One module -> its parallel counterpart. Subclasses set :attr:`name` and
    :attr:`applies_to` and implement :meth:`apply`; override :meth:`check` to verify more."""

    name: ClassVar[str] = ""
    applies_to: ClassVar[Tuple[type, ...]] = ()
    order: ClassVar[int] = 0  # styles apply by (order, depth): 1 = after the modules they share with
    # True: the module stays itself (its modules take their own styles, its output its caller's layout)
    transparent: ClassVar[bool] = False
    own_only: ClassVar[bool] = False  # True: it styles the module's own parameters, not its modules'

    def options(self) -> Dict[str, str]:
        return {}

    def describe(self) -> str:
        opts = self.options()
        return self.name + (f"({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")

    def kinds(self) -> Tuple[type, ...]:
        """The module types this style replaces (empty: any)."""
        return self.applies_to

    def check(self, fqn: str, module: nn.Module) -> None:
        """Raise :class:`ConfigError` (one line) if this style cannot replace ``module`` exactly."""
        if not self.kinds():
            return
        base = next((t for t in type(module).__mro__ if t in self.kinds()), None)  # the nearest kind
        if base is None:
            kinds = " or ".join(t.__name__ for t in self.kinds())
            raise ConfigError(f"parallel plan: '{fqn}' is a {type(module).__name__}, not the {kinds} that "
                              f"style '{self.name}' applies to")
        if type(module).forward is not base.forward:
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) overrides {base.__name__}.forward; "
                              f"style '{self.name}' would replace its computation, so it is refused")

    @abstractmethod
    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        """The replacement of ``module`` (already checked)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options() == self.options()

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.options().items())))

    def __repr__(self) -> str:
        return f"<style {self.describe()}>"


def _layout(style: str, key: str, value: str) -> str:
    if value not in LAYOUTS:
        raise ConfigError(f"style '{style}': {key}={value!r} must be one of {', '.join(LAYOUTS)}")
    return value


class _InOutStyle(ParallelStyle):
    """A style with an ``input`` and an ``output`` boundary layout (``full`` by default)."""

    def __init__(self, input: str = FULL, output: str = FULL) -> None:
        self.input, self.output = _layout(self.name, "input", input), _layout(self.name, "output", output)

    def options(self) -> Dict[str, str]:
        return {k: v for k, v in (("input", self.input), ("output", self.output)) if v != FULL}


class _LinearStyle(_InOutStyle):
    """``nn.Linear`` or a registered linear kind (:func:`~.linear.register_linear_kind`)."""

    first: ClassVar[str] = COLUMN

    def __init__(self, input: str = FULL, output: str = FULL, parts: str = "1", shared: str = "false") -> None:
        super().__init__(input, output)
        if not str(parts).isdigit() or int(parts) < 1 or (int(parts) > 1 and self.first != COLUMN):
            raise ConfigError(f"style '{self.name}': parts={parts!r} must be a positive integer "
                              f"(fused output segments; column-first only)")
        if str(shared).lower() not in ("true", "false"):
            raise ConfigError(f"style '{self.name}': shared={shared!r} must be true or false")
        self.parts = int(parts)
        self.shared = str(shared).lower() == "true"

    def options(self) -> Dict[str, str]:
        return {**super().options(), **({"parts": str(self.parts)} if self.parts > 1 else {}),
                **({"shared": "true"} if self.shared else {})}

    def kinds(self) -> Tuple[type, ...]:
        return linear_kinds()

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return ATPLinear.from_linear(module, ctx.mesh, self.first, input_is_parallel=self.input == SPLIT,
                                     gather_output=self.output == FULL, parts=self.parts,
                                     shared_input=self.shared)


class ColumnFirst(_LinearStyle):
    """Column-first linear (§3.2): output features over d1, input features over d2."""

    name = "column"
    first = COLUMN


class RowFirst(_LinearStyle):
    """Row-first linear (§3.2): input features over d1, output features over d2."""

    name = "row"
    first = ROW


class LayerNormStyle(_InOutStyle):
    """LayerNorm over a hidden dimension split across d2 (statistics all-reduced over d2)."""

    name = "layernorm"
    applies_to = (nn.LayerNorm,)

    def check(self, fqn: str, module: nn.Module) -> None:
        super().check(fqn, module)
        ln: nn.LayerNorm = module  # type: ignore[assignment]
        if len(ln.normalized_shape) != 1 or not ln.elementwise_affine or ln.bias is None:
            raise ConfigError(f"parallel plan: '{fqn}': style 'layernorm' needs a LayerNorm over one dimension "
                              f"with weight and bias")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return ParallelLayerNorm(module, ctx.mesh, self.input, self.output)  # type: ignore[arg-type]


class Gathered(_InOutStyle):
    """Any module run whole on activations gathered over d2 (:func:`~.layers.run_gathered`): the
    module's own ``forward`` runs, so nothing is substituted; with ``input``/``output`` =
    ``split`` it sits between modules that keep ATP's hidden-split layout."""

    name = "gathered"

    def __init__(self, input: str = FULL, output: str = FULL, partial_grad: str = "false",
                 inputs: str = "0", outputs: str = "0", stream: str = "") -> None:
        super().__init__(input, output)
        # ``stream=KxH``: the tensors of width K*H gathered and sliced are K hidden states (of H) side by
        # side, each split over d2 (a residual stream of hyper-connections)
        m = re.fullmatch(r"(\d+)x(\d+)", str(stream)) if stream else None
        if stream and (m is None or int(m.group(1)) < 2):
            raise ConfigError(f"style 'gathered': stream={stream!r} must be KxH (K >= 2 hidden states of width H)")
        self.stream = (int(m.group(1)), int(m.group(2))) if m else (1, 0)
        if partial_grad not in ("true", "false") or (partial_grad == "true" and output != FULL):
            raise ConfigError(f"style 'gathered': partial_grad={partial_grad!r} must be true or false (true with "
                              f"output=full only)")
        # a ``full`` output that code then combines with hidden-split tensors (a gate scaling a
        # split hidden): its gradient arrives partial over d2 and is summed there
        self.partial_grad = partial_grad == "true"
        # the inputs gathered (``input=split``): positional indices or keyword names, joined by '+'
        self.inputs = tuple(x for x in str(inputs).split("+") if x)
        if not self.inputs or not all(re.fullmatch(r"\d+|[A-Za-z_]\w*", x) for x in self.inputs):
            raise ConfigError(f"style 'gathered': inputs={inputs!r} must be positional indices or keyword names "
                              f"joined by '+' (e.g. 0+residual)")
        if not re.fullmatch(r"\d+(\+\d+)*", str(outputs)):
            raise ConfigError(f"style 'gathered': outputs={outputs!r} must be tuple positions joined by '+' (e.g. 0+2)")
        self.outputs = tuple(int(x) for x in str(outputs).split("+"))  # of a tuple output, those sliced

    def options(self) -> Dict[str, str]:
        return {**super().options(), **({"partial_grad": "true"} if self.partial_grad else {}),
                **({"inputs": "+".join(self.inputs)} if self.inputs != ("0",) else {}),
                **({"outputs": "+".join(map(str, self.outputs))} if self.outputs != (0,) else {}),
                **({"stream": f"{self.stream[0]}x{self.stream[1]}"} if self.stream[0] > 1 else {})}

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        module = run_gathered(module, ctx.mesh, self.input, self.output, self.partial_grad, self.inputs, self.outputs,
                              self.stream)
        fork_module(module, REPLICATED)  # its draws: on whole tensors, equal on every rank
        return module


class EmbeddingStyle(ParallelStyle):
    """Embedding table split by hidden feature over d2 (no communication)."""

    name = "embedding"
    applies_to = (nn.Embedding,)

    def __init__(self, output: str = FULL) -> None:
        self.output = _layout(self.name, "output", output)

    def options(self) -> Dict[str, str]:
        return {"output": self.output} if self.output != FULL else {}

    def check(self, fqn: str, module: nn.Module) -> None:
        super().check(fqn, module)
        emb: nn.Embedding = module  # type: ignore[assignment]
        if emb.max_norm is not None or emb.sparse:
            raise ConfigError(f"parallel plan: '{fqn}': style 'embedding' supports plain embeddings only "
                              f"(no max_norm or sparse gradients)")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return ParallelEmbedding(module, ctx.mesh, self.output)  # type: ignore[arg-type]


class Tied(ParallelStyle):
    """An LM head tied to an embedding styled ``embedding`` (:class:`~.layers.TiedHead`);
    applied after the embedding, whose split table it shares. ``table`` is named relative to
    the head's enclosing modules (nearest first)."""

    name = "tied"
    applies_to = (nn.Linear,)
    order = 1

    def __init__(self, table: str = "", input: str = FULL) -> None:
        if not table:
            raise ConfigError(f"style '{self.name}': name the embedding whose table the head shares, "
                              f"{self.name}(table=<module>)")
        self.table, self.input = table, _layout(self.name, "input", input)

    def options(self) -> Dict[str, str]:
        return {"table": self.table, **({"input": self.input} if self.input != FULL else {})}

    def _find_table(self, fqn: str, root: Optional[nn.Module]) -> Optional[nn.Module]:
        """``table`` named relative to the head's enclosing modules, nearest first (a family's
        plan placed inside a user's module keeps its relative names)."""
        parts = fqn.split(".")[:-1]
        for i in range(len(parts), -1, -1):
            try:
                return root.get_submodule(".".join(parts[:i] + [self.table])) if root is not None else None
            except AttributeError:
                continue
        return None

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        table = self._find_table(fqn, ctx.root)
        if not isinstance(table, ParallelEmbedding) or table.source_id != id(module.weight):
            raise ConfigError(f"parallel plan: '{fqn}': style 'tied' needs '{self.table}' styled 'embedding' "
                              f"and holding the same weight as '{fqn}' (tied embeddings)")
        return TiedHead(table, ctx.mesh, self.input, bias=module.bias)


class VocabLoss(ParallelStyle):
    """Cross-entropy of logits whose vocabulary is split over d1 (a column-first head with
    ``output=split`` before it)."""

    name = "vocab_loss"
    applies_to = (nn.CrossEntropyLoss,)

    def check(self, fqn: str, module: nn.Module) -> None:
        super().check(fqn, module)
        ce: nn.CrossEntropyLoss = module  # type: ignore[assignment]
        if ce.reduction != "mean" or ce.label_smoothing or ce.weight is not None or ce.ignore_index != -100:
            raise ConfigError(f"parallel plan: '{fqn}': style 'vocab_loss' reproduces a plain mean "
                              f"CrossEntropyLoss only (no weight, label smoothing or ignore_index)")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return VocabParallelLoss(ctx.mesh)


class VocabEmbedding(EmbeddingStyle):
    """Embedding table split by vocabulary over d1 and hidden over d2
    (:class:`~.vocab.VocabSplitEmbedding`): the table a ``vocab_tied`` head shares."""

    name = "vocab_embedding"

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return VocabSplitEmbedding(module, ctx.mesh, self.output)  # type: ignore[arg-type]


class VocabHead(ParallelStyle):
    """An LM head whose logits stay split over d1 (vocabulary) and d2 (tokens)
    (:class:`~.vocab.VocabSplitHead`); the model's loss must then be the vocabulary-parallel
    one (:func:`~.vocab.install_vocab_parallel_loss`)."""

    name = "vocab_head"

    def __init__(self, input: str = FULL) -> None:
        self.input = _layout(self.name, "input", input)

    def options(self) -> Dict[str, str]:
        return {"input": self.input} if self.input != FULL else {}

    def kinds(self) -> Tuple[type, ...]:
        return linear_kinds()

    def check(self, fqn: str, module: nn.Module) -> None:
        super().check(fqn, module)
        if getattr(module, "bias", None) is not None:
            raise ConfigError(f"parallel plan: '{fqn}': style '{self.name}' supports a head without bias")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        return VocabSplitHead(ctx.mesh, linear=module, input=self.input)


class VocabTied(Tied):
    """``vocab_head`` tied to the embedding styled ``vocab_embedding`` named by ``table``."""

    name = "vocab_tied"

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        table = self._find_table(fqn, ctx.root)
        if not isinstance(table, VocabSplitEmbedding) or table.source_id != id(module.weight):
            raise ConfigError(f"parallel plan: '{fqn}': style '{self.name}' needs '{self.table}' styled "
                              f"'vocab_embedding' and holding the same weight as '{fqn}' (tied embeddings)")
        return VocabSplitHead(ctx.mesh, table=table, input=self.input)


class AttentionHeads(ParallelStyle):
    """An attention core (``forward(q, k, v, ...)`` on ``[b, heads, s, head_dim]`` tensors, no
    parameters) whose q/k/v heads arrive split over d1 by column-first projections: the query
    heads are scattered over d2, the key/value heads placed as grouped-query attention needs
    (:class:`~atp_pipeline.parallel.attention.HeadSharding`: the core then sees one key/value
    head per query head, or the model's group size), and the output's heads gathered back over
    d2 (§3.2.1, Figure 6a). The module's own ``forward`` runs on the local heads."""

    name = "heads"

    def check(self, fqn: str, module: nn.Module) -> None:
        if next(module.parameters(), None) is not None:
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) holds parameters; style 'heads' "
                              f"places a parameter-free attention core")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        comm = comm_for(ctx.mesh)
        d1 = comm.size("d1")
        if d1 * comm.size("d2") == 1:
            return module
        cache: Dict[tuple, HeadSharding] = {}  # by (local query heads, local key/value heads)

        def sharding(q: torch.Tensor, k: torch.Tensor) -> HeadSharding:
            key = (int(q.shape[1]), int(k.shape[1]))
            if key not in cache:
                cache[key] = HeadSharding(comm, key[0] * d1, key[1] * d1)
            return cache[key]

        current = threading.local()  # the call's sharding, per thread (chunks run in threads of their own)

        def before(mod: nn.Module, args: tuple) -> tuple:
            current.sharding = sharding(args[0], args[1])
            q, k, v, _ = current.sharding.localize(*args[:3])
            return (q, k, v, *args[3:])

        def after(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return current.sharding.gather(out, 1)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        fork_module(module, LOCAL)  # its draws (attention dropout): on this rank's own heads
        return module


class SplitParams(ParallelStyle):
    """The module's own parameters ``params`` (names joined by '+'), each over the hidden state
    in its last dimension (an initial hidden state, a bias added to the hidden), split over d2
    as the hidden state is and replicated over d1 (as an ``embedding``'s table): the module's
    own code, which combines them elementwise with the hidden state, sees this rank's slice
    (its gradient then this slice's, complete). The module otherwise stays itself: its
    modules take their own styles. The layout that names it has shown, on a forward, that the
    code uses them elementwise with the hidden state only
    (:func:`~atp_pipeline.models.hf.whole.hidden_vector_use`)."""

    name = "split_params"
    transparent = True
    own_only = True

    def __init__(self, params: str = "") -> None:
        self.params = tuple(x for x in str(params).split("+") if x)
        if not self.params or not all(re.fullmatch(r"[A-Za-z_]\w*", x) for x in self.params):
            raise ConfigError(f"style 'split_params': params={params!r} must be parameter names joined by '+'")

    def options(self) -> Dict[str, str]:
        return {"params": "+".join(self.params)}

    def check(self, fqn: str, module: nn.Module) -> None:
        own = dict(module.named_parameters(recurse=False))
        bad = [n for n in self.params if n not in own or own[n].dim() < 1]
        if bad:
            raise ConfigError(f"parallel plan: '{fqn}' ({type(module).__name__}) holds no parameter "
                              f"{', '.join(bad)} of one dimension or more (style 'split_params')")

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        split: Dict[str, nn.Parameter] = {}
        for n in self.params:
            p = module._parameters[n]
            assert p is not None
            split[n] = sharded_parameter(p, ctx.mesh, [Replicate(), Shard(p.dim() - 1)])
            split[n].requires_grad_(p.requires_grad)
            module._parameters[n] = split[n]

        def local(mod: nn.Module, args: tuple) -> None:  # its code sees this rank's slices
            for n, q in split.items():
                mod._parameters[n] = q.to_local()  # type: ignore[assignment]

        def restore(mod: nn.Module, args: tuple, out: object) -> None:
            mod._parameters.update(split)

        module.register_forward_pre_hook(local)
        module.register_forward_hook(restore, always_call=True)
        return module


class Replicated(ParallelStyle):
    """Kept whole on every rank (stated explicitly; nothing changes). ``idle=true``: a module
    the layout found running in no forward of the model it lays out (an image encoder of a
    model trained on tokens): its parameters stay whole, receive no gradient, as on one
    process; should it run after all, it refuses in one line rather than meet inputs laid out
    for the rest of the model."""

    name = "replicated"
    transparent = True

    def __init__(self, idle: str = "false") -> None:
        if idle not in ("true", "false"):
            raise ConfigError(f"style 'replicated': idle={idle!r} must be true or false")
        self.idle = idle == "true"

    def options(self) -> Dict[str, str]:
        return {"idle": "true"} if self.idle else {}

    def apply(self, fqn: str, module: nn.Module, ctx: StyleContext) -> nn.Module:
        if self.idle:
            def refuse(mod: nn.Module, args: tuple) -> None:
                raise ConfigError(f"'{fqn}' ({type(mod).__name__}) was kept whole as running in no forward of the "
                                  f"model laid out (style 'replicated(idle=true)'), but it ran: ATP's layout does "
                                  f"not cover its inputs; pass a plan")

            module.register_forward_pre_hook(refuse)
        return module


StyleFactory = Callable[..., ParallelStyle]
_REGISTRY: Dict[str, StyleFactory] = {}
StyleSpec = Union[str, ParallelStyle]


def register_style(name: str, factory: StyleFactory, override: bool = False) -> None:
    """Make ``name`` (and ``name(key=value, ...)``) usable in plans; ``factory(**options)``
    returns the :class:`ParallelStyle`."""
    if not re.fullmatch(r"[A-Za-z_][\w]*", name):
        raise ValueError(f"style names are identifiers, got {name!r}")
    if name in _REGISTRY and not override and _REGISTRY[name] is not factory:
        raise ValueError(f"style '{name}' is already registered")
    _REGISTRY[name] = factory


def styles() -> Tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def parse_style(spec: StyleSpec) -> ParallelStyle:
    """A style object from ``"name"``, ``"name(key=value, ...)"`` or an object."""
    if isinstance(spec, ParallelStyle):
        return spec
    text = str(getattr(spec, "value", spec)).strip()
    m = re.fullmatch(r"(\w+)\s*(?:\((.*)\))?", text)
    factory = _REGISTRY.get(m.group(1)) if m else None
    if factory is None:
        raise ConfigError(f"parallel plan: unknown style '{text}' (styles: {', '.join(styles())})")
    opts: Dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):  # type: ignore[union-attr]
        key, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"parallel plan: style '{text}': options are key=value, got '{part}'")
        opts[key.strip()] = value.strip()
    try:
        return factory(**opts)
    except TypeError:
        raise ConfigError(f"parallel plan: style '{text}': unknown option(s) {', '.join(opts)}") from None


for _cls in (ColumnFirst, RowFirst, LayerNormStyle, Gathered, EmbeddingStyle, Tied, VocabLoss, AttentionHeads,
             Replicated, SplitParams, VocabEmbedding, VocabHead, VocabTied):
    register_style(_cls.name, _cls)

PlanSpec = Mapping[str, StyleSpec]
StyleType = Type[ParallelStyle]
