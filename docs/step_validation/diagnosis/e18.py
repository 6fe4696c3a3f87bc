"""Diagnosis e18 (issue 27, runs 18-19; a development check after their grids were seen): the step as
factors on the predicted compute CPU and collectives CPU (per cell or per process and chunk count, with or
without an offset), or the step-to-CPU ratio linear in the collectives share, fitted on each run s own probe
steps (local_anch3/4_probe_steps.json) and applied to its two grids.

    python docs/step_validation/diagnosis/e18.py > docs/step_validation/diagnosis/e18.log
"""
import json, statistics as st, numpy as np, yaml
from atp_pipeline.planning.lstsq import nnls
K3=lambda r:(r['processes'],r['mesh'],r['chunks']); K2=lambda r:(r['processes'],r['chunks'])
def split(cpu, comp, P, hb=None):
    if hb is None: hb = P==4 and comp > cpu
    k = comp/2 if (P==4 and hb) else comp
    return k, cpu-k
def group(rows,K):
    d={}
    for r in rows: d.setdefault(K(r),[]).append(r)
    return d
sets={'run18':('docs/step_validation/local_anch3_probe_steps.json',['steps_anch5','steps_anch6'],'docs/step_validation/local_anch3.yaml'),
      'run19':('docs/step_validation/local_anch4_probe_steps.json',['steps_anch7','steps_anch8'],'docs/step_validation/local_anch4.yaml')}
for name,(pf,grids,cal) in sets.items():
    probes=json.load(open(pf))['rows']
    for r in probes: r['k'],r['c']=split(r['cpu_s'],r['compute_s'],r['processes'])
    G={}
    for t in grids:
        try: G[t]=json.load(open(f'docs/step_validation/{t}.json'))['rows']
        except FileNotFoundError: pass
    for rs in G.values():
        for r in rs: r['k'],r['c']=split(r['predicted_rank_cpu_s'],r['predicted_compute_s'],r['processes'],r['predicted_host_bound'])
    def ev(label, pred):
        print(f"  {label:40s}", ' | '.join(f"{t} {st.median(e):.1%}/{max(e):.1%} n>25 {sum(x>.25 for x in e)}" for t,rs in G.items() for e in [[abs(pred(r)/r['measured_s']-1) for r in rs]]))
    print(name)
    ev('as run', lambda r:r['predicted_s'])
    for kn,K in [('P,mesh,c',K3),('P,c',K2)]:
        for off in (False,True):
            fit={}
            for k,v in group(probes,K).items():
                A=np.array([[r['k']/r['measured_s'], r['c']/r['measured_s']]+([1/r['measured_s']] if off else []) for r in v]); x=nnls(A,np.ones(len(v)))
                fit[k]=list(x)+([0] if not off else [])
            ev(f'T = x*Uk + y*Uc{" + z" if off else ""} per {kn}', lambda r: fit[K(r)][0]*r['k']+fit[K(r)][1]*r['c']+fit[K(r)][2])
    # ratio-as-function of coll share: T/Umeas = g0 + g1*share per P,c ; CPU as run
    sr=yaml.safe_load(open(cal))['device']['compute']['step_residual']['cpu_fit']
    for kn,K in [('P,c',K2),('P,mesh,c',K3)]:
        fit={}
        for k,v in group(probes,K).items():
            A=np.array([[1, r['c']/r['cpu_s']] for r in v]); y=np.array([r['measured_s']/r['measured_cpu_s'] for r in v])
            fit[k]=np.linalg.lstsq(A,y,rcond=None)[0]
        ev(f'ratio = g0 + g1*collshare per {kn}', lambda r:(fit[K(r)][0]+fit[K(r)][1]*r['c']/r['predicted_rank_cpu_s'])*(sr[r['processes']][r['chunks']][0]*r['predicted_rank_cpu_s']+sr[r['processes']][r['chunks']][1]*1e-6))
