"""Diagnosis e17 (issue 27, run 18; a development check, after run 18's grids were seen): the CPU form's
rank-CPU correction in other shapes, fitted on run 18's own probe steps (local_anch3_probe_steps.json) and
applied to run 18's two grids (steps_anch5/6.json).

    python docs/step_validation/diagnosis/e17.py > docs/step_validation/diagnosis/e17.log
"""
import json, statistics as st, numpy as np
from atp_pipeline.planning.lstsq import nnls
probes=json.load(open('docs/step_validation/local_anch3_probe_steps.json'))['rows']
grids={t: json.load(open(f'docs/step_validation/{t}.json'))['rows'] for t in ['steps_anch5','steps_anch6']}
K3=lambda r:(r['processes'],r['mesh'],r['chunks']); K2=lambda r:(r['processes'],r['chunks'])
def group(rows,K):
    d={}
    for r in rows: d.setdefault(K(r),[]).append(r)
    return d
ratio={k:st.median(r['measured_s']/r['measured_cpu_s'] for r in v) for k,v in group(probes,K3).items()}
def ab(v):
    a,b=nnls(np.array([[r['cpu_s']/r['measured_cpu_s'],1/r['measured_cpu_s']] for r in v]),np.ones(len(v))); return a,b
variants={
 'a,b per P,c (as run)': (K2, ab),
 'factor per P,c': (K2, lambda v:(st.median(r['measured_cpu_s']/r['cpu_s'] for r in v),0)),
 'factor per P,mesh,c': (K3, lambda v:(st.median(r['measured_cpu_s']/r['cpu_s'] for r in v),0)),
 'a,b per P,mesh,c': (K3, ab),
 'none': (K2, lambda v:(1.0,0.0)),
 'factor per P': (lambda r:r['processes'], lambda v:(st.median(r['measured_cpu_s']/r['cpu_s'] for r in v),0)),
 'b48 probes only, factor P,c': (K2, lambda v:(st.median(r['measured_cpu_s']/r['cpu_s'] for r in v if 'b48' in r['probe'] or 'gpt_m' in r['probe']),0)),
}
for name,(K,f) in variants.items():
    fit={k:f(v) for k,v in group(probes,K).items()}
    out=[]
    for t,rows in grids.items():
        e=[abs(ratio[K3(r)]*(fit[K(r)][0]*r['predicted_rank_cpu_s']+fit[K(r)][1])/r['measured_s']-1) for r in rows]
        out.append(f"{t} {st.median(e):.1%}/{max(e):.1%} n>25 {sum(x>.25 for x in e)}")
    print(f"{name:30s}", ' | '.join(out))

print('\nThe rank CPU split into its compute and its collectives\' backend CPU, a factor on each (+ an offset), fitted on the same probes:')
def split(cpu, comp, P, hb=None):
    if hb is None: hb = P==4 and comp > cpu  # host-bound rows carry compute x processes/cores
    k = comp/2 if (P==4 and hb) else comp
    return k, cpu-k
def group(rows,K):
    d={}
    for r in rows: d.setdefault(K(r),[]).append(r)
    return d
for r in probes: r['k'],r['c']=split(r['cpu_s'],r['compute_s'],r['processes'])
print("probe coll share", {k: round(st.median(r['c']/r['cpu_s'] for r in v),2) for k,v in group(probes,K3).items()})
for r in sum(grids.values(),[]): r['k'],r['c']=split(r['predicted_rank_cpu_s'],r['predicted_compute_s'],r['processes'],r['predicted_host_bound'])
def fit3(v, offset):
    A=np.array([[r['k']/r['measured_cpu_s'], r['c']/r['measured_cpu_s']]+([1/r['measured_cpu_s']] if offset else []) for r in v]); x=nnls(A,np.ones(len(v))); return list(x)+([] if offset else [0.0])
for offset in (False, True):
  for kn,K in [('P,c',K2),('P',lambda r:r['processes'])]:
    fit={k:fit3(v,offset) for k,v in group(probes,K).items()}
    print(kn, 'offset' if offset else '', {k:[round(x,3) for x in v] for k,v in fit.items()})
    out=[]
    for t,rows in grids.items():
        e=[abs(ratio[K3(r)]*(fit[K(r)][0]*r['k']+fit[K(r)][1]*r['c']+fit[K(r)][2])/r['measured_s']-1) for r in rows]
        out.append(f"{t} {st.median(e):.1%}/{max(e):.1%} n>25 {sum(x>.25 for x in e)}")
    print('   ', ' | '.join(out))
