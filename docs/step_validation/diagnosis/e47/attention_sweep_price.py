"""The off-grid cores of attention_sweep.json priced from its sweep three ways (a size curve over the
sweep before run 61's head sizes and sequences, run 61's grid, the grid at the sequence rounded up to
torch's CPU block) and by run 60's calibration (local_gc1.yaml): ratios measured/priced; the spread of
their logs is what matters (the level is the host's and the process count's).

    python docs/step_validation/diagnosis/e47/attention_sweep_price.py"""
import sys
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
import json, math, statistics
from atp_pipeline.planning.kernels import Kernel, ATTN_FWD, ATTN_BWD
from atp_pipeline.planning.compute_profile import ComputeProfile, grid_seconds
from atp_pipeline.run.calibrate_compute import fit_kind, sweep_kernels
data={Kernel(k,tuple(d)):t for k,d,t in json.load(open(_P(__file__).with_name('attention_sweep.json')))}
sweep=set(k for k in sweep_kernels() if k.kind in (ATTN_FWD,ATTN_BWD))
tests=[k for k in data if k not in sweep]
def pad(s):
    q = 256 if s>=768 else 64 if s>=192 else 32
    return -(-s//q)*q
methods={}
# size curve over all sweep points
fits={kind: fit_kind([k for k in sweep if k.kind==kind],[data[k] for k in sweep if k.kind==kind]) for kind in (ATTN_FWD,ATTN_BWD)}
prof=ComputeProfile(name='x',source='x',fits=fits,points={(k.kind,k.dims):data[k] for k in sweep})
curve=ComputeProfile(name='x',source='x',fits=fits,points={(k.kind,k.dims):data[k] for k in sweep if k.dims[3] in (8,32) and k.dims[2] in (32,128)})
object.__setattr__(curve,'_grid_cache',{})
methods['old-size-curve(d8,32;s32,128)']=lambda k: curve.seconds(k)
methods['grid raw s']=lambda k: prof.seconds(k)
g=prof.kernel_grids()
methods['grid padded s']=lambda k: grid_seconds(*g[k.kind], (k.dims[0]*k.dims[1], pad(k.dims[2]), k.dims[3]))
for name,f in methods.items():
    e=[data[k]/f(k)-1 for k in tests]
    ef=[data[k]/f(k)-1 for k in tests if k.kind==ATTN_FWD]; eb=[data[k]/f(k)-1 for k in tests if k.kind==ATTN_BWD]
    print(f"{name:32s} median |e| {statistics.median(map(abs,e)):.3f} worst {max(map(abs,e)):.3f}  fwd mean {statistics.mean(ef):+.3f} bwd mean {statistics.mean(eb):+.3f}")
for k in tests:
    print(k.kind[10:], k.dims, ' '.join(f"{data[k]/f(k):.2f}" for f in methods.values()))
from pathlib import Path
from benchmarks.step_validation import load_calibrated
from atp_pipeline.planning.compute_profile import profile_of
gc=profile_of(load_calibrated('docs/step_validation/local_gc1.yaml','',Path('conf'))[0])
object.__setattr__(gc,'_grid_cache',{})
methods['run60 profile (size curve)']=lambda k: gc.seconds(k)
print()
for name,f in methods.items():
    lr=[math.log(data[k]/f(k)) for k in tests]
    m=statistics.mean(lr)
    print(f"{name:32s} mean log ratio {m:+.3f} sd {statistics.pstdev(lr):.3f}  worst |dev| {max(abs(x-m) for x in lr):.3f}")
