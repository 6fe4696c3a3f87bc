# (issue 28, pass 6; PYTHONPATH=. python docs/ina_live/pass6/profile/<this file> ...; output beside it as .txt)
import numpy as np, time, sys
import atp_pipeline.ina.switchml as core
from atp_pipeline.ina.switchml import SMLSwitch, SMLSwitchJob
W, pool, k = 4, 512, int(sys.argv[1])
n = 875000 // k + 1
def mk():
    sw = SMLSwitch()
    lanes = [np.random.randint(-1000, 1000, (2, pool, k)).astype(np.int32) for _ in range(W)]
    sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), lanes=lanes)
    return sw
uses = np.zeros(pool, dtype=np.int64)
def rnd(empty):
    s = np.arange(n); v = uses[:n] & 1; uses[:n] += 1
    z = np.zeros(n, np.int64)
    return [(np.ones(n, np.int64), s, v, z, np.full(n, w), np.full(n, 120), np.full(n, int(empty)), [None]*n) for w in range(W)]
def go(sw, reps=40):
    dec = 0.0
    t = time.thread_time()
    for _ in range(reps):
        for e in (True, False):
            for b in rnd(e): sw.batch(*b)
    return (time.thread_time() - t) / reps * 1e3
for amin in (1024, 1, 1024, 1):
    core.ARRAY_MIN = amin
    sw = mk(); go(sw, 3)
    t0 = time.thread_time(); s0 = [0.0]
    o = core.SMLSwitch._sum
    def su(self, *a):
        c = time.thread_time(); r = o(self, *a); s0[0] += time.thread_time() - c; return r
    core.SMLSwitch._sum = su
    tot = go(sw)
    core.SMLSwitch._sum = o
    print(f"k={k} ARRAY_MIN={amin}: {tot:.3f} ms a sync, of which sums {s0[0]/40*1e3:.3f}")
