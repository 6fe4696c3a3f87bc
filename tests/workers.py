"""Functions run inside real gloo worker processes by tests (see atp_pipeline.parallel.launch).

Each returns plain data; the assertions are made in the test process. Cases are grouped
so one launch of N processes covers many meshes and chunk counts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from atp_pipeline.config.schema import CostModel, DType, ModelConfig
from atp_pipeline.errors import ConfigError
from atp_pipeline.models.gpt import GPT, GPTConfig
from atp_pipeline.models.gpt.native import native_tensor_parallel
from atp_pipeline.models.gpt.parallel import parallelize_gpt
from atp_pipeline.parallel import ATPLinear, comm_for, init_mesh
from atp_pipeline.parallel.emulation import TopologyEmulator
from atp_pipeline.parallel.mesh import full_tensor
from atp_pipeline.planning.search import evaluate
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.topology.builders import nodes

TINY = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=8, layers=2)
BATCH = 4


def _data(cfg: GPTConfig = TINY, batch: int = BATCH) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def equivalence(rank: int, world: int, meshes: List[Tuple[int, int]], chunk_list: List[int],
                device: str = "cpu") -> List[Dict[str, Any]]:
    """Parallel GPT (float64) vs the single-process model: loss, every full gradient, and the
    counted collectives of one training step (on CUDA tensors over NCCL with ``device="cuda"``)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    dense = GPT(TINY).double().to(dev)
    idx, tgt = (t.to(dev) for t in _data())
    ref = dense(idx, tgt)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
    out = []
    for d1, d2 in meshes:
        for chunks in chunk_list:
            mesh = init_mesh((d1, d2))
            model = parallelize_gpt(dense, mesh, chunks)
            comm = comm_for(mesh)
            comm.stats.reset()
            loss = model(idx, tgt)
            loss.backward()
            counted = {f"{k}/{a}": n for (k, a), n in comm.stats.elements().items()}
            calls = {f"{k}/{a}": c.calls for (k, a), c in comm.stats.totals.items()}
            grad_err = {n: _rel(p.grad.full_tensor(), ref_grads[n]) for n, p in model.named_parameters()}
            # the host-copy gather (gloo with CUDA tensors) equals DTensor's own, bit for bit
            host = chunks > 1 or all(torch.equal(full_tensor(t, host=True), t.full_tensor())
                                     for p in model.parameters() if isinstance(p.data, DTensor)
                                     for t in (p.data, p.grad))
            out.append({"mesh": (d1, d2), "chunks": chunks, "host_gather": host,
                        "loss_rel": abs(loss.item() - ref.item()) / abs(ref.item()),
                        "grad_rel": max(grad_err.values()), "worst": max(grad_err, key=grad_err.get),
                        "params": sorted(grad_err) == sorted(ref_grads), "counted": counted,
                        "calls": calls})
    return out


class DenseMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ATPMLP(nn.Module):
    """Figure 9: the same MLP with each nn.Linear swapped for an ATPLinear."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.fc1 = ATPLinear(16, 64, mesh, first="column", input_is_parallel=False)
        self.fc2 = ATPLinear(64, 16, mesh, first="row", gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _local_shard_adamw(mesh: Any, world: int) -> Dict[str, Any]:
    """Training's optimizer (AdamW on DTensors' local shards) against ``torch.optim.AdamW`` on the
    same DTensors and on plain full tensors: 3 steps, every placement kind and a pending-sum
    gradient; then a state laid out unlike its parameter."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from atp_pipeline.parallel.optim import LocalShardAdamW

    gen = torch.Generator().manual_seed(5)
    fulls = [torch.randn(8, 6, generator=gen, dtype=torch.float64) for _ in range(4)]
    places = [(Shard(0), Shard(1)), (Shard(1), Replicate()), (Replicate(), Replicate()), (Replicate(), Shard(0))]

    def make() -> List[nn.Parameter]:
        # a copy each: a replicated DTensor may keep the tensor it was given as its local shard
        return [nn.Parameter(distribute_tensor(f.clone(), mesh, list(pl))) for f, pl in zip(fulls, places)]

    local, ref, dense = make(), make(), [nn.Parameter(f.clone()) for f in fulls]
    kw = dict(lr=1e-2, weight_decay=0.1, foreach=True)
    opts = [LocalShardAdamW([{"params": local}], **kw), torch.optim.AdamW([{"params": ref}], **kw),
            torch.optim.AdamW(dense, **kw)]
    for _ in range(3):
        grads = [torch.randn(8, 6, generator=gen, dtype=torch.float64) for _ in range(4)]
        for ps in (local, ref):
            for i, (p, g) in enumerate(zip(ps, grads)):
                p.grad = (DTensor.from_local(g / world, mesh, [Partial(), Partial()], run_check=False) if i == 2
                          else distribute_tensor(g, mesh, p.placements))
        for p, g in zip(dense, grads):
            p.grad = g
        for o in opts:
            o.step()
    st_l, st_r = opts[0].state, opts[1].state
    out = {
        "equal_dtensor_path": all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(local, ref))
        and all(torch.equal(st_l[a][k].full_tensor(), st_r[b][k].full_tensor())
                for a, b in zip(local, ref) for k in ("exp_avg", "exp_avg_sq")),
        "max_diff_dense": max((a.full_tensor() - d).abs().max().item() for a, d in zip(local, dense)),
        "state_like_params": all(isinstance(st_l[p][k], DTensor) and st_l[p][k].placements == p.placements
                                 for p in local for k in ("exp_avg", "exp_avg_sq")),
    }
    st_l[local[0]]["exp_avg"] = st_l[local[0]]["exp_avg"].redistribute(mesh, [Replicate(), Replicate()])
    local[0].grad = distribute_tensor(fulls[0], mesh, local[0].placements)
    try:
        opts[0].step()
        out["refusal"] = None
    except RuntimeError as e:
        out["refusal"] = str(e)
    return out


def _last_dim_conjugates(mesh: Any) -> Dict[str, Any]:
    """``gather_last`` / ``split_last`` (mappings.GatherLast / SplitLast) on d1 of a (2, 2) mesh and
    of a (4, 1) one: the gather is the blocks side by side (contiguous; backward this rank's block of
    the gradient), the split its conjugate; one all-gather each, of the whole tensor's elements."""
    from atp_pipeline.parallel.mappings import gather_last, split_last

    out: Dict[str, Any] = {"exact": True, "contiguous": True, "calls": []}
    for m in (mesh, init_mesh((4, 1))):
        comm = comm_for(m)
        n, r = comm.size("d1"), comm.rank("d1")
        full = torch.randn(3, 5, 4 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        grad = torch.randn(3, 5, 4 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
        mine = full[..., 4 * r:4 * (r + 1)].clone().requires_grad_()
        comm.stats.reset()
        whole = gather_last(mine, comm, "d1")
        whole.backward(grad)
        own = full.clone().requires_grad_()
        part = split_last(own, comm, "d1")
        part.backward(grad[..., 4 * r:4 * (r + 1)])
        out["exact"] &= bool(torch.equal(whole, full) and torch.equal(mine.grad, grad[..., 4 * r:4 * (r + 1)])
                             and torch.equal(part, full[..., 4 * r:4 * (r + 1)]) and torch.equal(own.grad, grad))
        out["contiguous"] &= whole.is_contiguous() and part.is_contiguous()
        out["calls"].append({f"{kind}/{axis}": (c.calls, c.elements)
                             for (kind, axis), c in comm.stats.totals.items()})
    return out


def figure9_and_comparators(rank: int, world: int) -> Dict[str, Any]:
    """Figure 9's usage, the native comparator's loss, emulation accounting, bad meshes."""
    res: Dict[str, Any] = {}
    # Figure 9: init_mesh((2, 2)); nn.Linear -> ATPLinear, same seed, same results.
    mesh = init_mesh((2, 2))
    torch.manual_seed(0)
    dense = DenseMLP().double()
    torch.manual_seed(0)
    atp = ATPMLP(mesh).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xd, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, ya = dense(xd), atp(xa)
    (yd * yd).sum().backward()
    (ya * ya).sum().backward()
    res["fig9_out"] = _rel(ya, yd)
    res["fig9_xgrad"] = _rel(xa.grad, xd.grad)
    res["fig9_wgrad"] = max(_rel(getattr(atp, n).weight.grad.full_tensor(), getattr(dense, n).weight.grad)
                            for n in ("fc1", "fc2"))
    res["fig9_placements"] = [str(atp.fc1.weight.placements), str(atp.fc2.weight.placements)]
    res["fig9_local"] = [tuple(atp.fc1.weight.to_local().shape), tuple(atp.fc2.weight.to_local().shape)]

    # PyTorch-native TP on the same GPT gives the same loss.
    torch.manual_seed(0)
    gpt = GPT(TINY).double()
    idx, tgt = _data()
    native = native_tensor_parallel(gpt, world)
    res["native_loss_rel"] = abs(native(idx, tgt).item() - gpt(idx, tgt).item()) / gpt(idx, tgt).item()

    # Emulation: every collective's imposed time is the planner's model, so the step's
    # total emulated time equals the runtime cost model's T_comm (times the slowdown).
    topo_cfg = nodes(2, 2, 1.0, 4.0, 4.0, name="emu")
    from atp_pipeline.topology.model import Topology

    topo = Topology.from_config(topo_cfg)
    summary = ModelShape.of(ModelConfig(name="tiny", hidden=TINY.hidden, heads=TINY.heads,
                                          layers=TINY.layers, seq_len=TINY.seq_len, batch_size=BATCH,
                                          vocab_size=TINY.vocab_size, dtype=DType.fp64))
    res["emulated"] = []
    for d1, d2 in ((4, 1), (2, 2), (1, 4)):
        m = init_mesh((d1, d2))
        model = parallelize_gpt(gpt, m, chunks=2)
        comm = comm_for(m, TopologyEmulator(topo, (d1, d2), slowdown=50.0))
        comm.stats.reset()
        model(idx, tgt).backward()
        counters = list(comm.stats.totals.values())
        predicted = evaluate(topo, summary, (d1, d2), CostModel.runtime).t_comm_s * 50.0
        res["emulated"].append({
            "mesh": (d1, d2), "emulated_s": sum(c.emulated_s for c in counters), "predicted_s": predicted,
            "spans_cover_model": all(c.span_s >= c.emulated_s * (1 - 1e-9) for c in counters)})

    res["optim"] = _local_shard_adamw(atp.fc1.weight.device_mesh, world)  # the (d1, d2) mesh
    res["last_dim"] = _last_dim_conjugates(mesh)

    # Bad meshes: a clear error naming the sizes.
    errors = []
    for bad in (lambda: ATPLinear(9, 16, mesh, first="column"),
                lambda: parallelize_gpt(GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=24, heads=6, layers=1)),
                                        init_mesh((2, 2))),
                lambda: init_mesh((3, 2))):
        try:
            bad()
            errors.append(None)
        except ConfigError as e:
            errors.append(str(e))
    res["errors"] = errors
    return res

