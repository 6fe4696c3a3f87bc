"""(issue 28, pass 7) One process: the SwitchML switch role's handle_batch + flush (sends stubbed) on one worker's headers of a round, 4 workers, tiny's 136,960 values, pool 512; argv[1] = values a packet. PYTHONPATH=. python <this file> 16000"""
import time, numpy as np, cProfile, pstats, sys
from atp_pipeline.ina.live.nodes import SMLSwitchNode
from atp_pipeline.ina.live.shm import create_lanes, release
from atp_pipeline.ina.switchml import SMLFormat, WIRE_HEADER, SHM_FLAG
K=int(sys.argv[1]) if len(sys.argv)>1 else 16000; POOL=512; W=4; N=136960
n=-(-N//K)
fmt=SMLFormat(K, shm=True)
node=SMLSwitchNode(fmt)
segs=[create_lanes(POOL,K) for _ in range(W)]
job=node.op_add_job([], [("127.0.0.1", 9)]*W, pool=POOL, shm=[s.name for s,_ in segs])
node.outbox.send=lambda d,a: None
uses=[0]*POOL
def round_hdrs(w, items, data):
    h=np.zeros(len(items),dtype=WIRE_HEADER)
    h["job"]=job; h["slot"]=items % n if False else items; h["worker"]=w
    return h
def one_sync():
    # exponent round: items 0..n-1 in slots 0..n-1, version v
    for phase in (0,1):
        for w in range(W):
            h=np.zeros(n,dtype=WIRE_HEADER); h["job"]=job; h["slot"]=np.arange(n); h["worker"]=w
            v=uses_v[0]
            h["flags"]=(v<<7)|(0x20 if phase==0 else SHM_FLAG)
            h["word"]=(np.arange(n)+phase*n)<<8 | 130
            t0=time.perf_counter(); node.handle_batch([(h.tobytes(),None)]); node.outbox.flush(); dt.append(time.perf_counter()-t0)
        uses_v[0]^=1
uses_v=[0]; dt=[]
for _ in range(20): one_sync()
dt=[]
for _ in range(200): one_sync()
print(f"K={K} n={n}: per batch median {1e6*np.median(dt):.0f} us, mean {1e6*np.mean(dt):.0f}")
pr=cProfile.Profile(); pr.enable()
for _ in range(200): one_sync()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
node.op_remove_job(job); node.close(); node.control.close()
for s,_ in segs: release(s, True)
