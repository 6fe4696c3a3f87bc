"""Multi-head latent attention (MLA) read off a transformers attention module: ATP's layout of
it on the (d1, d2) mesh, as numbers the planners read.

An MLA attention projects the hidden state into low-rank latents first — the queries' (``a``
projection, a norm, then a per-head ``b`` projection; or queries straight from the hidden)
and the keys/values' (``a`` projection whose output is a latent, normed and expanded per head
by a ``b`` projection, plus a few trailing features — the rotary key — shared by every head).
What transformers declares (``mla_kv_a_proj``, the ``b`` projections ``colwise``, the output
``rowwise``) and what the modules show are read alike (:func:`read_latent`):

* the ``a`` projections run whole on the hidden gathered over d2 (style ``gathered(input=split,
  output=full)``, as routers do), their norms whole on the latents (parameters whole on every
  rank, gradients complete: nothing summed);
* the ``b`` projections (and queries read straight from the hidden) column-first like q/k/v:
  heads over d1, their latent input sliced over d2 (gradient: all-reduced over d1, then
  gathered over d2), so each rank expands its own heads;
* the shared trailing features reach every head: each rank's heads give a partial gradient,
  summed over d1 (:class:`SumTail`);
* the core on this rank's heads (scattered over d2, transformers' attention interface), the
  output projection row-first.

The module's own ``forward`` runs unchanged. What this layout cannot reproduce is refused in
one line: further projections (a per-head gate), parameters of the module's own, widths that
do not add up to heads; a probe (:func:`latent_infeasibility`) runs the module on blocks of its
heads and checks the shared features are the trailing ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.linear import as_linear, linear_kinds
from atp_pipeline.planning.shape import LatentShape

MLA_A = "mla_kv_a_proj"  # transformers' declared style of the key/value latent projection


@dataclass(frozen=True)
class LatentSpec:
    """One latent attention module's projections (names of its children)."""

    q: str  # per-head queries: from a latent (``q_latent``) or from the hidden
    kv: str  # per-head keys (their unshared part) and values, from the key/value latent
    o: str  # the output projection
    latent: Tuple[str, ...]  # the ``a`` projections of the hidden (run whole)
    shared: str  # the ``a`` projection whose trailing ``shared_width`` features every head reads
    shared_width: int
    q_latent: bool
    heads: int
    shape: LatentShape

    def style(self) -> str:
        return (f"hf_mla(q={self.q}, kv={self.kv}, o={self.o}, latent={'+'.join(self.latent)}, "
                f"shared={self.shared}, shared_width={self.shared_width}, "
                f"q_latent={'true' if self.q_latent else 'false'}, heads={self.heads})")


def read_latent(module: nn.Module, hidden: int, heads: int, rows: List[str], what: str) -> Optional[LatentSpec]:
    """The latent-attention layout of the attention ``module`` whose projections ``rows`` write
    the hidden state (declared row-wise, or read so off the modules) (None: it is not one — no
    other linear reads anything but the hidden state); refused in one line (``what`` names the
    module) where its projections do not add up to one."""
    lin = {n: as_linear(m)[:2] for n, m in module.named_children() if isinstance(m, linear_kinds())}
    latent_readers = [n for n, (i, _) in lin.items() if i != hidden and n not in rows]
    if not latent_readers:
        return None
    if len(rows) != 1 or lin.get(rows[0], (0, 0))[1] != hidden:
        raise ConfigError(f"{what}: a latent attention with {len(rows)} output projections; pass a plan")
    o = rows[0]
    if any(i == o_ == hidden for n, (i, o_) in lin.items() if n != o):
        raise ConfigError(f"{what}: a latent attention whose projection reads and writes the hidden width "
                          f"({hidden}): its latents cannot be told from the hidden state; pass a plan")
    from_hidden = [n for n, (i, _) in lin.items() if i == hidden and n != o]
    pairs: Dict[str, Tuple[str, int]] = {}  # b projection -> (its a projection, a's features it does not read)
    for b in sorted(latent_readers, key=lambda n: lin[n][0], reverse=True):
        fits = sorted((lin[a][1] - lin[b][0], a) for a in from_hidden
                      if lin[a][1] >= lin[b][0] and a not in {p for p, _ in pairs.values()})
        if not fits:
            raise ConfigError(f"{what}: latent projection '{b}' reads {lin[b][0]} features no projection of the "
                              f"hidden writes; pass a plan")
        pairs[b] = (fits[0][1], fits[0][0])
    kv = [b for b, (_, extra) in pairs.items() if extra > 0]
    used = {a for a, _ in pairs.values()}
    q = [b for b in pairs if b not in kv] + [n for n in from_hidden if n not in used]
    if len(kv) != 1 or len(q) != 1:
        raise ConfigError(f"{what}: latent attention projections {sorted(lin)} are not queries, one key/value "
                          f"latent with features shared by all heads and an output (further projections, e.g. a "
                          f"per-head gate, are not laid out); pass a plan")
    kv_, q_ = kv[0], q[0]
    a_kv, shared = pairs[kv_]
    widths = (lin[q_][1], lin[kv_][1], lin[o][0])
    if any(w % heads for w in widths):
        raise ConfigError(f"{what}: latent attention widths {list(widths)} are not per head ({heads}); pass a plan")
    qk, kvh, v = (w // heads for w in widths)
    if qk != kvh - v + shared:
        raise ConfigError(f"{what}: latent attention queries of {qk} features a head are not the keys' "
                          f"{kvh - v} plus {shared} shared; pass a plan")
    own = [n for n, _ in module.named_parameters(recurse=False)]
    latent_widths = {lin[b][0] for b in pairs}
    odd = [n for n, m in module.named_children() if n not in lin and next(m.parameters(), None) is not None
           and not all(p.dim() == 1 and p.numel() in latent_widths for p in m.parameters())]
    if own or odd:
        raise ConfigError(f"{what}: latent attention holding parameters other than its projections and the "
                          f"latents' norms ({', '.join(own + odd)}); pass a plan")
    q_from_latent = q_ in pairs
    latent = tuple(sorted(used))
    shape = LatentShape(q_latent=lin[q_][0] if q_from_latent else 0, kv_latent=lin[kv_][0], shared=shared,
                        qk_head_dim=qk, v_head_dim=v, projections=len(latent))
    return LatentSpec(q=q_, kv=kv_, o=o, latent=latent, shared=a_kv, shared_width=shared, q_latent=q_from_latent,
                      heads=heads, shape=shape)


def latent_infeasibility(target: nn.Module, args: tuple, kwargs: dict, spec: LatentSpec,
                         run: Callable[[nn.Module, tuple, dict], Any],
                         cut: Callable[[nn.Module, Any, bool], None],
                         interface: Callable[[nn.Module, tuple, dict], bool], blocks: int = 2) -> Optional[str]:
    """Why the latent attention ``target``, run on its captured inputs, does not run on blocks
    of its heads as :class:`~atp_pipeline.models.hf.attention.HFLatentAttention` lays it out
    (None: it does, or it cannot run here). Its core must be reached through transformers'
    attention interface (``interface``). The module is run once per block of ``heads/blocks`` heads — the per-head
    projections cut to the block's rows, the output projection to its input columns — and the
    blocks' outputs must add up to the module's own; and the gradient reaching the shared
    ``a`` projection other than through the key/value expansion must sit on its trailing
    ``shared_width`` features only (those the layout sums over d1)."""
    import copy

    if spec.heads % blocks:
        return None
    with torch.no_grad():
        try:
            reference = run(target, args, kwargs)
        except Exception:  # noqa: BLE001 — the module fails on its own inputs here: no answer
            return None
        if not interface(target, args, kwargs):
            return "its code computes the attention itself, not through transformers' attention interface"
        base = copy.deepcopy(target)  # what the module adds besides its output projection's product
        getattr(base, spec.o).weight.zero_()
        total = run(base, args, kwargs)
        for b in range(blocks):
            probe = copy.deepcopy(target)
            for name in (spec.q, spec.kv):
                w = as_linear(getattr(probe, name))[1] // blocks
                cut(getattr(probe, name), torch.arange(b * w, (b + 1) * w), True)
            w = as_linear(getattr(probe, spec.o))[0] // blocks
            cut(getattr(probe, spec.o), torch.arange(b * w, (b + 1) * w), False)
            try:
                total = total + run(probe, args, kwargs) - run(base, args, kwargs)
            except Exception as exc:  # noqa: BLE001 — the module's own code refuses a block
                return f"its code does not run on a block of its heads ({type(exc).__name__}: " \
                       f"{str(exc).splitlines()[0][:100]})"
    if total.shape != reference.shape or not torch.allclose(total, reference, rtol=1e-4,
                                                            atol=1e-5 * float(reference.abs().max())):
        return "its output is not the sum over blocks of its heads (its code mixes heads)"
    # the shared features: with the key/value expansion's input detached, only they get a gradient
    probe = copy.deepcopy(target)
    seen: List[torch.Tensor] = []
    probe.get_submodule(spec.kv).register_forward_pre_hook(lambda m, a: tuple(x.detach() for x in a))
    probe.get_submodule(spec.shared).register_forward_hook(lambda m, a, out: seen.append(out) or out.retain_grad())
    with torch.enable_grad():
        out = run(probe, args, kwargs)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
         .to(out.device)).sum().backward()
    grad = seen[0].grad if seen and seen[0].grad is not None else None
    if grad is None:
        return "its shared key features get no gradient"
    reached = grad.reshape(-1, grad.shape[-1]).abs().amax(0) > 0
    if bool(reached[:grad.shape[-1] - spec.shared_width].any()) or not bool(reached[-spec.shared_width:].all()):
        return "the features its heads share are not the trailing ones of its key/value latent projection"
    return None


class SumTail(torch.autograd.Function):
    """Identity forward; backward: the gradient's trailing ``width`` features summed over
    ``axis`` (features every head reads, each rank's heads giving a partial gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, axis: str, width: int) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.width = comm, axis, width
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        g = g.clone()
        tail = g[..., -ctx.width:].contiguous()
        ctx.comm.all_reduce(tail, ctx.axis)
        g[..., -ctx.width:] = tail
        return g, None, None, None
