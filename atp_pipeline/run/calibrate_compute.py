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
where the runtime uses it), parameters of the optimizer as DTensors with AdamW.

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
from atp_pipeline.planning.steptime import (ATTN_BWD, ATTN_FWD, GEMM, KINDS, NORM_BWD, NORM_FWD, OPTIMIZER,
                                            POINTWISE, ComputeProfile, Kernel, KindFit, _all_items, build_program)

CONF = Path("conf")


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
                if (c > 1 and shape.comm_layout == "module_styles") or shape.batch_size % c:
                    continue
                prog, _ = build_program(shape, mesh, shape.batch_size, c)
                seen.update(item[1] for item in _all_items(prog) if item[0] == "k")
    return sorted(seen, key=lambda k: (k.kind, k.dims))


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
    if k.kind == OPTIMIZER:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        tensors, elements = k.dims
        mesh = init_device_mesh("cpu", (world,))
        sizes = [elements // tensors] * tensors
        sizes[0] += elements - sum(sizes)
        params = [torch.nn.Parameter(DTensor.from_local(rnd(max(1, s)), mesh, [Shard(0)], run_check=False))
                  for s in sizes]
        for p in params:
            p.grad = DTensor.from_local(rnd(p.to_local().numel()), mesh, [Shard(0)], run_check=False)
        opt = torch.optim.AdamW(params, lr=1e-6)
        return opt.step
    raise ConfigError(f"compute calibration: unknown kernel kind '{k.kind}'")


def _worker(rank: int, world: int, kernels: List[Kernel], passes: int, batch_ms: float) -> List[List[float]]:
    import torch
    import torch.distributed as dist

    fns = [_runner(k, rank, world) for k in kernels]
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
            timeout: float = 1800.0) -> List[float]:
    """Seconds per call of each kernel on ``world`` concurrent processes (median over passes
    of the slowest rank)."""
    from atp_pipeline.launch import spawn

    runs = spawn(_worker, world, kernels, passes, batch_ms, timeout=timeout)[0]
    return [statistics.median(r) for r in runs]


# ------------------------------------------------------------------------ fitting
def fit_kind(kernels: Sequence[Kernel], seconds: Sequence[float]) -> KindFit:
    """``t = α + work·γ`` (optimizer: ``t = tensors·τ + work·γ``), least squares on relative
    residuals, non-negative."""
    t = np.asarray(seconds, dtype=np.float64)
    work = np.array([k.work for k in kernels], dtype=np.float64)
    first = np.array([k.dims[0] if k.kind == OPTIMIZER else 1.0 for k in kernels], dtype=np.float64)
    A = np.stack([first, work], axis=1) / t[:, None]
    ones = np.ones_like(t)
    best: Optional[Tuple[float, float, float]] = None
    cands = []
    if len(t) >= 2 and np.linalg.matrix_rank(A) == 2:
        coef, *_ = np.linalg.lstsq(A, ones, rcond=None)
        cands.append((float(coef[0]), float(coef[1])))
    for j in (0, 1):
        col = A[:, j]
        den = float(col @ col)
        x = float(col @ ones) / den if den > 0 else 0.0
        cands.append((x, 0.0) if j == 0 else (0.0, x))
    for a, b in cands:
        if a < 0 or b < 0:
            continue
        r = float(np.sum((A @ np.array([a, b]) - ones) ** 2))
        if best is None or r < best[2]:
            best = (a, b, r)
    assert best is not None
    a, b, _ = best
    if kernels and kernels[0].kind == OPTIMIZER:
        return KindFit(0.0, b, a)
    return KindFit(a, b)


def make_profile(name: str, kernels: Sequence[Kernel], seconds: Sequence[float], world: int) -> ComputeProfile:
    fits: Dict[str, KindFit] = {}
    for kind in KINDS:
        idx = [i for i, k in enumerate(kernels) if k.kind == kind]
        if not idx:
            raise ConfigError(f"compute calibration: no kernel of kind '{kind}' was measured")
        fits[kind] = fit_kind([kernels[i] for i in idx], [seconds[i] for i in idx])
    gemm = [(k.work / s) for k, s in zip(kernels, seconds) if k.kind == GEMM]
    source = (f"measured {_dt.date.today().isoformat()} on {platform.node() or 'this host'} "
              f"({platform.machine()}, {world} processes at once, 1 thread each, {len(kernels)} kernels)")
    return ComputeProfile(name=name, source=source, fits=fits,
                          points={(k.kind, k.dims): s for k, s in zip(kernels, seconds)},
                          processes=world, peak_flops=max(gemm))


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
        shapes = model_shapes([m for m in args.models.split(",") if m], args.conf)
        kernels = plan_kernels(shapes, args.world, chunks)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    name = args.name or f"{base['name']}_compute"
    print(f"timing {len(kernels)} kernels of the plans of {args.models} on {args.world} concurrent processes, "
          f"{args.passes} passes")
    t0 = time.perf_counter()
    seconds = measure(kernels, args.world, args.passes, args.batch_ms)
    profile = make_profile(name, kernels, seconds, args.world)
    for kind, f in profile.fits.items():
        print(f"  {kind:<14} alpha {f.alpha_s * 1e6:8.1f} us  {f.per_unit_s * 1e9:9.4f} ns/unit"
              + (f"  {f.per_tensor_s * 1e6:.1f} us/tensor" if f.per_tensor_s else ""))
    print(f"  peak GEMM throughput {profile.peak_flops / 1e9:.2f} GFLOP/s per process")
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
