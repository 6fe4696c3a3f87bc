"""Diagnosis e33 (issue 27, after e32; development check, not a validation): the calls chunking adds, priced at what
the probes' own steps measured them (e32), in e31's arithmetic.

e32: the calls a chunks-2 step adds cost a probe's rank, per mesh on 4 processes, a median 0.98 (4x1), 0.35 (2x2) and
0.51 (1x4) of the pure loops' price — what e26 measured for the validation models. Here the predicted rank CPU of
every 4-process chunks-2 point (probe and validation alike) re-predicted by the current code with those calls at that
share, ``Û' = Û - (1 - k[mesh])·(K̂(chunks 2) - K̂(chunks 1))`` (``K̂`` the timeline's collectives' backend CPU), then
e31's three forms of the rank CPU's line on it. Arithmetic on the committed grids, no measurement (k from e32's
measurement on today's host, applied to every calibration's grids).

    python docs/step_validation/diagnosis/e33.py > docs/step_validation/diagnosis/e33.log
"""
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[2]))
import e29  # noqa: E402
import e31  # noqa: E402
from e25 import probe_steps_of, rows_of, score  # noqa: E402


K = {(4, 1): 0.98, (2, 2): 0.35, (1, 4): 0.51}  # e32's medians (4 processes)


def parts(name, shape, mesh, chunks, processes, speed=None):
    from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
    from atp_pipeline.planning.step_program import build_program
    from atp_pipeline.planning.steptime import CommClock, _run
    topo = e29.topo_of(name).restrict(processes); prof = profile_of(topo)
    if speed: prof = prof.at_speed(HostSpeed(float(speed['compute']), float(speed['overhead']), ''))
    out=[]
    for c in (chunks, 1):
        prog, _ = build_program(shape, mesh, shape.batch_size, c)
        clock = CommClock(topo, mesh, shape.bytes_per_element, None, prof.comm_factor(processes))
        tl = _run(prog, clock, prof, shape.bytes_per_element, prof.timeline_factor(processes), prof.sync_factor(processes), prof.skewed(processes))
        out.append((tl.compute + tl.coll_cpu, tl.dispatch, tl.coll_cpu))
    (u, d, k), (_, _, k1) = out
    kk = K.get(mesh, 1.0) if processes == 4 and chunks > 1 else 1.0
    return u - (1 - kk) * (k - k1), d

def main():
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.run.calibrate_compute import PROBES
    from benchmarks.step_validation import variant_overrides
    res = {f: [] for f in e31.FORMS}
    for g in e29.GRIDS_40:
        name, probe = probe_steps_of(g)
        if any(r['probe'] not in PROBES for r in probe): continue
        try: profile_of(e29.topo_of(name))
        except ConfigError: continue
        rows = rows_of(g)
        pp = [parts(name, e29.shape_of((r['probe'], tuple(PROBES[r['probe']]))), e29.mesh_of(r), r['chunks'], r['processes']) for r in probe]
        rp = [parts(name, e29.shape_of((f"{r['model']}@{r['batch']}x{r['seq_len']}", tuple(variant_overrides(r['model'], r['batch'], r['seq_len'], e29.CONF)))), e29.mesh_of(r), r['chunks'], r['processes'], r.get('host_speed')) for r in rows]
        s={}
        for f in e31.FORMS:
            p = e31.fit(probe, pp, f); by = {id(r): p(r, uh, d) for r, (uh, d) in zip(rows, rp)}
            s[f] = score(rows, lambda r: by[id(r)]); res[f].append(s[f])
        print(f"  {g:16s} " + ' | '.join(f"{f} {s[f]['median']:5.1%} / {s[f]['worst']:5.1%}{' ok' if s[f]['ok'] else '   '}" for f in e31.FORMS), flush=True)
    for f, v in res.items():
        print(f"  {f:18s}: every target in {sum(x['ok'] for x in v):2d} of {len(v)} grids; mean worst {np.mean([x['worst'] for x in v]):.3f}; mean level {np.mean([x['level'] for x in v]):+.3f}; mean sd {np.mean([x['sd'] for x in v]):.3f}")
        r = v[-8:]; print(f"  {f:18s} on runs 35-38: every target in {sum(x['ok'] for x in r)} of {len(r)}; mean worst {np.mean([x['worst'] for x in r]):.3f}")

if __name__ == '__main__':
    sys.exit(main())
