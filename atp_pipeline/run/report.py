"""Report: the plan report of a resolved run, and the training run's outputs.

``stage=plan`` and ``stage=fit`` print and write the same plan report
(:func:`atp_pipeline.planning.report.write_report`), with the data-parallel gradient sync
of the planned step under every aggregation mode (the packet geometry comes from the
protocol's own wire format, :class:`~atp_pipeline.ina.packet.PacketFormat`). After a fit,
rank 0's logs become ``metrics.csv``, ``loss.png``, ``summary.json`` and ``summary.txt``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

from atp_pipeline.ina.packet import L2L4_OVERHEAD_BYTES, PacketFormat
from atp_pipeline.ina.sim.switchml import SML_HEADER_BYTES
from atp_pipeline.planning import gradsync
from atp_pipeline.planning.fmt import human_bytes
from atp_pipeline.planning.report import write_report
from atp_pipeline.run.resolve import RunSpec


def packet_geometry(payload_k: int) -> gradsync.PacketGeometry:
    """The estimate's packet geometry from the protocol's wire format."""
    fmt = PacketFormat(payload_k=payload_k)
    return gradsync.PacketGeometry(payload_k=fmt.payload_k, header_bytes=fmt.header_bytes,
                                   l2l4_bytes=L2L4_OVERHEAD_BYTES, switchml_header_bytes=int(SML_HEADER_BYTES))


def gradsync_estimate(spec: RunSpec) -> Optional[gradsync.GradSyncReport]:
    """The data-parallel gradient sync of the planned step under every aggregation mode."""
    buckets = spec.plan.grad_buckets(spec.dp)  # type: ignore[attr-defined]
    agg = spec.config.aggregation
    return gradsync.estimate(spec.occupied, buckets, spec.shape.bytes_per_element, configured=agg.mode.value,
                             packets=packet_geometry(agg.payload_k),
                             tp_comm_s=spec.plan.tp_comm_s)  # type: ignore[attr-defined]


def report_plan(spec: RunSpec, out: Path, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Print and write the plan report (with the model's shape and, for an ATP plan, the
    per-device memory estimate); the summary row."""
    gs = gradsync_estimate(spec)
    mem, fsdp = spec.memory, spec.config.mesh.fsdp
    extra_plan = None if mem is None else {"memory_per_device": {**mem.to_dict(), "fsdp": fsdp}}
    if extra_plan is not None and spec.memory_unsharded is not None:  # the same run without FSDP, beside it
        extra_plan["memory_per_device_without_fsdp"] = spec.memory_unsharded.to_dict()
    paths, row = write_report(spec.plan, out, plot=spec.config.planner.plot, gradsync=gs, extra_summary=extra,
                              extra_plan=extra_plan)
    s = spec.shape
    print(f"model shape read: h={s.hidden}, heads={s.heads} (kv {s.kv_heads}, head dim {s.head_dim}), "
          f"FFN {s.ffn}{' gated' if s.gated else ''}, {s.norm}, vocab {s.vocab_size}, L={s.layers}, "
          f"{'tied' if s.tied_embeddings else 'untied'} head"
          + (" (logits split by vocabulary over d1 x d2, vocabulary-parallel loss)" if s.head_layout == "vocab_split"
             else ""))
    if mem is not None:
        print(f"memory per device on {'x'.join(map(str, spec.plan.mesh_shape))} (dp={spec.dp}"
              f"{', FSDP' if fsdp else ''}): "
              f"~{human_bytes(mem.total_bytes)} = weights+grads {human_bytes(mem.weights_grads_bytes)} + optimizer "
              f"{human_bytes(mem.optimizer_bytes)} + activations {human_bytes(mem.activation_bytes)}; "
              f"logits and loss {human_bytes(mem.logits_bytes)} besides")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return row


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
    from atp_pipeline.figures import axes

    pts = [(r["step"] + 1, r["loss"]) for r in rows if "loss" in r]
    with axes(path, (5.5, 3.4)) as ax:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (cross-entropy, nats)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)


def report_fit(spec: RunSpec, out: Path, first: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``metrics.csv``, ``loss.png``, ``summary.json``/``.txt`` from rank 0's logs; the summary row."""
    metrics_path = out / "metrics.csv"
    metrics_path.write_bytes(Path(first["metrics_csv"]).read_bytes())
    rows = read_metrics(metrics_path)
    losses = [r["loss"] for r in rows if "loss" in r]
    steps = [r for r in rows if "step_time_s" in r][1:] or [r for r in rows if "step_time_s" in r]
    dp, d1, d2 = spec.mesh
    chunks, fsdp = spec.config.overlap.chunks, spec.config.mesh.fsdp
    plot_loss(rows, out / "loss.png", f"{spec.shape.name} on {spec.topology.name}: mesh {d1}x{d2}, dp {dp}, "
                                      f"chunks {chunks}")

    last = next((r for r in reversed(rows) if "param_bytes" in r), {})  # rank 0's state, last step

    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in steps if key in r]
        return statistics.median(vals) if vals else None

    row = {
        "topology": spec.topology.name, "model": spec.shape.name, "world_size": spec.devices, "dp": spec.dp,
        "planner": spec.plan.kind, "selected": spec.plan.label, "chunks": chunks,
        "steps": first["global_step"], "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "loss_drop": (1 - losses[-1] / losses[0]) if losses and losses[0] else None,
        "step_time_s": med("step_time_s"), "tokens_per_s": med("tokens_per_s"),
        "tflops_per_device": med("tflops_per_device"),
        **{f"comm_{a}_bytes": med(f"comm_{a}_bytes") for a in ("dp", "d1", "d2")},
        **{f"comm_{a}_wait_s": med(f"comm_{a}_wait_s") for a in ("dp", "d1", "d2")},
        "aggregation": spec.config.aggregation.mode.value,
        **{k: med(k) for k in ("atp_sync_s", "atp_gbps", "atp_in_switch_frac", "atp_fallback_frac",
                               "atp_retransmits", "atp_window_pkts") if any(k in r for r in steps)},
        "predicted_t_comm_s": spec.plan.predicted_comm_s, "atp_linears": first["atp_linears"],
        "fsdp": fsdp, **{k: last.get(k) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")},
        **spec.job, **extra,
    }
    (out / "summary.json").write_text(json.dumps(row, indent=2) + "\n")
    lines = [f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print(f"loss {row['first_loss']:.4f} -> {row['final_loss']:.4f} "
          f"({100 * (row['loss_drop'] or 0):.1f}% lower) in {first['global_step']} steps; "
          f"median step {1e3 * (row['step_time_s'] or math.nan):.1f} ms, "
          f"{row['tokens_per_s'] or math.nan:.0f} tokens/s; wrote {out}")
    if last:
        state = last["param_bytes"] + last["grad_bytes"] + last["optimizer_bytes"]
        print(f"rank 0 holds {human_bytes(state)} of training state{' (FSDP-sharded)' if fsdp else ''}: "
              f"parameters {human_bytes(last['param_bytes'])} + gradients {human_bytes(last['grad_bytes'])} + "
              f"optimizer {human_bytes(last['optimizer_bytes'])}")
    return row
