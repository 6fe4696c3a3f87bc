import os, sys, time
from atp_pipeline.ina.live import nodes as N, role as R, frames as F
from atp_pipeline.ina import switchml as S
if "GATHER_S" in os.environ:  # pass 6: the switch role's gather deadline (0: decide every drain, as before)
    N.GATHER_S = float(os.environ["GATHER_S"])
if "SML_THREADS" in os.environ:  # pass 6: threads summing the lanes (1: one, as before)
    i0 = N.SMLSwitchNode.__init__
    def init(self, *a, **kw):
        i0(self, *a, **kw)
        self.sml.threads = int(os.environ["SML_THREADS"])
    N.SMLSwitchNode.__init__ = init
    if hasattr(N.SMLSwitchNode, "_spin_for_routes"):  # pass 8: the role sets its threads per job installed
        s0 = N.SMLSwitchNode._spin_for_routes
        def spin(self):
            s0(self)
            self.sml.threads = int(os.environ["SML_THREADS"])
        N.SMLSwitchNode._spin_for_routes = spin
acc = {}
sizes = {}
b0 = S.SMLSwitch.batch
def batch(self, job, *a):
    n = len(job)
    k = "<256" if n < 256 else "<1024" if n < 1024 else ">=1024"
    sizes[k] = sizes.get(k, 0) + 1
    return b0(self, job, *a)
S.SMLSwitch.batch = batch
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
N.SMLSwitchNode.op_timers = lambda self: {**{k: list(v) for k, v in acc.items()},
                                           **{"batches " + k: [0.0, v] for k, v in sizes.items()}}
if os.environ.get("SWPROF"):  # pass 8: the role under cProfile with a CPU-time timer, written to $SWPROF
    import cProfile, pstats
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    try:
        rc = N.main(sys.argv[1:])
    finally:
        prof.disable()
        with open(os.environ["SWPROF"], "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(45)
    sys.exit(rc)
sys.exit(N.main(sys.argv[1:]))
