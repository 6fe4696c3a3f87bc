"""Worker for tests/test_vocab_loss.py: transformers causal LMs (tiny configs, float64) marked
with ``vocab_parallel_loss`` (what ``model.vocab_parallel_loss=true`` does) and laid out by the
HF adapter's own plan, which splits the head (and, tied, the embedding) by vocabulary and
installs the vocabulary-parallel loss, against the single-process model under transformers'
own loss. Returns plain data; the test asserts."""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .hf_workers import VOCAB, build

FAMILIES = {"llama": "untied", "gpt2": "tied"}


def vocab_plan(sub: torch.nn.Module, plan: Dict[str, Any]) -> Dict[str, Any]:
    """The adapter's plan with the head's (and a tied head's table's) entries swapped for the
    vocabulary-split styles: the entries the adapter is to emit."""
    names = {id(m): n for n, m in sub.named_modules()}
    head, table = names[id(sub.get_output_embeddings())], names[id(sub.get_input_embeddings())]
    out = dict(plan)
    if sub.get_output_embeddings().weight is sub.get_input_embeddings().weight:
        out[table] = "vocab_embedding(output=split)"
        out[head] = f"vocab_tied(table={table}, input=split)"
    else:
        out[head] = "vocab_head(input=split)"
    return out


def transformers_loss64() -> Callable[..., torch.Tensor]:
    """transformers' own ``ForCausalLMLoss``, its source with the one line ``logits =
    logits.float()`` removed (which would round float64 logits to float32): the reference the
    vocabulary-parallel loss must equal within 1e-9 in float64."""
    from transformers.loss import loss_utils

    src = inspect.getsource(loss_utils.ForCausalLMLoss)
    line = "    logits = logits.float()\n"
    assert src.count(line) == 1, "transformers' ForCausalLMLoss changed: review the reference"
    scope = dict(vars(loss_utils))
    exec(compile(src.replace(line, ""), loss_utils.__file__, "exec"), scope)  # noqa: S102
    return scope["ForCausalLMLoss"]


CAP = 3.0


def softcap(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
    """Gemma-2's final logit softcapping, ``cap * tanh(logits / cap)``, between the head and the
    loss (as a forward hook on the head: the families laid out today apply none)."""
    return torch.tanh(logits / CAP) * CAP


def cases(batch: torch.Tensor) -> List[Tuple[str, Dict[str, Any]]]:
    """The loss's inputs: labels with some -100, labels plus ``shift_labels``, ``num_items_in_batch``,
    and labels with the logits softcapped (:func:`softcap`)."""
    labels = batch.clone()
    labels[0, :3] = -100
    labels[-1, 4] = -100
    shift = torch.roll(batch, -2, dims=1)
    shift[1, 2:5] = -100
    return [("labels", dict(labels=labels)),
            ("shift_labels", dict(labels=labels, shift_labels=shift)),
            ("num_items", dict(labels=labels, num_items_in_batch=torch.tensor(37))),
            ("softcap", dict(labels=labels))]


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def exactness(rank: int, world: int, meshes: List[Tuple[int, int]]) -> Dict[str, Any]:
    """For each family and mesh and each of :func:`cases` (and a token count the mesh does not
    divide): the loss and every full gradient against the single-process model under
    transformers' loss (float64), the logits' shape on this rank, the counted collectives of
    the first case (to compare with the cost model), and transformers' own float32-upcast loss."""
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.models.hf.adapter import vocab_parallel_loss
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.dense import dense_tensors
    from atp_pipeline.parallel.mesh import init_mesh
    from atp_pipeline.parallel.vocab import VocabParallelCausalLMLoss

    ref_loss = transformers_loss64()
    batches = {"even": torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1)),
               "padded": torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))}
    out = []
    for family in FAMILIES:
        dense = build(family)
        refs: Dict[Tuple[str, str], Dict[str, Any]] = {}
        for bname, idx in batches.items():
            for cname, kw in (cases(idx) if bname == "even" else cases(idx)[:1]):
                hook = dense.get_output_embeddings().register_forward_hook(softcap) if cname == "softcap" else None
                logits = dense(input_ids=idx).logits
                loss = ref_loss(logits, vocab_size=VOCAB, **kw)
                loss.backward()
                grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
                dense.zero_grad(set_to_none=True)
                with torch.no_grad():  # transformers' own path: the model's loss, upcast to float32
                    own = dense(input_ids=idx, **kw).loss.item()
                if hook is not None:
                    hook.remove()
                refs[(bname, cname)] = {"loss": loss.item(), "grads": grads, "own": own,
                                        "logits_numel": logits.numel()}
        for d1, d2 in meshes:
            mesh = init_mesh((d1, d2))
            model = copy.deepcopy(dense)
            (name, adapter, sub), = find_adapters(model)
            vocab_parallel_loss(sub)  # what model.vocab_parallel_loss=true does to the model train.py builds
            shape = adapter.shape(sub)
            plan = prefixed(name, adapter.parallel_plan(sub))
            expected = vocab_plan(sub, plan)
            apply_plan(model, plan, mesh)
            comm = comm_for(mesh)
            for (bname, cname), ref in refs.items():
                idx = batches[bname]
                kw = dict(cases(idx))[cname]
                comm.stats.reset()
                hook = model.get_output_embeddings().register_forward_hook(softcap) if cname == "softcap" else None
                res = model(input_ids=idx, **kw)
                res.loss.backward()
                if hook is not None:
                    hook.remove()
                counted = {f"{k}/{a}": n for (k, a), n in comm.stats.elements().items()}
                grads = dense_tensors(model, grad=True)
                model.zero_grad(set_to_none=True)
                floor = 1e-3 * max(float(g.abs().max()) for g in ref["grads"].values())
                err = {n: _rel(grads[n], g, floor) for n, g in ref["grads"].items()}
                out.append({"family": family, "tied": FAMILIES[family], "mesh": (d1, d2), "batch": bname,
                            "case": cname, "loss": res.loss.item(), "ref": ref["loss"], "own": ref["own"],
                            "loss_err": abs(res.loss.item() - ref["loss"]) / abs(ref["loss"]),
                            "grad_err": max(err.values()), "worst": max(err, key=err.get),
                            "same_params": sorted(grads) == sorted(ref["grads"]),
                            "logits_shape": tuple(res.logits.shape), "logits_numel": ref["logits_numel"],
                            "tokens": int(idx.numel()), "counted": counted,
                            "shape": shape.to_dict(), "plan_as_expected": plan == expected,
                            "loss_installed": isinstance(model.loss_function, VocabParallelCausalLMLoss)})
    return {"rows": out, "refusal": loss_of_whole_logits(comm_for(init_mesh((2, 2))))}


def loss_of_whole_logits(comm: Any) -> Optional[str]:
    """The vocabulary-parallel loss refuses logits that are not this rank's block (one line)."""
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.parallel.vocab import causal_lm_loss

    try:
        causal_lm_loss(torch.zeros(4, 8, VOCAB, dtype=torch.float64), F.pad(torch.ones(4, 7, dtype=torch.long), (0, 1)),
                       VOCAB, comm)
    except ConfigError as e:
        return str(e)
    return None
