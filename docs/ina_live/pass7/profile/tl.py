"""(issue 28, pass 7; from the root of the tree to profile: PYTHONPATH=. python <this file>; N, K, POOL, STEPS, OUT in the environment)
Critical path of one live SwitchML shm sync: time stamps (CLOCK_MONOTONIC, shared by the processes) of each
stage in every rank (the caller, the engine thread) and in the switch role, 4 ranks, STEPS syncs of a flat
gradient of N values; prints the median offset of each stage from the sync's start on rank 0."""
import json, os, subprocess, sys, time, statistics
import numpy as np

N = int(os.environ.get("N", 136960)); K = int(os.environ.get("K", 16000)); POOL = int(os.environ.get("POOL", 512))
STEPS = int(os.environ.get("STEPS", 40)); OUT = os.environ.get("OUT", "/tmp/p7/tl")
HERE = os.path.dirname(os.path.abspath(__file__))


def worker(rank, world, addr):
    import torch, torch.distributed as dist
    from atp_pipeline.config.schema import AggregationConfig, AggregationMode, Transport
    from atp_pipeline.ina.live import engine as E
    from atp_pipeline.ina import switchml as S
    from atp_pipeline.ina.live.sync import ATPSync
    ev = []
    def stamp(cls, name, tag):
        f = getattr(cls, name)
        def g(*a, **kw):
            ev.append((time.perf_counter(), tag + ">"))
            try:
                return f(*a, **kw)
            finally:
                ev.append((time.perf_counter(), tag + "<"))
        setattr(cls, name, g)
    for n, t in (("start_float", "start"), ("on_headers", "recv"), ("_quantize", "quant"), ("_dequantize", "deq")):
        stamp(S.SMLFloatWorker, n, t)
    stamp(E.Engine, "_put", "send"); stamp(E.Engine, "_sync", "engine")
    cfg = AggregationConfig(mode=AggregationMode.switchml, payload_k=K, pool=POOL, transport=Transport.shm, switch=addr)
    sync = ATPSync.setup(dist.group.WORLD, cfg)
    flat = torch.randn(N, generator=torch.Generator().manual_seed(rank)) * 1e-2
    for _ in range(3):
        sync.engine.all_reduce(flat.clone())
    dist.barrier()
    ev.clear()
    for _ in range(STEPS):
        buf = flat.clone()
        dist.barrier()
        ev.append((time.perf_counter(), "call>"))
        sync.engine.all_reduce(buf)
        ev.append((time.perf_counter(), "call<"))
    dist.barrier()
    rt = []
    for _ in range(STEPS):
        buf = flat.clone(); dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(buf); rt.append(time.perf_counter() - t0)
    sync.close()
    return {"ev": ev, "ring_ms": 1e3 * statistics.median(rt)}


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    env = {**os.environ, "TL_OUT": f"{OUT}/switch.json"}
    sw = subprocess.Popen([sys.executable, os.path.join(HERE, "tlrole.py"), "switch", "--protocol", "switchml", "--transport",
                           "shm", "--payload-k", str(K)], stdout=subprocess.PIPE, text=True, env=env)
    info = json.loads(sw.stdout.readline())
    from atp_pipeline.launch import spawn
    from atp_pipeline.ina.live.rpc import call
    res = spawn(worker, 4, "%s:%d" % tuple(info["control"]), timeout=600)
    call(tuple(info["control"]), "dump", what="switch")
    call(tuple(info["control"]), "shutdown", what="switch")
    sw.wait()
    swev = json.load(open(f"{OUT}/switch.json"))
    # split each rank's events by sync
    per = []  # per sync: {key: offset ms}
    starts = [[t for t, e in r["ev"] if e == "call>"] for r in res]
    ends = [[t for t, e in r["ev"] if e == "call<"] for r in res]
    rows = []
    for s in range(STEPS):
        t0 = min(starts[r][s] for r in range(4)); t1 = max(ends[r][s] for r in range(4))
        d = {}
        for r in range(4):
            cnt = {}
            for t, e in res[r]["ev"]:
                if starts[r][s] <= t <= ends[r][s]:
                    c = cnt[e] = cnt.get(e, 0) + 1
                    d[f"w{r} {e}{c}"] = 1e3 * (t - t0)
        cnt = {}
        for t, e, n in swev:
            if t0 <= t <= t1:
                c = cnt[e] = cnt.get(e, 0) + 1
                d[f"sw {e}{c} (n={n})" if e.endswith(">") else f"sw {e}{c}"] = 1e3 * (t - t0)
        rows.append(d)
    keys = {}
    for d in rows:
        for k in d:
            keys[k] = keys.get(k, 0) + 1
    med = {k: statistics.median(d[k] for d in rows if k in d) for k, c in keys.items() if c >= STEPS // 2}
    print(f"N={N} K={K} pool={POOL} steps={STEPS}; ring median {statistics.median(r['ring_ms'] for r in res):.2f} ms")
    print("sync (max over ranks of call< - min call>) median ms:", round(statistics.median(
        1e3 * (max(ends[r][s] for r in range(4)) - min(starts[r][s] for r in range(4))) for s in range(STEPS)), 3))
    for k, v in sorted(med.items(), key=lambda kv: kv[1]):
        print(f"  {v:8.3f}  {k}  ({keys[k]}/{STEPS} syncs)")
