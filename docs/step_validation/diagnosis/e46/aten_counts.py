import sys, collections, torch
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from pathlib import Path
from torch.utils._python_dispatch import TorchDispatchMode
from atp_pipeline.run.calibrate_compute import compose_models, probe_entries
from atp_pipeline.planning.step_program import build_program, all_items
import transformers
class Count(TorchDispatchMode):
    def __init__(s): super().__init__(); s.calls=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket.__name__ not in ('detach','lift_fresh','alias'):
            n = out.numel() if isinstance(out, torch.Tensor) else 0
            s.calls.append((func.overloadpacket.__name__, n))
        return out
def main():
    ents = [('probe_llama_b48', None), ('probe_gpt2', None), ('probe_llama', None)]
    from atp_pipeline.run.calibrate_compute import PROBES
    names = ['probe_llama', 'probe_llama_b48', 'probe_gpt2']
    built = compose_models(probe_entries(names), Path('conf'))
    for name, (shape, spec) in zip(names, built):
        cfg = spec['model_config']
        hf = dict(cfg.hf); mt = hf.pop('model_type')
        conf = transformers.AutoConfig.for_model(mt, **hf)
        m = transformers.AutoModelForCausalLM.from_config(conf)
        b, s = spec['batch'], spec['seq_len']; T = b * s
        ids = torch.randint(0, spec['vocab'], (b, s))
        with Count() as c:
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
        big = [x for x in c.calls if x[1] >= T]
        print(name, 'T', T, 'aten calls', len(c.calls), 'token-sized', len(big))
        print('   ', collections.Counter(n for n, _ in big).most_common(40))
        prog, _ = build_program(shape, (1, 1), b, 1)
        ks = [it[1] for it in all_items(prog) if it[0] == 'k']
        print('   program kernels', len(ks), collections.Counter(k.kind for k in ks))
if __name__ == '__main__':
    main()
