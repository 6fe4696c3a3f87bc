"""Attention cores on one process: the calibration's sweep (run 61's grid) and off-grid cores of the
validation's shapes, each the lower of two timings (a process's CPU time): attention_sweep.json.

    python docs/step_validation/diagnosis/e47/attention_sweep_measure.py"""
import sys
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
import torch, time, math, statistics, json
from atp_pipeline.planning.kernels import Kernel, ATTN_FWD, ATTN_BWD
from atp_pipeline.run.calibrate_compute import _runner, fit_kind, sweep_kernels
from atp_pipeline.planning.compute_profile import ComputeProfile, grid_seconds
torch.set_num_threads(1)
def bench(f):
    f(); t0=time.process_time(); n=0
    while time.process_time()-t0 < 0.1: f(); n+=1
    return (time.process_time()-t0)/n
sweep=[k for k in sweep_kernels() if k.kind in (ATTN_FWD, ATTN_BWD)]
tests=[]
for b,a,s,d in [(12,4,140,8),(12,4,140,16),(4,4,228,8),(4,4,228,16),(14,4,92,8),(6,2,212,16),(12,2,140,8),(8,8,128,8),(6,2,48,12),(48,2,48,12),(3,2,228,16),(7,4,92,8),(8,4,196,8),(4,2,196,16),(5,4,172,8),(10,2,172,16),(8,2,100,8),(16,4,76,8),(2,8,512,64),(4,4,100,16)]:
    for kind in (ATTN_FWD,ATTN_BWD): tests.append(Kernel(kind,(b,a,s,d)))
ms={}
for rep in range(2):
    for k in sweep+tests: ms.setdefault(k,[]).append(bench(_runner(k,0,1)))
ms={k:min(v) for k,v in ms.items()}
json.dump([[k.kind,k.dims,t] for k,t in ms.items()], open(_P(__file__).with_name('attention_sweep.json'),'w'))
