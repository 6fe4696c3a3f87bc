import sys, time
from atp_pipeline.ina.live import nodes as N, role as R, frames as F
from atp_pipeline.ina import switchml as S
acc = {}
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **kw):
        c0 = time.thread_time()
        try:
            return f(*a, **kw)
        finally:
            d = acc.setdefault(key, [0.0, 0]); d[0] += time.thread_time() - c0; d[1] += 1
    setattr(cls, name, g)
wrap(N.SMLSwitchNode, "handle_batch", "handle_batch")
wrap(S.SMLSwitch, "batch", "batch")
wrap(S.SMLSwitch, "_sum", "_sum")
wrap(S.SMLSwitch, "_batch_arrays", "_batch_arrays")
wrap(S.SMLFormat, "headers", "headers")
wrap(F.Outbox, "flush", "outbox_flush")
d0 = F.drain
def drain(*a):
    c0 = time.thread_time()
    r = d0(*a)
    d = acc.setdefault("drain", [0.0, 0]); d[0] += time.thread_time() - c0; d[1] += 1
    return r
R.drain = drain
N.SMLSwitchNode.op_timers = lambda self: {k: list(v) for k, v in acc.items()}
sys.exit(N.main(sys.argv[1:]))
