"""(issue 28, pass 8) One process, one thread: the SwitchML switch function over a live sync of small's
875,000 values as the live role sees it (pool 512, 4 workers, shared lanes; per round each worker's
headers one batch: the exponent-only round, then the data round), thread CPU per sync of the whole
switch function and of its lane sums. Compare trees with PYTHONPATH.
Usage: PYTHONPATH=<tree> python docs/ina_live/pass8/profile/switch_round.py K [threads]"""
import statistics, sys, time
import numpy as np
import atp_pipeline.ina.switchml as core
from atp_pipeline.ina.switchml import SMLSwitch, SMLSwitchJob
W, pool, k = 4, 512, int(sys.argv[1])
n = -(-875000 // k)
sw = SMLSwitch()
sw.threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
rng = np.random.default_rng(0)
lanes = [rng.integers(-2**28, 2**28, (2, pool, k), dtype=np.int32) for _ in range(W)]
sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), lanes=lanes)
uses = np.zeros(pool, dtype=np.int64)
def rnd(empty):
    s = np.arange(n); v = uses[:n] & 1; uses[:n] += 1
    z = np.zeros(n, np.int64)
    return [(np.ones(n, np.int64), s, v, z, np.full(n, w), np.full(n, 120), np.full(n, int(empty)), [None] * n)
            for w in range(W)]
sums = [0.0]
o = SMLSwitch._sum
def su(self, *a):
    c = time.thread_time(); r = o(self, *a); sums[0] += time.thread_time() - c; return r
SMLSwitch._sum = su
tot, ss = [], []
for rep in range(63):
    sums[0] = 0.0
    bs = [rnd(True), rnd(False)]
    t = time.thread_time()
    for r in bs:
        for b in r:
            sw.batch(*b)
    if rep >= 3:
        tot.append(time.thread_time() - t); ss.append(sums[0])
ref = sum(l[1 - (int(uses[0]) & 1) ^ 1].astype(np.int64) for l in lanes)
print(f"K={k} chunks={n} threads={sw.threads} ARRAY_MIN={core.ARRAY_MIN}: switch function {1e3 * statistics.median(tot):.3f} ms "
      f"a sync (median of 60), of which sums {1e3 * statistics.median(ss):.3f}")
