"""(issue 28, pass 7) The switch role of tl.py (this folder): time stamps of each batch it decides and of each flush."""
import json, os, sys, time
from atp_pipeline.ina.live import nodes as N, role as R
ev = []
h0 = N.SMLSwitchNode.handle_batch
def hb(self, got):
    ev.append((time.perf_counter(), "batch>", sum(len(b) for b, _ in got) // 10))
    try:
        return h0(self, got)
    finally:
        ev.append((time.perf_counter(), "batch<", 0))
N.SMLSwitchNode.handle_batch = hb
f0 = R.Outbox.flush
def fl(self):
    r = f0(self)
    ev.append((time.perf_counter(), "sent", 0))
    return r
R.Outbox.flush = fl
def dump(self):
    json.dump(ev, open(os.environ["TL_OUT"], "w")); return True
N.SMLSwitchNode.op_dump = dump
sys.exit(N.main(sys.argv[1:]))
