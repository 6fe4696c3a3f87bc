"""Gradient-sync throughput and step time of the live ATP backend against ring all-reduce.

    python -m benchmarks.live_sync --world 4 --model tiny --payloads 62,2048

Run from the repository root (``--conf``, default ``conf``). On ``world`` CPU processes
(gloo) it trains the GPT of ``<conf>/model/<model>.yaml`` with
DistributedDataParallel, once per mode, interleaved over ``--repeats`` rounds so machine
noise hits every mode alike:

* ``ring``: DDP's own all-reduce (gloo);
* ``atp-K``: DDP with :func:`atp_pipeline.ina.live.sync.atp_hook` — real switch-emulator
  and PS processes, ``K`` int32 values per packet (62 as on hardware; more for loopback
  speed: fewer Python-level packet events per byte, at the price of datagrams far larger
  than an Ethernet MTU);
* ``atp2-K`` (``--modes`` has ``atp2``): the same with two racks, two-level aggregation (§4.1);
* ``switchml-K`` (``--modes`` has ``switchml``): SwitchML live (``--pool`` slots);
* ``switchml_shm-K`` (``--modes`` has ``switchml_shm``): the same with the shared-memory
  transport (headers as UDP datagrams, lanes in shared memory: ``atp_pipeline.ina.live.shm``).

Packets travel batched, several per datagram (``atp_pipeline.ina.live.frames``).

Per mode it reports the median step time (forward + backward with gradient sync +
optimizer step), the median time of one gradient sync of the flat gradient alone, the
per-worker gradient-sync throughput (gradient bytes / sync time, GB/s) and both relative
to ring *measured in the same run*, and the CPU time one sync costs: every rank's process
(all its threads; gloo's for ring) plus the role processes the mode uses (switches, PS
shards; each asked for its own) — on a host with fewer cores than processes, a sync cannot take
less wall time than its CPU time over the cores. Writes JSON, CSV and a bar chart into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from atp_pipeline.config.schema import AggregationConfig, AggregationMode, ModelConfig, Transport
from atp_pipeline.launch import spawn
from atp_pipeline.models.gpt import GPT, GPTConfig
from benchmarks.tp_step import CONF, load_model


def _configs(modes: List[str], payloads: List[int], pools: List[int]) -> Dict[str, AggregationConfig]:
    """The live configurations measured beside ring, named ``<mode>-<K>`` (SwitchML with several
    ``--pool`` sizes: ``<mode>-<K>-p<pool>``)."""
    out: Dict[str, AggregationConfig] = {}
    for k in payloads:
        for m in modes:
            if m == "atp":
                out[f"atp-{k}"] = AggregationConfig(mode=AggregationMode.atp, payload_k=k)
            elif m == "atp2":
                out[f"atp2-{k}"] = AggregationConfig(mode=AggregationMode.atp, payload_k=k, racks=2)
            elif m in ("switchml", "switchml_shm"):
                for pool in pools:
                    name = f"{m}-{k}" + (f"-p{pool}" if len(pools) > 1 else "")
                    out[name] = AggregationConfig(mode=AggregationMode.switchml, payload_k=k, pool=pool,
                                                  transport=Transport.shm if m == "switchml_shm" else Transport.udp)
            else:
                raise SystemExit(f"--modes: unknown mode {m!r} (atp, atp2, switchml, switchml_shm)")
    return out


def _worker(rank: int, world: int, mcfg: ModelConfig, configs: Dict[str, AggregationConfig], steps: int,
            repeats: int) -> Dict[str, Any]:
    from atp_pipeline.ina.live.sync import ATPSync, atp_hook

    cfg = GPTConfig.from_model_config(mcfg)
    torch.manual_seed(0)
    net = GPT(cfg)
    n_params = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, cfg.vocab_size, (max(1, mcfg.batch_size // world), cfg.seq_len), generator=g)
    syncs: Dict[str, Any] = {"ring": None}
    for name, acfg in configs.items():
        syncs[name] = ATPSync.setup(dist.group.WORLD, acfg)
    models: Dict[str, Any] = {}
    for name, sync in syncs.items():
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        if sync is not None:
            ddp.register_comm_hook(sync, atp_hook)
        models[name] = ddp
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    flat = torch.randn(n_params, generator=g) * 1e-2
    rows: Dict[str, Dict[str, List[float]]] = {n: {"step": [], "sync": [], "cpu": [], "roles_cpu": []} for n in syncs}
    # the roles' control channels with their owner tokens (rank 0 started them)
    roles = {n: ([e.peer(e.owner) for e in [s.services.switch, *s.services.racks, *s.services.ps]]
                 if s is not None and rank == 0 else []) for n, s in syncs.items()}
    for rep in range(repeats + 1):  # round 0 warms up
        for name, ddp in models.items():
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                ddp(idx, idx).backward()
                opt.step()
                if rep:
                    rows[name]["step"].append(time.perf_counter() - t0)
            dist.barrier()
            c0, r0 = _cpu_s(), _roles_cpu_s(roles[name])
            for _ in range(steps):  # the flat gradient alone
                buf = flat.clone()
                t0 = time.perf_counter()
                if syncs[name] is None:
                    dist.all_reduce(buf)
                else:
                    syncs[name].engine.all_reduce(buf)
                if rep:
                    rows[name]["sync"].append(time.perf_counter() - t0)
            if rep:  # CPU time per sync: this rank's process (all its threads), rank 0 also the roles'
                rows[name]["cpu"].append((_cpu_s() - c0) / steps)
                rows[name]["roles_cpu"].append((_roles_cpu_s(roles[name]) - r0) / steps)
    info = {n: (s.step_metrics(with_roles=rank == 0) if s is not None else {}) for n, s in syncs.items()}
    dist.barrier()
    for s in syncs.values():
        if s is not None:
            s.close()
    return {"n_params": n_params, "rows": rows, "info": info}


def _cpu_s() -> float:
    """CPU seconds (user + system) this process has used, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _roles_cpu_s(controls: List[Any]) -> float:
    """CPU seconds (user + system) the role processes at ``controls`` (their control channels,
    with the owner token) have used (asked of each)."""
    return sum(float(c.call("cpu")) for c in controls)


def main(argv: Any = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--payloads", default="62,2048", help="values per packet, comma-separated")
    ap.add_argument("--modes", default="atp", help="live modes measured beside ring: atp, atp2, switchml, switchml_shm")
    ap.add_argument("--pool", default=str(AggregationConfig().pool),
                    help="switchml: slots of the job's partition, comma-separated (each measured)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/benchmarks/live_sync")
    ap.add_argument("--conf", type=Path, default=CONF,
                    help="config tree with model/ (default: conf under the current directory)")
    a = ap.parse_args(argv)
    payloads = [int(x) for x in a.payloads.split(",")]
    pools = [int(x) for x in a.pool.split(",")]
    configs = _configs(a.modes.split(","), payloads, pools)
    res = spawn(_worker, a.world, load_model(a.model, a.conf), configs, a.steps, a.repeats, timeout=3600)
    n = res[0]["n_params"]
    table = []
    for name in res[0]["rows"]:
        step = statistics.median(v for r in res for v in r["rows"][name]["step"])
        sync = statistics.median(v for r in res for v in r["rows"][name]["sync"])
        # CPU per sync: the sum over the ranks of each one's median, plus the role processes' (rank 0 reads them)
        workers_cpu = sum(statistics.median(r["rows"][name]["cpu"]) for r in res)
        roles_cpu = statistics.median(res[0]["rows"][name]["roles_cpu"])  # (rank 0 asked the roles)
        table.append({"mode": name, "step_ms": 1e3 * step, "sync_ms": 1e3 * sync,
                      "gbps_per_worker": 4 * n / sync / 1e9,
                      "in_switch_frac": res[0]["info"][name].get("atp_in_switch_frac"),
                      "workers_cpu_ms": 1e3 * workers_cpu, "roles_cpu_ms": 1e3 * roles_cpu,
                      "cpu_ms": 1e3 * (workers_cpu + roles_cpu)})
    ring = table[0]
    for row in table:
        row["step_vs_ring"] = row["step_ms"] / ring["step_ms"]
        row["sync_vs_ring"] = row["sync_ms"] / ring["sync_ms"]
        row["cpu_vs_ring"] = row["cpu_ms"] / ring["cpu_ms"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"world": a.world, "model": a.model, "params": n, "gradient_bytes": 4 * n, "steps": a.steps,
           "repeats": a.repeats, "pool": pools if len(pools) > 1 else pools[0],
           "command": "python -m benchmarks.live_sync " + " ".join(
               argv if argv is not None else __import__("sys").argv[1:]), "rows": table}
    (out / "live_sync.json").write_text(json.dumps(doc, indent=2) + "\n")
    with (out / "live_sync.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [r["mode"] for r in table]
    ax[0].bar(names, [r["step_ms"] for r in table])
    ax[0].set_ylabel("step time (ms)")
    ax[1].bar(names, [r["gbps_per_worker"] for r in table])
    ax[1].set_ylabel("gradient sync GB/s per worker")
    fig.suptitle(f"{a.model} ({n} params), {a.world} CPU processes: live in-network aggregation vs ring", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "live_sync.png", dpi=120)
    plt.close(fig)
    print(f"{a.model}: {n} parameters ({4 * n / 1e6:.2f} MB of gradients), {a.world} workers")
    for r in table:
        print(f"  {r['mode']:>14}: step {r['step_ms']:7.1f} ms ({r['step_vs_ring']:.2f}x ring), sync "
              f"{r['sync_ms']:7.1f} ms ({r['sync_vs_ring']:.2f}x), {r['gbps_per_worker']:.4f} GB/s per worker"
              + (f", {100 * r['in_switch_frac']:.1f}% in switch" if r["in_switch_frac"] is not None else "")
              + f"; CPU {r['cpu_ms']:.1f} ms a sync ({r['cpu_vs_ring']:.2f}x; roles {r['roles_cpu_ms']:.1f})")
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
