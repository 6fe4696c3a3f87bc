"""Calibrate the alpha-beta model on this machine and write a topology (AutoDDL §3.2).

    python -m atp_pipeline.run.calibrate --world 4 --name calib_local
    python train.py 'hydra.searchpath=[atpmesh://,file://'$PWD'/outputs/conf]' topology=calib_local stage=plan

The measuring half of calibration: this module runs collectives on processes; the fit, its
quality check and the written topology are :mod:`atp_pipeline.planning.alphabeta_fit` (pure).

**Measure.** One launch of ``--world`` processes (:func:`atp_pipeline.launch.spawn`,
gloo) runs the four collectives of Table 2 — all-reduce, all-gather, reduce-scatter and
all-to-all — for every message size of ``--sizes`` and every group layout ``(size,
stride)`` that tiles the world (group sizes 2 … world, consecutive and strided ranks).
All groups of a layout run at once, as the groups of one mesh dimension do in a training
step, so the measurement includes their sharing of the links. Each measurement is
preceded by ``--warmup`` untimed calls; then ``--passes`` timed batches, interleaved over
all measurements (so a burst of load on a shared machine hits every point alike), each
batch ``k`` back-to-back calls (``k`` chosen from the warm-up so a batch lasts about
``--batch-ms``). A batch's time is the median over ranks of each rank's elapsed time / k,
and a point's time the median over passes.

**Fit** (:func:`atp_pipeline.planning.alphabeta_fit.fit_calibration`): α and β per level by
least squares, per collective and as the paper's one pair, 25 % of the points held out to
report the fit's median relative error (criterion ≤ 25 %).

**Output.** A topology config (default ``outputs/conf/topology/<name>.yaml``; ``--out``
anywhere, e.g. ``conf/topology/<name>.yaml``) with the fitted bandwidths and ``alpha_beta:``
per level and collective, and a report (``--report-dir``, default
``outputs/calibration``): ``<name>.json`` (every point, both fits, the errors),
``<name>_points.csv`` and ``<name>_fit.png`` (predicted vs measured time).
``--samples <name>.json`` refits the points of an earlier report without measuring.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.alphabeta import Collective
from atp_pipeline.planning.alphabeta_fit import (
    COLLECTIVES,
    CalibrationResult,
    LevelSpec,
    Sample,
    fit_calibration,
    level_specs,
    load_samples,
    print_summary,
    write_report,
    write_topology,
)

DEFAULT_SIZES = tuple(4**k * 4096 for k in range(6))  # 4 KiB ... 4 MiB
ELEMENT_BYTES = 4  # float32 buffers


# ------------------------------------------------------------------------ the sweep
@dataclass(frozen=True)
class SweepSpec:
    """What one calibration launch measures (see the module docstring)."""

    world: int
    sizes: Tuple[int, ...] = DEFAULT_SIZES
    layouts: Tuple[Tuple[int, int], ...] = ()  # (size, stride); default: all that tile the world
    collectives: Tuple[Collective, ...] = COLLECTIVES
    warmup: int = 2
    passes: int = 7
    batch_ms: float = 25.0
    max_batch: int = 16

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ConfigError(f"calibrate: --world must be >= 2 processes, got {self.world}")
        if not self.sizes or any(s < ELEMENT_BYTES for s in self.sizes):
            raise ConfigError(f"calibrate: --sizes must be byte counts >= {ELEMENT_BYTES}, "
                              f"got {list(self.sizes)}")
        if self.passes < 1 or self.warmup < 0 or self.max_batch < 1:
            raise ConfigError("calibrate: --passes and --max-batch must be >= 1, --warmup >= 0")
        for size, stride in self.layouts:
            if size < 2 or stride < 1 or self.world % (size * stride):
                raise ConfigError(f"calibrate: group layout {size}x{stride} (size x stride) does not "
                                  f"tile {self.world} processes")

    def group_layouts(self) -> Tuple[Tuple[int, int], ...]:
        return self.layouts or default_layouts(self.world)


def default_layouts(world: int) -> Tuple[Tuple[int, int], ...]:
    """Every ``(size, stride)`` with ``size >= 2`` whose groups tile ``world`` ranks."""
    return tuple((g, s) for g in range(2, world + 1) for s in range(1, world // g + 1)
                 if world % (g * s) == 0)


def layout_groups(world: int, size: int, stride: int) -> List[List[int]]:
    """The concurrent groups of a layout: blocks of ``size·stride`` consecutive ranks, in
    each block the ``stride`` groups ``{o, o+stride, …}`` (row-major mesh dimension)."""
    span = size * stride
    return [[b + o + k * stride for k in range(size)]
            for b in range(0, world, span) for o in range(stride)]


def elements(size: int, nbytes: int) -> int:
    """Float32 elements of Table 2's N (``nbytes``), rounded to a multiple of the group size."""
    return max(size, (nbytes // ELEMENT_BYTES) // size * size)


# ------------------------------------------------------------------------ measurement
def make_groups(world: int, rank: int, layouts: Sequence[Tuple[int, int]]) -> Dict[Tuple[int, int], Any]:
    """Create the process groups of every layout (collectively, same order on every rank);
    returns this rank's group per layout."""
    import torch.distributed as dist

    mine: Dict[Tuple[int, int], Any] = {}
    for size, stride in layouts:
        for ranks in layout_groups(world, size, stride):
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[(size, stride)] = g
    return mine


def collective_call(c: Collective, size: int, n: int, group: Any):
    """A closure running collective ``c`` on ``group`` with Table 2's ``N = n`` elements."""
    import torch
    import torch.distributed as dist

    full = torch.ones(n)
    part = torch.ones(n // size)
    if c is Collective.all_reduce:
        return lambda: dist.all_reduce(full, group=group)
    if c is Collective.all_gather:
        return lambda: dist.all_gather_single(full, part, group=group)
    if c is Collective.reduce_scatter:
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    if c is Collective.all_to_all:
        out = torch.empty(n)
        return lambda: dist.all_to_all_single(out, full, group=group)
    raise ConfigError(f"calibrate: unknown collective {c}")


def timed_batches(rank: int, jobs: Sequence[Any], warmup: int, passes: int, batch_ms: float,
                  max_batch: int) -> List[List[float]]:
    """Run every job (a list of zero-argument calls run back to back) ``passes`` times,
    interleaved, after ``warmup`` untimed runs; returns per job this rank's seconds per run.
    A pass during which other jobs loaded the host is run again (at most ``passes`` more;
    :func:`atp_pipeline.run.hostload.quiet_rounds`).

    All ranks call this with the same jobs. Before each timed batch the whole world passes
    a barrier; the batch repeats the job ``k`` times (``k`` from the slowest rank's
    warm-up time, the same on every rank).
    """
    import torch
    import torch.distributed as dist

    reps: List[int] = []
    for job in jobs:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            for call in job:
                call()
        t = torch.tensor([(time.perf_counter() - t0) / max(1, warmup)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        reps.append(int(min(max_batch, max(1, round(batch_ms * 1e-3 / max(float(t), 1e-9))))))
    from atp_pipeline.run.hostload import quiet_rounds

    order = list(range(len(jobs)))

    def one_pass(p: int) -> List[float]:
        row = [0.0] * len(jobs)
        shift = (p * 7919) % len(jobs)  # a different interleaving each pass
        for j in order[shift:] + order[:shift]:
            job, k = jobs[j], reps[j]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                for call in job:
                    call()
            row[j] = (time.perf_counter() - t0) / k
        return row
    rows, _ = quiet_rounds(passes, passes, one_pass)  # a pass other jobs loaded the host in is measured again
    return [[row[j] for row in rows] for j in range(len(jobs))]


def _sweep_worker(rank: int, world: int, spec: SweepSpec) -> List[List[float]]:
    groups = make_groups(world, rank, spec.group_layouts())
    jobs = []
    for size, stride in spec.group_layouts():
        for c in spec.collectives:
            for nbytes in spec.sizes:
                jobs.append([collective_call(c, size, elements(size, nbytes), groups[(size, stride)])])
    return timed_batches(rank, jobs, spec.warmup, spec.passes, spec.batch_ms, spec.max_batch)


def measure(spec: SweepSpec, timeout: float = 900.0) -> List[Sample]:
    """Run the sweep on ``spec.world`` gloo processes (one launch) and return its points."""
    from atp_pipeline.launch import spawn

    per_rank = spawn(_sweep_worker, spec.world, spec, timeout=timeout)
    stats = combine(per_rank)
    samples, i = [], 0
    for size, stride in spec.group_layouts():
        for c in spec.collectives:
            for nbytes in spec.sizes:
                n = elements(size, nbytes)
                samples.append(Sample(c, size, stride, n * ELEMENT_BYTES,
                                      statistics.median(stats[i]), stats[i]))
                i += 1
    return samples


def _schedule_worker(rank: int, world: int, layouts: Sequence[Tuple[int, int]],
                     jobs: Sequence[Sequence[Tuple[str, int, int, int]]], warmup: int, passes: int,
                     batch_ms: float, max_batch: int) -> List[List[float]]:
    groups = make_groups(world, rank, layouts)
    built = [[collective_call(Collective(c), size, n, groups[(size, stride)])
              for c, size, stride, n in job] for job in jobs]
    return timed_batches(rank, built, warmup, passes, batch_ms, max_batch)


def measure_schedules(world: int, schedules: Sequence[Sequence[Any]], warmup: int = 1,
                      passes: int = 7, batch_ms: float = 0.0, max_batch: int = 1,
                      timeout: float = 900.0) -> List[Tuple[float, Tuple[float, ...]]]:
    """Seconds of each schedule — a list of
    :class:`~atp_pipeline.planning.sbp.schedule.CollectiveCall` run back to back, each call
    ``times`` times on all groups of its layout at once — on ``world`` gloo processes (one
    launch): (median over passes of the median over ranks, the passes)."""
    from atp_pipeline.launch import spawn

    layouts = sorted({(c.size, c.stride) for sch in schedules for c in sch})
    jobs = [[(c.collective.value, c.size, c.stride, elements(c.size, int(c.nbytes)))
             for c in sch for _ in range(c.times)] for sch in schedules]
    per_rank = spawn(_schedule_worker, world, layouts, jobs, warmup, passes, batch_ms, max_batch,
                     timeout=timeout)
    return [(statistics.median(runs), runs) for runs in combine(per_rank)]


def combine(per_rank: Sequence[Sequence[Sequence[float]]]) -> List[Tuple[float, ...]]:
    """Per job and pass: the median over ranks of their seconds per call."""
    return [tuple(statistics.median(r[j][p] for r in per_rank) for p in range(len(per_rank[0][j])))
            for j in range(len(per_rank[0]))]


def calibrate(spec: SweepSpec, name: str, levels: Sequence[LevelSpec], seed: int = 0,
              samples: Optional[List[Sample]] = None) -> CalibrationResult:
    """Measure (unless ``samples`` are given), fit, evaluate on held-out points
    (:func:`~atp_pipeline.planning.alphabeta_fit.fit_calibration`)."""
    t0 = time.perf_counter()
    if samples is None:
        samples = measure(spec)
    res = fit_calibration(samples, name, levels, seed=seed)
    res.seconds = time.perf_counter() - t0
    return res


def parse_sizes(text: str) -> Tuple[int, ...]:
    """``4096,65536`` or ``4K:4M`` (powers of 4 between); suffixes K, M (2^10, 2^20)."""
    def one(x: str) -> int:
        x = x.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(x[-1:], 1)
        return int(float(x[:-1] if mult > 1 else x) * mult)

    try:
        if ":" in text:
            lo, hi = (one(x) for x in text.split(":"))
            out, s = [], lo
            while s <= hi:
                out.append(s)
                s *= 4
            return tuple(out)
        return tuple(one(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"calibrate: --sizes '{text}' is not a list of byte counts "
                          f"(e.g. 4K:4M or 4096,65536)") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atp_pipeline.run.calibrate",
        description="Measure all-reduce/all-gather/reduce-scatter/all-to-all on gloo processes, "
                    "fit alpha and beta per level (AutoDDL §3.2) and write a topology config.")
    parser.add_argument("--world", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--name", default="calib_local", help="topology name (default calib_local)")
    parser.add_argument("--out", default=None,
                        help="topology YAML (default outputs/conf/topology/<name>.yaml)")
    parser.add_argument("--report-dir", default="outputs/calibration",
                        help="JSON/CSV/plot directory (default outputs/calibration)")
    parser.add_argument("--levels", default=None,
                        help="level counts outermost first, product = world (default: one level)")
    parser.add_argument("--level-names", default=None, help="names of the levels (comma-separated)")
    parser.add_argument("--sizes", default="4K:4M", help="message bytes: 4K:4M (powers of 4) or a list")
    parser.add_argument("--passes", type=int, default=7, help="timed passes per point (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per point")
    parser.add_argument("--batch-ms", type=float, default=25.0, help="target length of a timed batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the 25%% held-out split")
    parser.add_argument("--samples", default=None,
                        help="refit the points of an earlier report (<name>.json) instead of measuring")
    args = parser.parse_args(argv)
    from atp_pipeline.cli import EXIT_BAD_INPUT

    try:
        counts = [int(x) for x in args.levels.split(",")] if args.levels else [args.world]
        names = args.level_names.split(",") if args.level_names else None
        levels = level_specs(args.world, counts, names)
        spec = SweepSpec(world=args.world, sizes=parse_sizes(args.sizes), passes=args.passes,
                         warmup=args.warmup, batch_ms=args.batch_ms)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    try:
        samples = load_samples(Path(args.samples)) if args.samples else None
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    if samples is None:
        print(f"calibrating: {args.world} gloo processes, {len(spec.group_layouts())} group layouts "
              f"(size x stride: {', '.join(f'{g}x{s}' for g, s in spec.group_layouts())}), "
              f"{len(spec.sizes)} sizes {spec.sizes[0]}..{spec.sizes[-1]} B, 4 collectives, "
              f"{spec.passes} passes")
    else:
        print(f"refitting {len(samples)} measured points from {args.samples}")
    res = calibrate(spec, args.name, levels, seed=args.seed, samples=samples)
    print_summary(res)
    out = Path(args.out) if args.out else Path("outputs/conf/topology") / f"{args.name}.yaml"
    header = (f"# Calibrated by `python -m atp_pipeline.run.calibrate "
              f"{' '.join(sys.argv[1:] if argv is None else argv)}` (AutoDDL §3.2).\n"
              f"# levels: p2p/group GB/s = the fitted all-reduce bus bandwidth 1/beta (ATP Eq. 3);\n"
              f"# alpha_beta: fitted alpha (us) and 1/beta (GB/s) per level and collective (Table 2).\n")
    write_topology(res.topology, out, header)
    paths = write_report(res, Path(args.report_dir), args.name)
    search_dir = out.parent.parent.resolve()
    print(f"wrote {out} ({res.seconds:.1f} s); report {', '.join(str(p) for p in paths.values())}")
    print(f"use it: python train.py 'hydra.searchpath=[atpmesh://,file://{search_dir}]' "
          f"topology={args.name} stage=plan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
