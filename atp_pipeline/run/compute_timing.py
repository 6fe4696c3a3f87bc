"""Timing a compute calibration's measurements on concurrent processes (the workers).

Training runs ``world`` processes on this host at once, every rank running the same kernel at
the same time; so everything is timed that way: ``world`` processes
(:func:`atp_pipeline.launch.spawn`, one thread each), a barrier, then every rank runs the
measurement ``k`` times back to back (``k`` from a warm-up so a batch lasts about ``batch_ms``);
a measurement's time is the slowest rank's mean per call, its CPU the ranks' mean, and the
median over interleaved passes. A pass during which other jobs loaded the host is measured
again (:mod:`atp_pipeline.run.hostload`). A process holds one device mesh per shape
(:func:`_mesh`), as training holds one.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.kernels import (
    ATTN_BWD,
    ATTN_FWD,
    GEMM,
    LOSS_BWD,
    LOSS_FWD,
    NORM_BWD,
    NORM_FWD,
    OPTIMIZER,
    POINTWISE,
    Kernel,
)
from atp_pipeline.planning.profile_fit import ASYNC, SYNC, SYNC_GEMM, Pattern, Plan, Timed
from atp_pipeline.run.compute_measure import CONTENTION_BYTES, CONTENTION_KERNELS, LOOP_BATCH


def loop_batch(pat: Pattern) -> int:
    """How many batches of calls a pattern runs a pass: a pure collective loop (no GEMMs,
    blocking) :data:`LOOP_BATCH`, what :func:`fit_collective_cpu_loops` fits from; others 1."""
    return LOOP_BATCH if pat[5] == 0 and pat[6] == SYNC else 1


def calls_per_batch(batch_ms: float, seconds: float, batches: int = 1) -> int:
    """Calls of a measurement a pass: ``batches × batch_ms`` of calls that took ``seconds``
    each (1 to 200)."""
    return max(1, min(200, int(batches * batch_ms * 1e-3 / max(seconds, 1e-7))))


def _runner(k: Kernel, rank: int, world: int) -> Any:
    """A zero-argument callable that runs kernel ``k`` once, as the runtime runs it."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rank)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if k.kind == GEMM:
        m, kk, n = k.dims
        a, b = rnd(m, kk), rnd(kk, n)
        return lambda: torch.matmul(a, b)
    if k.kind in (ATTN_FWD, ATTN_BWD):
        b, h, s, d = k.dims
        q, kk, v = (rnd(b, h, s, d).requires_grad_() for _ in range(3))
        if k.kind == ATTN_FWD:
            return lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        out = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        go = torch.ones_like(out)
        return lambda: torch.autograd.grad(out, (q, kk, v), go, retain_graph=True)
    if k.kind in (NORM_FWD, NORM_BWD):
        n = k.dims[0]
        width = 64 if n % 64 == 0 else 1
        x = rnd(n // width, width).requires_grad_()
        w, bias = torch.ones(width, requires_grad=True), torch.zeros(width, requires_grad=True)

        def norm() -> Any:  # ParallelLayerNorm's statistics form (sums, then the affine map)
            stats = torch.stack([x.sum(-1), (x * x).sum(-1)], dim=-1)
            mean = stats[..., 0] / width
            var = stats[..., 1] / width - mean * mean
            return (x - mean.unsqueeze(-1)) * torch.rsqrt(var + 1e-5).unsqueeze(-1) * w + bias
        if k.kind == NORM_FWD:
            return norm
        y = norm()
        gy = torch.ones_like(y)
        return lambda: torch.autograd.grad(y, (x, w, bias), gy, retain_graph=True)
    if k.kind == POINTWISE:
        n = k.dims[0]
        x, y = rnd(n).requires_grad_(), rnd(n)
        return lambda: x + y
    if k.kind in (LOSS_FWD, LOSS_BWD):  # a model's own loss (transformers': mean cross-entropy, -100 ignored)
        n, vocab = k.dims
        logits = rnd(n, vocab).requires_grad_()
        targets = torch.randint(0, vocab, (n,), generator=g)
        if k.kind == LOSS_FWD:
            return lambda: F.cross_entropy(logits, targets, ignore_index=-100)
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        return lambda: torch.autograd.grad(loss, logits, retain_graph=True)
    if k.kind == OPTIMIZER:  # as training runs it: foreach AdamW on DTensors' shards of a (d1, d2) mesh
        from torch.distributed.tensor import DTensor, Shard

        from atp_pipeline.lightning.module import adamw

        tensors, elements = k.dims
        mesh = _optimizer_mesh(world)
        place = [Shard(0)] * mesh.ndim
        sizes = [elements // tensors] * tensors
        sizes[0] += elements - sum(sizes)
        params = [torch.nn.Parameter(DTensor.from_local(rnd(max(1, s)), mesh, place, run_check=False))
                  for s in sizes]
        for p in params:
            p.grad = DTensor.from_local(rnd(p.to_local().numel()), mesh, place, run_check=False)
        opt = adamw(params, lr=1e-6)
        return opt.step
    raise ConfigError(f"compute calibration: unknown kernel kind '{k.kind}'")


_MESHES: Dict[Any, Any] = {}


def _mesh(d1: int, d2: int) -> Any:
    """This process's one :func:`~atp_pipeline.parallel.init_mesh` of shape ``(d1, d2)``, shared by
    every measurement on that mesh. Training holds one mesh; every new one holds new gloo
    process groups, whose threads wake up many times a second while idle (on a 2-core host, 48
    extra 2x2 meshes: ~440 threads per rank, ~10 % of a core busy per rank asleep, kernels
    ~1.5-2x the CPU per call of a process with none, docs/step-time.md), so a mesh per
    measurement would price every kernel of the calibration at that cost."""
    key = ("mesh", d1, d2)
    if key not in _MESHES:
        from atp_pipeline.parallel import init_mesh

        _MESHES[key] = init_mesh((d1, d2))
    return _MESHES[key]


def _optimizer_mesh(world: int) -> Any:
    """A (d1, d2) device mesh like the runtime's tensor-parallel one (2 x world/2 where it splits)."""
    if "opt" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (2, world // 2) if world % 2 == 0 and world > 2 else (world,)
        _MESHES["opt"] = init_device_mesh("cpu", shape)
    return _MESHES["opt"]


def _plan_runner(plan: Plan, models: Sequence[Dict[str, Any]], rank: int) -> Any:
    """One forward + backward of the runtime's parallel model of ``plan`` (built as training
    builds it), every collective skipped (``Comm`` still books it): what the step computes
    around its kernels, without communication."""
    import copy

    import torch

    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import comm_for
    from atp_pipeline.parallel.apply import apply_plan

    mi, d1, d2, chunks = plan
    spec = models[mi]
    adapter = get_adapter(spec["family"])
    key = ("dense", mi)
    if key not in _MESHES:
        torch.manual_seed(0)
        dense = adapter.build(spec["model_config"])
        g = torch.Generator().manual_seed(0)
        b, s_, V = spec["batch"], spec["seq_len"], spec["vocab"]
        _MESHES[key] = (dense, torch.randint(0, V, (b, s_), generator=g), torch.randint(0, V, (b, s_), generator=g))
    dense, idx, tgt = _MESHES[key]
    mesh = _mesh(d1, d2)
    model = copy.deepcopy(dense)
    apply_plan(model, adapter.parallel_plan(model), mesh, chunks)
    comm = comm_for(mesh)  # the mesh's one Comm, shared with the live runners: skipped only here

    def step() -> None:
        launch = comm._launch
        comm._launch = lambda kind, axis, el, nb, work_fn: launch(kind, axis, el, nb, lambda: None)  # type: ignore
        try:
            adapter.lm_loss(model, idx, tgt).backward()
            model.zero_grad(set_to_none=True)
        finally:
            del comm._launch  # the class's own again
    return step


def _live_runner(plan: Plan, models: Sequence[Dict[str, Any]], rank: int) -> Any:
    """A probe's whole training step as the validation times one: :func:`_plan_runner`'s forward
    and backward with its collectives run, the optimizer step (training's AdamW), then a barrier
    (the step's end: every rank waits for the slowest, as between two steps timed by
    ``benchmarks.step_validation``). What :class:`StepResidual` is fitted from; the callable's
    ``comm`` counts the time the rank waits in collectives."""
    import copy

    import torch.distributed as dist

    from atp_pipeline.lightning.module import adamw
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import comm_for
    from atp_pipeline.parallel.apply import apply_plan

    _plan_runner(plan, models, rank)  # the dense model and batch, built once
    mi, d1, d2, chunks = plan
    adapter = get_adapter(models[mi]["family"])
    dense, idx, tgt = _MESHES[("dense", mi)]
    mesh = _mesh(d1, d2)
    model = copy.deepcopy(dense)
    apply_plan(model, adapter.parallel_plan(model), mesh, chunks)
    opt = adamw(model.parameters(), lr=1e-6)

    def step() -> None:
        adapter.lm_loss(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
    step.comm = comm_for(mesh)  # type: ignore[attr-defined]
    return step


def _pattern_runner(pat: Pattern, rank: int) -> Any:
    """``m`` SYNC_GEMMs then one blocking collective on the mesh dimension's group (plain
    ``torch.distributed``, as the collective calibration times them); ``ASYNC``: the
    collective launched first, the GEMMs while it is in flight, then its wait."""
    import torch
    import torch.distributed as dist

    from atp_pipeline.parallel import comm_for
    from atp_pipeline.parallel.comm import _all_gather

    d1, d2, dim, coll, nbytes, m, mode = pat
    comm = comm_for(_mesh(d1, d2))
    axis = f"d{dim}"
    group, size = comm.group(axis), comm.size(axis)
    g = torch.Generator().manual_seed(rank)
    mm, kk, nn_ = SYNC_GEMM.dims
    a, b = torch.randn(mm, kk, generator=g), torch.randn(kk, nn_, generator=g)
    elements = nbytes // 4
    if coll == "all_reduce":
        buf = torch.randn(elements, generator=g)
        send = lambda: dist.all_reduce(buf, group=group, async_op=True)  # noqa: E731
    else:
        mine, out = torch.randn(elements // size, generator=g), torch.empty(elements)
        send = lambda: _all_gather(out, mine, group=group, async_op=True)  # noqa: E731

    def run() -> None:
        if mode == ASYNC:
            work = send()
        for _ in range(m):
            torch.matmul(a, b)
        if mode != ASYNC:
            work = send()
        work.wait()
    return run


def _worker(rank: int, world: int, kernels: List[Kernel], passes: int, batch_ms: float,
            plans: Sequence[Plan] = (), models: Sequence[Dict[str, Any]] = (),
            patterns: Sequence[Pattern] = (), progress: str = "", live: Sequence[Plan] = ()) -> List[List[Any]]:
    import torch
    import torch.distributed as dist

    def tick(n: int) -> None:  # rank 0 counts finished measurements for the parent's progress bar
        if progress and rank == 0:
            Path(progress).write_text(str(n))

    fns = ([_runner(k, rank, world) for k in kernels] + [_plan_runner(p, models, rank) for p in plans]
           + [_pattern_runner(p, rank) for p in patterns] + [_live_runner(p, models, rank) for p in live])
    batches = [1] * (len(kernels) + len(plans)) + [loop_batch(p) for p in patterns] + [1] * len(live)
    kernels = [*kernels, *plans, *patterns, *live]  # type: ignore[list-item]
    reps = []
    # warm-up; calls per batch (the same on every rank: the largest; a pure loop's LOOP_BATCH x)
    for fn, nb in zip(fns, batches):
        fn()
        t0 = time.perf_counter()
        fn()
        r = torch.tensor([calls_per_batch(batch_ms, time.perf_counter() - t0, nb)])
        dist.all_reduce(r, op=dist.ReduceOp.MIN)
        reps.append(int(r))
    from atp_pipeline.run.hostload import quiet_rounds

    finished = [0]

    def one_pass(_: int) -> List[Tuple[float, float, Dict[int, float]]]:
        row = []
        for i, fn in enumerate(fns):
            comm = getattr(fn, "comm", None)
            if comm is not None:
                comm.stats.reset()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps[i]):
                fn()
            # wall per call, this rank's CPU per call (all its threads), its wait per call by group size
            mine = torch.tensor([(time.perf_counter() - t0) / reps[i], (time.process_time() - c0) / reps[i]],
                                dtype=torch.float64)
            every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, mine)
            waits: Dict[int, float] = {}
            if comm is not None:
                for axis, c in comm.stats.by_axis().items():
                    size = comm.size(axis)
                    waits[size] = waits.get(size, 0.0) + c.wait_s / reps[i]
            row.append((max(float(t[0]) for t in every), statistics.mean(float(t[1]) for t in every), waits))
            finished[0] += 1
            tick(finished[0])
        return row
    rows, foreign = quiet_rounds(passes, passes, one_pass)  # passes with other jobs' load measured again
    return [[row[i] for row in rows] for i in range(len(fns))] + ([foreign] if rank == 0 else [])  # type: ignore[list-item]


def measure(kernels: List[Kernel], world: int, passes: int = 5, batch_ms: float = 10.0,
            timeout: float = 1800.0, plans: Sequence[Plan] = (), models: Sequence[Dict[str, Any]] = (),
            patterns: Sequence[Pattern] = (), progress: str = "") -> List[float]:
    """Seconds per call of each kernel, then of each plan's collective-free forward and
    backward, then of each compute-then-collective pattern, on ``world`` concurrent
    processes (median over interleaved passes of the slowest rank; a pass during which
    other jobs loaded the host is measured again, :mod:`atp_pipeline.run.hostload`).
    ``progress``: a file rank 0 keeps the count of finished measurements in."""
    return measure_with_load(kernels, world, passes, batch_ms, timeout, plans, models, patterns, progress)[0]


def measure_with_load(kernels: List[Kernel], world: int, passes: int = 5, batch_ms: float = 10.0,
                      timeout: float = 1800.0, plans: Sequence[Plan] = (), models: Sequence[Dict[str, Any]] = (),
                      patterns: Sequence[Pattern] = (), progress: str = "") -> Tuple[List[float], List[float]]:
    """:func:`measure`, and the other jobs' load (cores) during each kept pass."""
    got, _, foreign = measure_all(kernels, world, passes, batch_ms, timeout, plans, models, patterns, progress)
    return got, foreign


def measure_all(kernels: List[Kernel], world: int, passes: int = 5, batch_ms: float = 10.0,
                timeout: float = 1800.0, plans: Sequence[Plan] = (), models: Sequence[Dict[str, Any]] = (),
                patterns: Sequence[Pattern] = (), progress: str = "", live: Sequence[Plan] = ()
                ) -> Tuple[List[float], List[Timed], List[float]]:
    """Wall seconds per call of each measurement (kernels, collective-free plans, patterns,
    then ``live`` plans: the probes' steps with their collectives), every one's
    :class:`Timed`, and the other jobs' load (cores) during each kept pass."""
    from atp_pipeline.launch import spawn

    runs = spawn(_worker, world, kernels, passes, batch_ms, plans, models, patterns, progress, live,
                 timeout=timeout)[0]
    timed = [Timed(statistics.median(w for w, _, _ in r), statistics.median(c for _, c, _ in r),
                   {s: statistics.median(ws.get(s, 0.0) for _, _, ws in r)
                    for s in sorted({s for _, _, ws in r for s in ws})})
             for r in runs[:-1]]
    return [t.wall for t in timed], timed, list(runs[-1])


def contention_counts(world: int) -> List[int]:
    """Process counts the contention factor is measured at: 1, 2, 4, ... and ``world``."""
    out, p = [], 1
    while p < world:
        out.append(p)
        p *= 2
    return out + [world]


def _contention_worker(rank: int, world: int, counts: Sequence[int], passes: int,
                       batch_ms: float) -> List[List[List[float]]]:
    """Per pass, per count ``P`` (interleaved), per contention kernel and then the pairs'
    all-reduce: the slowest of the first ``P`` ranks' seconds per call while the others wait at
    the next barrier (the all-reduce: ranks ``2i, 2i+1`` of the first ``P`` in a group each; 0
    with fewer than 2)."""
    import torch
    import torch.distributed as dist

    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]  # every rank creates every group
    buf = torch.ones(CONTENTION_BYTES // 4)
    mine_pair = pairs[rank // 2] if rank // 2 < len(pairs) else None

    def pair_all_reduce() -> None:
        dist.all_reduce(buf, group=mine_pair)
    fns = [_runner(k, rank, world) for k in CONTENTION_KERNELS] + [pair_all_reduce]
    reps = []
    for fn in fns:
        dt = 1.0
        if mine_pair is not None or fn is not pair_all_reduce:
            fn()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        r = torch.tensor([max(1, min(2000, int(batch_ms * 1e-3 / max(dt, 1e-7))))])
        dist.all_reduce(r, op=dist.ReduceOp.MIN)
        reps.append(int(r))
    out = []
    for p in range(passes):
        row = []
        for count in (counts if p % 2 == 0 else list(reversed(counts))):
            times = []
            for fn, k in zip(fns, reps):
                dist.barrier()
                mine = 0.0
                if rank < count and (fn is not pair_all_reduce or rank < count - count % 2):
                    t0 = time.perf_counter()
                    for _ in range(k):
                        fn()
                    mine = (time.perf_counter() - t0) / k
                t = torch.tensor([mine], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(float(t))
            row.append((count, times))
        out.append([times for _, times in sorted(row)])
    return out


def measure_contention(world: int, passes: int = 3, batch_ms: float = 10.0,
                       timeout: float = 600.0) -> Tuple[Dict[int, float], Dict[int, float]]:
    """The slowdown of CPU work with ``P`` processes on the host against ``world`` of them
    (:meth:`~atp_pipeline.planning.compute_profile.ComputeProfile.contention_factor`): the geometric
    mean over :data:`CONTENTION_KERNELS` (an overhead-bound GEMM, a compute-bound one, an
    elementwise kernel) of their time on ``P`` concurrent processes over their time on
    ``world``. One launch of ``world`` processes; in every pass the counts take turns (the
    first ``P`` ranks run, the others wait at a barrier), so a burst of other jobs' load hits
    every count alike; median per kernel and count over the passes. Second, the collectives'
    factor (:meth:`~atp_pipeline.planning.compute_profile.ComputeProfile.comm_factor`): an
    all-reduce of :data:`CONTENTION_BYTES` in pairs of ranks, ``P // 2`` pairs at once over
    ``world // 2`` (counts of 2 and more; the pairs' median time)."""
    from atp_pipeline.launch import spawn

    counts = contention_counts(world)
    runs = spawn(_contention_worker, world, counts, passes, batch_ms, timeout=timeout)[0]
    nk = len(CONTENTION_KERNELS)
    med = {c: [statistics.median(run[ci][ki] for run in runs) for ki in range(nk + 1)] for ci, c in enumerate(counts)}
    ref = med[world]
    kernels = {c: float(np.exp(np.mean([np.log(t / r) for t, r in zip(ts[:nk], ref[:nk])]))) for c, ts in med.items()}
    comm = {c: ts[nk] / ref[nk] for c, ts in med.items() if c >= 2 and ts[nk] > 0 and ref[nk] > 0}
    return kernels, comm
