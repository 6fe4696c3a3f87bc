"""Calibrate compute: a sweep of kernels, probe models and loops on concurrent processes -> a profile.

    python -m atp_pipeline.run.calibrate_compute --world 4 --topology outputs/conf/topology/cpu4.yaml

The measuring half of the step-time model's compute (:mod:`atp_pipeline.planning.steptime`,
which is pure); ``python train.py stage=calibrate`` (:mod:`atp_pipeline.run.calibration`) runs it
after the collectives. Nothing measured here is a plan of a model the step model then predicts
(issue 27: the model must generalize, and the validation checks it on models, batches and
sequence lengths the calibration never ran):

* **kernels** — a sweep of shapes per kind (:func:`sweep_kernels`): GEMMs over a grid of token
  counts and widths in both orientations, attention over batch x heads x sequence x head size,
  norms and elementwise kernels over element counts, foreach AdamW on DTensor parameters'
  local shards (training's, ``lightning.module.adamw``) over tensor counts x elements. The step model
  interpolates between the measured points (log work, log time) and fits ``α + work·γ``
  per kind beyond them.
* **framework** — the runtime's CPU work around kernels and collectives (:class:`Framework`):
  the *probe* models (:data:`PROBES`: synthetic sizes of the families the runtime lays out)
  run their forward and backward on every candidate mesh and chunk count with every
  collective skipped (``Comm`` still books it, the buffers and copies around it still run);
  ``T = K·(1 + f) + n·o + m·a + B·b`` is fitted over all of them at once (``K`` the profile's
  time of the plan's ``n`` kernels, ``m`` collective calls moving ``B`` bytes).
* **sync** — on every group layout of the candidate meshes' dimensions, ``m`` GEMMs then a
  blocking all-reduce / all-gather (``m`` = 0, 1, 4, 16; 16 KiB and 256 KiB): what a loop
  takes over the profile's compute plus the topology's α-β is fitted as ``α + r·compute``;
  the same loops with the collective launched before the GEMMs and waited after give the
  share of that overlap compute really hides. The loops with no GEMMs, also at 1 KiB, 4 KiB,
  64 KiB and 1 MiB and with :data:`LOOP_BATCH` times the calls, give a collective's backend CPU
  per call and byte (:func:`fit_collective_cpu_loops`).
* **contention** — the slowdown of CPU work with 1, 2, …, ``world`` processes on the host
  against ``world`` (:func:`measure_contention`): a run with fewer processes than the
  calibration's is predicted from the same profile.
* **step residual** — the probes' whole training steps (collectives run, the optimizer, a
  closing barrier, as the validation times a step) on ``world`` and on 2 processes, against
  the step the rest of the profile predicts for them: per process count and chunk count a
  factor on the predicted compute and one on the exposed communication (:class:`StepResidual`),
  what the terms' sum misses of a step; and the step from a rank's CPU (:class:`CpuStep`: the
  probes' measured step over their measured rank CPU per mesh and chunk count, their measured
  rank CPU against the predicted one), the form kept being the one that predicts better the
  probe models left out of the fit in turn (:func:`fit_residual`).

**Concurrency and load.** Training runs ``world`` processes on this host at once, every rank
running the same kernel at the same time; so everything is timed that way: ``--world``
processes (:func:`atp_pipeline.launch.spawn`, one thread each), a barrier, then every rank runs
the measurement ``k`` times back to back (``k`` from a warm-up so a batch lasts about
``--batch-ms``); a measurement's time is the slowest rank's mean per call, and the median over
``--passes`` passes interleaved over all measurements. A pass during which other jobs loaded
the host is measured again (:mod:`atp_pipeline.run.hostload`). A process holds one device mesh per
shape (:func:`_mesh`), as training holds one: a mesh per measurement left ~50 meshes' gloo threads
waking up in every rank and priced every kernel 1.5-2x its CPU (docs/step-time.md, run 8).

**Output.** The topology ``--topology`` (a config name under ``--conf`` or
``outputs/conf``, or a YAML path) with ``device.compute`` = the profile: measured points,
fits per kind, the framework, sync and contention terms, the peak GEMM throughput measured
(MFU's denominator), the probes it ran (the validation's in-sample check), its name, date
and source, which every prediction quotes. Written to ``--out`` (default
``outputs/conf/topology/<name>.yaml``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.lstsq import bounded_lstsq, nnls
from atp_pipeline.planning.comm_clock import CommClock
from atp_pipeline.planning.compute_profile import (STEPS_GROUP, CollectiveCPU, ComputeProfile, CpuStep, Framework,
                                                   HostSpeed, KindFit, Mesh, Probe, StepResidual, SyncFit, cell_key,
                                                   parse_step_label, shape_key, step_label, steps_count,
                                                   steps_speed)
from atp_pipeline.planning.kernels import (ATTN_BWD, ATTN_FWD, GEMM, KINDS, LOSS_BWD, LOSS_FWD, NORM_BWD, NORM_FWD,
                                           OPTIMIZER, POINTWISE, Kernel)
from atp_pipeline.planning.step_program import all_items, build_program

CONF = Path("conf")
OPTIMIZER_DESC = "AdamW foreach=True on DTensor parameters' local shards (lightning.module.adamw)"
SYNC_GEMM = Kernel(GEMM, (64, 256, 256))  # the compute of the compute-then-collective loop
SYNC_COMPUTE = (0, 1, 4, 16)  # SYNC_GEMMs before each collective
SYNC_BYTES = (16384, 262144)
SYNC_COLLECTIVES = ("all_reduce", "all_gather")
# besides SYNC_BYTES: the pure collective loops the collectives' CPU per call and byte is fitted over. The
# small sizes are where tensor-parallel activations of small models sit (a few KiB to ~100 KiB); with
# 16 KiB, 256 KiB and 1 MiB alone, eight calibrations fitted 345-535 us a 2-rank call and 847-1286 us a
# 4-rank one (docs/step_validation/diagnosis/e19.log)
LOOP_BYTES = (1024, 4096, 65536, 1048576)
LOOP_BATCH = 4  # a pure loop runs 4x the batch of calls a pass (one call is ~0.3-1.5 ms of scattered CPU)
SYNC, ASYNC = "sync", "async"  # collective after the GEMMs / launched before them, waited after
MIN_FACTOR = -0.5  # the least the framework's kernel_factor may be: a kernel never takes 0 s
CONTENTION_KERNELS = (Kernel(GEMM, (32, 16, 16)), Kernel(GEMM, (512, 128, 256)), Kernel(POINTWISE, (65536,)))
CONTENTION_BYTES = 262144  # the all-reduce of pairs of ranks the collectives' contention factor is timed by

# The probe models: what the framework cost is fitted from. Synthetic sizes of the families
# the runtime lays out (built-in GPT, transformers' llama and gpt2 configs), each a config
# of conf/model with overrides; none is a model, batch or sequence length the validation uses.
PROBES: Dict[str, Tuple[str, ...]] = {
    "probe_gpt_s": ("model=tiny", "model.hidden=48", "model.heads=4", "model.layers=1",
                    "model.seq_len=48", "model.batch_size=6"),
    "probe_gpt_m": ("model=tiny", "model.hidden=96", "model.heads=4", "model.layers=2",
                    "model.seq_len=96", "model.batch_size=6"),
    "probe_llama": ("model=llama_tiny", "model.hf.hidden_size=48", "model.hf.intermediate_size=96",
                    "model.hf.num_attention_heads=4", "model.hf.num_key_value_heads=2",
                    "model.hf.num_hidden_layers=1", "model.seq_len=48", "model.batch_size=6"),
    "probe_gpt2": ("model=gpt2_tiny", "model.hf.hidden_size=48", "model.hf.num_attention_heads=4",
                   "model.hf.num_hidden_layers=1", "model.seq_len=48", "model.batch_size=6"),
}
# Two of them again at 8x the batch: the same kernels (n) and collective calls (m), 8x the work of
# each (K). With the batch-6 steps alone, K and n rose together from probe to probe, so the
# framework's kernel_factor f and per-kernel o traded against each other: two calibrations taken
# back to back fitted 57 us + 101 % and 113 us - 10 % (docs/step_validation/diagnosis/e9.md), and
# predicted the same validation rows 0.72-1.15x apart.
PROBES["probe_gpt_s_b48"] = (*PROBES["probe_gpt_s"][:-1], "model.batch_size=48")
PROBES["probe_llama_b48"] = (*PROBES["probe_llama"][:-1], "model.batch_size=48")
# And the GPT-2 family's at 8x the batch (run 59): on 2 processes the rank CPU over its predicted
# time grew with the tokens a kernel runs on in both transformers families (the 2x1 cell's validation
# models x1.39-1.43, `probe_llama_b48` x1.52, the batch-6 probes x1.09-1.25), and with one such probe
# the CPU's line of that cell leant on it alone; run 59's own grids refitted without it: worst 42.7 and
# 46.8 % against 39.4 and 43.5 % (docs/step-time.md, "Runs 59-60").
PROBES["probe_gpt2_b48"] = (*PROBES["probe_gpt2"][:-1], "model.batch_size=48")


# ------------------------------------------------------------------------ what is measured
def sweep_kernels(quick: bool = False) -> List[Kernel]:
    """A sweep of shapes per kernel kind (not any plan's own): GEMMs ``[M,K]@[K,N]`` over a
    grid of token counts and widths in both orientations (a forward/input-gradient GEMM has
    the tokens outside, a weight gradient inside), attention over batch x heads x sequence x
    head size, norms and elementwise kernels over element counts, the optimizer over tensor
    counts x elements, a model's own loss over tokens x vocabulary. ``quick``: a coarser grid (tests)."""
    tokens = (32, 256, 2048) if quick else (32, 128, 512, 2048)
    widths = (16, 128) if quick else (16, 64, 256)
    outs = (16, 256) if quick else (16, 64, 256, 1024)
    gemm = {(m, k, n) for m in tokens for k in widths for n in outs}
    gemm |= {(k, m, n) for m in tokens for k in widths for n in outs if m >= 256}  # weight gradients
    gemm.add(SYNC_GEMM.dims)
    # attention cores on a full grid of (b·a, s, d) (:attr:`Kernel.grid`; priced multilinear in its
    # logs): independent cores 4-64, sequences 32-256, head sizes 8-128
    attn = [(b, 4, s, d) for b in ((1, 4) if quick else (1, 4, 16)) for s in ((32, 128) if quick else (32, 64, 128, 256))
            for d in ((8, 32) if quick else (8, 16, 32, 64, 128))]
    elems = (1024, 16384, 262144) if quick else (1024, 8192, 65536, 524288)
    opt = ([(8, 20000), (32, 200000)] if quick else
           [(8, 20000), (32, 20000), (8, 400000), (32, 400000), (64, 100000)])
    out = [Kernel(GEMM, d) for d in sorted(gemm)]
    out += [Kernel(kind, d) for kind in (ATTN_FWD, ATTN_BWD) for d in attn]
    out += [Kernel(kind, (n,)) for kind in (NORM_FWD, NORM_BWD, POINTWISE) for n in elems]
    out += [Kernel(OPTIMIZER, d) for d in opt]
    logits = ([(256, 256), (2048, 256)] if quick else [(64, 256), (256, 256), (2048, 256), (256, 2048), (2048, 2048)])
    out += [Kernel(kind, d) for kind in (LOSS_FWD, LOSS_BWD) for d in logits]
    return out


Plan = Tuple[int, int, int, int]  # (model index, d1, d2, chunks)
Pattern = Tuple[int, int, int, str, int, int, str]  # (d1, d2, dim, collective, bytes, SYNC_GEMMs, SYNC|ASYNC)


def plan_points(shapes: Sequence[Any], world: int, chunks: Sequence[int]) -> List[Plan]:
    """Every candidate (mesh, chunks) of every probe: the runtime's forward and backward of
    each is timed with its collectives skipped (the framework cost, :class:`Framework`)."""
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


def cpu_loops(world: int) -> List[Pattern]:
    """Pure collective loops at LOOP_BYTES on every group layout :func:`sync_patterns` times (no
    GEMMs, blocking): with its own pure loops, what :func:`fit_collective_cpu_loops` prices a
    collective's backend CPU per call and per byte from (not the sync fit's)."""
    return [(d1, d2, dim, coll, b, 0, SYNC) for d1, d2, dim, coll, b0, m, mode in sync_patterns(world)
            if m == 0 and mode == SYNC and b0 == SYNC_BYTES[0] for b in LOOP_BYTES]


# ------------------------------------------------------------------------ timing (workers)
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


@dataclass(frozen=True)
class Timed:
    """One measurement's medians over the passes: wall seconds per call (the slowest rank),
    CPU seconds per call (the ranks' mean, all threads), seconds waited in collectives per
    call by group size (rank 0; live probe steps only)."""

    wall: float
    cpu: float
    waits: Dict[int, float]


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
                   {s: statistics.median(ws.get(s, 0.0) for _, _, ws in r) for s in sorted({s for _, _, ws in r for s in ws})})
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


# ------------------------------------------------------------------------ fitting
def fit_kind(kernels: Sequence[Kernel], seconds: Sequence[float]) -> KindFit:
    """``t = α + size·γ`` (:attr:`Kernel.size`: the work, an attention core's score elements;
    optimizer: ``t = α + tensors·τ + work·γ``), least squares on relative residuals, non-negative."""
    t = np.asarray(seconds, dtype=np.float64)
    per_size = any(k.size != k.work for k in kernels)
    size = np.array([k.size for k in kernels], dtype=np.float64)
    opt = bool(kernels) and kernels[0].kind == OPTIMIZER
    cols = [np.ones_like(t)] + ([np.array([k.dims[0] for k in kernels], dtype=np.float64)] if opt else []) + [size]
    x = nnls(np.stack(cols, axis=1) / t[:, None], np.ones_like(t))
    if opt:
        return KindFit(float(x[0]), float(x[2]), float(x[1]))
    return KindFit(float(x[0]), float(x[1]), per_size=per_size)


def plan_features(profile: ComputeProfile, shape: Any, mesh: Tuple[int, int], chunks: int,
                  batch: Optional[int] = None) -> Tuple[float, int, int, float, int]:
    """What the framework cost of a plan's forward and backward is fitted over: the
    profile's seconds ``K`` of its ``n`` kernels (but the optimizer), its ``m`` collective
    calls, the bytes ``B`` they move and its ``r`` sharded parameter reads
    (:func:`~atp_pipeline.planning.step_program.build_program`)."""
    prog, _ = build_program(shape, mesh, shape.batch_size if batch is None else batch, chunks)
    items = list(all_items(prog))
    ks = [it[1] for it in items if it[0] == "k" and it[1].kind != OPTIMIZER]
    colls = [it[1] for it in items if it[0] in ("sync", "async", "linear")]
    nbytes = float(sum(c.elements for c in colls)) * shape.bytes_per_element
    return sum(profile.seconds(k) for k in ks), len(ks), len(colls), nbytes, prog.reads


def plan_calls(shape: Any, mesh: Tuple[int, int], chunks: int) -> Dict[int, int]:
    """A plan's collective calls in its forward and backward by group size."""
    prog, _ = build_program(shape, mesh, shape.batch_size, chunks)
    colls = [it[1] for it in all_items(prog) if it[0] in ("sync", "async", "linear")]
    calls: Dict[int, int] = {}
    for c in colls:
        size = mesh[0] if c.term.dim == 1 else mesh[1]
        calls[size] = calls.get(size, 0) + 1
    return calls


def framework_seconds(fw: Framework, features: Tuple[float, int, int, float, int]) -> float:
    """A plan's collective-free forward and backward under ``fw``: ``K·(1 + f) + n·o + m·a + B·b + r·p``."""
    k, n, m, nbytes, reads = features
    return (k * (1 + fw.kernel_factor) + n * fw.per_kernel_s + m * fw.per_collective_s + nbytes * fw.per_collective_byte_s
            + reads * fw.per_read_s)


def fit_framework(profile: ComputeProfile, shapes: Sequence[Any], plans: Sequence[Plan],
                  seconds: Sequence[float]) -> Framework:
    """``T = K·(1 + f) + n·o + m·a + B·b + r·p`` over every probe plan (T its measured
    collective-free forward and backward; :func:`plan_features`), one set for all models and
    meshes, relative least squares with ``f >= -0.5`` (kernels can run faster in a plan's
    sequence than each timed alone: warm caches) and ``o, a, b, p >= 0``
    (:func:`~atp_pipeline.planning.lstsq.bounded_lstsq`). The probes' layouts read 0.14-0.44
    sharded parameters a kernel (``r`` against ``n``), so ``p`` and ``o`` are told apart."""
    feats = [plan_features(profile, shapes[mi], (d1, d2), c) for mi, d1, d2, c in plans]
    A = np.array([[k / t, n / t, m / t, b / t, r / t] for (k, n, m, b, r), t in zip(feats, seconds)])
    y = np.array([(t - ft[0]) / t for ft, t in zip(feats, seconds)])
    f, o, a, b, p = bounded_lstsq(A, y, [MIN_FACTOR, 0.0, 0.0, 0.0, 0.0])
    return Framework(float(o), float(f), float(a), float(b), float(p))


def pattern_prediction(profile: ComputeProfile, topo: Any, pat: Pattern) -> Tuple[float, float]:
    """(compute, collective) seconds the model gives a pattern without the sync term: its GEMMs
    as every rank runs them at once on the host (:meth:`ComputeProfile.host_factor`)."""
    d1, d2, dim, coll, nbytes, m, _ = pat
    return (m * profile.seconds(SYNC_GEMM) * profile.host_factor(d1 * d2),
            CommClock(topo, (d1, d2), 4).seconds(coll, dim, float(nbytes)))


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


def fit_collective_cpu_loops(patterns: Sequence[Pattern], timed: Sequence[Timed]) -> Optional[CollectiveCPU]:
    """The collectives' backend CPU from the pure collective loops (the patterns with no GEMMs,
    ``SYNC``: every rank in the same back-to-back collectives after a barrier, so no rank waits
    for a slower one's compute): per group size, a rank's CPU per call ``c + b·bytes`` (relative
    non-negative least squares over the loops of that size, every collective and message size
    alike). Waiting costs nothing (no busy share): a rank blocked in a gloo collective sleeps
    (``docs/step_validation/diagnosis/e7.log``). None without such loops (a world of one process)."""
    by_size: Dict[int, List[Tuple[float, float]]] = {}
    for pat, t in zip(patterns, timed):
        d1, d2, dim, _, nbytes, m, mode = pat
        if m == 0 and mode == SYNC and t.cpu > 0:
            by_size.setdefault(d1 if dim == 1 else d2, []).append((float(nbytes), t.cpu))
    if not by_size:
        return None
    per_call, per_byte = {}, {}
    for size, pts in sorted(by_size.items()):
        a = np.array([[1.0 / c, b / c] for b, c in pts])
        x = nnls(a, np.ones(len(pts))) if len({b for b, _ in pts}) > 1 else np.array(
            [statistics.median(c for _, c in pts), 0.0])
        per_call[size], per_byte[size] = float(x[0]), float(x[1])
    return CollectiveCPU({}, per_call, per_byte)


def probe_step_predictions(profile: ComputeProfile, topo: Any, shapes: Sequence[Any],
                           plans: Sequence[Plan]) -> List[Any]:
    """The step model's prediction (:class:`~atp_pipeline.planning.steptime.StepEstimate`) of each
    probe's whole training step (:func:`_live_runner`) on its mesh's process count (``topo``
    restricted to it, as the validation predicts)."""
    from atp_pipeline.planning.steptime import StepSetting, estimate_step

    return [estimate_step(topo.restrict(d1 * d2), shapes[mi], (d1, d2), StepSetting(chunks=c), profile)
            for mi, d1, d2, c in plans]


def probe_step_errors(predicted: Sequence[Any], measured: Sequence[float]) -> List[float]:
    """The step model's relative error on the probes' own training steps with their collectives
    (``predicted``: :func:`probe_step_predictions`; in sample: a check of the calibration, not a validation)."""
    return [abs(e.step_s - t) / t for e, t in zip(predicted, measured)]


def fit_step_residual(parts: Sequence[Tuple[float, float]], measured: Sequence[float],
                      processes: Sequence[int], chunks: Optional[Sequence[int]] = None) -> Optional[StepResidual]:
    """:class:`StepResidual` from the probes' own training steps: per process count and chunk count,
    ``T = a·C + b·E`` (``parts``: each step's predicted compute ``C`` and exposed communication ``E``;
    ``T`` measured), relative non-negative least squares over the steps at those counts; with fewer
    than 3 steps, or no exposed communication to tell the two apart, one factor for both (the median
    of T / (C + E)). ``chunks`` None: every step's 1. None without a step measured."""
    by: Dict[int, Dict[int, List[Tuple[float, float, float]]]] = {}
    for (c, e), t, n, k in zip(parts, measured, processes, chunks or [1] * len(parts)):
        if c + e > 0 and t > 0:
            by.setdefault(int(n), {}).setdefault(int(k), []).append((c, e, t))
    if not by:
        return None
    comp: Dict[int, Dict[int, float]] = {}
    expo: Dict[int, Dict[int, float]] = {}
    for n, per in sorted(by.items()):
        for k, pts in sorted(per.items()):
            if len(pts) >= 3 and any(e > 0 for _, e, _ in pts):
                a, b = nnls(np.array([[c / t, e / t] for c, e, t in pts]), np.ones(len(pts)))
            else:
                a = b = statistics.median(t / (c + e) for c, e, t in pts)
            comp.setdefault(n, {})[k], expo.setdefault(n, {})[k] = float(a), float(b)
    return StepResidual(comp, expo, {n: sum(len(p) for p in per.values()) for n, per in sorted(by.items())})


def fit_cpu_step(cpu_pred: Sequence[float], cpu_meas: Sequence[float], measured: Sequence[float],
                 processes: Sequence[int], meshes: Sequence[Mesh], chunks: Sequence[int]) -> Optional[CpuStep]:
    """:class:`CpuStep` from the probes' own training steps: per process count and (mesh, chunk
    count) cell the measured step ``T`` against the measured rank CPU ``U`` as ``T = ratio·U + wait``,
    and the measured rank CPU against the predicted ``Û`` as ``U = a·Û + b`` (both :func:`_line`;
    the CPU's line per cell since run 57, diagnosis e45). None without a step whose three times are
    all measured."""
    steps: Dict[int, Dict[str, List[Tuple[float, float]]]] = {}
    cpu: Dict[int, Dict[str, List[Tuple[float, float]]]] = {}
    for u_hat, u, t, n, mesh, k in zip(cpu_pred, cpu_meas, measured, processes, meshes, chunks):
        if u_hat > 0 and u > 0 and t > 0:
            steps.setdefault(int(n), {}).setdefault(cell_key(mesh, k), []).append((u, t))
            cpu.setdefault(int(n), {}).setdefault(cell_key(mesh, k), []).append((u_hat, u))
    if not steps:
        return None
    cells = {n: {c: _line(pts) for c, pts in sorted(per.items())} for n, per in sorted(steps.items())}
    return CpuStep({n: {c: g for c, (g, _) in per.items()} for n, per in cells.items()},
                   {n: {k: _line(pts) for k, pts in sorted(per.items())} for n, per in sorted(cpu.items())},
                   {n: {c: w for c, (_, w) in per.items()} for n, per in cells.items()})


def _line(pts: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``y = s·x + c`` over ``(x, y)`` points: relative non-negative least squares; with fewer than
    3 points, or no fit with ``s > 0``, ``s`` the median of ``y / x`` and ``c = 0``."""
    s = c = 0.0
    if len(pts) >= 3:
        s, c = nnls(np.array([[x / y, 1.0 / y] for x, y in pts]), np.ones(len(pts)))
    if not s > 0:
        s, c = statistics.median(y / x for x, y in pts), 0.0
    return float(s), float(c)


def fit_residual(parts: Sequence[Tuple[float, float]], cpu_pred: Sequence[float], cpu_meas: Sequence[float],
                 measured: Sequence[float], processes: Sequence[int], meshes: Sequence[Mesh], chunks: Sequence[int],
                 models: Sequence[int]) -> Optional[StepResidual]:
    """The :class:`StepResidual` of the probes' own steps in both forms — the terms' two factors
    (:func:`fit_step_residual`) and the step from a rank's CPU (:func:`fit_cpu_step`) — and the form
    that predicts better the probe *models* left out of the fit, one at a time (``models``: each
    step's probe model; the root mean square of the relative errors over every left-out step; the
    terms' form where there are fewer than two models or no CPU measured). Both forms' left-out
    errors (median, worst) are kept in ``cv``."""
    terms = fit_step_residual(parts, measured, processes, chunks)
    anchored = fit_cpu_step(cpu_pred, cpu_meas, measured, processes, meshes, chunks)
    if terms is None or anchored is None or len(set(models)) < 2:
        return terms
    errs: Dict[str, List[float]] = {"terms": [], "cpu": []}
    idx = range(len(measured))
    for m in sorted(set(models)):
        keep = [i for i in idx if models[i] != m]
        sub = lambda xs: [xs[i] for i in keep]  # noqa: E731
        t_fit = fit_step_residual(sub(parts), sub(measured), sub(processes), sub(chunks))
        c_fit = fit_cpu_step(sub(cpu_pred), sub(cpu_meas), sub(measured), sub(processes), sub(meshes), sub(chunks))
        for i in idx:
            if models[i] != m or not measured[i] > 0 or t_fit is None or c_fit is None:
                continue
            fc, fe = t_fit.at(processes[i], chunks[i])
            errs["terms"].append((fc * parts[i][0] + fe * parts[i][1]) / measured[i] - 1.0)
            errs["cpu"].append(c_fit.step(processes[i], meshes[i], chunks[i], cpu_pred[i]) / measured[i] - 1.0)
    if not errs["cpu"]:
        return terms
    rms = {f: math.sqrt(statistics.fmean(e * e for e in v)) for f, v in errs.items()}
    cv = {f: (statistics.median(abs(e) for e in v), max(abs(e) for e in v)) for f, v in errs.items()}
    return dataclasses.replace(terms, anchored=anchored, form=min(rms, key=lambda f: (rms[f], f != "terms")), cv=cv)


def probe_step_rows(probe_names: Sequence[str], plans: Sequence[Plan], processes: Sequence[int],
                    wall: Sequence[float], cpu: Sequence[float], terms: Sequence[Any], final: Sequence[Any]
                    ) -> List[Dict[str, Any]]:
    """One row per probe step the step residual was fitted over: its probe, process count, mesh and
    chunks, its measured wall and rank CPU, the terms' prediction (``terms``: compute, exposed, the
    rank's CPU, the step) and the profile's with the residual (``final``) — what a later diagnosis
    of the residual's forms needs (the calibration's ``<topology>_probe_steps.json``)."""
    return [{"probe": probe_names[mi], "processes": n,
             "mesh": f"{d1}x{d2}", "chunks": c, "measured_s": t, "measured_cpu_s": u,
             "compute_s": e.compute_s, "exposed_s": e.exposed_comm_s, "cpu_s": e.cpu_s, "coll_cpu_s": e.coll_cpu_s,
             "terms_s": e.step_s,
             "predicted_s": f.step_s}
            for (mi, d1, d2, c), n, t, u, e, f in zip(plans, processes, wall, cpu, terms, final)]


def residual_counts(world: int) -> List[int]:
    """The process counts the probes' whole steps are timed at for :class:`StepResidual`: the
    calibration's ``world`` and 2 (the smallest run with collectives)."""
    return sorted({world, 2}) if world >= 2 else []


def probe_records(probe_names: Sequence[str], shapes: Sequence[Any], plans: Sequence[Plan],
                  with_processes: bool = False) -> Tuple[Probe, ...]:
    """The :class:`Probe` record of each plan a calibration ran (``probe_names`` name ``shapes``;
    empty: the shapes' own names); ``with_processes``: each records its mesh's process count (the
    step residual's probe steps on counts other than the profile's ``processes``)."""
    names = list(probe_names) or [getattr(sh, "name", f"probe{i}") for i, sh in enumerate(shapes)]
    return tuple(Probe(names[mi], shape_key(shapes[mi]), (d1, d2), shapes[mi].batch_size, shapes[mi].seq_len,
                       d1 * d2 if with_processes else 0) for mi, d1, d2, _ in plans)


def utc_now() -> str:
    """Now (UTC) as a profile's ``date`` and a re-timing's ``measured`` spell it."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_profile(name: str, kernels: Sequence[Kernel], seconds: Sequence[float], world: int,
                 shapes: Sequence[Any] = (), plans: Sequence[Plan] = (), plan_seconds: Sequence[float] = (),
                 topo: Any = None, patterns: Sequence[Pattern] = (), pattern_seconds: Sequence[float] = (),
                 contention: Optional[Mapping[int, float]] = None, probe_names: Sequence[str] = (),
                 collective_cpu: Optional[CollectiveCPU] = None, kernel_time: str = "wall",
                 comm_contention: Optional[Mapping[int, float]] = None) -> ComputeProfile:
    """The profile of a calibration's measurements: kernel points and per-kind fits, the
    framework cost fitted over the probe plans, the sync fit over the loops, the contention
    factors, the collectives' CPU (:func:`fit_collective_cpu_loops`), and the probes it ran
    (``probe_names`` name ``shapes``). ``kernel_time``: what ``seconds`` and ``plan_seconds``
    are — ``"cpu"``, a rank's CPU per call (``process_time``; :attr:`Timed.cpu`), or ``"wall"``
    (the loops' ``pattern_seconds`` are wall times either way)."""
    fits: Dict[str, KindFit] = {}
    for kind in KINDS:
        idx = [i for i, k in enumerate(kernels) if k.kind == kind]
        if not idx:
            raise ConfigError(f"compute calibration: no kernel of kind '{kind}' was measured")
        fits[kind] = fit_kind([kernels[i] for i in idx], [seconds[i] for i in idx])
    gemm = [(k.work / s) for k, s in zip(kernels, seconds) if k.kind == GEMM]
    source = (f"measured on {platform.node() or 'this host'} "
              f"({platform.machine()}, {world} processes at once, 1 thread each, a sweep of {len(kernels)} kernels"
              + (f", {len(plans)} collective-free probe steps of {len(shapes)} probe models" if plans else "")
              + (f", {len(patterns)} compute-then-collective loops" if patterns else "")
              + (f", contention at {'/'.join(str(p) for p in sorted(contention))} processes" if contention else "")
              + (", the collectives' CPU per call and byte from the pure collective loops" if collective_cpu is not None else "")
              + ")")
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    base = ComputeProfile(name=name, source=source, fits=fits,
                          points={(k.kind, k.dims): s for k, s in zip(kernels, seconds)},
                          processes=world, peak_flops=max(gemm), optimizer=OPTIMIZER_DESC, cores=cores,
                          kernel_time=kernel_time)
    framework = fit_framework(base, shapes, plans, plan_seconds) if plans else None
    sync = fit_sync(base, topo, patterns, pattern_seconds) if patterns else None
    probes = probe_records(probe_names, shapes, plans)
    return ComputeProfile(name=name, source=source, fits=fits, points=base.points, processes=world, cores=cores,
                          peak_flops=base.peak_flops, framework=framework, sync=sync, optimizer=OPTIMIZER_DESC,
                          contention=dict(contention or {}), date=utc_now(), probes=probes, collective_cpu=collective_cpu,
                          kernel_time=kernel_time, comm_contention=dict(comm_contention or {}))


# ------------------------------------------------------------------------ the host's speed now
# The kernel reference probe: a fixed synthetic set of the calibration's own measurements, timed in
# a launch of its own at calibration (recorded in the profile, ``reference``) and again by the step
# validation's ``--retime bracket|group|once`` (and by ``stage=plan`` for a calibration from before
# run 45), so a prediction is priced at the host's speed now
# (:class:`~atp_pipeline.planning.compute_profile.HostSpeed`, basis "kernels"; since run 45 the
# probes' whole steps are, :func:`retime_steps`). Never a model, batch or sequence length a user
# plans: kernels at sweep shapes and the smallest probe model's step.
REFERENCE: Dict[str, Tuple[Kernel, ...]] = {
    "compute": (Kernel(GEMM, (512, 256, 256)), Kernel(GEMM, (2048, 64, 256)), Kernel(NORM_FWD, (65536,)),
                Kernel(NORM_BWD, (65536,)), Kernel(POINTWISE, (65536,))),  # rate-bound
    "overhead": (Kernel(GEMM, (32, 16, 16)), Kernel(POINTWISE, (1024,)), Kernel(NORM_FWD, (1024,))),  # per call
}
REFERENCE_STEP = "probe_gpt_s"  # its collective-free step on (world, 1), chunks 1: the framework's per-kernel work
REFERENCE_PASSES, REFERENCE_BATCH_MS = 9, 20.0


def reference_label(k: Kernel) -> str:
    return f"{k.kind} {'x'.join(str(d) for d in k.dims)}"


def reference_probe(world: int, conf: Path = CONF, passes: int = REFERENCE_PASSES,
                    batch_ms: float = REFERENCE_BATCH_MS) -> Dict[str, Dict[str, float]]:
    """Time the reference probe on ``world`` processes at once, as the calibration times its
    kernels (:func:`measure_all`: the same runners, one thread per process, a rank's CPU per
    call, median over interleaved passes, passes under other jobs' load measured again):
    group -> label -> seconds. Its own launch, at calibration and wherever it is timed again."""
    built = compose_models(probe_entries([REFERENCE_STEP]), conf)
    kernels = [k for ks in REFERENCE.values() for k in ks]
    plan: Plan = (0, world, 1, 1)
    _, timed, _ = measure_all(kernels, world, passes, batch_ms, plans=[plan], models=[built[0][1]])
    out: Dict[str, Dict[str, float]] = {g: {} for g in REFERENCE}
    i = 0
    for g, ks in REFERENCE.items():
        for k in ks:
            out[g][reference_label(k)] = max(timed[i].cpu, 1e-9)
            i += 1
    out["overhead"][f"step {REFERENCE_STEP} {world}x1/c1"] = max(timed[i].cpu, 1e-9)
    return out


def retime(profile: ComputeProfile, conf: Path = CONF) -> Any:
    """The host's speed now against the calibration's (:class:`HostSpeed`): the reference probe
    timed again on the calibration's process count; None for a profile without a reference
    (calibrated before it had one: predicted at its calibration's speed, and said so)."""
    from atp_pipeline.planning.compute_profile import host_speed

    if not profile.reference:
        return None
    now = reference_probe(profile.processes, conf)
    return host_speed(profile.reference, now, utc_now())


# The probe models whose whole steps are the host's speed on the steps' basis (recorded at
# calibration, timed again before a prediction: ``stage=plan``, the step validation's ``--retime
# steps``): two of the calibration's probes, every mesh and chunk count of the process count, as
# the calibration timed them for the step residual (:func:`_live_runner`).
RETIME_STEP_PROBES = ("probe_gpt_s", "probe_llama")


def time_probe_steps(probes: Sequence[str], processes: int, conf: Path = CONF, passes: int = 3,
                     batch_ms: float = 8.0, built: Optional[List[Tuple[Any, Dict[str, Any]]]] = None) -> Dict[str, float]:
    """``probes``' whole training steps (forward, backward with collectives, optimizer, a closing
    barrier: :func:`_live_runner`, what the step residual is fitted over) on every candidate mesh
    of ``processes`` and chunk count 1 and 2, in a launch of their own (:func:`measure_all`: the
    slowest rank's wall per step, median over interleaved passes): label
    (:func:`~atp_pipeline.planning.compute_profile.step_label`) -> seconds: recorded at calibration,
    and timed again for the host's speed on the steps' basis (:func:`retime_steps`). ``built``: the
    probes as :func:`compose_models` composed them (composed here if None). Probe models only:
    never a model, batch or sequence length a user plans."""
    if processes < 2:
        raise ConfigError(f"probe steps: {processes} processes (the probes' steps need >= 2 to run collectives)")
    built = built or compose_models(probe_entries(probes), conf)
    live = plan_points([sh for sh, _ in built], processes, (1, 2))
    _, timed, _ = measure_all([], processes, passes, batch_ms, models=[spec for _, spec in built], live=live)
    return {step_label(probes[mi], (d1, d2), c, processes): t.wall for (mi, d1, d2, c), t in zip(live, timed)}


@dataclass(frozen=True)
class ProbeSteps:
    """The probe steps the host's speed on ``processes`` processes is timed over (the steps'
    basis): the labels the calibration recorded on the recorded count nearest them
    (:func:`~atp_pipeline.planning.compute_profile.steps_count`), the probes as
    :func:`compose_models` composed them, each label's plan (probe index, mesh, chunks), and the
    calibrated step model's own time for each label (:func:`probe_step_predictions` on the
    calibration's topology, at the calibration's speed)."""

    processes: int
    probes: Tuple[str, ...]
    built: Tuple[Tuple[Any, Dict[str, Any]], ...]
    labels: Tuple[str, ...]
    plans: Tuple[Plan, ...]
    model_s: Dict[str, float]

    def speed(self, now: Mapping[str, float], measured: str) -> HostSpeed:
        """The host's speed from the labels' steps ``now`` over the model's time for them."""
        return steps_speed(self.model_s, now, self.processes, measured)


def probe_steps(profile: ComputeProfile, processes: int, topo: Any, conf: Path = CONF) -> ProbeSteps:
    """The :class:`ProbeSteps` of ``profile`` (its reference's ``steps``) for ``processes``."""
    recorded = dict(profile.reference.get(STEPS_GROUP) or {})
    if not recorded:
        raise ConfigError(f"compute profile '{profile.name}': no probe steps in its reference (calibrated before "
                          f"run 45; calibrate again: python train.py stage=calibrate)")
    n = steps_count(recorded, processes)
    cells = [(label, *parse_step_label(label)) for label in sorted(recorded)]
    cells = [c for c in cells if c[4] == n]
    probes = sorted({probe for _, probe, _, _, _ in cells})
    built = compose_models(probe_entries(probes), conf)
    plans = [(probes.index(probe), mesh[0], mesh[1], c) for _, probe, mesh, c, _ in cells]
    model = probe_step_predictions(profile, topo, [shape for shape, _ in built], plans)
    return ProbeSteps(n, tuple(probes), tuple(built), tuple(c[0] for c in cells), tuple(plans),
                      {label: est.step_s for (label, *_), est in zip(cells, model)})


def retime_steps(profile: ComputeProfile, processes: int, topo: Any, conf: Path = CONF) -> HostSpeed:
    """The host's speed now on the steps' basis (:func:`~atp_pipeline.planning.compute_profile.steps_speed`):
    the probe steps the calibration recorded (its reference's ``steps``) on the recorded process
    count nearest ``processes`` (ties: the larger) timed again (:func:`time_probe_steps`), over the
    calibrated step model's own time for them (:func:`probe_steps`). The model was fitted to these probes'
    steps interleaved through the calibration's main launch, so the ratio carries the host's speed
    now against the calibration's whole launch, not against the one short launch that recorded the
    steps: that launch's own level read x0.78-1.39 the model's (runs 46-49, docs/step-time.md "Runs 47–49")."""
    ps = probe_steps(profile, processes, topo, conf)
    now = time_probe_steps(list(ps.probes), ps.processes, conf, built=list(ps.built))
    return ps.speed(now, utc_now())


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


def compose_models(entries: Sequence[Tuple[str, Sequence[str]]], conf: Path) -> List[Tuple[Any, Dict[str, Any]]]:
    """Per ``(name, overrides)`` (``overrides`` of the config: ``model=<config>``, then
    ``model.<key>=...``), the shape as the run resolves it and what a worker needs to build
    the model as training does (family, typed config, batch, sequence length, vocabulary)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from atp_pipeline.config import register_mesh_source, register_schemas
    from atp_pipeline.config.schema import ModelConfig
    from atp_pipeline.models.adapter import get_adapter

    register_schemas()
    register_mesh_source()
    out = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(conf.resolve())):
            for name, overrides in entries:
                base = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), None)
                if base is None or not (conf / "model" / f"{base}.yaml").is_file():
                    raise ConfigError(f"model '{name}': no model config '{base}' in {conf / 'model'}")
                try:
                    cfg = compose("config", overrides=[*overrides, f"model.name={name}"])
                except HydraException as exc:
                    raise ConfigError(f"model '{name}': {exc}") from None
                try:
                    shape = get_adapter(cfg.model.family).shape_from_config(cfg.model)  # as the run resolves it
                except ValueError as exc:
                    raise ConfigError(f"model '{name}': {exc}") from None
                typed = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                        OmegaConf.to_container(cfg.model, resolve=True))
                out.append((shape, {"family": str(typed.family), "model_config": typed, "batch": shape.batch_size,
                                    "seq_len": shape.seq_len, "vocab": shape.vocab_size}))
    finally:
        GlobalHydra.instance().clear()
    return out


def probe_entries(names: Sequence[str]) -> List[Tuple[str, Sequence[str]]]:
    """The :data:`PROBES` of ``names`` as :func:`compose_models` entries."""
    bad = [n for n in names if n not in PROBES]
    if bad:
        raise ConfigError(f"calibrate_compute: unknown probe(s) {', '.join(bad)} (one of {', '.join(PROBES)})")
    return [(n, PROBES[n]) for n in names]


@dataclass(frozen=True)
class ComputeRun:
    """What one compute calibration measures (:func:`calibrate_compute`)."""

    world: int
    probes: Tuple[str, ...] = tuple(PROBES)
    chunks: Tuple[int, ...] = (1, 2)
    passes: int = 3
    batch_ms: float = 8.0
    quick: bool = False  # a coarser kernel sweep (tests)
    framework: bool = True  # probes (framework cost), loops (sync), contention


def calibrate_compute(run: ComputeRun, topo: Any, name: str, conf: Path = CONF,
                      progress: Optional[Any] = None, probe_steps: Optional[Path] = None) -> ComputeProfile:
    """Measure and fit a compute profile for ``topo`` (its α-β prices the loops' collectives).
    ``progress(phase, done, total)``, if given, is called as measurements finish; ``probe_steps``:
    a JSON file to write the probes' whole steps to (:func:`probe_step_rows`)."""
    import tempfile
    import threading

    from atp_pipeline.run.hostload import wait_quiet

    kernels = sweep_kernels(run.quick)
    built = compose_models(probe_entries(run.probes), conf) if run.framework else []
    probe_names = list(run.probes) if run.framework else []  # (name ``shapes``, in order)
    shapes = [sh for sh, _ in built]
    plans = plan_points(shapes, run.world, run.chunks) if run.framework else []
    patterns = sync_patterns(run.world) if run.framework else []
    nsync = len(patterns)
    patterns += cpu_loops(run.world) if run.framework else []
    live = list(plans)  # the same probe steps with their collectives (their CPU: CollectiveCPU)
    total = (len(kernels) + len(plans) + len(patterns) + len(live)) * run.passes
    with tempfile.TemporaryDirectory() as tmp:
        tick = Path(tmp) / "progress"
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.5):
                try:
                    if progress is not None:
                        progress("kernels, probes, loops", min(total, int(tick.read_text() or 0)), total)
                except (OSError, ValueError):
                    pass
        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            if not run.quick:
                wait_quiet(20.0)  # other jobs' load: wait a while for a quiet host (then passes are checked)
            ref_timing = (1, 2.0) if run.quick else (REFERENCE_PASSES, REFERENCE_BATCH_MS)
            before = reference_probe(run.world, conf, *ref_timing)
            if progress is not None:
                progress("reference probe (before, after)", 1, 2)
            got, timed, foreign = measure_all(kernels, run.world, run.passes, run.batch_ms, plans=plans,
                                              models=[spec for _, spec in built], patterns=patterns,
                                              progress=str(tick), live=live)
        finally:
            done.set()
            watcher.join()
    if progress is not None:
        progress("kernels, probes, loops", total, total)
    contention = comm_contention = None
    if run.framework:
        contention, comm_contention = measure_contention(run.world, 2 * run.passes + 1, 4 * run.batch_ms)
        if progress is not None:
            progress("contention", 1, 1)
    # the probes' whole steps on the other process counts of the step residual (their own launch each;
    # a quick calibration: the world's only)
    live_wall = [t.wall for t in timed[len(kernels) + len(plans) + len(patterns):]]
    live_cpu = [t.cpu for t in timed[len(kernels) + len(plans) + len(patterns):]]
    live_at = [run.world] * len(live)
    for count in ([] if run.quick or not live else [c for c in residual_counts(run.world) if c != run.world]):
        extra = plan_points(shapes, count, run.chunks)
        _, timed_c, _ = measure_all([], count, run.passes, run.batch_ms, models=[spec for _, spec in built], live=extra)
        live, live_wall, live_at = [*live, *extra], [*live_wall, *(t.wall for t in timed_c)], [*live_at, *[count] * len(extra)]
        live_cpu = [*live_cpu, *(t.cpu for t in timed_c)]
        if progress is not None:
            progress(f"probe steps on {count} processes", 1, 1)
    nk, npl, npa = len(kernels), len(plans), len(patterns)
    # the collectives' backend CPU per call and byte, from the pure collective loops (no rank waits
    # for another's compute there; the probes' live steps stay the in-sample check below)
    collective_cpu = (fit_collective_cpu_loops(patterns, timed[nk + npl:nk + npl + npa])
                      if run.framework and run.world > 1 else None)
    # kernels and the probes' collective-free steps at a rank's CPU time (what the work costs a
    # core, whatever shares it); the loops at their wall time (their compute priced as the host runs it)
    cpu = [max(t.cpu, 1e-9) for t in timed]
    profile = make_profile(name, kernels, cpu[:nk], run.world, shapes, plans, cpu[nk:nk + npl], topo, patterns[:nsync],
                           got[nk + npl:nk + npl + nsync], contention, probe_names,
                           collective_cpu, kernel_time="cpu", comm_contention=comm_contention)
    # the host's speed at calibration: the reference probe before and after the measurements (the host's
    # speed moves by 10-30 % within a minute, docs/step_validation/diagnosis/e9.md), their geometric mean;
    # timed again wherever a prediction is made
    after = reference_probe(run.world, conf, *ref_timing)
    if progress is not None:
        progress("reference probe (before, after)", 2, 2)
    reference = {g: {k: math.sqrt(v * after[g][k]) for k, v in before[g].items()} for g in before}
    # and on the steps' basis (what stage=plan times again, run 45): two probes' whole steps on each
    # process count of the step residual, in launches of their own as they are timed again
    steps_probes = [p for p in RETIME_STEP_PROBES if p in probe_names]
    if steps_probes and run.world >= 2:
        counts = [run.world] if run.quick else residual_counts(run.world)
        reference[STEPS_GROUP] = {}
        for i, count in enumerate(counts):
            reference[STEPS_GROUP].update(time_probe_steps(steps_probes, count, conf, *((1, 2.0) if run.quick else ())))
            if progress is not None:
                progress("probe steps (the host's speed)", i + 1, len(counts))
    profile = dataclasses.replace(profile, reference=reference)
    load = f"; other jobs' load in its kept passes {statistics.median(foreign):.2f} cores" if foreign else ""
    if live and topo is not None and getattr(topo, "alpha_beta", None):
        # the step residual: the probes' whole steps against this profile's prediction of them (an
        # end-to-end check of the terms, and what they miss of a step, fitted from probes only)
        predicted = probe_step_predictions(profile, topo, shapes, live)
        residual = fit_residual([(e.compute_s, e.exposed_comm_s) for e in predicted], [e.cpu_s for e in predicted],
                                live_cpu, live_wall, live_at, [(d1, d2) for _, d1, d2, _ in live],
                                [c for _, _, _, c in live], [mi for mi, _, _, _ in live])
        extra_probes = probe_records(probe_names, shapes, [pl for pl, n in zip(live, live_at) if n != run.world],
                                     with_processes=True)
        profile = dataclasses.replace(profile, step_residual=residual, probes=profile.probes + extra_probes)
        final = probe_step_predictions(profile, topo, shapes, live)  # with the residual
        errs = probe_step_errors(final, live_wall)
        if probe_steps is not None:
            rows = probe_step_rows(probe_names, live, live_at, live_wall, live_cpu, predicted, final)
            probe_steps.write_text(json.dumps({"profile": name, "date": profile.date, "rows": rows}, indent=1) + "\n")
        raw = probe_step_errors(predicted, live_wall)
        ratio = {n: statistics.median(t / p.step_s for p, t, m in zip(predicted, live_wall, live_at) if m == n)
                 for n in sorted(set(live_at))}
        load += (f"; the probes' own training steps (collectives, optimizer, a closing barrier; in sample) measured "
                 f"{'/'.join(f'x{f:.3f} ({n} processes)' for n, f in ratio.items())} the terms' sum (median; "
                 f"error median {statistics.median(raw):.1%}, worst {max(raw):.1%}): the "
                 + residual.describe(source=False)
                 + f"; with it median error {statistics.median(errs):.1%}, worst {max(errs):.1%}") if residual is not None else ""
    return dataclasses.replace(profile, source=profile.source + load)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atp_pipeline.run.calibrate_compute",
                                description="Time a sweep of kernels, probe models and compute-then-collective "
                                            "loops on concurrent processes and write a compute profile into a "
                                            "topology (issue 27).")
    p.add_argument("--world", type=int, default=4, help="processes at once (training's), default 4")
    p.add_argument("--topology", default="local", help="topology to extend: a config name or a YAML path")
    p.add_argument("--name", default=None, help="name of the written topology (default: <topology>_compute)")
    p.add_argument("--probes", default=",".join(PROBES), help="probe models the framework cost is fitted from")
    p.add_argument("--chunks", default="1,2", help="chunk counts (§4.1) the probes run")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--batch-ms", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="a coarser kernel sweep")
    p.add_argument("--conf", type=Path, default=CONF)
    p.add_argument("--out", default=None, help="YAML path (default outputs/conf/topology/<name>.yaml)")
    p.add_argument("--kernels-only", action="store_true",
                   help="no framework cost (probes), synchronization (loops) or contention terms")
    args = p.parse_args(argv)
    from atp_pipeline.cli import EXIT_BAD_INPUT
    from atp_pipeline.topology.model import Topology

    try:
        if args.world < 1 or args.passes < 1 or not args.batch_ms > 0:
            raise ConfigError("calibrate_compute: --world and --passes must be >= 1, --batch-ms > 0")
        chunks = tuple(int(c) for c in args.chunks.split(","))
        if any(c < 1 for c in chunks):
            raise ConfigError(f"calibrate_compute: --chunks {args.chunks} must be positive integers")
        base, base_path = load_topology_yaml(args.topology, args.conf)
        topo = Topology.from_config(base)
        if topo.world_size != args.world:
            raise ConfigError(f"calibrate_compute: topology '{topo.name}' has {topo.world_size} devices, "
                              f"--world is {args.world}")
        run = ComputeRun(args.world, tuple(x for x in args.probes.split(",") if x), chunks, args.passes,
                         args.batch_ms, args.quick, not args.kernels_only)
        probe_entries(run.probes)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    name = args.name or f"{base['name']}_compute"
    t0 = time.perf_counter()
    profile = calibrate_compute(run, topo, name, args.conf)
    print_profile(profile)
    out_cfg = dict(base)
    out_cfg["name"] = name
    out_cfg["device"] = {**(base.get("device") or {}), "compute": profile.to_config()}
    out = Path(args.out) if args.out else Path("outputs/conf/topology") / f"{name}.yaml"
    from atp_pipeline.planning.alphabeta_fit import write_topology

    write_topology(out_cfg, out, f"# {base_path} with device.compute measured by `python -m "
                                 f"atp_pipeline.run.calibrate_compute {' '.join(sys.argv[1:] if argv is None else argv)}`"
                                 f"\n# (issue 27: the step-time model's compute profile)\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f} s)")
    return 0


def print_profile(profile: ComputeProfile) -> None:
    """The fitted terms, one line each."""
    grids = profile.kernel_grids()
    for kind, f in profile.fits.items():
        grid = grids.get(kind)
        print(f"  {kind:<14} alpha {f.alpha_s * 1e6:8.1f} us  {f.per_unit_s * 1e9:9.4f} ns/unit"
              + (f"  {f.per_tensor_s * 1e6:.1f} us/tensor" if f.per_tensor_s else "")
              + (f"  (priced on its grid of {len(grid[1])} measured cores, "
                 f"{' x '.join(str(len(a)) for a in grid[0])})" if grid else ""))
    print(f"  peak GEMM throughput {profile.peak_flops / 1e9:.2f} GFLOP/s per process")
    print(f"  {profile.describe(profile.processes)}")
    if profile.contention:
        print("  contention: " + ", ".join(f"{p} processes x{c:.2f}" for p, c in sorted(profile.contention.items())))
    if profile.comm_contention:
        print("  collectives' contention: " + ", ".join(f"{p} processes x{c:.2f}"
                                                       for p, c in sorted(profile.comm_contention.items())))
    check = profile.source.partition("; the probes' own ")[2]
    if check:
        print(f"  the probes' own {check}")


if __name__ == "__main__":
    raise SystemExit(main())
