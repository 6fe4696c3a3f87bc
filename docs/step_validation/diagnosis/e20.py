"""Diagnosis e20 (issue 27, after runs 20-21; no timing): the sharded parameters a step reads. The runtime's DTensor
``to_local`` calls in one training forward and backward (counted on rank 0 of 2 processes) against
``step_program.param_reads`` of the same shape, for the probes and the three validation models at batch 8, sequence 32,
on 2x1 and 1x2, chunks 1 and 2 (4 processes: ``python ... 4``, meshes 4x1, 2x2, 1x4).

    python docs/step_validation/diagnosis/e20.py 2 > docs/step_validation/diagnosis/e20.log
"""
import sys
from pathlib import Path
sys.path.insert(0, '.')
from atp_pipeline.planning.step_program import param_reads
from atp_pipeline.run import calibrate_compute as C
from tests.test_steptime import _count_reads

if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    from benchmarks.step_validation import variant_overrides
    conf = Path('conf')
    ents = [(n, C.PROBES[n]) for n in ('probe_gpt_s', 'probe_gpt_m', 'probe_llama', 'probe_gpt2')] + [
        (f"{m}@8x32", variant_overrides(m, 8, 32, conf)) for m in ('llama_tiny', 'gpt2_tiny', 'small')]
    built = C.compose_models(ents, conf)
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    meshes = [(2, 1), (1, 2)] if world == 2 else [(4, 1), (2, 2), (1, 4)]
    points = [(label, shape, spec, m, c) for (label, _), (shape, spec) in zip(ents, built) for m in meshes for c in (1, 2)]
    got = spawn(_count_reads, world, [(spec, m, c) for _, _, spec, m, c in points], timeout=600)[0]
    print("model             mesh  chunks  runtime to_local  param_reads   layout")
    for (label, sh, _, m, c), n in zip(points, got):
        print(f"{label:16s} {m[0]}x{m[1]}  {c:6d}  {n:16d}  {param_reads(sh, c):11d}   L={sh.layers} bias={sh.bias} "
              f"{sh.norm}:{sh.norm_layout} {sh.position} head={sh.head_layout} qkv_fused={sh.qkv_fused} ffn_matrices={sh.ffn_matrices}")
    print("all equal:", all(n == param_reads(sh, c) for (_, sh, _, _, c), n in zip(points, got)))
