import numpy as np, time
from atp_pipeline.ina import switchml as core
from atp_pipeline.ina.switchml import SMLSwitch, SMLSwitchJob
W, pool, k, n = 4, 512, 2048, 428
lanes = [np.ones((2, pool, k), np.int32) for _ in range(W)]
def run(array_min, rounds=20):
    core.ARRAY_MIN = array_min
    sw = SMLSwitch(); sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), lanes=lanes)
    tot = 0.0
    for r in range(rounds):
        for phase in range(2):  # exponent-only then lanes
            v = (2 * r + phase) & 1
            for w in range(W):
                f = dict(job=np.ones(n, np.int64), slot=np.arange(n), ver=np.full(n, v), is_result=np.zeros(n, np.int64),
                         worker=np.full(n, w), exp=np.full(n, 130), empty=np.full(n, 1 - phase))
                t = time.thread_time()
                out = sw.batch(**f, payload=[None] * n)
                tot += time.thread_time() - t
    return tot / rounds * 1e3
for am in (1 << 30, 32):
    print("ARRAY_MIN", am, round(run(am), 3), "ms per sync (8 batches of 428)")
def dec(array_min, rounds=20):
    core.ARRAY_MIN = array_min
    sw = SMLSwitch(); sw.jobs[1] = SMLSwitchJob(1, W, pool, k, -1, list(range(W)), lanes=lanes)
    tot = 0.0
    for r in range(rounds):
        for phase in range(2):
            v = (2 * r + phase) & 1
            for w in range(W):
                f = dict(job=np.ones(n, np.int64), slot=np.arange(n), ver=np.full(n, v), is_result=np.zeros(n, np.int64),
                         worker=np.full(n, w), exp=np.full(n, 130), empty=np.ones(n, np.int64))
                t = time.thread_time()
                out = sw.batch(**f, payload=[None] * n)
                tot += time.thread_time() - t
    return tot / rounds * 1e3
for am in (1 << 30, 32):
    print("decisions only ARRAY_MIN", am, round(dec(am), 3), "ms per sync (8 batches of 428)")
