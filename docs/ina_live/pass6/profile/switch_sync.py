# (issue 28, pass 6; PYTHONPATH=. python docs/ina_live/pass6/profile/<this file> ...; output beside it as .txt)
import numpy as np, time, cProfile, pstats, sys
from atp_pipeline.ina.switchml import SMLSwitch, SMLSwitchJob
W, pool, k = 4, 512, int(sys.argv[1]) if len(sys.argv) > 1 else 2048
n = 875000 // k + 1
sw = SMLSwitch()
lanes = [np.random.randint(-1000, 1000, (2, pool, k)).astype(np.int32) for _ in range(W)]
sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), lanes=lanes)
uses = np.zeros(pool, dtype=np.int64)
def rnd(empty):
    global uses
    s = np.arange(n); v = uses[:n] & 1; uses[:n] += 1
    sl = np.tile(s, W); vr = np.tile(v, W); wk = np.repeat(np.arange(W), n)
    m = len(sl)
    z = np.zeros(m, np.int64)
    return (np.ones(m, np.int64), sl, vr, z, wk, np.full(m, 120), np.full(m, int(empty)), [None]*m)
def go(reps=30):
    t = time.thread_time()
    for _ in range(reps):
        sw.batch(*rnd(True)); sw.batch(*rnd(False))
    return (time.thread_time() - t) / reps * 1e3
go(3)
print("ms per sync (2 batches)", go())
pr = cProfile.Profile(); pr.enable(); go(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
