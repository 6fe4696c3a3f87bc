"""(issue 28, pass 8: pass 6's harness, plus MARK — a file rank 0 creates when the timed loop starts (for a
system-wide `perf record` of the loop alone, perf_window.sh) — and RING=0 to skip the ring loop; pass 6: pass 5's harness plus CPU per thread of a rank; run from the repository root: PYTHONPATH=. python docs/ina_live/pass6/profile/harness.py)
Profile the live SwitchML shm path: 4 ranks, flat gradient of a model's size, per-phase timers
(thread CPU + wall) in each rank's engine thread, optional cProfile of the engine thread; the switch
is started here (optionally under cProfile) and shared by the job."""
import json, os, subprocess, sys, time, statistics, cProfile, pstats, io
import numpy as np

N = int(os.environ.get("N", 875000))
K = int(os.environ.get("K", 16000))
POOL = int(os.environ.get("POOL", 512))
STEPS = int(os.environ.get("STEPS", 30))
PROF = os.environ.get("PROF", "")  # 'w' workers cProfile, 's' switch cProfile
OUT = os.environ.get("OUT", "/tmp/live_sync_profile")


def worker(rank, world, addr):
    import torch, torch.distributed as dist, threading
    from atp_pipeline.config.schema import AggregationConfig, AggregationMode, Transport
    from atp_pipeline.ina.live import engine as E
    from atp_pipeline.ina import switchml as S
    from atp_pipeline.ina.live import frames as F
    from atp_pipeline.ina.live.sync import ATPSync
    acc = {}
    def timed(cls, name, key=None):
        f = getattr(cls, name)
        key = key or name
        def g(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **kw)
            finally:
                d = acc.setdefault(key, [0.0, 0.0, 0])
                d[0] += time.perf_counter() - t0; d[1] += time.thread_time() - c0; d[2] += 1
        setattr(cls, name, g)
    for n in ("start_float", "on_headers", "flush", "_quantize", "_dequantize", "_results", "_send_many"):
        timed(S.SMLFloatWorker, n)
    timed(E.SMLEngine, "_send", "engine_send")
    timed(E.Engine, "_put", "sendto")
    timed(E.Engine, "_sync", "sync")
    # wait: wait_readable in engine module
    wr = E.wait_readable
    def wr2(p, t):
        t0, c0 = time.perf_counter(), time.thread_time()
        r = wr(p, t)
        d = acc.setdefault("wait", [0.0, 0.0, 0]); d[0] += time.perf_counter() - t0; d[1] += time.thread_time() - c0; d[2] += 1
        return r
    E.wait_readable = wr2
    dr = E.drain
    def dr2(s, l):
        t0, c0 = time.perf_counter(), time.thread_time()
        r = dr(s, l)
        d = acc.setdefault("drain", [0.0, 0.0, 0]); d[0] += time.perf_counter() - t0; d[1] += time.thread_time() - c0; d[2] += 1
        return r
    E.drain = dr2
    prof = cProfile.Profile() if "w" in PROF else None
    if prof is not None:
        run0 = E.Engine._run
        def run(self):
            prof.enable()
            try:
                run0(self)
            finally:
                prof.disable()
        E.Engine._run = run
    cfg = AggregationConfig(mode=AggregationMode.switchml, payload_k=K, pool=POOL, transport=Transport.shm,
                            switch=addr)
    sync = ATPSync.setup(dist.group.WORLD, cfg)
    g = torch.Generator().manual_seed(rank)
    flat = torch.randn(N, generator=g) * 1e-2
    for _ in range(3):
        sync.engine.all_reduce(flat.clone())
    acc.clear()
    dist.barrier()
    times = []
    import resource
    def ctx(pid="self"):
        v = n = 0
        for t in os.listdir(f"/proc/{pid}/task"):
            for line in open(f"/proc/{pid}/task/{t}/status"):
                if line.startswith("voluntary_ctxt_switches"): v += int(line.split()[1])
                if line.startswith("nonvoluntary_ctxt_switches"): n += int(line.split()[1])
        return v, n
    from atp_pipeline.ina.live.rpc import call
    ctl = tuple(int(x) if x.isdigit() else x for x in addr.split(":"))
    s0 = call(ctl, "cpu", what="switch") if rank == 0 else 0
    t0_ = call(ctl, "timers", what="switch") if rank == 0 else {}
    def thr():
        out = {}
        for t in os.listdir("/proc/self/task"):
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            out[f"{name}.{t}"] = int(open(f"/proc/self/task/{t}/schedstat").read().split()[0]) / 1e6
        return out
    th0 = thr()
    if rank == 0 and os.environ.get("MARK"):
        open(os.environ["MARK"], "w").close()
    x0 = ctx()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    iprof = cProfile.Profile(time.thread_time) if "i" in PROF else None  # pass 8: the inline syncs, CPU time
    for _ in range(STEPS):
        buf = flat.clone()
        t0 = time.perf_counter()
        if iprof is not None:
            iprof.enable()
        sync.engine.all_reduce(buf)
        if iprof is not None:
            iprof.disable()
        times.append(time.perf_counter() - t0)
    if iprof is not None:
        s_ = io.StringIO()
        pstats.Stats(iprof, stream=s_).sort_stats("tottime").print_stats(40)
        open(f"{OUT}/inline{rank}.txt", "w").write(s_.getvalue())
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    x1 = ctx()
    th1 = thr()
    s1 = call(ctl, "cpu", what="switch") if rank == 0 else 0
    t1_ = call(ctl, "timers", what="switch") if rank == 0 else {}
    swt = {k: (1e3 * (v[0] - t0_.get(k, [0, 0])[0]) / STEPS, (v[1] - t0_.get(k, [0, 0])[1]) / STEPS) for k, v in t1_.items()}
    dist.barrier()
    rt = [0.0]
    for _ in range(STEPS if os.environ.get("RING", "1") != "0" else 0):
        buf = flat.clone()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        rt.append(time.perf_counter() - t0)
    sync.close()
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        open(f"{OUT}/worker{rank}.txt", "w").write(s.getvalue())
    return {"sync_ms": 1e3 * statistics.median(times), "ring_ms": 1e3 * statistics.median(rt),
            "swt": swt, "sw_ms": 1e3 * (s1 - s0) / STEPS, "ctx": ((x1[0] - x0[0]) / STEPS, (x1[1] - x0[1]) / STEPS), "threads": {k: round((v - th0.get(k, 0)) / STEPS, 2) for k, v in th1.items() if v - th0.get(k, 0) > 0}, "cpu_ms": 1e3 * ((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)) / STEPS,
            "phases": {k: (1e3 * v[0] / STEPS, 1e3 * v[1] / STEPS, v[2] / STEPS) for k, v in acc.items()}}


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    cmd = [sys.executable] + (["-m", "cProfile", "-o", f"{OUT}/switch.prof"] if "s" in PROF else []) + [
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "swrole.py"), "switch", "--protocol", "switchml", "--transport", "shm",
        "--payload-k", str(K)]
    sw = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    info = json.loads(sw.stdout.readline())
    addr = "%s:%d" % tuple(info["control"])
    from atp_pipeline.launch import spawn
    from atp_pipeline.ina.live.rpc import call
    c0 = call(tuple(info["control"]), "cpu", what="switch")
    res = spawn(worker, 4, addr, timeout=600)
    c1 = call(tuple(info["control"]), "cpu", what="switch")
    call(tuple(info["control"]), "shutdown", what="switch")
    sw.wait()
    print(f"N={N} K={K} pool={POOL} steps={STEPS} prof={PROF!r}")
    print("sync ms per rank", [round(r["sync_ms"], 2) for r in res], "ring", [round(r["ring_ms"], 2) for r in res])
    print("switch cpu ms/sync", round(res[0]["sw_ms"], 3))
    for k, v in res[0]["swt"].items(): print(f"  switch {k:>14}: cpu {v[0]:7.3f} ms  calls {v[1]:6.1f}/sync")
    print("worker ctx switches/sync (vol, invol)", [r["ctx"] for r in res])
    print("worker cpu ms/sync", [round(r["cpu_ms"], 2) for r in res], "switch cpu total s (incl ring+warmup)", round(c1 - c0, 3))
    print("rank 0 CPU ms/sync per thread (schedstat)", res[0]["threads"])
    keys = sorted({k for r in res for k in r["phases"]})
    for k in keys:
        v = [r["phases"].get(k, (0, 0, 0)) for r in res]
        print(f"  {k:>12}: wall {np.mean([x[0] for x in v]):7.3f} ms  cpu {np.mean([x[1] for x in v]):7.3f} ms  calls {np.mean([x[2] for x in v]):6.1f}/sync")
    if "s" in PROF:
        s = io.StringIO()
        pstats.Stats(f"{OUT}/switch.prof", stream=s).sort_stats("tottime").print_stats(30)
        open(f"{OUT}/switch.txt", "w").write(s.getvalue())
