"""Calibrate compute: time the kernels the plans run, at their local shapes, and write a profile.

    python -m atp_pipeline.run.calibrate_compute --world 4 --topology cpu4 --models tiny,small,llama_tiny

The measuring half of the step-time model's compute (:mod:`atp_pipeline.planning.steptime`,
which is pure). The shapes are *the plans' own*: for every model of ``--models`` (config
names under ``--conf``/model), every candidate ``DeviceMesh(d1, d2)`` of ``--world``
devices and every chunk count of ``--chunks`` the model can run, the step model's program
lists its local kernels (GEMMs of the forward, input and weight gradients; attention core
forward and backward; norms; elementwise kernels; the optimizer over the rank's parameter
tensors); the distinct ones are measured.

**Concurrency.** Training runs ``world`` processes on this host at once, every rank running
the same kernel at the same time; so the kernels are timed the same way: ``--world``
processes (:func:`atp_pipeline.launch.spawn`, one thread each, as in training), a barrier,
then every rank runs the kernel ``k`` times back to back (``k`` chosen from a warm-up so
a batch lasts about ``--batch-ms``); a kernel's time is the slowest rank's mean per call
(a step's ranks meet at every collective, so the slowest one sets the pace), and the median over ``--passes`` passes interleaved over all kernels (a burst of
load from elsewhere hits every kernel alike). Kernels run as the runtime runs them: under
autograd (forward kernels record their backward; backward kernels by ``torch.autograd``
where the runtime uses it), parameters of the optimizer as DTensors with training's AdamW.

**What the runtime pays beyond the kernels** (skipped with ``--kernels-only``), measured in
the same launch, interleaved with the kernels:

* *dispatch* — every candidate plan's parallel model, built as training builds it, runs its
  forward and backward with every collective skipped (``Comm`` still books it); per layout,
  ``T = K·(1 + f) + n·o`` is fitted over the plans (``K`` the profile's time of the plan's
  ``n`` kernels): ``o`` per kernel (Python, autograd Functions, DTensor ``to_local``,
  views, module calls), ``f`` of the kernels' own time;
* *sync* — on every group layout of the candidate meshes' dimensions, ``m`` GEMMs then a
  blocking all-reduce / all-gather (``m`` = 0, 1, 4, 16; 16 KiB and 256 KiB) under the same
  concurrency: what a loop takes over the profile's compute plus the topology's α-β is
  fitted as ``α + r·compute``; the same loops with the collective launched before the GEMMs
  and waited after give the share of that overlap compute really hides;
* *optimizer* — foreach AdamW (training's, ``lightning.module.adamw``) over DTensor
  parameters on a (d1, d2) mesh, at each plan's tensor count and elements and at half and
  twice the tensors (``α + tensors·τ + elements·γ``).

**Output.** The topology ``--topology`` (a config name under ``--conf`` or
``outputs/conf``, or a YAML path: e.g. the one the collective calibration
:mod:`atp_pipeline.run.calibrate` wrote) with ``device.compute`` = the profile: measured
points by kernel and shape, a fit ``t = α + work·γ`` per kernel kind for other shapes
(least squares on relative residuals), the peak GEMM throughput measured (MFU's
denominator), and its name and source, which every prediction quotes. Written to
``--out`` (default ``outputs/conf/topology/<name>.yaml``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.calibrate import bounded_lstsq, nnls
from atp_pipeline.planning.steptime import (ATTN_BWD, ATTN_FWD, GEMM, KINDS, NORM_BWD, NORM_FWD, OPTIMIZER,
                                            POINTWISE, CommClock, ComputeProfile, Dispatch, Kernel, KindFit, SyncFit,
                                            RUNTIME, _all_items, build_program, dispatch_key)

CONF = Path("conf")
OPTIMIZER_DESC = "AdamW foreach=True over DTensor parameters (lightning.module.adamw)"
SYNC_GEMM = Kernel(GEMM, (64, 256, 256))  # the compute of the compute-then-collective loop
SYNC_COMPUTE = (0, 1, 4, 16)  # SYNC_GEMMs before each collective
SYNC_BYTES = (16384, 262144)
SYNC_COLLECTIVES = ("all_reduce", "all_gather")
SYNC, ASYNC = "sync", "async"  # collective after the GEMMs / launched before them, waited after
MIN_FACTOR = -0.95  # the least a mesh's dispatch kernel_factor may be: a kernel never takes 0 s


# ------------------------------------------------------------------------ which kernels
def plan_kernels(shapes: Sequence[Any], world: int, chunks: Sequence[int]) -> List[Kernel]:
    """The distinct local kernels of every candidate mesh × chunk count of ``shapes``
    (:class:`~atp_pipeline.planning.shape.ModelShape`) on ``world`` devices."""
    from atp_pipeline.planning.search import candidate_meshes, mesh_infeasibility

    seen: Set[Kernel] = set()
    for shape in shapes:
        for mesh in candidate_meshes(world):
            if mesh_infeasibility(shape, mesh):
                continue
            for c in chunks:
                if shape.batch_size % c:
                    continue
                prog, _ = build_program(shape, mesh, shape.batch_size, c)
                seen.update(item[1] for item in _all_items(prog) if item[0] == "k")
    for k in [k for k in seen if k.kind == OPTIMIZER]:  # other tensor counts: alpha, per tensor, per element apart
        t, e = k.dims
        seen.update({Kernel(OPTIMIZER, (max(1, t // 2), e)), Kernel(OPTIMIZER, (2 * t, e))})
    seen.add(SYNC_GEMM)
    return sorted(seen, key=lambda k: (k.kind, k.dims))


Plan = Tuple[int, int, int, int]  # (model index, d1, d2, chunks)
Pattern = Tuple[int, int, int, str, int, int, str]  # (d1, d2, dim, collective, bytes, SYNC_GEMMs, SYNC|ASYNC)


def plan_points(shapes: Sequence[Any], world: int, chunks: Sequence[int]) -> List[Plan]:
    """Every candidate (mesh, chunks) of every model: the runtime's forward and backward of
    each is timed with its collectives skipped (the framework cost, :class:`Dispatch`)."""
    from atp_pipeline.planning.search import candidate_meshes, mesh_infeasibility

    return [(i, mesh[0], mesh[1], c) for i, shape in enumerate(shapes) for mesh in candidate_meshes(world)
            if not mesh_infeasibility(shape, mesh) for c in chunks
            if not shape.batch_size % c]


def sync_patterns(world: int) -> List[Pattern]:
    """Compute-then-collective loops (and collective-during-compute loops: launched, the
    GEMMs, waited) on every distinct group layout (size, stride) of the candidate meshes'
    dimensions (:class:`SyncFit`)."""
    from atp_pipeline.planning.search import candidate_meshes

    seen, out = set(), []
    for d1, d2 in candidate_meshes(world):
        for dim, layout in ((1, (d1, d2)), (2, (d2, 1))):
            if layout[0] == 1 or layout in seen:
                continue
            seen.add(layout)
            out += [(d1, d2, dim, coll, b, m, mode) for coll in SYNC_COLLECTIVES for b in SYNC_BYTES
                    for mode in (SYNC, ASYNC) for m in SYNC_COMPUTE if m or mode == SYNC]
    return out


# ------------------------------------------------------------------------ timing (workers)
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
    if k.kind == OPTIMIZER:  # as training runs it: foreach AdamW over DTensors on a (d1, d2) mesh
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
    from atp_pipeline.parallel import comm_for, init_mesh
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
    mesh = init_mesh((d1, d2))
    model = copy.deepcopy(dense)
    apply_plan(model, adapter.parallel_plan(model), mesh, chunks)
    comm = comm_for(mesh)
    launch = comm._launch
    comm._launch = lambda kind, axis, el, nb, work_fn: launch(kind, axis, el, nb, lambda: None)  # type: ignore

    def step() -> None:
        adapter.lm_loss(model, idx, tgt).backward()
        model.zero_grad(set_to_none=True)
    return step


def _pattern_runner(pat: Pattern, rank: int) -> Any:
    """``m`` SYNC_GEMMs then one blocking collective on the mesh dimension's group (plain
    ``torch.distributed``, as the collective calibration times them); ``ASYNC``: the
    collective launched first, the GEMMs while it is in flight, then its wait."""
    import torch
    import torch.distributed as dist

    from atp_pipeline.parallel import comm_for, init_mesh
    from atp_pipeline.parallel.comm import _all_gather

    d1, d2, dim, coll, nbytes, m, mode = pat
    key = ("mesh", d1, d2)
    if key not in _MESHES:
        _MESHES[key] = comm_for(init_mesh((d1, d2)))
    comm = _MESHES[key]
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
            patterns: Sequence[Pattern] = ()) -> List[List[float]]:
    import torch
    import torch.distributed as dist

    fns = ([_runner(k, rank, world) for k in kernels] + [_plan_runner(p, models, rank) for p in plans]
           + [_pattern_runner(p, rank) for p in patterns])
    kernels = [*kernels, *plans, *patterns]  # type: ignore[list-item]
    reps = []
    for fn in fns:  # warm-up; calls per batch (the same on every rank: the largest)
        fn()
        t0 = time.perf_counter()
        fn()
        dt = max(time.perf_counter() - t0, 1e-7)
        r = torch.tensor([max(1, min(200, int(batch_ms * 1e-3 / dt)))])
        dist.all_reduce(r, op=dist.ReduceOp.MIN)
        reps.append(int(r))
    out: List[List[float]] = [[] for _ in kernels]
    for _ in range(passes):
        for i, fn in enumerate(fns):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps[i]):
                fn()
            mine = torch.tensor([(time.perf_counter() - t0) / reps[i]], dtype=torch.float64)
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, mine)
            out[i].append(max(float(t) for t in every))
    return out


def measure(kernels: List[Kernel], world: int, passes: int = 5, batch_ms: float = 10.0,
            timeout: float = 1800.0, plans: Sequence[Plan] = (), models: Sequence[Dict[str, Any]] = (),
            patterns: Sequence[Pattern] = ()) -> List[float]:
    """Seconds per call of each kernel, then of each plan's collective-free forward and
    backward, then of each compute-then-collective pattern, on ``world`` concurrent
    processes (median over interleaved passes of the slowest rank)."""
    from atp_pipeline.launch import spawn

    runs = spawn(_worker, world, kernels, passes, batch_ms, plans, models, patterns, timeout=timeout)[0]
    return [statistics.median(r) for r in runs]


# ------------------------------------------------------------------------ fitting
def fit_kind(kernels: Sequence[Kernel], seconds: Sequence[float]) -> KindFit:
    """``t = α + work·γ`` (optimizer: ``t = α + tensors·τ + work·γ``), least squares on
    relative residuals, non-negative."""
    t = np.asarray(seconds, dtype=np.float64)
    work = np.array([k.work for k in kernels], dtype=np.float64)
    opt = bool(kernels) and kernels[0].kind == OPTIMIZER
    cols = [np.ones_like(t)] + ([np.array([k.dims[0] for k in kernels], dtype=np.float64)] if opt else []) + [work]
    x = nnls(np.stack(cols, axis=1) / t[:, None], np.ones_like(t))
    if opt:
        return KindFit(float(x[0]), float(x[2]), float(x[1]))
    return KindFit(float(x[0]), float(x[1]))


def plan_kernel_sum(profile: ComputeProfile, shape: Any, mesh: Tuple[int, int], chunks: int) -> Tuple[float, int]:
    """The profile's seconds and count of a plan's kernels but the optimizer (its forward and backward)."""
    prog, _ = build_program(shape, mesh, shape.batch_size, chunks)
    ks = [it[1] for it in _all_items(prog) if it[0] == "k" and it[1].kind != OPTIMIZER]
    return sum(profile.seconds(k) for k in ks), len(ks)


def fit_dispatch(profile: ComputeProfile, shapes: Sequence[Any], plans: Sequence[Plan],
                 seconds: Sequence[float]) -> Dict[str, Dispatch]:
    """``T = K·(1 + f) + n·o`` (T a plan's measured collective-free forward and backward, K the
    profile's sum of its n kernels), relative least squares, per layout over every plan
    (``o, f >= 0``: the fallback for a mesh not calibrated) and per layout and mesh
    (:func:`~atp_pipeline.planning.steptime.dispatch_key`): the runtime's work around a
    kernel differs by mesh (on d2 > 1 it splits and gathers activations over d2). On one
    mesh ``f >= -0.95`` (kernels timed each on its own with every rank at it at once can run
    faster in a plan's sequence: warm caches, ranks out of phase) where the plans there
    tell ``f`` from ``o`` (kernels of different mean times); else ``o`` alone."""
    out: Dict[str, Dispatch] = {}
    sums = [plan_kernel_sum(profile, shapes[mi], (d1, d2), c) for mi, d1, d2, c in plans]  # (K, n) per plan
    for layout in (RUNTIME,):
        ours = list(zip(plans, sums, seconds))
        out[layout] = _fit_o_f([(kn, t) for _, kn, t in ours], 0.0)
        for mesh in sorted({(p[1], p[2]) for p, _, _ in ours}):
            out[dispatch_key(layout, mesh)] = _fit_o_f([(kn, t) for p, kn, t in ours if (p[1], p[2]) == mesh],
                                                       MIN_FACTOR)
    return out


def _fit_o_f(points: Sequence[Tuple[Tuple[float, int], float]], min_factor: float) -> Dispatch:
    """``(o, f)`` of ``T = K·(1 + f) + n·o`` over ``((K, n), T)`` points, ``f >= min_factor``,
    ``o >= 0``; ``o`` alone where the points' kernels have about one mean time."""
    A = np.array([[k / t, n / t] for (k, n), t in points])
    y = np.array([(t - k) / t for (k, _), t in points])
    per_kernel = [k / n for (k, n), _ in points]
    if max(per_kernel) < 1.1 * min(per_kernel):  # f and o not told apart
        return Dispatch(float(nnls(A[:, 1:], y)[0]), 0.0)
    f, o = bounded_lstsq(A, y, [min_factor, 0.0])
    return Dispatch(float(o), float(f))


def pattern_prediction(profile: ComputeProfile, topo: Any, pat: Pattern) -> Tuple[float, float]:
    """(compute, collective) seconds the model gives a pattern without the sync term."""
    d1, d2, dim, coll, nbytes, m, _ = pat
    return m * profile.seconds(SYNC_GEMM), CommClock(topo, (d1, d2), 4).seconds(coll, dim, float(nbytes))


def fit_sync(profile: ComputeProfile, topo: Any, patterns: Sequence[Pattern], seconds: Sequence[float]) -> SyncFit:
    """From the compute-then-collective loops, ``extra = α + r·compute`` (extra: a loop's
    measured time over the profile's compute plus the topology's collective time); then from
    the collective-during-compute loops, the hidden share ``h`` of the step model's
    ``max(c + (1 - h)·min(c, d), d)`` (``d`` the collective with its extra, the compute since
    the previous launch being the previous iteration's). Relative least squares, α, r >= 0,
    h in [0, 1] (to 0.001)."""
    rows, ys = [], []
    for pat, t in zip(patterns, seconds):
        if pat[6] != SYNC:
            continue
        comp, coll = pattern_prediction(profile, topo, pat)
        rows.append([1.0 / t, comp / t])
        ys.append((t - comp - coll) / t)
    a, r = nnls(np.array(rows), np.array(ys))
    pts = []
    for pat, t in zip(patterns, seconds):
        if pat[6] == ASYNC:
            comp, coll = pattern_prediction(profile, topo, pat)
            d = coll + a + r * comp
            pts.append((comp, d, t))
    hidden = 1.0
    if pts:
        grid = np.linspace(0.0, 1.0, 1001)
        err = [sum(((max(c + (1 - h) * min(c, d), d) - t) / t) ** 2 for c, d, t in pts) for h in grid]
        hidden = float(grid[int(np.argmin(err))])
    return SyncFit(float(a), float(r), hidden)


def make_profile(name: str, kernels: Sequence[Kernel], seconds: Sequence[float], world: int,
                 shapes: Sequence[Any] = (), plans: Sequence[Plan] = (), plan_seconds: Sequence[float] = (),
                 topo: Any = None, patterns: Sequence[Pattern] = (),
                 pattern_seconds: Sequence[float] = ()) -> ComputeProfile:
    fits: Dict[str, KindFit] = {}
    for kind in KINDS:
        idx = [i for i, k in enumerate(kernels) if k.kind == kind]
        if not idx:
            raise ConfigError(f"compute calibration: no kernel of kind '{kind}' was measured")
        fits[kind] = fit_kind([kernels[i] for i in idx], [seconds[i] for i in idx])
    gemm = [(k.work / s) for k, s in zip(kernels, seconds) if k.kind == GEMM]
    source = (f"measured {_dt.date.today().isoformat()} on {platform.node() or 'this host'} "
              f"({platform.machine()}, {world} processes at once, 1 thread each, {len(kernels)} kernels"
              + (f", {len(plans)} collective-free plan steps" if plans else "")
              + (f", {len(patterns)} compute-then-collective loops" if patterns else "") + ")")
    profile = ComputeProfile(name=name, source=source, fits=fits,
                             points={(k.kind, k.dims): s for k, s in zip(kernels, seconds)},
                             processes=world, peak_flops=max(gemm), optimizer=OPTIMIZER_DESC)
    dispatch = fit_dispatch(profile, shapes, plans, plan_seconds) if plans else {}
    sync = fit_sync(profile, topo, patterns, pattern_seconds) if patterns else None
    return ComputeProfile(name=name, source=source, fits=fits, points=profile.points, processes=world,
                          peak_flops=profile.peak_flops, dispatch=dispatch, sync=sync, optimizer=OPTIMIZER_DESC)


# ------------------------------------------------------------------------ the command
def load_topology_yaml(ref: str, conf: Path) -> Tuple[Dict[str, Any], Path]:
    """A topology config by path or name (``<conf>/topology``, then ``outputs/conf/topology``)."""
    import yaml

    cands = [Path(ref)] if ref.endswith((".yaml", ".yml")) else [
        conf / "topology" / f"{ref}.yaml", Path("outputs/conf/topology") / f"{ref}.yaml"]
    for p in cands:
        if p.is_file():
            return yaml.safe_load(p.read_text()), p
    raise ConfigError(f"calibrate_compute: --topology {ref}: no such topology ({', '.join(map(str, cands))})")


def model_shapes(names: Sequence[str], conf: Path) -> List[Any]:
    """The shapes of ``<conf>/model/<name>.yaml`` (as the run resolves them)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from atp_pipeline.config import register_mesh_source, register_schemas
    from atp_pipeline.run.resolve import model_shape

    register_schemas()
    register_mesh_source()
    out = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(conf.resolve())):
            for n in names:
                if not (conf / "model" / f"{n}.yaml").is_file():
                    raise ConfigError(f"calibrate_compute: --models: no model '{n}' in {conf / 'model'}")
                out.append(model_shape(compose("config", overrides=[f"model={n}"])))
    finally:
        GlobalHydra.instance().clear()
    return out


def model_spec(name: str, shape: Any, conf: Path) -> Dict[str, Any]:
    """What a worker needs to build model ``name`` as training does (family, typed config,
    batch, sequence length, vocabulary)."""
    from omegaconf import OmegaConf

    from atp_pipeline.config.schema import ModelConfig

    typed = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                            OmegaConf.to_container(OmegaConf.load(conf / "model" / f"{name}.yaml"), resolve=True))
    return {"family": str(typed.family), "model_config": typed, "batch": shape.batch_size,
            "seq_len": shape.seq_len, "vocab": shape.vocab_size}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atp_pipeline.run.calibrate_compute",
                                description="Time the plans' local kernels on concurrent processes and write "
                                            "a compute profile into a topology (issue 15).")
    p.add_argument("--world", type=int, default=4, help="processes at once (training's), default 4")
    p.add_argument("--topology", default="local", help="topology to extend: a config name or a YAML path")
    p.add_argument("--name", default=None, help="name of the written topology (default: <topology>_compute)")
    p.add_argument("--models", default="tiny,small,llama_tiny", help="models whose plans' kernels to measure")
    p.add_argument("--chunks", default="1,2", help="chunk counts (§4.1) the plans may use")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--batch-ms", type=float, default=10.0)
    p.add_argument("--conf", type=Path, default=CONF)
    p.add_argument("--out", default=None, help="YAML path (default outputs/conf/topology/<name>.yaml)")
    p.add_argument("--kernels-only", action="store_true",
                   help="no framework-cost (dispatch) and synchronization (sync) terms")
    args = p.parse_args(argv)
    from atp_pipeline.cli import EXIT_BAD_INPUT
    from atp_pipeline.topology.model import Topology

    try:
        if args.world < 1 or args.passes < 1 or not args.batch_ms > 0:
            raise ConfigError("calibrate_compute: --world and --passes must be >= 1, --batch-ms > 0")
        chunks = [int(c) for c in args.chunks.split(",")]
        if any(c < 1 for c in chunks):
            raise ConfigError(f"calibrate_compute: --chunks {args.chunks} must be positive integers")
        base, base_path = load_topology_yaml(args.topology, args.conf)
        topo = Topology.from_config(base)
        if topo.world_size != args.world:
            raise ConfigError(f"calibrate_compute: topology '{topo.name}' has {topo.world_size} devices, "
                              f"--world is {args.world}")
        names = [m for m in args.models.split(",") if m]
        shapes = model_shapes(names, args.conf)
        kernels = plan_kernels(shapes, args.world, chunks)
        plans = [] if args.kernels_only else plan_points(shapes, args.world, chunks)
        patterns = [] if args.kernels_only else sync_patterns(args.world)
        models = [model_spec(n, sh, args.conf) for n, sh in zip(names, shapes)] if plans else []
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    name = args.name or f"{base['name']}_compute"
    print(f"timing {len(kernels)} kernels of the plans of {args.models} on {args.world} concurrent processes, "
          f"{args.passes} passes; {len(plans)} plans' collective-free forward+backward; "
          f"{len(patterns)} compute-then-collective loops")
    t0 = time.perf_counter()
    got = measure(kernels, args.world, args.passes, args.batch_ms, plans=plans, models=models, patterns=patterns)
    nk, npl = len(kernels), len(plans)
    seconds, plan_s, pattern_s = got[:nk], got[nk:nk + npl], got[nk + npl:]
    profile = make_profile(name, kernels, seconds, args.world, shapes, plans, plan_s, topo, patterns, pattern_s)
    for kind, f in profile.fits.items():
        print(f"  {kind:<14} alpha {f.alpha_s * 1e6:8.1f} us  {f.per_unit_s * 1e9:9.4f} ns/unit"
              + (f"  {f.per_tensor_s * 1e6:.1f} us/tensor" if f.per_tensor_s else ""))
    print(f"  peak GEMM throughput {profile.peak_flops / 1e9:.2f} GFLOP/s per process")
    for (mi, d1, d2, c), t in zip(plans, plan_s):
        k, n = plan_kernel_sum(profile, shapes[mi], (d1, d2), c)
        d = profile.dispatch_of(RUNTIME, (d1, d2))[1]
        print(f"  plan {names[mi]:<11} {d1}x{d2}/c{c}: fwd+bwd {t * 1e3:7.1f} ms, kernels {k * 1e3:7.1f} ms "
              f"({n} kernels), model {(k * (1 + d.kernel_factor) + n * d.per_kernel_s) * 1e3:7.1f} ms")
    for layout, d in profile.dispatch.items():
        print(f"  dispatch[{layout}]: {d.per_kernel_s * 1e6:.1f} us per kernel + {d.kernel_factor:.1%} of its time")
    for pat, t in zip(patterns, pattern_s):
        comp, coll = pattern_prediction(profile, topo, pat)
        print(f"  loop {pat[0]}x{pat[1]} d{pat[2]} {pat[3]:<10} {pat[4]:>7} B {pat[6]:<5} {pat[5]:>2} GEMMs: "
              f"{t * 1e6:8.0f} us = compute {comp * 1e6:6.0f} + collective {coll * 1e6:6.0f} "
              f"+ extra {(t - comp - coll) * 1e6:6.0f}")
    if profile.sync is not None:
        print(f"  sync: {profile.sync.alpha_s * 1e6:.1f} us + {profile.sync.per_compute:.3f} x compute per collective;"
              f" {profile.sync.hidden:.1%} of a collective's overlap with compute hidden")
    out_cfg = dict(base)
    out_cfg["name"] = name
    out_cfg["device"] = {**(base.get("device") or {}), "compute": profile.to_config()}
    out = Path(args.out) if args.out else Path("outputs/conf/topology") / f"{name}.yaml"
    from atp_pipeline.planning.calibrate import write_topology

    write_topology(out_cfg, out, f"# {base_path} with device.compute measured by `python -m "
                                 f"atp_pipeline.run.calibrate_compute {' '.join(sys.argv[1:] if argv is None else argv)}`"
                                 f"\n# (issue 15: the step-time model's compute profile)\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
