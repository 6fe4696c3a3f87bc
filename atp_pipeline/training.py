"""build -> fit -> report: ``stage=fit`` of ``train.py``.

The parent process checks everything first — devices against the topology, the
sub-topology actually occupied, the mesh against the model, the parallel plan's patterns
against the model's modules, the per-device memory against the devices — and writes
``plan.json``; only then does it start the worker processes (torchrun's environment, so
Lightning treats them as externally launched), each running a Lightning ``Trainer`` with
``ATPStrategy``. Under ``torchrun`` itself (multi-node) every process runs its own worker
in place instead, with the run directory given on the command line. Rank 0's logs become the run's ``metrics.csv``, ``loss.png`` and
``summary.json``; sharded checkpoints go to ``checkpoints/`` (``resume=<dir>`` continues).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from atp_pipeline.config.schema import AggregationConfig, AggregationMode, DataSource, MeshStrategy, Stage
from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.models.gpt import GPT, GPTConfig
from atp_pipeline.parallel.gpt import check_mesh_fits
from atp_pipeline.parallel.plan import match_plan
from atp_pipeline.planning.flops import ModelSummary
from atp_pipeline.planning.memory import per_device_memory
from atp_pipeline.planning.report import report_plan
from atp_pipeline.planning.search import Plan, make_plan
from atp_pipeline.topology.model import Topology


def resolve_dp(cfg: DictConfig, devices: int) -> int:
    """``mesh.dp``, or for ``dp: null``: the devices a fixed d1 x d2 mesh leaves over; else
    every device when gradients go through the aggregation backend (atp/ps), 1 for ring."""
    if cfg.mesh.dp is not None:
        return int(cfg.mesh.dp)
    if cfg.mesh.strategy == MeshStrategy.fixed and cfg.mesh.d1 and cfg.mesh.d2:
        tp = int(cfg.mesh.d1) * int(cfg.mesh.d2)
        return devices // tp if devices % tp == 0 else 1  # 1: the planner names the mismatch
    return devices if cfg.aggregation.mode in (AggregationMode.atp, AggregationMode.ps) else 1


def check_aggregation(agg: DictConfig, dp: int) -> Optional[AggregationConfig]:
    """Validate ``aggregation`` for a run; the live backend's config (None for ring)."""
    mode = agg.mode
    if mode == AggregationMode.switchml:
        raise ConfigError("aggregation=switchml runs in the simulator only (python -m "
                          "atp_pipeline.ina.experiments); training supports ring, atp and ps")
    if mode == AggregationMode.ring or dp == 1:
        return None
    from atp_pipeline.ina.live.engine import MAX_DATAGRAM

    limit = (MAX_DATAGRAM - PacketFormat(1).header_bytes) // 4
    if not 1 <= agg.payload_k <= limit:
        raise ConfigError(f"aggregation.payload_k={agg.payload_k} must be 1..{limit} (one UDP datagram)")
    for key in ("loss", "duplicate"):
        if not 0.0 <= agg[key] < 1.0:
            raise ConfigError(f"aggregation.{key}={agg[key]} must be in [0, 1)")
    if agg.aggregators < 0:
        raise ConfigError(f"aggregation.aggregators={agg.aggregators} must be >= 0")
    if not 1 <= agg.n_ps <= 4:
        raise ConfigError(f"aggregation.n_ps={agg.n_ps} must be 1..4 (2-bit PS index)")
    if dp > PacketFormat().bitmap_bits:
        raise ConfigError(f"mesh.dp={dp} exceeds the {PacketFormat().bitmap_bits}-bit worker bitmap of one "
                          f"ATP job (single-level aggregation)")
    if agg.stall_timeout_s <= 0 or agg.rto_s <= 0:
        raise ConfigError("aggregation.stall_timeout_s and aggregation.rto_s must be > 0")
    if agg.switch is not None:
        from atp_pipeline.ina.live.rpc import parse_addr

        try:
            parse_addr(agg.switch)
        except ValueError as e:
            raise ConfigError(f"aggregation.switch: {e}") from None
        if agg.loss or agg.duplicate:
            raise ConfigError("aggregation.loss/duplicate are set when the switch is started; a shared "
                              "switch (aggregation.switch) keeps its own")
    cfg = OmegaConf.to_object(agg)
    assert isinstance(cfg, AggregationConfig)
    return cfg


def prepare(cfg: DictConfig, summary: ModelSummary) -> Dict[str, Any]:
    """Every check that can fail, before any process starts; returns the worker spec."""
    topo = Topology.from_config(cfg.topology)
    devices = cfg.trainer.devices or topo.world_size
    if devices > topo.world_size:
        raise ConfigError(f"trainer.devices={devices} but topology '{topo.name}' has only "
                          f"{topo.world_size} devices")
    dp = resolve_dp(cfg, devices)
    if dp < 1 or devices % dp:
        raise ConfigError(f"mesh.dp={dp} does not divide trainer.devices={devices}")
    live = check_aggregation(cfg.aggregation, dp) if cfg.stage == Stage.fit else None
    occupied = topo.restrict(devices)
    tp_topo = occupied.restrict(devices // dp)
    sbp = cfg.mesh.strategy == MeshStrategy.sbp
    if sbp:  # AutoDDL (issue 8): per-layer SBP plan, data parallelism inside it
        from atp_pipeline.planning.sbp.report import plan_sbp

        if dp != 1 or cfg.overlap.chunks != 1:
            raise ConfigError(f"mesh=sbp plans data parallelism per layer itself: it needs mesh.dp=1 "
                              f"(got {dp}), aggregation=ring and overlap=chunk1 (got chunks="
                              f"{cfg.overlap.chunks})")
        plan = plan_sbp(tp_topo, summary, cfg.mesh.sbp)
        d1, d2 = devices, 1  # the strategy's bookkeeping mesh (data loading); the plan has its own
    else:
        plan = make_plan(tp_topo, summary, cfg.mesh, cfg.planner)
        d1, d2 = plan.selected
        check_mesh_fits(summary.heads, summary.hidden, summary.vocab_size, summary.ffn_mult, d1, d2,
                        what=f"model '{summary.name}' on mesh {d1}x{d2}")
    local_batch = summary.batch_size // dp
    if summary.batch_size % dp or local_batch % cfg.overlap.chunks:
        raise ConfigError(f"model.batch_size={summary.batch_size} must split over mesh.dp={dp} and then "
                          f"over overlap.chunks={cfg.overlap.chunks}")
    if cfg.data.source == DataSource.corpus and summary.vocab_size < 256:
        raise ConfigError(f"data.source=corpus is byte-level and needs model.vocab_size >= 256, got "
                          f"{summary.vocab_size}")
    gpt_cfg = GPTConfig.from_model_config(cfg.model)
    plan_cfg = {k: getattr(v, "value", v) for k, v in cfg.model.parallel_plan.items()}
    with torch.device("meta"):
        match_plan(GPT(gpt_cfg), plan_cfg)  # every pattern must name real modules
    mem = per_device_memory(summary, (d1, d2), dp)
    capacity = topo.device.get("memory_GB")
    if capacity and mem.total_bytes > capacity * 1e9 and not sbp:  # sbp: the search's own limit
        raise ConfigError(
            f"model '{summary.name}' needs ~{mem.total_bytes / 1e9:.1f} GB per device on mesh {d1}x{d2} "
            f"(dp={dp}): weights+grads {mem.weights_grads_bytes / 1e9:.1f}, optimizer "
            f"{mem.optimizer_bytes / 1e9:.1f}, activations {mem.activation_bytes / 1e9:.1f}; "
            f"'{topo.name}' devices have {capacity:g} GB")
    accel = str(cfg.trainer.accelerator)
    device_name = str(topo.device.get("name") or "unknown")
    fitting = cfg.stage == Stage.fit
    if fitting and accel == "cpu" and device_name not in ("cpu", "unknown"):
        raise ConfigError(f"topology '{topo.name}' describes {device_name} devices but trainer.accelerator=cpu; "
                          f"set trainer.accelerator=gpu to train on them, or stage=plan to only plan")
    if fitting and accel in ("gpu", "cuda") and not os.environ.get("TORCHELASTIC_RUN_ID"):
        local = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local < devices:
            raise ConfigError(f"trainer.accelerator={accel} with {devices} processes needs {devices} GPUs on "
                              f"this host, found {local} (several nodes: launch with torchrun)")
    if cfg.resume and not Path(cfg.resume).exists():
        raise ConfigError(f"resume={cfg.resume}: no such checkpoint")
    notes = list(plan.notes)
    if devices < topo.world_size:
        notes.insert(0, f"{devices} of {topo.world_size} devices of '{topo.name}' are used: planned and "
                        f"run on that sub-topology")
    plan = plan.with_notes(notes) if sbp else Plan(
        topology=plan.topology, model=plan.model, strategy=plan.strategy, cost_model=plan.cost_model,
        candidates=plan.candidates, selected=plan.selected, notes=tuple(notes))
    flops = summary.layers * summary.flops_per_layer + summary.flops_lm_head
    return {
        "plan": plan, "devices": devices, "dp": dp, "mesh": (d1, d2), "aggregation": live,
        "worker": {
            "aggregation": asdict(live) if live is not None else "ring", "services": None,
            "gpt": asdict(gpt_cfg), "lr": cfg.trainer.lr, "weight_decay": cfg.trainer.weight_decay,
            "seed": cfg.seed, "source": cfg.data.source.value, "batch": summary.batch_size,
            "mesh": (d1, d2), "dp": dp, "chunks": cfg.overlap.chunks,
            "sbp": plan.exec_plan.to_dict() if sbp else None,
            "plan": {f"model.{k}": v for k, v in plan_cfg.items()}, "max_steps": cfg.trainer.max_steps,
            "accelerator": cfg.trainer.accelerator, "log_every": cfg.trainer.log_every_n_steps,
            "ckpt_every": cfg.trainer.checkpoint_every_n_steps, "progress": cfg.trainer.progress_bar,
            "resume": cfg.resume, "flops_per_step": flops,
            "tokens_per_step": summary.batch_size * summary.seq_len,
            "dtype": summary.dtype,
        },
    }


def _digest(module: torch.nn.Module) -> Dict[str, str]:
    import hashlib

    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        out[name] = hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]
    return out


def fit_worker(rank: int, world: int, spec: Dict[str, Any], out_dir: str) -> Dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    from atp_pipeline.lightning import ATPStrategy, GPTModule, StepMetrics, TokenDataModule

    out = Path(out_dir)
    dtype = {"fp64": torch.float64}.get(spec["dtype"], torch.float32)
    module = GPTModule(GPTConfig(**spec["gpt"]), lr=spec["lr"], weight_decay=spec["weight_decay"],
                       seed=spec["seed"]).to(dtype)
    data = TokenDataModule(spec["source"], spec["gpt"]["seq_len"], spec["batch"], spec["gpt"]["vocab_size"],
                           seed=spec["seed"])
    from atp_pipeline.parallel.sbp_exec import SBPPlan

    mesh = SBPPlan.from_dict(spec["sbp"]) if spec.get("sbp") else tuple(spec["mesh"])
    strategy = ATPStrategy(mesh=mesh, dp=spec["dp"], chunks=spec["chunks"], plan=spec["plan"],
                           aggregation=spec["aggregation"], services=spec["services"])
    every = spec["ckpt_every"] or spec["max_steps"]
    ckpt = ModelCheckpoint(dirpath=out / "checkpoints", filename="step{step}", save_last=True,
                           every_n_train_steps=every, save_top_k=-1, auto_insert_metric_name=False)
    logger = CSVLogger(save_dir=str(out), name="", version="lightning_logs")
    loggers: List[Any] = [logger]
    if importlib.util.find_spec("tensorboard") is not None:  # optional
        from pytorch_lightning.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(out), name="", version="tensorboard"))
    trainer = pl.Trainer(strategy=strategy, accelerator=spec["accelerator"], devices=world, num_nodes=1,
                         max_steps=spec["max_steps"], logger=loggers, log_every_n_steps=1,
                         callbacks=[StepMetrics(spec["flops_per_step"], spec["tokens_per_step"]), ckpt],
                         enable_progress_bar=spec["progress"], enable_model_summary=False,
                         precision="64-true" if dtype == torch.float64 else "32-true")
    trainer.fit(module, datamodule=data, ckpt_path=spec["resume"])
    coord = strategy.device_mesh.get_coordinate()
    return {"rank": rank, "coord": list(coord) if coord else None, "global_step": trainer.global_step,
            "metrics_csv": str(Path(logger.log_dir) / "metrics.csv"), "digest": _digest(module),
            "applied_plan": strategy.applied_plan,
            "atp_linears": sum(type(m).__name__ == "ATPLinear" for m in module.modules())}


def _role_report(services: Any) -> Dict[str, Any]:
    """What the switch and the PS counted for this run (printed, and kept in summary.json)."""
    try:
        st = services.stats()
    except Exception as e:  # noqa: BLE001 - a role that died: say so, do not mask the run's error
        print(f"aggregation: could not read the roles' counters ({e})")
        return {"error": str(e)}
    sw = st["switch"]
    rep = {"switch_allocated_after": sw["allocated"], "switch_jobs": sw["jobs"],
           "injected_loss": sw["injected_loss"], "injected_dup": sw["injected_dup"],
           "socket_drops": sw["socket_drops"] + sum(p["socket_drops"] for p in st["ps"]),
           "ecn_marked": sw["ecn_marked"], "ps_jobs": [p["jobs"] for p in st["ps"]]}
    print(f"aggregation: switch allocated {sum(j['allocs'] for j in sw['jobs'].values())} aggregators over "
          f"{len(sw['jobs'])} job(s), {sw['allocated']} still allocated after teardown; injected loss "
          f"{sw['injected_loss']}, duplicates {sw['injected_dup']}, socket drops {rep['socket_drops']}")
    return rep


def read_metrics(path: Path) -> List[Dict[str, float]]:
    rows: Dict[int, Dict[str, float]] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            step = int(float(r["step"]))
            for k, v in r.items():
                if v not in ("", None) and k != "step":
                    rows.setdefault(step, {"step": step})[k] = float(v)
    return [rows[k] for k in sorted(rows)]


def plot_loss(rows: List[Dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["step"] + 1, r["loss"]) for r in rows if "loss" in r]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fit(cfg: DictConfig, summary: ModelSummary, out: Path, job: Dict[str, Any]) -> Dict[str, Any]:
    from atp_pipeline.parallel.launch import spawn

    prepared = prepare(cfg, summary)
    plan: Plan = prepared["plan"]
    lead = os.environ.get("RANK", "0") == "0" or not os.environ.get("TORCHELASTIC_RUN_ID")
    if lead:
        report_plan(cfg, plan, out)
    d1, d2 = prepared["mesh"]
    if lead:
        print(f"fit: {prepared['devices']} processes, mesh dp x d1 x d2 = {prepared['dp']} x {d1} x {d2}, "
              f"chunks={cfg.overlap.chunks}, {cfg.trainer.max_steps} steps -> {out}")
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # launched by torchrun (e.g. one process per GPU on every node): run in place
        world = int(os.environ["WORLD_SIZE"])
        if world != prepared["devices"]:
            raise ConfigError(f"torchrun started {world} processes but the run needs trainer.devices="
                              f"{prepared['devices']}")
        mine = fit_worker(int(os.environ["RANK"]), world, prepared["worker"], str(out))
        if mine["rank"] != 0:
            return {"rank": mine["rank"]}
        results = [mine]
    else:
        services, roles = None, None
        if prepared["aggregation"] is not None:  # started here so they outlive any worker
            from atp_pipeline.ina.live.services import Services

            services = Services.start(prepared["aggregation"])
            prepared["worker"]["services"] = services.to_dict()
        try:
            results = spawn(fit_worker, prepared["devices"], prepared["worker"], str(out), init=False,
                            timeout=max(600.0, 10.0 * cfg.trainer.max_steps))
        finally:
            if services is not None:
                roles = _role_report(services)
                services.stop()
        if roles is not None:
            job["aggregation_roles"] = roles
    first = results[0]
    metrics_path = out / "metrics.csv"
    shutil.copyfile(first["metrics_csv"], metrics_path)
    rows = read_metrics(metrics_path)
    losses = [r["loss"] for r in rows if "loss" in r]
    steps = [r for r in rows if "step_time_s" in r][1:] or [r for r in rows if "step_time_s" in r]
    plot_loss(rows, out / "loss.png", f"{summary.name} on {plan.topology.name}, mesh {prepared['dp']}x{d1}x{d2}, "
                                      f"chunks {cfg.overlap.chunks}")

    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in steps if key in r]
        return statistics.median(vals) if vals else None

    summary_row = {
        "topology": plan.topology.name, "model": summary.name, "world_size": prepared["devices"],
        "dp": prepared["dp"], "selected": plan.label if cfg.mesh.strategy == MeshStrategy.sbp else f"{d1}x{d2}", "chunks": cfg.overlap.chunks,
        "steps": first["global_step"], "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "loss_drop": (1 - losses[-1] / losses[0]) if losses and losses[0] else None,
        "step_time_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
        "tflops_per_device": med("tflops_per_device"),
        **{f"comm_{a}_bytes": med(f"comm_{a}_bytes") for a in ("dp", "d1", "d2")},
        **{f"comm_{a}_wait_s": med(f"comm_{a}_wait_s") for a in ("dp", "d1", "d2")},
        "aggregation": cfg.aggregation.mode.value,
        **{k: med(k) for k in ("atp_sync_s", "atp_gbps", "atp_in_switch_frac", "atp_fallback_frac",
                               "atp_retransmits", "atp_window_pkts") if any(k in r for r in steps)},
        "predicted_t_comm_s": (plan.cost_s if cfg.mesh.strategy == MeshStrategy.sbp
                               else plan.candidate(plan.selected).t_comm_s),
        "atp_linears": first["atp_linears"], **job,
    }
    (out / "summary.json").write_text(json.dumps(summary_row, indent=2) + "\n")
    lines = [f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary_row.items()]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print(f"loss {summary_row['first_loss']:.4f} -> {summary_row['final_loss']:.4f} "
          f"({100 * (summary_row['loss_drop'] or 0):.1f}% lower) in {first['global_step']} steps; "
          f"median step {1e3 * (summary_row['step_time_s'] or math.nan):.1f} ms, "
          f"{summary_row['tokens_per_s'] or math.nan:.0f} tokens/s; wrote {out}")
    summary_row["_results"] = results
    return summary_row
