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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[2]))
import e29  # noqa: E402
import e31  # noqa: E402

K = {(4, 1): 0.98, (2, 2): 0.35, (1, 4): 0.51}  # e32's medians (4 processes)


def parts(name, shape, mesh, chunks, processes, speed=None):
    """(Û', D̂): the predicted rank CPU with the calls chunking adds at ``K`` of their price, and its dispatch."""
    tl = e29.timeline(name, shape, mesh, chunks, processes, speed)
    k = K.get(mesh, 1.0) if processes == 4 and chunks > 1 else 1.0
    added = tl.coll_cpu - e29.timeline(name, shape, mesh, 1, processes, speed).coll_cpu if k != 1.0 else 0.0
    return tl.compute + tl.coll_cpu - (1 - k) * added, tl.dispatch


if __name__ == '__main__':
    sys.exit(e31.main(parts, "Û' (chunking's added calls at e32's share) and D̂", 'e33'))
