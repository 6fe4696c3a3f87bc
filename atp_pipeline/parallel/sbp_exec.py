"""Execute an SBP plan (AutoDDL §4.2–§4.4) with PyTorch DTensor: issue 8, item 5.

A plan from :mod:`atp_pipeline.planning.sbp` gives every matmul layer (a tie group, §4.5.1)
a :class:`~atp_pipeline.planning.sbp.space.Strategy`: group sizes ``pb·pm·pn = p`` of the
roles ``b`` (rows split, weight replicated: data parallel), ``m`` (output columns split)
and ``n`` (input columns split, output a partial sum), laid out row-major over the ranks in
the order ``Strategy.order``. DTensor's ``Shard``/``Replicate``/``Partial`` are SBP's
Split/Broadcast/Partial (§4.1), so each layer's layouts are DTensor placements.

**One mesh for the whole plan.** DTensor redistributes only within one DeviceMesh, but
consecutive layers may split the ranks differently (layer 1 ``b4·m2``, layer 2 ``b2·n4``).
:func:`plan_mesh_shape` therefore builds the coarsest row-major mesh that refines every
strategy of the plan: the cut points (rank strides where a role's group starts) of all
strategies, sorted, must form a divisibility chain, and the mesh's dimensions are the
ratios of consecutive cut points (e.g. ``(2, 2, 2)`` on 8 ranks for 3-D strategies). A role
of a strategy then owns a contiguous run of mesh dimensions, and its placement is written
on each of them (``b4`` on ``(2, 2, 2)``: ``[Shard(0), Shard(0), ...]``; DTensor's default
left-to-right shard order on one tensor dimension is exactly the row-major block index).
For 4 and 8 ranks (and any power of two) a refinement always exists; plans whose
strategies cut the ranks incompatibly (e.g. ``b2·m3`` and ``b3·m2`` on 6) are refused with
a :class:`~atp_pipeline.errors.ConfigError` before anything runs.

**One layer** (:class:`LayerLayout`, the §4.2.2 matmul): ``X = (S0:pb, B:pm, S1:pn)``,
``W = (B:pb, S1:pm, S0:pn)`` (``nn.Linear``'s out×in weight: ``Shard(0)`` on ``m``,
``Shard(1)`` on ``n``), ``Y = (S0:pb, S1:pm, P:pn)`` from a purely local matmul. Every
output is then made split (§4.2): ``Y.redistribute(S0:pb, S1:pm·pn)`` — a reduce-scatter
over ``n`` — and the bias (split like ``Y``'s columns) is added locally.

**Between layers** (§4.3) the next layer's input layout is reached with
``DTensor.redistribute``: DTensor issues the all-gather over the consumer's ``m``, the
all-to-all when the row split changes, and in the backward pass the dual collectives.
Where the paper relabels columns for free (the ``pm = pn'`` path and the gather of an
outer shard), DTensor's standard placements keep the dense column order and may move more
data than the planner's count; the values are exact either way.

**Weight gradients** (§4.4.1): a weight replicated over ``b`` gets a ``Partial`` gradient;
a post-accumulate-grad hook redistributes every gradient to its parameter's placements
(the all-reduce over ``b``), so an optimizer sees gradients laid out like the weights.

**GPT** (:class:`SBPGPT`): per block QKV (heads split evenly: every rank holds whole heads
with their q, k and v, because the dense model orders QKV outputs head by head), the
attention core on local sequences and heads, the output projection, FC1, GeLU, FC2, each
with its planned strategy (ties ``qkv``, ``proj``, ``fc1``, ``fc2``). LayerNorms need whole
rows: the residual stream is redistributed to the consumer's rows (``S0`` over its ``b``,
replicated elsewhere), normalized, then chunked locally into the consumer's input layout.
Embeddings, the final LayerNorm, the LM head and the loss are outside the SBP search
space: they run split by tokens over all ranks with replicated weights (data parallel).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from atp_pipeline.errors import ConfigError
from atp_pipeline.models.gpt import GPT, attention_core
from atp_pipeline.planning.sbp.space import ROLES, Strategy

GPT_KEYS = ("qkv", "proj", "fc1", "fc2")

# placements per role (b, m, n) of the tensors of one SBP matmul (§4.2.2)
_TABLE: Dict[str, Dict[str, Placement]] = {
    "X": {"b": Shard(0), "m": Replicate(), "n": Shard(1)},
    "W": {"b": Replicate(), "m": Shard(0), "n": Shard(1)},  # nn.Linear weight (out x in)
    "bias": {"b": Replicate(), "m": Shard(0), "n": Shard(0)},
    "Y": {"b": Shard(0), "m": Shard(1), "n": Partial()},
    "split": {"b": Shard(0), "m": Shard(1), "n": Shard(1)},
    "rows": {"b": Shard(0), "m": Replicate(), "n": Replicate()},
}


# ---------------------------------------------------------------------- plan and mesh
@dataclass(frozen=True)
class SBPPlan:
    """What the executor needs from a search result: the device count and one strategy per
    layer key (tie name, e.g. ``qkv``; layer name for untied layers such as ``fc0``)."""

    devices: int
    strategies: Mapping[str, Strategy]
    cost_s: Optional[float] = None  # the planner's predicted communication per step

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"sbp plan: devices must be >= 1, got {self.devices}")
        for key, s in self.strategies.items():
            if s.pb * s.pm * s.pn != self.devices:
                raise ConfigError(f"sbp plan: layer '{key}' strategy {s.label()} uses "
                                  f"{s.pb * s.pm * s.pn} devices, the plan has {self.devices}")
            if sorted(s.order) != sorted(ROLES):
                raise ConfigError(f"sbp plan: layer '{key}' has mesh roles {s.order}, "
                                  f"expected an order of {ROLES}")

    @classmethod
    def from_search(cls, problem, result) -> "SBPPlan":
        """From a compiled :class:`~atp_pipeline.planning.sbp.space.Problem` and a
        :class:`~atp_pipeline.planning.sbp.search.SearchResult`."""
        return cls(problem.p, {v.name: v.strategies[s] for v, s in zip(problem.vars, result.assignment)},
                   cost_s=result.cost)

    def to_dict(self) -> dict:
        return {"devices": self.devices, "cost_s": self.cost_s,
                "strategies": {k: {"pb": s.pb, "pm": s.pm, "pn": s.pn, "order": list(s.order)}
                               for k, s in self.strategies.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SBPPlan":
        try:
            strat = {k: Strategy(int(v["pb"]), int(v["pm"]), int(v["pn"]),
                                 tuple(v.get("order", ROLES)))  # type: ignore[arg-type]
                     for k, v in d["strategies"].items()}
            return cls(int(d["devices"]), strat, d.get("cost_s"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"sbp plan: malformed plan ({exc!r}); expected devices and "
                              f"strategies {{key: {{pb, pm, pn, order}}}}") from None

    def mesh_shape(self) -> Tuple[int, ...]:
        return plan_mesh_shape(self.strategies.values(), self.devices)

    def label(self) -> str:
        return ", ".join(f"{k}={s.label()}" for k, s in self.strategies.items())


def _cuts(s: Strategy) -> List[int]:
    """Rank strides at which the groups of ``s``'s roles start (row-major over its order)."""
    acc, cuts = 1, [1]
    for size in reversed(s.mesh):
        acc *= size
        cuts.append(acc)
    return cuts


def plan_mesh_shape(strategies: Iterable[Strategy], devices: int) -> Tuple[int, ...]:
    """The coarsest row-major mesh refining every strategy (see the module docstring)."""
    strategies = list(strategies)
    cuts = {1, devices}
    for s in strategies:
        if s.pb * s.pm * s.pn != devices:
            raise ConfigError(f"sbp plan: strategy {s.label()} needs {s.pb * s.pm * s.pn} devices, "
                              f"not {devices}")
        cuts.update(_cuts(s))
    chain = sorted(cuts)
    for lo, hi in zip(chain, chain[1:]):
        if hi % lo:
            raise ConfigError(
                f"sbp plan: the strategies {', '.join(s.label() for s in strategies)} split the "
                f"{devices} ranks into groups that no single row-major device mesh refines (rank "
                f"strides {chain}); use a device count that is a power of two or tie the layers")
    if len(chain) == 1:  # one device
        return (1,)
    return tuple(hi // lo for lo, hi in zip(chain, chain[1:]))[::-1]


def role_dims(s: Strategy, shape: Sequence[int]) -> Dict[str, List[int]]:
    """Mesh dimensions of ``shape`` (outermost first) owned by each role of ``s``."""
    # stride of each mesh dim (row-major)
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    strides = strides[::-1]
    out: Dict[str, List[int]] = {r: [] for r in ROLES}
    for r in ROLES:
        lo, hi = s.stride(r), s.stride(r) * s.size(r)
        out[r] = [d for d in range(len(shape)) if shape[d] > 1 and lo <= strides[d]
                  and strides[d] * shape[d] <= hi]
        got = 1
        for d in out[r]:
            got *= shape[d]
        if got != s.size(r):
            raise ConfigError(f"sbp plan: mesh {tuple(shape)} does not refine strategy {s.label()} "
                              f"(role {r} of size {s.size(r)})")
    return out


@dataclass(frozen=True)
class LayerLayout:
    """DTensor placements of one SBP matmul on the plan's mesh (see :data:`_TABLE`)."""

    strategy: Strategy
    dims: Dict[str, List[int]]
    placements: Dict[str, Tuple[Placement, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, s: Strategy, shape: Sequence[int]) -> "LayerLayout":
        dims = role_dims(s, shape)
        owner = {d: r for r, ds in dims.items() for d in ds}
        places = {t: tuple(_TABLE[t][owner[d]] if d in owner else Replicate() for d in range(len(shape)))
                  for t in _TABLE}
        return cls(s, dims, places)

    def __getitem__(self, tensor: str) -> Tuple[Placement, ...]:
        return self.placements[tensor]


_MESHES: Dict[Tuple[str, Tuple[int, ...]], DeviceMesh] = {}


def plan_mesh(plan: SBPPlan, device_type: str = "cpu") -> DeviceMesh:
    """The plan's DeviceMesh (cached per shape: creating one is a collective on all ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("sbp: call torch.distributed.init_process_group first")
    if dist.get_world_size() != plan.devices:
        raise ConfigError(f"sbp plan for {plan.devices} devices cannot run on {dist.get_world_size()} "
                          f"processes")
    shape = plan.mesh_shape()
    key = (device_type, shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape,
                                        mesh_dim_names=tuple(f"sbp{i}" for i in range(len(shape))))
    return _MESHES[key]


# ---------------------------------------------------------------------- helpers
def _sync_grad(param: torch.Tensor) -> None:
    """§4.4.1: a replicated weight's gradient arrives ``Partial``; all-reduce it into the
    parameter's own placements (a no-op when they already agree)."""
    g = param.grad
    if isinstance(g, DTensor) and isinstance(param, DTensor) and tuple(g.placements) != tuple(param.placements):
        param.grad = g.redistribute(param.device_mesh, param.placements)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
    """Replace ``module.<name>`` by a DTensor parameter of the same values and name."""
    t = getattr(module, name)
    if t is None:
        return
    p = nn.Parameter(distribute_tensor(t.detach(), mesh, list(placements)), requires_grad=t.requires_grad)
    p.register_post_accumulate_grad_hook(_sync_grad)
    setattr(module, name, p)


def _replicated(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A tensor identical on every rank as a replicated DTensor (no communication)."""
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _check_div(what: str, n: int, k: int, role: str, key: str) -> None:
    if k > 1 and n % k:
        raise ConfigError(f"sbp plan: layer '{key}': {what} {n} does not split over {role}={k}")


class SBPLinear(nn.Module):
    """An ``nn.Linear`` run as the SBP matmul of §4.2.2 with its output made split (§4.2)."""

    def __init__(self, linear: nn.Linear, key: str, layout: LayerLayout, mesh: DeviceMesh) -> None:
        super().__init__()
        s = layout.strategy
        _check_div("input features", linear.in_features, s.pn, "pn", key)
        _check_div("output features", linear.out_features, s.pm * s.pn, "pm*pn", key)
        self.key, self.layout, self.mesh = key, layout, mesh
        self.weight = linear.weight
        self.bias = linear.bias
        _distribute(self, "weight", mesh, layout["W"])
        _distribute(self, "bias", mesh, layout["bias"])

    def forward(self, x: DTensor) -> DTensor:
        """``x``: a 2-D DTensor (tokens × features) in any layout -> ``Y`` split."""
        rows = x.shape[0]
        _check_div("token rows", rows, self.layout.strategy.pb, "pb", self.key)
        x = x.redistribute(self.mesh, self.layout["X"])  # §4.3 redistribution
        y = F.linear(x, self.weight)  # local: (S0:pb, S1:pm, P:pn)
        y = y.redistribute(self.mesh, self.layout["split"])  # reduce-scatter over n
        return y + self.bias if self.bias is not None else y


def _rows_all(mesh: DeviceMesh, rows: int) -> Tuple[Placement, ...]:
    """Token rows split over every mesh dimension when they divide, else over a prefix."""
    out: List[Placement] = []
    k = 1
    for d in range(mesh.ndim):
        if rows % (k * mesh.size(d)) == 0:
            k *= mesh.size(d)
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return tuple(out)


# ---------------------------------------------------------------------- MLP stack
class SBPMLP(nn.Module):
    """A stack of ``nn.Linear`` layers (GeLU between them) run by an SBP plan whose keys
    are the layer names ``fc0``, ``fc1``, ... (:func:`atp_pipeline.planning.sbp.space.mlp`)."""

    def __init__(self, linears: Sequence[nn.Linear], plan: SBPPlan, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        keys = [f"fc{i}" for i in range(len(linears))]
        missing = [k for k in keys if k not in plan.strategies]
        if missing:
            raise ConfigError(f"sbp plan: no strategy for MLP layer(s) {', '.join(missing)}")
        self.mesh = mesh or plan_mesh(plan)
        shape = tuple(self.mesh.shape)
        self.layers = nn.ModuleList(
            SBPLinear(copy.deepcopy(lin), k, LayerLayout.of(plan.strategies[k], shape), self.mesh)
            for k, lin in zip(keys, linears))

    def forward(self, x: torch.Tensor) -> DTensor:
        """``x``: the full input (identical on every rank) -> the output, split as the last
        layer's output (§4.2)."""
        h: DTensor = _replicated(x, self.mesh)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i + 1 < len(self.layers):
                h = F.gelu(h)
        return h


# ---------------------------------------------------------------------- GPT
class _SBPAttention(nn.Module):
    def __init__(self, attn: nn.Module, layouts: Mapping[str, LayerLayout], mesh: DeviceMesh) -> None:
        super().__init__()
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.qkv = SBPLinear(attn.qkv, "qkv", layouts["qkv"], mesh)
        self.proj = SBPLinear(attn.proj, "proj", layouts["proj"], mesh)


class _SBPMLPPart(nn.Module):
    def __init__(self, mlp: nn.Module, layouts: Mapping[str, LayerLayout], mesh: DeviceMesh) -> None:
        super().__init__()
        self.fc1 = SBPLinear(mlp.fc1, "fc1", layouts["fc1"], mesh)
        self.fc2 = SBPLinear(mlp.fc2, "fc2", layouts["fc2"], mesh)


class _SBPBlock(nn.Module):
    def __init__(self, block: nn.Module, layouts: Mapping[str, LayerLayout], mesh: DeviceMesh,
                 seq_len: int) -> None:
        super().__init__()
        self.layouts, self.mesh, self.seq_len = layouts, mesh, seq_len
        self.ln1, self.ln2 = block.ln1, block.ln2
        for ln in (self.ln1, self.ln2):
            _distribute(ln, "weight", mesh, [Replicate()] * mesh.ndim)
            _distribute(ln, "bias", mesh, [Replicate()] * mesh.ndim)
        self.attn = _SBPAttention(block.attn, layouts, mesh)
        self.mlp = _SBPMLPPart(block.mlp, layouts, mesh)

    def _norm(self, ln: nn.LayerNorm, x: DTensor, key: str) -> DTensor:
        """LayerNorm on whole rows: the consumer's rows (S0 over its b), then its input."""
        lay = self.layouts[key]
        h = F.layer_norm(x.redistribute(self.mesh, lay["rows"]), ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        return h.redistribute(self.mesh, lay["X"])  # Replicate -> Shard: local chunks

    def _attention(self, qkv: DTensor) -> DTensor:
        """The attention core on local whole sequences and whole heads (§4.2: heads split
        evenly); the output keeps QKV's split layout, with ``h`` instead of ``3h`` columns."""
        local = qkv.to_local()
        seqs = local.shape[0] // self.seq_len
        t = local.view(seqs, self.seq_len, -1, 3, self.attn.head_dim)
        q, k, v = (t[:, :, :, i].transpose(1, 2) for i in range(3))
        out = attention_core(q, k, v).transpose(1, 2).reshape(seqs * self.seq_len, -1)
        rows, cols = qkv.shape
        return DTensor.from_local(out, self.mesh, qkv.placements, run_check=False,
                                  shape=torch.Size((rows, cols // 3)), stride=(cols // 3, 1))

    def forward(self, x: DTensor) -> DTensor:
        a = self.attn.proj(self._attention(self.attn.qkv(self._norm(self.ln1, x, "qkv"))))
        x = x.redistribute(self.mesh, a.placements) + a
        m = self.mlp.fc2(F.gelu(self.mlp.fc1(self._norm(self.ln2, x, "fc1"))))
        return x.redistribute(self.mesh, m.placements) + m


def check_gpt_plan(plan: SBPPlan, hidden: int, heads: int, ffn_mult: int, batch: Optional[int] = None,
                   what: str = "model") -> None:
    """Clear errors (before anything runs) when a GPT cannot execute ``plan``."""
    missing = [k for k in GPT_KEYS if k not in plan.strategies]
    if missing:
        raise ConfigError(f"sbp plan: {what} needs strategies for {', '.join(GPT_KEYS)}; missing "
                          f"{', '.join(missing)}")
    if hidden % heads:
        raise ConfigError(f"sbp plan: {what}: hidden {hidden} is not divisible by heads {heads}")
    q = plan.strategies["qkv"]
    if heads % (q.pm * q.pn):
        raise ConfigError(f"sbp plan: {what}: {heads} heads do not split over the QKV layer's "
                          f"pm*pn = {q.pm}*{q.pn} = {q.pm * q.pn} devices")
    dims = {"qkv": (hidden, 3 * hidden), "proj": (hidden, hidden), "fc1": (hidden, ffn_mult * hidden),
            "fc2": (ffn_mult * hidden, hidden)}
    for k, (n, m) in dims.items():
        s = plan.strategies[k]
        _check_div("input features", n, s.pn, "pn", k)
        _check_div("output features", m, s.pm * s.pn, "pm*pn", k)
        if batch is not None:
            _check_div("batch (sequences)", batch, s.pb, "pb", k)
    plan.mesh_shape()


class SBPGPT(nn.Module):
    """A dense :class:`~atp_pipeline.models.gpt.GPT` run by an SBP plan (keys ``qkv``,
    ``proj``, ``fc1``, ``fc2``, tied over the blocks); same parameter names, every parameter
    a DTensor on the plan's mesh, same loss and gradients as the dense model."""

    def __init__(self, model: GPT, plan: SBPPlan, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        cfg = model.cfg
        check_gpt_plan(plan, cfg.hidden, cfg.heads, cfg.ffn_mult)
        self.cfg, self.plan = cfg, plan
        self.mesh = mesh or plan_mesh(plan)
        shape = tuple(self.mesh.shape)
        if shape != plan.mesh_shape():
            raise ConfigError(f"sbp plan: mesh {shape} is not the plan's mesh {plan.mesh_shape()}")
        layouts = {k: LayerLayout.of(plan.strategies[k], shape) for k in GPT_KEYS}
        dense = copy.deepcopy(model)
        everywhere = [Replicate()] * self.mesh.ndim
        self.wte, self.wpe, self.ln_f, self.head = dense.wte, dense.wpe, dense.ln_f, dense.head
        for mod in (self.wte, self.wpe, self.ln_f, self.head):
            _distribute(mod, "weight", self.mesh, everywhere)
            if isinstance(mod, nn.LayerNorm):
                _distribute(mod, "bias", self.mesh, everywhere)
        self.blocks = nn.ModuleList(_SBPBlock(b, layouts, self.mesh, cfg.seq_len) for b in dense.blocks)
        self._first_rows = layouts["qkv"]["rows"]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` (full tensor), or the mean cross-entropy (identical on
        every rank) if ``targets`` are given; ``idx``/``targets`` are the full batch."""
        b, s = idx.shape
        for k in GPT_KEYS:
            _check_div("batch (sequences)", b, self.plan.strategies[k].pb, "pb", k)
        pos = torch.arange(s, device=idx.device).repeat(b)
        rows = self._first_rows
        tok = _replicated(idx.reshape(-1), self.mesh).redistribute(self.mesh, rows)
        pos_dt = _replicated(pos, self.mesh).redistribute(self.mesh, rows)
        x = F.embedding(tok, self.wte.weight) + F.embedding(pos_dt, self.wpe.weight)
        for block in self.blocks:
            x = block(x)
        final = _rows_all(self.mesh, b * s)
        x = x.redistribute(self.mesh, final)
        x = F.layer_norm(x, self.ln_f.normalized_shape, self.ln_f.weight, self.ln_f.bias, self.ln_f.eps)
        logits = F.linear(x, self.head.weight)
        if targets is None:
            return logits.full_tensor().view(b, s, -1)
        tgt = _replicated(targets.reshape(-1), self.mesh).redistribute(self.mesh, final)
        return F.cross_entropy(logits, tgt).full_tensor()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def apply_sbp(root: nn.Module, plan: SBPPlan, mesh: Optional[DeviceMesh] = None) -> List[str]:
    """Replace every :class:`GPT` inside ``root`` (or ``root`` itself, not replaceable in
    place) by its :class:`SBPGPT`; returns the names replaced."""
    done: List[str] = []
    for name, module in list(root.named_modules()):
        if isinstance(module, GPT) and name:
            parent_name, _, attr = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            setattr(parent, attr, SBPGPT(module, plan, mesh))
            done.append(name)
    if not done:
        raise ConfigError(f"sbp plan: {type(root).__name__} has no built-in GPT submodule to execute the "
                          f"plan on")
    return done
