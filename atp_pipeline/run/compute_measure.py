"""What a compute calibration measures: the kernel sweep, the probe models, the loops.

None of it is a model, batch or sequence length a user plans; the step-time model predicts
those from the terms fitted over these (:mod:`atp_pipeline.planning.profile_fit`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

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
from atp_pipeline.planning.profile_fit import ASYNC, SYNC, SYNC_GEMM, Pattern, Plan

CONF = Path("conf")
SYNC_COMPUTE = (0, 1, 4, 16)  # SYNC_GEMMs before each collective
SYNC_BYTES = (16384, 262144)
SYNC_COLLECTIVES = ("all_reduce", "all_gather")
# besides SYNC_BYTES: the pure collective loops the collectives' CPU per call and byte is fitted over. The
# small sizes are where tensor-parallel activations of small models sit (a few KiB to ~100 KiB); with
# 16 KiB, 256 KiB and 1 MiB alone, calibrations fitted a call's CPU 1.5x apart from one to the next
LOOP_BYTES = (1024, 4096, 65536, 1048576)
LOOP_BATCH = 4  # a pure loop makes 4x the batch of calls a pass (one call is ~0.3-1.5 ms of scattered CPU)
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
# back to back fitted 57 us + 101 % and 113 us - 10 %, and predicted the same validation rows
# 0.72-1.15x apart.
PROBES["probe_gpt_s_b48"] = (*PROBES["probe_gpt_s"][:-1], "model.batch_size=48")
PROBES["probe_llama_b48"] = (*PROBES["probe_llama"][:-1], "model.batch_size=48")
# And the GPT-2 family's at 8x the batch: on 2 processes the rank CPU over its predicted time grows
# with the tokens a kernel runs on in both transformers families, and with one such probe the CPU's
# line of a cell leans on it alone.
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
    attn = [(b, 4, s, d) for b in ((1, 4) if quick else (1, 4, 16))
            for s in ((32, 128) if quick else (32, 64, 128, 256))
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
