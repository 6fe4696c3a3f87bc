"""Dataclass schemas of every config group, registered in Hydra's ConfigStore.

The root schema (:class:`Config`) is the first entry of ``conf/config.yaml``'s defaults
list, so *every* option of every group — including a user's own topology file added with
``hydra.searchpath`` — merges into a typed node: a misspelled key, a wrong type or an
invalid enum value fails at compose time, naming the key.

The schemas are the single description of the options. Each group checks its own values
when it is instantiated (``__post_init__``): a count that must be positive, a probability in
[0, 1), a duration > 0 — one :class:`~atp_pipeline.errors.ConfigError` line naming the key.
OmegaConf merges overrides into the typed nodes without instantiating them, so
:func:`typed` (called by ``train.py`` right after composition, and by
:func:`atp_pipeline.run.resolve.resolve`) instantiates every group, running those checks
before anything else happens. Checks that relate several groups (a mesh that fits the
world, chunks that divide the batch) run once, when the run is resolved
(:mod:`atp_pipeline.run.resolve`). Importing this module does not import Hydra:
:func:`register_schemas` (called by ``train.py``) does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from atp_pipeline.errors import ConfigError, describe_omegaconf


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at_least(obj: Any, group: str, low: float, *keys: str) -> None:
    """Each of ``keys`` of ``obj`` (a number, or ``None`` where the field is optional) is
    ``>= low``; else one line naming ``<group>.<key>``."""
    for key in keys:
        value = getattr(obj, key)
        if _number(value) and value < low:
            raise ConfigError(f"{group}.{key}={value} must be >= {low:g}")


def above(obj: Any, group: str, low: float, *keys: str) -> None:
    """Each of ``keys`` of ``obj`` is ``> low`` (durations, budgets)."""
    for key in keys:
        value = getattr(obj, key)
        if _number(value) and not value > low:
            raise ConfigError(f"{group}.{key}={value} must be > {low:g}")


def one_of(obj: Any, group: str, key: str, allowed: Sequence[str]) -> None:
    """``obj.key`` is one of ``allowed`` (a string option whose values are not Python names,
    e.g. ``32-true``); else one line naming ``<group>.<key>`` and the choices."""
    value = getattr(obj, key)
    if value not in allowed:
        raise ConfigError(f"{group}.{key}={value} must be one of {', '.join(allowed)}")


class Routing(str, Enum):
    """How traffic between two units of one topology level travels.

    ``direct``: only over the units' own point-to-point link (NVLink bridges, PCIe P2P,
    a switch port). A collective group can then use at most the sum of the P2P bandwidths
    to the other group members it reaches at that level (the §3.5 P2P correction).
    ``routed``: units forward traffic for each other (a torus' ICI links), so a group can
    use a unit's full group bandwidth whatever its membership; the P2P matrix then
    describes the wiring and zero entries (no direct link) are allowed.
    """

    direct = "direct"
    routed = "routed"


class DType(str, Enum):
    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"
    fp64 = "fp64"


DTYPE_BYTES = {DType.fp16: 2, DType.bf16: 2, DType.fp32: 4, DType.fp64: 8}


class MeshStrategy(str, Enum):
    auto = "auto"  # the whole-layout search: dp x d1 x d2 (and FSDP, chunks, aggregation) (§3.5)
    fixed = "fixed"  # DeviceMesh(d1, d2) given by the user (``mesh=2x4``)
    megatron = "megatron"  # DeviceMesh(N, 1): Megatron-LM's 1D tensor parallelism


class PlannerKind(str, Enum):
    """The ``planner`` config group: which search decides how the model is split."""

    atp = "atp"  # ATP: one 2D tensor-parallel mesh for the whole model (§3.5, Eq. 2-4)
    sbp = "sbp"  # AutoDDL: a Split/Broadcast/Partial strategy per layer (alpha-beta model)


class AggregationMode(str, Enum):
    ring = "ring"  # torch.distributed all-reduce
    auto = "auto"  # chosen by the whole-layout search among the modes the topology supports (resolve)
    ps = "ps"  # plain N-to-1 parameter server
    switchml = "switchml"  # static per-job switch memory (SwitchML)
    atp = "atp"  # ATP best-effort in-network aggregation


class SwitchImpl(str, Enum):
    """What runs the switch of the live ``atp`` backend (the ``aggregation.switch_impl`` key)."""

    python = "python"  # the emulator: atp_pipeline.ina.switch.process in a Python process
    bmv2 = "bmv2"  # BMv2 simple_switch running the compiled p4/v1model/atp.p4 (veth pairs, own netns)


class Transport(str, Enum):
    """How the live SwitchML path moves lanes between processes (``aggregation.transport``)."""

    udp = "udp"  # the lanes in the UDP datagrams (every live mode; the default)
    shm = "shm"  # headers in UDP datagrams, lanes in shared memory (switchml only; one host)


class Stage(str, Enum):
    plan = "plan"  # compose -> plan -> report (no process is started)
    fit = "fit"  # compose -> plan -> build -> fit -> report
    calibrate = "calibrate"  # measure this host for the topology: collectives, kernels, framework cost


class DataSource(str, Enum):
    corpus = "corpus"  # the shipped public-domain text, byte-level (vocab 256)
    synthetic = "synthetic"  # seeded random tokens (paper-size models)


class Objective(str, Enum):
    """What ATP's mesh search minimizes."""

    step = "step"  # the predicted step time: compute + exposed communication (planning/steptime.py)
    comm = "comm"  # the communication time of Eq. 2-4 alone (the paper's Eq. 4 selection)


class CostModel(str, Enum):
    eq2 = "eq2"  # the paper's Eq. 2 (four conjugate all-reduces, forward size counted twice)
    runtime = "runtime"  # every collective atp_pipeline.parallel sends, each with its own size


@dataclass
class LevelConfig:
    """One level of the hierarchical communication matrix (ATP §3.4).

    ``count`` units of this level sit inside each unit of the level above. ``p2p_GBps`` is
    the aggregate bandwidth between two sibling units: a scalar (every pair alike) or a
    ``count``x``count`` matrix with a zero diagonal. ``group_GBps`` is one unit's aggregate
    bandwidth to its siblings. GB/s means 10^9 bytes/s.
    """

    name: str = MISSING
    count: int = MISSING
    p2p_GBps: Any = MISSING
    group_GBps: float = MISSING
    routing: Routing = Routing.direct
    # the switches joining this level's units aggregate gradients in the network (ATP/SwitchML
    # programmable switches): the whole-layout search then also tries aggregation atp, ps and
    # switchml for the data-parallel gradient sync (planning/layout.py); false: ring only
    aggregates: bool = False


@dataclass
class CalibratedMeshConfig:
    """Measured all-reduce algorithm bandwidths of one mesh (ATP §5.3, IC1).

    They replace the B1/B2 that Eq. 3-4 would estimate for that mesh. A mesh dimension of
    size 1 has no collective and takes no value.
    """

    mesh: List[int] = MISSING
    B1_GBps: Optional[float] = None
    B2_GBps: Optional[float] = None


@dataclass
class KindFitConfig:
    """A kernel kind's fit ``t = α + units·γ`` (+ ``per_tensor_us`` per tensor: the optimizer)."""

    alpha_us: float = MISSING
    ns_per_unit: float = MISSING
    per_tensor_us: float = 0.0
    per_size: bool = False  # units: the kernel's size (an attention core's score elements), not its work


@dataclass
class FrameworkConfig:
    """The runtime's CPU work around kernels and collectives
    (:class:`~atp_pipeline.planning.compute_profile.Framework`)."""

    per_kernel_us: float = MISSING
    kernel_factor: float = 0.0
    per_collective_us: float = 0.0
    per_collective_ns_per_byte: float = 0.0
    per_read_us: float = 0.0


@dataclass
class SyncConfig:
    """A collective's extra cost when processes share the cores, and the share of overlap hidden."""

    alpha_us: float = MISSING
    per_compute: float = 0.0
    hidden: float = 1.0


@dataclass
class CollectiveCPUConfig:
    """A collective's backend CPU per call and per byte, by group size."""

    per_call_us: Dict[int, float] = field(default_factory=dict)
    per_byte_ns: Dict[int, float] = field(default_factory=dict)
    busy: Dict[int, float] = field(default_factory=dict)  # share of a core kept busy per second waited


@dataclass
class ProbeConfig:
    """A probe model the calibration ran whole (the validation's in-sample check)."""

    name: str = MISSING
    key: str = MISSING
    mesh: List[int] = MISSING
    batch: int = MISSING
    seq_len: int = MISSING
    processes: int = 0


@dataclass
class StepResidualConfig:
    """What a step takes beyond the terms' sum (:class:`~atp_pipeline.planning.step_residual.StepResidual`):
    factors per process count and chunk count, and the step from a rank's CPU per cell."""

    compute: Dict[int, Dict[int, float]] = MISSING
    exposed: Dict[int, Dict[int, float]] = MISSING
    probe_steps: Dict[int, int] = field(default_factory=dict)
    form: str = "terms"
    cpu_ratio: Dict[int, Dict[str, float]] = field(default_factory=dict)
    cpu_fit: Dict[int, Dict[str, List[float]]] = field(default_factory=dict)
    cpu_wait: Dict[int, Dict[str, float]] = field(default_factory=dict)
    cv: Dict[str, List[float]] = field(default_factory=dict)


@dataclass
class ComputeProfileConfig:
    """A measured compute profile, as ``python train.py stage=calibrate`` writes it
    (:meth:`~atp_pipeline.planning.compute_profile.ComputeProfile.from_config` reads it)."""

    name: str = MISSING
    source: str = ""
    date: str = ""
    processes: int = 1
    cores: int = 0
    kernel_time: str = "wall"  # "cpu": a rank's CPU seconds (a calibration's); "wall"
    peak_GFLOPs: float = 0.0
    contention: Dict[int, float] = field(default_factory=dict)
    comm_contention: Dict[int, float] = field(default_factory=dict)
    fits: Dict[str, KindFitConfig] = MISSING
    optimizer: str = ""
    framework: Optional[FrameworkConfig] = None
    sync: Optional[SyncConfig] = None
    collective_cpu: Optional[CollectiveCPUConfig] = None
    probes: List[ProbeConfig] = field(default_factory=list)
    reference: Dict[str, Dict[str, float]] = field(default_factory=dict)
    step_residual: Optional[StepResidualConfig] = None
    points: List[Any] = field(default_factory=list)  # [kind, [dims], microseconds]


@dataclass
class DeviceConfig:
    """A device: its memory, its datasheet peak (the step-time model's compute where it has
    no calibration: :meth:`~atp_pipeline.planning.compute_profile.ComputeProfile.from_spec`) and
    ``compute``, a measured compute profile (``python train.py stage=calibrate``; read by
    :mod:`atp_pipeline.planning.steptime`)."""

    name: str = "unknown"
    memory_GB: Optional[float] = None
    peak_TFLOPs: Optional[float] = None
    memory_GBps: Optional[float] = None
    compute: Optional[ComputeProfileConfig] = None


@dataclass
class CollectiveAlphaBetaConfig:
    """Fitted latency (µs) and bandwidth (GB/s = 1/β) of one collective kind on a level."""

    alpha_us: float = MISSING
    GBps: float = MISSING


@dataclass
class AlphaBetaLevelConfig:
    """Alpha-beta parameters of one level, fitted by least squares from measured
    collectives (AutoDDL §3.2; ``python -m atp_pipeline.run.calibrate``). Collectives
    whose group spans this level (and no outer one) cost ``α·steps + volume/GBps`` (Table 2);
    ``collectives`` optionally gives all_reduce / all_gather / reduce_scatter / all_to_all
    their own pair."""

    level: str = MISSING
    alpha_us: float = MISSING
    GBps: float = MISSING
    collectives: Dict[str, CollectiveAlphaBetaConfig] = field(default_factory=dict)


@dataclass
class TopologyConfig:
    """An interconnect as a hierarchical communication matrix, levels outermost first."""

    name: str = MISSING
    description: str = ""
    levels: List[LevelConfig] = MISSING
    world_size: Optional[int] = None  # if given, must equal the product of the counts
    calibrated: List[CalibratedMeshConfig] = field(default_factory=list)
    alpha_beta: List[AlphaBetaLevelConfig] = field(default_factory=list)  # fitted, per level
    device: DeviceConfig = field(default_factory=DeviceConfig)
    note: str = ""  # how it was derived (e.g. a sub-topology); set by the tools


@dataclass
class ModelConfig:
    """A model: its ``family`` (an adapter of :mod:`atp_pipeline.models`: ``gpt``, the
    built-in one, or a user's registered family), its shape, and the per-step b and s of
    Eq. 2. ``parallel_plan`` (module-name pattern -> style, see
    :mod:`atp_pipeline.parallel.styles`) overrides the family's own layout."""

    name: str = MISSING
    family: str = "gpt"
    hidden: int = MISSING
    heads: int = MISSING
    layers: int = MISSING
    seq_len: int = 2048
    batch_size: int = 4
    vocab_size: int = 50304
    ffn_mult: int = 4
    dtype: DType = DType.fp16
    parallel_plan: Optional[Dict[str, str]] = None
    # family "hf": the transformers config (``model_type`` and its fields); the shape keys
    # above interpolate from it (see ``conf/model/llama3_8b.yaml``)
    hf: Optional[Dict[str, Any]] = None
    # a local checkpoint directory in the family's format (HF: config.json + safetensors); the
    # model's config is read from it (``hf`` then overrides fields) and each rank loads its shards
    pretrained: Optional[str] = None
    # the LM head's logits stay split over d1 x d2 and the loss runs on the blocks (family "hf":
    # vocabulary-parallel cross-entropy, docs/vocab-parallel-loss.md); false: whole logits on every
    # rank (what generation and code reading ``outputs.logits`` need)
    vocab_parallel_loss: bool = False

    def __post_init__(self) -> None:
        at_least(self, "model", 1, "seq_len", "batch_size", "ffn_mult")
        # family "hf" reads its shape from model.hf / model.pretrained: 0 there means "read it"
        at_least(self, "model", 0 if self.family == "hf" else 1, "hidden", "heads", "layers", "vocab_size")


class SBPMethod(str, Enum):
    """Search algorithms of the SBP planner (AutoDDL §4.6)."""

    exhaustive = "exhaustive"
    random = "random"
    metropolis = "metropolis"
    coordinate = "coordinate"


@dataclass
class SBPConfig:
    """The SBP search of ``planner=sbp`` (:mod:`atp_pipeline.planning.sbp`): the method and its
    time budget, the mesh orders tried (``paper``: the §4.2.2 order; ``all``: every order,
    which matters when topology levels differ), at most ``max_split_dims`` roles of size > 1
    (2: Megatron-like 2-D plans only), and the latency α of links without a calibration."""

    method: SBPMethod = SBPMethod.coordinate
    budget_s: float = 10.0
    seed: int = 0
    orders: str = "paper"
    max_split_dims: int = 3
    alpha_us: float = 5.0

    def __post_init__(self) -> None:
        above(self, "planner.sbp", 0, "budget_s")
        at_least(self, "planner.sbp", 1, "max_split_dims")
        at_least(self, "planner.sbp", 0, "alpha_us")


@dataclass
class MeshConfig:
    """Which tensor-parallel DeviceMesh(d1, d2) to use (d1, d2 only for ``fixed``), and the
    data-parallel size: the world is dp x d1 x d2. ``dp: null`` (default) is chosen by the
    whole-layout search (:mod:`atp_pipeline.planning.layout`) among the divisors of the devices,
    as is ``fsdp: null``; a value given constrains the search (a fixed mesh leaves dp = the
    devices over d1 x d2). ``fsdp`` shards parameters, gradients and optimizer state over the
    ``dp`` replicas (FSDP2, composed with the (d1, d2) tensor parallelism;
    :mod:`atp_pipeline.parallel.fsdp`)."""

    strategy: MeshStrategy = MeshStrategy.auto
    d1: Optional[int] = None
    d2: Optional[int] = None
    dp: Optional[int] = None
    fsdp: Optional[bool] = None

    def __post_init__(self) -> None:
        at_least(self, "mesh", 1, "d1", "d2", "dp")


@dataclass
class OverlapConfig:
    """Chunk-based overlap (ATP §4.1): the batch is split into ``chunks`` pieces per block;
    ``null`` (``overlap=auto``, the default): chosen by the whole-layout search among 1, 2, 4."""

    chunks: Optional[int] = None

    def __post_init__(self) -> None:
        at_least(self, "overlap", 1, "chunks")


@dataclass
class AggregationConfig:
    """Data-parallel gradient synchronization backend.

    ``ring`` keeps torch.distributed's all-reduce; ``atp`` runs the live in-network
    aggregation backend (:mod:`atp_pipeline.ina.live`: a switch emulator — or the shared
    switch at ``switch`` — and ``n_ps`` parameter-server shards, real UDP packets); ``ps``
    is the same stack with a switch that has no aggregators (a plain N-to-1 PS). The other
    fields only apply to those two modes. ``switch_impl=bmv2`` (``atp`` only) replaces the
    emulator by BMv2 ``simple_switch`` running the compiled v1model program (``p4_program``,
    default the checkout's ``p4/v1model/atp.p4``, with ``aggregators`` registers): the
    gradients are summed by the P4 program (needs root and the P4 toolchain).

    ``racks`` (``atp`` only) splits the workers into that many racks, each behind a first-level
    switch, all feeding the second-level switch at the PS's rack (ATP §4.1 two-level
    aggregation; with ``switch_impl=bmv2`` every rack switch and the second level is a BMv2 running
    the program, ``n_ps`` 1). ``transport=shm`` (``switchml`` only) keeps the lanes in shared memory and sends
    only the headers as datagrams (``atp_pipeline.ina.live.shm``).
    ``switchml`` runs the SwitchML protocol live (Sapio et al., NSDI'21; ATP §3,
    §6): a static partition of ``pool`` slots × 2 versions at one switch that is itself the
    aggregation endpoint (no PS), per-packet shared exponents, per-slot timeouts ``rto_s``.
    Knobs of one mode given to another are refused (``racks``, ``aggregators``, ``n_ps``,
    ``duplicate``, ``switch``, ``switch_impl`` are ATP's; ``pool`` and ``transport`` are SwitchML's).
    """

    mode: AggregationMode = AggregationMode.ring  # conf/aggregation/auto.yaml (the default): auto
    payload_k: int = 62  # int32 values per packet: 62 as on hardware, more for loopback speed
    aggregators: int = 4096  # switch aggregator slots (switch memory)
    n_ps: int = 1  # parameter-server shards
    loss: float = 0.0  # injected ingress loss probability at the emulated switch
    duplicate: float = 0.0  # injected duplication probability at the emulated switch
    seed: int = 0  # fault injection seed
    switch: Optional[str] = None  # control address host:port of a running (shared) switch
    stall_timeout_s: float = 10.0  # no progress this long: fail naming the missing workers
    rto_s: float = 0.2  # worker retransmission timeout (§5.4)
    switch_impl: SwitchImpl = SwitchImpl.python  # the started switch: emulator or BMv2 + P4 program
    p4_program: Optional[str] = None  # switch_impl=bmv2: v1model source (default: <checkout>/p4/v1model/atp.p4)
    racks: int = 1  # atp: first-level switches (racks of workers); > 1: two-level aggregation (§4.1)
    pool: int = 64  # switchml: slots of the job's static partition (2 versions each)
    transport: Transport = Transport.udp  # switchml: lanes in the datagrams, or in shared memory (one host)
    role_max_bytes: int = 1 << 30  # the bound on each started role's stored state, bytes (--max-bytes)

    def __post_init__(self) -> None:
        # n_ps=0 starts a switch alone (one that several runs share); a run needs 1..4 (resolve)
        at_least(self, "aggregation", 1, "payload_k", "racks", "pool", "role_max_bytes")
        at_least(self, "aggregation", 0, "aggregators", "n_ps")
        above(self, "aggregation", 0, "stall_timeout_s", "rto_s")
        for key in ("loss", "duplicate"):
            value = getattr(self, key)
            if _number(value) and not 0.0 <= value < 1.0:
                raise ConfigError(f"aggregation.{key}={value} must be in [0, 1)")


@dataclass
class PlannerConfig:
    """The ``planner`` group: ``atp`` (ATP's mesh search; ``cost_model`` ...
    ``select_uncalibrated`` apply) or ``sbp`` (AutoDDL's per-layer search; ``sbp`` applies)."""

    name: PlannerKind = PlannerKind.atp
    cost_model: CostModel = CostModel.eq2
    # step: select by predicted step time (compute + exposed communication, planning/steptime.py;
    # where the topology's device has neither a compute profile nor a peak_TFLOPs, by
    # communication, with a note); comm: by Eq. 2-4's communication time (the paper's).
    objective: Objective = Objective.step
    # Only meshes the runtime can execute (heads divisible by d1*d2) may be selected.
    # Off for pure interconnect studies (the paper's Figure 12 goes past the head count).
    require_divisible: bool = True
    # When a topology carries calibrated bandwidths, the paper's statement is that the
    # matrix estimate is not trusted there (§5.3): uncalibrated meshes are listed but not
    # selected unless this is set.
    select_uncalibrated: bool = False
    plot: bool = True
    top: int = 5  # whole layouts printed by stage=plan (all of them are in plan.json)
    sbp: SBPConfig = field(default_factory=SBPConfig)  # planner ``sbp`` only


@dataclass
class TrainerConfig:
    """The training run (``stage=fit``): processes, steps, optimizer, logging, checkpoints."""

    devices: Optional[int] = None  # processes; default: every device of the topology
    accelerator: str = "cpu"
    max_steps: int = 150
    lr: float = 3e-3
    weight_decay: float = 0.0
    # the learning rate over the steps: a linear warmup over warmup_steps, then constant, cosine (down to
    # min_lr at max_steps) or linear (down to min_lr); stepped per optimizer step, resumed with the run
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    log_every_n_steps: int = 1  # a row of metrics.csv (loss, step time, bytes) every n steps
    checkpoint_every_n_steps: int = 0  # 0: only the last step
    progress_bar: bool = True
    export: bool = True  # at the end, the model in its family's own format (HF: <run>/hf), if it has one
    # a collective of the process group that makes no progress this long fails the rank (torch's
    # default); a failing rank closes its connections, so its peers fail at once after it
    collective_timeout_s: float = 1800.0
    # Lightning's own: clip the gradients before each optimizer step — by their global 2-norm over
    # every tensor-parallel shard and data-parallel replica ("norm"), or each element ("value");
    # null or 0: no clipping. The norm is logged as grad_norm (metrics.csv).
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    # Lightning's precision: 32-true (float32, or the model's float64), bf16-mixed (autocast: bf16
    # matmuls, float32 weights and optimizer), bf16-true (weights and activations in bf16)
    precision: str = "32-true"
    # a fit whose ranks fail is launched again, from its newest complete checkpoint, up to this many times
    max_restarts: int = 0

    def __post_init__(self) -> None:
        at_least(self, "trainer", 1, "devices", "max_steps", "log_every_n_steps")
        at_least(self, "trainer", 0, "checkpoint_every_n_steps", "lr", "weight_decay", "max_restarts",
                 "gradient_clip_val", "warmup_steps", "min_lr")
        one_of(self, "trainer", "lr_schedule", LR_SCHEDULES)
        above(self, "trainer", 0, "collective_timeout_s")
        one_of(self, "trainer", "gradient_clip_algorithm", CLIP_ALGORITHMS)
        one_of(self, "trainer", "precision", PRECISIONS)


#: ``trainer.lr_schedule`` (:mod:`atp_pipeline.lightning.schedule`)
LR_SCHEDULES = ("constant", "cosine", "linear")
#: ``trainer.gradient_clip_algorithm`` (Lightning's names)
CLIP_ALGORITHMS = ("norm", "value")
#: ``trainer.precision``: Lightning's precisions strategy "atp" runs (ModelParallelStrategy's, less 16-bit floats)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


@dataclass
class DataConfig:
    source: DataSource = DataSource.corpus


@dataclass
class PathsConfig:
    output_dir: str = "${hydra:runtime.output_dir}"


@dataclass
class CalibrationConfig:
    """``stage=calibrate`` writes the topology's calibration (α-β per level and collective,
    the compute profile) to ``<dir>/<topology name>.yaml``; ``stage=plan`` and ``stage=fit``
    read it from there when the topology has no calibration of its own (``use``) and the
    file was measured for the same levels (:mod:`atp_pipeline.run.calibration`)."""

    dir: str = "outputs/calibration/profiles"
    use: bool = True
    passes: int = 5  # interleaved timed passes per measurement (median)
    quick: bool = False  # a coarse sweep, one probe (a smoke run: tests)
    # time the host's speed now before pricing (the probes' whole steps the calibration recorded,
    # ~15 s on the plan's processes; reused for ``retime_s`` seconds, ``<dir>/<topology>_speed.json``);
    # false: at the calibration's speed, unless the calibration is stale (measured on another host
    # or more than ``stale_days`` days ago; 0: never), which a one-line note says
    retime: bool = False
    stale_days: float = 30.0
    retime_s: float = 300.0

    def __post_init__(self) -> None:
        at_least(self, "calibration", 1, "passes")
        at_least(self, "calibration", 0, "retime_s")
        at_least(self, "calibration", 0, "stale_days")


@dataclass
class Config:
    stage: Stage = Stage.fit
    seed: int = 0
    # a checkpoint of an earlier run to continue; auto: the newest complete one of this run directory
    resume: Optional[str] = None
    topology: TopologyConfig = MISSING
    model: ModelConfig = MISSING
    mesh: MeshConfig = MISSING
    overlap: OverlapConfig = MISSING
    aggregation: AggregationConfig = MISSING
    planner: PlannerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


def typed(cfg: Any) -> Config:
    """The composed config as its schema dataclasses: every group instantiated
    (``OmegaConf.to_object``), which runs each group's checks; a bad value is one
    :class:`ConfigError` line. ``paths`` keeps its composed values unresolved: its run
    directory interpolates Hydra's runtime, which the compose API does not set."""
    if isinstance(cfg, Config):
        return cfg
    values: Dict[str, Any] = {}
    try:
        for f in fields(Config):
            node = cfg[f.name]
            if f.name == "paths":
                values[f.name] = PathsConfig(**OmegaConf.to_container(node, resolve=False))  # type: ignore[arg-type]
            else:
                values[f.name] = OmegaConf.to_object(node) if isinstance(node, DictConfig) else node
    except OmegaConfBaseException as exc:
        raise ConfigError(describe_omegaconf(exc)) from None
    return Config(**values)


SCHEMA_NAME = "atp_schema"


def register_schemas() -> None:
    """Store the root schema; ``conf/config.yaml`` lists it first in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
