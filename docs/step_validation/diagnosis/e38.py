"""Diagnosis e38 (issue 27, after runs 42-44): the 2-process cells long, 4-process short -- the harness or the model?

The same two probe models (probe_llama_b48, probe_gpt_s_b48: in the calibration's sample), the same calibration
(docs/step_validation/local_br5.yaml), measured alternately by the calibration's own live-step protocol
(calibrate_compute.retime_steps) and by the validation harness (benchmarks.step_validation._worker) on 2 and 4
processes, twice; measured / predicted, geometric mean (range) over the cells. Run from the repository root:

    PYTHONPATH=. python docs/step_validation/diagnosis/e38.py docs/step_validation/local_br5.yaml
"""
import json, statistics as st, sys, math
from pathlib import Path
from atp_pipeline.launch import spawn
from atp_pipeline.run.calibrate_compute import compose_models, probe_entries, retime_steps
from atp_pipeline.planning.compute_profile import profile_of
from atp_pipeline.planning.search import candidate_meshes
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from benchmarks.step_validation import _worker, load_calibrated
CONF=Path("conf")
PROBES=("probe_llama_b48","probe_gpt_s_b48")
def harness(topo, prof, w):
    out={}
    for (shape,spec),name in zip(compose_models(probe_entries(PROBES),CONF),PROBES):
        pts=[(d1,d2,c,False) for d1,d2 in candidate_meshes(w) for c in (1,2)]
        got=spawn(_worker,w,{**spec,"points":pts,"emulate":None,"slowdown":1.0,"steps":3,"warmup":2,"repeats":4},timeout=1200)[0]
        for d1,d2,c,_ in pts:
            meas=st.median(got["times"][json.dumps([d1,d2,c,False])])
            pred=estimate_step(topo.restrict(w),shape,(d1,d2),StepSetting(chunks=c),prof).step_s
            out[f"{name} {d1}x{d2}/c{c}"]=meas/pred
    return out
def main():
    topo,_=load_calibrated(sys.argv[1],"",CONF); prof=profile_of(topo)
    for rep in range(2):
        for w in (2,4):
            ps=retime_steps(prof,topo,w,CONF,probes=PROBES)
            cal={k:m/p for k,(m,p) in ps.steps.items()}
            h=harness(topo,prof,w)
            gm=lambda d: math.exp(st.fmean(math.log(v) for v in d.values()))
            print(f"rep {rep} {w} proc.: calibration protocol x{gm(cal):.2f} ({min(cal.values()):.2f}-{max(cal.values()):.2f}), harness x{gm(h):.2f} ({min(h.values()):.2f}-{max(h.values()):.2f})", flush=True)
if __name__=="__main__":
    main()
