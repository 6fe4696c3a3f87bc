"""Diagnosis e19, ops (issue 27; no timing): the aten operators one forward and backward of the runtime's parallel model
dispatches (torch.profiler, the operators called from Python, not those inside another aten operator) against the
kernels the step model's program lists for it (`build_program`, the optimizer apart), on 2 processes, meshes 2x1 and
1x2, chunks 1: the probes and the three validation models at batch 8, sequence 32.

    python docs/step_validation/diagnosis/e19_ops.py > docs/step_validation/diagnosis/e19_ops.log
"""
import collections, copy, sys
from pathlib import Path
sys.path.insert(0, '.')
from atp_pipeline.run import calibrate_compute as C


def runtime_step(spec, mesh, chunks=1):
    """One training forward and backward of the runtime's parallel model of ``spec`` on ``mesh`` (a callable)."""
    import torch
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel.apply import apply_plan
    adapter = get_adapter(spec['family'])
    torch.manual_seed(0)
    model = copy.deepcopy(adapter.build(spec['model_config']))
    b, s, V = spec['batch'], spec['seq_len'], spec['vocab']
    idx, tgt = torch.randint(0, V, (b, s)), torch.randint(0, V, (b, s))
    apply_plan(model, adapter.parallel_plan(model), C._mesh(*mesh), chunks)

    def step():
        adapter.lm_loss(model, idx, tgt).backward()
        model.zero_grad(set_to_none=True)
    return step


def worker(rank, world, entries):
    from torch.profiler import ProfilerActivity, profile
    out = []
    for label, spec, mesh in entries:
        step = runtime_step(spec, mesh)
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ev = [e for e in prof.events() if e.name.startswith('aten::')]
        out.append((label, mesh, sum(1 for e in ev if e.cpu_parent is None or not e.cpu_parent.name.startswith('aten::'))))
    return out


if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    from atp_pipeline.planning.step_program import all_items, build_program
    from benchmarks.step_validation import variant_overrides
    conf = Path('conf')
    ents = [(n, C.PROBES[n]) for n in C.PROBES] + [(f"{m}@8x32", variant_overrides(m, 8, 32, conf))
                                                   for m in ('llama_tiny', 'gpt2_tiny', 'small')]
    built = C.compose_models(ents, conf)
    shapes = {label: sh for (label, _), (sh, _) in zip(ents, built)}
    res = spawn(worker, 2, [(label, spec, mesh) for (label, _), (_, spec) in zip(ents, built) for mesh in ((2, 1), (1, 2))],
                timeout=600)[0]
    print("model               mesh  aten ops  program kernels  ops a kernel   the program's kernels by kind")
    for label, mesh, n in res:
        prog, _ = build_program(shapes[label], mesh, shapes[label].batch_size, 1)
        ks = [it[1].kind for it in all_items(prog) if it[0] == 'k' and it[1].kind != 'optimizer']
        print(f"{label:18s} {mesh[0]}x{mesh[1]}  {n:8d}  {len(ks):15d}  {n / len(ks):12.2f}   {dict(collections.Counter(ks))}")
