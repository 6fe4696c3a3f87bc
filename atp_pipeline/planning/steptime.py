"""The step a user pays: compute + exposed communication per candidate plan.

Eq. 2–4 rank meshes by communication alone; this model predicts the whole training step of
one tensor-parallel replica on ``DeviceMesh(d1, d2)`` and what it adds up to. One rank's
program (:mod:`~atp_pipeline.planning.step_program`: every local kernel at its local shape and
every collective of the runtime cost model, :func:`atp_pipeline.planning.cost.comm_terms` with
``cost_model=runtime``, placed where the runtime sends it) runs on a timeline (:func:`simulate`):

* **compute** advances the clock: each kernel's time from the
  :class:`~atp_pipeline.planning.compute_profile.ComputeProfile` (calibrated by ``python train.py
  stage=calibrate``, or derived from the device's datasheet) with the runtime's framework cost;
* **a collective** lasts the topology's fitted α-β for its kind and level (AutoDDL §3.2), else
  Eq. 3–4's bandwidths (:mod:`~atp_pipeline.planning.comm_clock`), plus the sync cost of ranks
  sharing cores; collectives on one mesh dimension run one after another;
* **overlap as the runtime does it**: the forward runs ``chunks`` pieces of the batch as a
  wavefront over a block's stages (§4.1, Figure 8), a chunk waiting for its collective only when
  its next stage starts; in the backward each linear's input-gradient all-reduce runs while its
  weight-gradient GEMM computes (§4.2); a collective in flight takes ``1 - hidden`` of the compute
  it overlaps. Then the optimizer and, with ``dp > 1``, the data-parallel gradient sync under the
  aggregation mode (:mod:`atp_pipeline.planning.gradsync`, not overlapped).

The profile gives every factor of a run of ``P`` processes at once
(:meth:`~atp_pipeline.planning.compute_profile.ComputeProfile.at_processes`): with more
processes than cores the step is the larger of the rank's timeline and every rank's CPU over the
cores (``host_bound``). Then the profile's step residual
(:meth:`~atp_pipeline.planning.compute_profile.ComputeProfile.residual_seconds`: what the probe
models' own steps took beyond the terms' sum) gives the whole step; ``residual_s`` is the
difference. ``exposed = step - compute - residual`` is the communication the user pays;
``total_comm`` is what Eq. 2-style sums would charge. Tokens/s and model FLOPs utilization
(MFU: the model's FLOPs of §5 over step time × devices × the profile's peak) follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from atp_pipeline.errors import ConfigError
from atp_pipeline.planning.comm_clock import CommClock
from atp_pipeline.planning.compute_profile import ComputeProfile
from atp_pipeline.planning.kernels import OPTIMIZER, Kernel
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.planning.step_program import Coll, Item, Program, build_program, stages
from atp_pipeline.topology.model import Topology

Mesh = Tuple[int, int]
# a collective in flight: start, end, end of its real transfer, dimension, its backend's CPU
Flight = Tuple[float, float, float, int, float]


@dataclass
class _Timeline:
    clock: CommClock
    profile: ComputeProfile
    q: int
    scale: float = 1.0  # the factor of the profile's kernel times on this rank's timeline
    sync_scale: float = 1.0  # the factor of its sync term (a collective's extra)
    skew: bool = True  # ranks reach a collective apart by a share of the compute before it (they share cores)
    now: float = 0.0
    compute: float = 0.0
    comm_total: float = 0.0
    dispatch: float = 0.0  # framework cost around the kernels and collectives (in ``compute``)
    sync: float = 0.0  # the host's synchronization cost added to collectives (in ``comm_total``)
    optimizer: float = 0.0  # (in ``compute``)
    coll_cpu: float = 0.0  # CPU the rank keeps busy while it waits in collectives (not in ``compute``)
    since: float = 0.0  # compute since this rank's previous collective
    launches: int = 0  # collectives launched that moved bytes
    link_free: Dict[int, float] = field(default_factory=dict)

    def launch(self, c: Coll) -> Flight:
        """Start a collective now (after the ones in flight on its dimension); ``(start, end,
        end of its real transfer, its dimension, its backend's CPU)`` (an emulated link's
        remaining time is a sleep)."""
        nbytes = float(c.elements) * self.q
        bare = self.clock.seconds(c.term.collective, c.term.dim, nbytes)
        dur = real = bare
        cpu = 0.0
        if bare > 0:
            self.framework(self.scale * self.profile.collective_framework_seconds(nbytes))  # before launch
            extra = self.sync_scale * self.profile.sync_seconds(self.since if self.skew else 0.0)
            dur = self.clock.seconds(c.term.collective, c.term.dim, nbytes, extra)
            real = (self.clock.unemulated_seconds(c.term.collective, c.term.dim, nbytes) + extra
                    if self.clock.emulated is not None else dur)
            self.sync += dur - bare
            self.since = 0.0
            self.launches += 1
            if self.profile.collective_cpu is not None:  # its backend's CPU (in the transfer's time)
                d1, d2 = self.clock.mesh
                cpu = self.scale * self.profile.collective_cpu.call_seconds(d1 if c.term.dim == 1 else d2, nbytes)
                self.coll_cpu += cpu
        start = max(self.now, self.link_free.get(c.term.dim, 0.0))
        end = start + dur
        self.link_free[c.term.dim] = end
        self.comm_total += dur
        return start, end, start + real, c.term.dim, cpu

    def framework(self, seconds: float) -> None:
        """The runtime's own CPU work outside any kernel (around a collective's launch, the step's
        parameter reads): the rank's compute, all of it framework cost."""
        self.now += seconds
        self.compute += seconds
        self.dispatch += seconds
        self.since += seconds

    def run(self, items: Sequence[Item], pending: List[Flight]) -> None:
        joined: List[Flight] = []
        for item in items:
            tag = item[0]
            if tag == "k":
                k: Kernel = item[1]
                dt = self.scale * self.profile.step_kernel_seconds(k)
                if k.kind == OPTIMIZER:
                    self.optimizer += dt
                else:
                    self.dispatch += dt - self.scale * self.profile.seconds(k)
                self.now += dt
                self.compute += dt
                self.since += dt
            elif tag == "sync":
                end = self.launch(item[1])[1]
                self.waited(item[1].term.dim, end - self.now)
                self.now = max(self.now, end)
            elif tag == "async":
                pending.append(self.launch(item[1]))
            elif tag == "linear":
                joined.append(self.launch(item[1]))
            elif tag == "join":
                self.wait(joined)
            else:  # pragma: no cover - the builders emit only the tags above
                raise ValueError(f"unknown schedule item {tag!r}")

    def wait(self, pending: List[Flight]) -> None:
        """Wait for collectives in flight (:data:`Flight`): the compute that ran during a real
        transfer is late by the share of that overlap the transfer took from it (:meth:`stolen`;
        its backend's CPU spread over the transfer besides); the clock moves to that or the last end."""
        if pending:
            steal = sum(self.stolen(d, cpu, r - i) * max(0.0, min(self.now, r) - i) for i, _, r, d, cpu in pending)
            last = max(self.now, *(e for _, e, _, _, _ in pending))
            now = max(self.now + steal, last)
            self.sync += now - last
            self.comm_total += now - last
            self.waited(max(pending, key=lambda p: p[1])[3], now - self.now)
            self.now = now
            pending.clear()

    def stolen(self, dim: int, cpu: float = 0.0, transfer: float = 0.0) -> float:
        """The share of a collective's overlap with compute that the compute loses. Where the
        profile has the collective-during-compute loops' hidden share (:class:`SyncFit`), ``1 -
        hidden``: on a CPU host a transfer in flight is the backends' work on the ranks' own
        cores, and those loops time exactly how much of it compute hides (its backend CPU
        ``cpu`` over the ``transfer``'s seconds is within it). Else that backend CPU spread over
        the transfer plus the share of a core a collective keeps busy (:class:`CollectiveCPU`)."""
        if self.profile.sync is not None or self.profile.collective_cpu is None:
            return 1.0 - self.profile.hidden
        d1, d2 = self.clock.mesh
        return min(1.0, self.profile.collective_busy(d1 if dim == 1 else d2)
                   + (cpu / transfer if transfer > 0 else 0.0))

    def waited(self, dim: int, seconds: float) -> None:
        """The rank waits ``seconds`` in a collective on ``dim``: the CPU its backend keeps busy meanwhile."""
        if seconds > 0:
            d1, d2 = self.clock.mesh
            self.coll_cpu += seconds * self.profile.collective_busy(d1 if dim == 1 else d2)


def _round_robin(tl: "_Timeline", stages: List[List[List[Item]]]) -> None:
    """Chunks' stages (``stages[chunk][stage]``) as the runtime's wavefront runs them: chunks
    take turns stage by stage; a chunk waits for its collectives in flight when its turn comes."""
    pending: List[List[Flight]] = [[] for _ in stages]
    for st in range(max(len(s) for s in stages)):
        for c, chunk in enumerate(stages):
            if st < len(chunk):
                tl.wait(pending[c])
                tl.run(chunk[st], pending[c])
    for p in pending:
        tl.wait(p)


#: the timeline's running totals: a repeated block adds the same to each
_TOTALS = ("now", "compute", "comm_total", "dispatch", "sync", "optimizer", "coll_cpu")


def _blocks(tl: "_Timeline", layers: List[List[List[Item]]]) -> None:
    """Run the blocks ``layers`` (``[layer][chunk]``) one after another. A block ends with every
    collective it launched waited for, so the next one starts from the same state but for the
    compute since the last collective (``since``, the sync skew's): a run of the *same* block
    (one object, :func:`~atp_pipeline.planning.step_program.build_program`) repeats the second
    one's additions exactly, and is added, not simulated, after two."""
    i = 0
    while i < len(layers):
        layer = layers[i]
        run = 1
        while i + run < len(layers) and layers[i + run] is layer:
            run += 1
        staged = [stages(items) for items in layer]
        _round_robin(tl, staged)
        if run > 1:
            before = {k: getattr(tl, k) for k in _TOTALS}
            since, launches = tl.since, tl.launches
            _round_robin(tl, staged)
            if run > 2:
                more = run - 2
                step = {k: getattr(tl, k) - before[k] for k in _TOTALS}
                for k in _TOTALS:
                    setattr(tl, k, getattr(tl, k) + more * step[k])
                tl.link_free = {d: t + more * step["now"] for d, t in tl.link_free.items()}
                if tl.launches == launches:  # no collective: the compute since the last one grows on
                    tl.since += more * (tl.since - since)
        i += run


def simulate(prog: Program, clock: CommClock, profile: ComputeProfile, bytes_per_element: int,
             scale: float = 1.0) -> Tuple[float, float, float]:
    """``(step, compute, total communication)`` seconds of one rank's program: the forward
    of each block as :mod:`~atp_pipeline.parallel.overlap` runs it (chunks take turns stage by
    stage, a stage ending where its chunk launches a collective, which the chunk waits for when
    its turn comes again), each block's backward the same way over the chunks' separate graphs
    (a backward stage also ends after a linear's weight gradient, its input-gradient
    all-reduce in flight, §4.2). ``scale``: the profile's contention factor (every calibrated time)."""
    tl = _run(prog, clock, profile, bytes_per_element, scale)
    return tl.now, tl.compute, tl.comm_total


def _run(prog: Program, clock: CommClock, profile: ComputeProfile, bytes_per_element: int,
         scale: float = 1.0, sync_scale: Optional[float] = None, skew: bool = True) -> "_Timeline":
    tl = _Timeline(clock, profile, bytes_per_element, scale, sync_scale=scale if sync_scale is None else sync_scale,
                   skew=skew)
    tl.framework(scale * profile.read_seconds(prog.reads))  # the step's sharded parameter reads (Framework.per_read_s)
    tl.run(prog.pre, [])
    _blocks(tl, prog.blocks_fwd)
    tl.run(prog.post_fwd, [])
    tl.run(prog.post_bwd, [])
    _blocks(tl, prog.blocks_bwd[::-1])  # each chunk's backward of the block, chunks taking turns too
    tl.run(prog.pre_bwd, [])
    tl.run(prog.tail, [])
    return tl


# ----------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class StepSetting:
    """What the step runs besides the mesh: §4.1 chunks, data-parallel replicas and the
    aggregation mode of their gradient sync."""

    chunks: int = 1
    dp: int = 1
    aggregation: str = "ring"
    world: Optional[Topology] = None  # the topology of all dp replicas (their gradient sync)
    fsdp: bool = False  # parameters, gradients, optimizer state sharded over dp (memory)

    def __post_init__(self) -> None:
        if self.chunks < 1 or self.dp < 1:
            raise ConfigError(f"step model: chunks and dp must be >= 1, got chunks={self.chunks}, dp={self.dp}")


@dataclass(frozen=True)
class StepEstimate:
    """Predicted step of one candidate: ``step_s = compute_s + exposed_comm_s + gradsync_s + residual_s``."""

    step_s: float
    compute_s: float
    exposed_comm_s: float  # tensor-parallel communication not hidden behind compute
    total_comm_s: float  # every tensor-parallel collective's duration, summed
    gradsync_s: float
    tokens_per_s: float
    mfu: Optional[float]
    profile: str  # which compute calibration
    comm_source: str
    dispatch_s: float = 0.0  # of compute_s: the runtime's framework cost around the kernels
    optimizer_s: float = 0.0  # of compute_s
    sync_s: float = 0.0  # of total_comm_s: the host's synchronization cost of the collectives
    calibration: str = ""  # which calibrated terms the prediction used
    cpu_s: float = 0.0  # one rank's CPU in the step (its compute and its collectives' CPU)
    host_bound: bool = False  # the step is every rank's CPU over the host's cores (more processes than cores)
    timeline_s: float = 0.0  # the rank's own timeline (compute at a core's speed, the exposed collectives)
    residual_s: float = 0.0  # of step_s: the step beyond the terms' sum (the profile's StepResidual)
    coll_cpu_s: float = 0.0  # of cpu_s: its collectives' backend CPU (CollectiveCPU)

    def to_dict(self) -> Dict[str, Any]:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "total_comm_s": self.total_comm_s, "gradsync_s": self.gradsync_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "profile": self.profile,
                "comm_source": self.comm_source, "dispatch_s": self.dispatch_s, "optimizer_s": self.optimizer_s,
                "sync_s": self.sync_s, "calibration": self.calibration, "cpu_s": self.cpu_s,
                "host_bound": self.host_bound, "timeline_s": self.timeline_s, "residual_s": self.residual_s,
                "coll_cpu_s": self.coll_cpu_s}


def estimate_step(topo: Topology, shape: ModelShape, mesh: Mesh, setting: StepSetting,
                  profile: ComputeProfile, emulated: Optional[Tuple[Topology, float]] = None,
                  gradsync_s: float = 0.0) -> StepEstimate:
    """The predicted step of ``shape`` on ``mesh`` of ``topo`` (one replica of ``setting.dp``;
    its local batch is ``batch_size / dp``); ``gradsync_s`` is the data-parallel sync to add."""
    if shape.batch_size % setting.dp:
        raise ConfigError(f"step model: batch {shape.batch_size} does not split over dp={setting.dp}")
    batch = shape.batch_size // setting.dp
    prog, _ = build_program(shape, mesh, batch, setting.chunks)
    processes = mesh[0] * mesh[1] * setting.dp  # on one host: what the contention factors are for
    at = profile.at_processes(processes)
    clock = CommClock(topo, mesh, shape.bytes_per_element, emulated, at.comm)
    tl = _run(prog, clock, profile, shape.bytes_per_element, at.timeline, at.sync, at.skew)
    cpu = tl.compute + tl.coll_cpu
    path, compute = tl.now, tl.compute
    host_bound = False
    if at.oversubscribed:
        # more ranks than cores: a rank's compute runs at the speed of a core to itself while other
        # ranks wait in collectives (its timeline above), and the step is no less than every rank's
        # CPU over the cores (``host``: processes / cores for a CPU-priced profile)
        cores_s = cpu * at.host
        if cores_s > path:
            # its compute: the timeline's and the kernels' share of the CPU beyond the timeline
            # (``tl.compute / cpu``), so that the compute / exposed split the step residual's terms
            # form scales runs on continuously where the bound takes over
            compute = tl.compute + (cores_s - tl.now) * (tl.compute / cpu if cpu > 0 else 0.0)
            path, host_bound = cores_s, True
    # what the terms' sum misses of a whole step (closing barrier, run queue, ...), as the probes'
    # own steps measured it at the calibration
    residual = profile.residual_seconds(processes, mesh, setting.chunks, path, compute, cpu)
    step = path + residual + gradsync_s
    devices = mesh[0] * mesh[1] * setting.dp
    mfu = shape.flops_per_step / (step * devices * profile.peak_flops) if profile.peak_flops > 0 else None
    return StepEstimate(step, compute, step - compute - gradsync_s - residual, tl.comm_total, gradsync_s,
                        shape.tokens_per_step / step, mfu, profile.name, clock.source, tl.dispatch, tl.optimizer,
                        tl.sync, profile.describe(processes), cpu, host_bound, tl.now, residual, tl.coll_cpu)
