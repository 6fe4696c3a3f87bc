"""Every causal LM transformers registers, laid out by ATP with no plan of ours: the coverage sweep.

    python -m benchmarks.hf_coverage                      # all of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    python -m benchmarks.hf_coverage --types llama,gpt2   # a subset

For each model type it builds a tiny configuration (:func:`tiny_config`: the type's own
defaults with every size field shrunk, dropout 0, float64) where transformers can build one
on CPU without downloads, and on 4 gloo processes lays the model out with the HF adapter's
plan (no plan given: derived from what transformers declares and what the modules show) on
2x2 and 1x4; one forward and backward, the loss and every gradient against the single
process. Each type ends in one of:

* ``exact``   — loss and every gradient within 1e-9 (relative) on both meshes;
* ``refused`` — the layout refused it in one line (the reason is recorded);
* ``skipped`` — not a decoder-only model this sweep can build here (no tiny config,
  an encoder-decoder or multimodal wrapper); the reason is recorded;
* ``wrong``   — laid out but not exact (a bug: silently wrong);
* ``error``   — anything else (a traceback: a bug).

It writes ``<out>/hf_coverage.json`` and the table ``docs/hf_coverage.md`` (``--doc``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

VOCAB, SEQ, BATCH = 128, 8, 2
MESHES: Tuple[Tuple[int, int], ...] = ((2, 2), (1, 4))
TOL = 1e-9  # float64 throughout
TOL32 = 1e-6  # where the model's own code computes in float32 (float32_inside)

# size fields and the tiny value each takes (whichever names a config uses)
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "n_embed", "word_embed_proj_dim",
           "emb_dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads")
_KV = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
_FFN = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "inner_hidden_size",
        "decoder_ffn_dim", "encoder_ffn_dim", "dim_feedforward", "mlp_dim", "hidden_dim", "ffn_hidden_dim",
        "expert_ffn_hidden_size")
_POS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")
_LATENT = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
TINY = dict(hidden=64, heads=8, kv=4, head_dim=8, layers=2, ffn=96, positions=64, experts=4)


class Skip(Exception):
    """A model type this sweep does not build (the message says why)."""


def _shrink(config: Any, cover: bool = False) -> None:
    """Shrink ``config`` (and its sub-configs) in place to :data:`TINY` sizes. The tiny stack
    keeps the first layers (``cover``: the first layer of each kind, for a config that rejects a
    stack without some kind); per-layer lists and per-layer overrides follow the layers kept."""
    d = config.__dict__
    before = dict(d)
    layers_before = next((int(d[k]) for k in _LAYERS if isinstance(d.get(k), int)), None)
    for names, value in ((_HIDDEN, TINY["hidden"]), (_HEADS, TINY["heads"]), (_LAYERS, TINY["layers"]),
                         (_FFN, TINY["ffn"]), (_POS, TINY["positions"]), (_EXPERTS, TINY["experts"])):
        for k in names:
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
                d[k] = value
    for k in _KV:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            d[k] = TINY["kv"] if d[k] > 1 else 1  # multi-query stays multi-query
    if isinstance(d.get("head_dim"), int) or ("head_dim" in d and d["head_dim"] is None):
        d["head_dim"] = TINY["head_dim"]  # (None: some families' code then divides by it)
    for k in _KV:
        if k in d and d[k] is None:
            d[k] = TINY["heads"]  # unset: as many key/value heads as query heads
    if all(isinstance(d.get(k), int) for k in ("qk_rope_head_dim", "qk_nope_head_dim")):
        # multi-head latent attention: tiny latents and heads, its head_dim the rotary part (as its
        # config derives it), every head its own keys (as these models ship)
        for k, v in _LATENT.items():
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
                d[k] = v
        for k, v in (("qk_head_dim", d["qk_nope_head_dim"] + d["qk_rope_head_dim"]),
                     ("head_dim", d["qk_rope_head_dim"]),
                     *((k, TINY["heads"]) for k in _KV)):
            if isinstance(d.get(k), int):
                d[k] = v
    for k in list(d):
        if k.endswith("intermediate_size") and (d[k] is None or type(d[k]) is int and d[k] % 4):
            d[k] = TINY["ffn"]  # (unset, or not split over 4 ranks: DeepSeek-V2's experts' 1407)
    if d.get("rope_parameters") == {} and isinstance(d.get("layer_types"), list):
        d["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in set(d["layer_types"])}
    groups = [k for k, v in d.items() if re.fullmatch(r"n_\w+_layers", k) and type(v) is int]
    if layers_before and len(groups) > 1 and sum(d[k] for k in groups) == layers_before:
        # the stack split into groups (input, recurrent, output layers): one layer to each of the largest
        ranked = sorted(groups, key=lambda k: -d[k])
        d.update({k: int(k in ranked[:TINY["layers"]]) for k in groups})
    for k, v in list(d.items()):  # layer groups and a looped span of layers: within the tiny stack (its last layer)
        if isinstance(v, int) and not isinstance(v, bool) and layers_before:
            if k.startswith("n_layers_per_"):
                d[k] = 1
            elif k.endswith("layer_index_start"):
                d[k] = TINY["layers"] - 1
            elif k.endswith("layer_index_end"):
                d[k] = TINY["layers"]
    if all(isinstance(d.get(k), int) for k in ("mamba_n_heads", "mamba_d_head", "mamba_expand")):
        # a Mamba-2 mixer's heads tile its expanded width (mamba_expand x hidden = heads x head size)
        d["mamba_n_heads"] = TINY["heads"]
        d["mamba_d_head"] = d["mamba_expand"] * TINY["hidden"] // TINY["heads"]
        d.update({k: 16 for k in ("mamba_d_state", "mamba_chunk_size") if isinstance(d.get(k), int)})
        if isinstance(d.get("mamba_d_ssm"), int):  # the expanded width, where a config gives it
            d["mamba_d_ssm"] = d["mamba_expand"] * TINY["hidden"]
    for heads, size, expand in (("num_heads", "head_dim", "expand"),
                                ("n_mamba_heads", "mamba_headdim", "mamba_expand")):
        if all(isinstance(d.get(k), int) for k in (heads, size, expand)) and \
                any(k in d for k in ("state_size", "mamba_d_state")):  # a Mamba-2 mixer's heads, as above
            d[size] = d[expand] * TINY["hidden"] // d[heads]
    if isinstance(d.get("rotary_dim"), int):
        d["rotary_dim"] = TINY["head_dim"] // 2  # partial rotary, as GPT-J and CodeGen ship it
    if isinstance(d.get("vocab_size"), int):
        d["vocab_size"] = VOCAB
    for k, v in list(d.items()):  # every vocabulary (BLT's hash-embedding tables too)
        if "vocab" in k.lower() and isinstance(v, int) and not isinstance(v, bool) and v > VOCAB:
            d[k] = VOCAB
    per_layer = [k for k, v in d.items() if isinstance(v, list) and layers_before and len(v) == layers_before
                 and k != "architectures"]  # per-layer lists (layer_types, ...)
    keep = _layers_kept(layers_before, [d[k] for k in per_layer], cover) if layers_before else []
    for k in per_layer:
        d[k] = [d[k][i] for i in keep]
    for k, v in list(d.items()):
        low = k.lower()
        if isinstance(v, float) and not isinstance(v, bool) and ("dropout" in low or "pdrop" in low) and v > 0:
            d[k] = 0.0
        if isinstance(v, int) and not isinstance(v, bool) and ("token_id" in low) and v >= VOCAB:
            d[k] = VOCAB - 1
        if hasattr(v, "to_dict") and hasattr(v, "model_type"):  # a sub-config (text_config, ...)
            _shrink(v, cover)
    if any(k in d and d[k] is None for k in _EXPERTS):  # experts left unset by the defaults (Dots1)
        d.update({k: TINY["experts"] for k in _EXPERTS if k in d and d[k] is None})
        d.update({k: v for k, v in (("num_experts_per_tok", 2), ("n_shared_experts", 1)) if k in d and d[k] is None})
    experts = next((d[k] for k in _EXPERTS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), 0)
    if experts and d.get("num_experts_per_tok", 0) is None:  # routed experts, experts per token left unset
        d["num_experts_per_tok"] = 2
    if experts and isinstance(d.get("n_group"), int) and d["n_group"] > experts:  # expert groups: fewer than experts
        d["n_group"] = 2
        if isinstance(d.get("topk_group"), int):
            d["topk_group"] = min(d["topk_group"], 2)
    for k in ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k", "moe_topk"):  # fewer than the experts
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            d[k] = min(d[k], 2)
    if isinstance(d.get("sliding_window"), int) and d.get("use_sliding_window") is not False:
        d["sliding_window"] = None if "use_sliding_window" in d else max(SEQ // 2, 2)
    d["use_cache"] = False
    spec = d.get("_heterogeneity_spec")
    if spec is not None and keep:
        # per-layer overrides (transformers' heterogeneous configs): those of the layers kept, at their
        # new index, without the size fields shrunk above (the tiny value holds for every layer)
        shrunk = {k for k in before if k in d and before[k] is not d[k] and before[k] != d[k]}
        config.per_layer_config = {j: {a: v for a, v in spec.per_layer_overrides[i].items() if a not in shrunk}
                                   for j, i in enumerate(keep) if i in spec.per_layer_overrides}


def _layers_kept(layers: int, per_layer: List[List[Any]], cover: bool) -> List[int]:
    """The indices of the :data:`TINY` layers kept of ``layers``: the first ones, or (``cover``)
    the first layer of each kind (its entries in the ``per_layer`` lists), then the first ones."""
    n = min(TINY["layers"], layers)
    if not cover:
        return list(range(n))
    first: Dict[Any, int] = {}
    for i in range(layers):
        first.setdefault(repr(tuple(v[i] for v in per_layer)), i)
    kept = sorted(first.values())[:n]
    return sorted(kept + [i for i in range(layers) if i not in kept][:n - len(kept)])


def tiny_config(model_type: str) -> Any:
    """A tiny configuration of ``model_type``: its own defaults with the sizes shrunk."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 — transformers raises many kinds here
        raise Skip(f"no default config: {_line(exc)}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise Skip("encoder-decoder")
    pristine = copy.deepcopy(config)
    _shrink(config)
    try:  # what an exported checkpoint's config must pass: transformers' validation on reading it
        text = config.get_text_config(decoder=True)
        lists = [{k: v for k, v in c.to_dict().items() if isinstance(v, list)}
                 for c in (text, type(text).from_dict(text.to_dict()))]
        if lists[0] != lists[1]:
            raise ValueError("the layer kinds read back differ")  # (transformers changed a layer's kind)
    except Exception:  # noqa: BLE001 — the first layers alone may lack a kind the config requires
        config = pristine
        _shrink(config, cover=True)
    return config


def build(model_type: str) -> torch.nn.Module:
    """The float64 causal LM of :func:`tiny_config`, built from seed 0, its 1-D parameters
    (norm weights, biases) perturbed so a norm applied on the wrong slice cannot hide."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"does not build from a tiny config: {_line(exc)}") from None
    if getattr(type(model), "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")  # the default grouped GEMM computes in float32 at most
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def float32_inside(model: torch.nn.Module, idx: torch.Tensor) -> List[str]:
    """The aten ops of a float64 model's forward and backward that compute in float32 (a norm
    upcasting to float32 by design): there, the model's own rounding is float32's, and a
    parallel run that sums the same terms in another grouping (a per-head norm's weight
    gradient, summed per rank, then over ranks) agrees to float32's precision only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: List[str] = []

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() > 1
                   for t in (out if isinstance(out, (tuple, list)) else (out,))):
                name = str(func.overloadpacket)
                if name not in seen:
                    seen.append(name)
            return out

    probe = copy.deepcopy(model)
    with _Watch():
        probe(input_ids=idx, labels=idx).loss.backward()
    return seen


def _dense_step(model: torch.nn.Module, idx: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=idx, labels=idx).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_type(model_type: str, meshes: Tuple[Tuple[int, int], ...] = MESHES) -> Dict[str, Any]:
    """One model type on this rank's mesh(es) (collective: every rank calls it)."""
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.comm import comm_for
    from atp_pipeline.parallel.dense import dense_tensors
    from atp_pipeline.parallel.mesh import init_mesh

    row: Dict[str, Any] = {"type": model_type}
    try:
        dense = build(model_type)
    except Skip as exc:
        return {**row, "result": "skipped", "reason": str(exc)}
    row["class"] = type(dense).__name__
    try:  # the layout's refusal comes first (it needs no process group and no step)
        found = find_adapters(copy.deepcopy(dense))
        if not found:
            from atp_pipeline.models.hf.adapter import not_a_causal_lm

            return {**row, "result": "refused", "reason": not_a_causal_lm(dense)}
        (_, adapter, sub), = found
        adapter.parallel_plan(sub)
    except ConfigError as exc:
        return {**row, "result": "refused", "reason": str(exc).splitlines()[0]}
    except Exception as exc:  # noqa: BLE001
        return {**row, "result": "error", "reason": _line(exc), "trace": traceback.format_exc()[-2000:]}
    idx = _batch()
    try:
        ref, ref_grads = _dense_step(dense, idx)
    except Exception as exc:  # noqa: BLE001
        return {**row, "result": "skipped", "reason": f"the single-process model does not train: {_line(exc)}"}
    try:
        f32 = float32_inside(dense, idx)
    except Exception as exc:  # noqa: BLE001
        return {**row, "result": "skipped", "reason": f"the single-process model does not train: {_line(exc)}"}
    tol = TOL if not f32 else TOL32
    if f32:
        row["float32_ops"] = f32[:6]
    worst: Dict[str, Any] = {}
    for d1, d2 in meshes:
        model = copy.deepcopy(dense)
        try:
            (name, adapter, sub), = find_adapters(model)
            plan = prefixed(name, adapter.parallel_plan(sub))
            mesh = init_mesh((d1, d2))
            apply_plan(model, plan, mesh)
            model.zero_grad(set_to_none=True)
            comm = comm_for(mesh)
            comm.stats.reset()
            loss = model(input_ids=idx, labels=idx).loss
            loss.backward()
            counted = {f"{k}/{a}": n for (k, a), n in comm.stats.elements().items()}
            local = {id(p): (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()}
            grads = dense_tensors(model, grad=True)
            row["shape"] = adapter.shape(sub).to_dict()
        except ConfigError as exc:
            return {**row, "result": "refused", "reason": str(exc).splitlines()[0]}
        except Exception as exc:  # noqa: BLE001
            return {**row, "result": "error", "reason": _line(exc), "trace": traceback.format_exc()[-2000:],
                    "mesh": f"{d1}x{d2}"}
        loss_rel = abs(float(loss.detach()) - float(ref)) / abs(float(ref))
        floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values())
        errs = {n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(floor))
                for n, g in ref_grads.items() if n in grads}
        missing = sorted(set(ref_grads) - set(grads))
        grad_rel = max(errs.values()) if errs else math.inf
        mesh_row = {"loss_rel": loss_rel, "grad_rel": grad_rel, "worst": max(errs, key=errs.get) if errs else None,
                    "missing": missing[:3], "counted": counted, "local_params": sum(local.values())}
        worst[f"{d1}x{d2}"] = mesh_row
        if missing or not (loss_rel <= tol and grad_rel <= tol):
            return {**row, "result": "wrong",
                    "reason": f"{d1}x{d2}: loss {loss_rel:.1e}, grad {grad_rel:.1e} "
                              f"({mesh_row['worst']})"
                              f"{' missing ' + str(missing[:3]) if missing else ''}",
                    "meshes": worst}
    return {**row, "result": "exact", "tolerance": tol, "meshes": worst,
            "max_rel": max(max(m["loss_rel"], m["grad_rel"]) for m in worst.values()),
            "export": export_round_trip(model, dense)}


def export_round_trip(model: torch.nn.Module, dense: torch.nn.Module) -> str:
    """The laid-out ``model`` exported in HF format (collective) and read back by
    ``AutoModelForCausalLM.from_pretrained`` on rank 0, against the single-process ``dense``
    model it was laid out from: ``"bit-exact"`` (every parameter equal, bit for bit), or what
    differs. Every rank returns rank 0's verdict."""
    import shutil
    import tempfile

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from atp_pipeline.models.hf.weights import export_pretrained

    hf_logging.disable_progress_bar()  # one table row per type, not a bar per checkpoint written and read
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tmp = tempfile.mkdtemp(prefix="hf_coverage_export_") if rank0 else ""
    verdict = ["bit-exact"]
    try:
        path = export_pretrained(model, tmp)
        if rank0:
            back = dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).named_parameters())
            want = dict(dense.named_parameters())
            diff = sorted(n for n in set(want) | set(back) if n not in want or n not in back
                          or back[n].shape != want[n].shape or not torch.equal(back[n], want[n]))
            if diff:
                verdict = [f"differs: {', '.join(diff[:3])}{' ...' if len(diff) > 3 else ''}"]
    except Exception as exc:  # noqa: BLE001
        verdict = [f"export failed: {_line(exc)}"]
    finally:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.broadcast_object_list(verdict, src=0)
    return str(verdict[0])


def predicted(shape: Dict[str, Any], mesh: Tuple[int, int]) -> Dict[str, int]:
    """The runtime cost model's elements per (collective, axis) for one step of :func:`_batch`
    of the model of ``shape`` (a row's ``shape``) on ``mesh``: what ``counted`` must equal."""
    from atp_pipeline.planning.cost import predicted_counts

    return predicted_counts(shape, mesh, BATCH * SEQ)


def worker(rank: int, world: int, types: List[str],
           meshes: Tuple[Tuple[int, int], ...] = MESHES) -> List[Dict[str, Any]]:
    import torch.distributed as dist

    torch.set_default_dtype(torch.float32)
    out = []
    for t in types:
        t0 = time.perf_counter()
        row = check_type(t, meshes)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        # every rank must agree (a rank-local failure would otherwise hang the next collective)
        results = [None] * world
        dist.all_gather_object(results, row["result"])
        if len(set(results)) > 1:
            row = {**row, "result": "error", "reason": f"ranks disagree: {results}"}
        out.append(row)
    return out


def all_types() -> List[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def declared(model_type: str) -> Optional[bool]:
    """Whether transformers declares a tensor-parallel plan for the type (None: no config)."""
    from transformers import AutoConfig

    try:
        c = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001
        return None
    sub = getattr(c, "text_config", None)
    return bool(getattr(c, "base_model_tp_plan", None) or getattr(sub, "base_model_tp_plan", None))


def run(types: List[str], batch: int = 12, timeout: float = 900.0) -> List[Dict[str, Any]]:
    """:func:`worker` over ``types`` on 4 processes, ``batch`` types a launch (a launch that
    fails or hangs is retried type by type, so one bad type cannot hide the others)."""
    from atp_pipeline.launch import spawn

    rows: List[Dict[str, Any]] = []
    for i in range(0, len(types), batch):
        part = types[i:i + batch]
        try:
            rows += spawn(worker, 4, part, timeout=timeout)[0]
        except Exception:  # noqa: BLE001 — retry one by one
            for t in part:
                try:
                    rows += spawn(worker, 4, [t], timeout=timeout / 4)[0]
                except Exception as exc:  # noqa: BLE001
                    rows.append({"type": t, "result": "error", "reason": _line(exc)})
    return rows


def run_whole(row: Dict[str, Any]) -> List[str]:
    """The classes of the modules an exact row's layout runs whole (replicated; the plan's note)."""
    import re

    note = (row.get("shape") or {}).get("whole_note", "")
    return re.findall(r"': ([\w/]+) run whole", note) + (["the LM head's module"] if "the LM head" in note else [])


def _doc(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    decl = [r for r in rows if r.get("declared")]
    lines = [
        "# transformers causal LMs laid out by ATP with no plan of ours",
        "",
        f"Written by `python -m benchmarks.hf_coverage --doc docs/hf_coverage.md` on {meta['date']} "
        f"(transformers {meta['transformers']}, torch {meta['torch']}, {meta['machine']}; "
        f"{meta['wall_s']:.0f} s). Every type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: a tiny float64 "
        f"config of its own defaults, one forward and backward on 2x2 and 1x4 (4 gloo processes) against "
        f"one process; exact = loss and every gradient within {TOL:g} (relative), or {TOL32:g} where the "
        f"model's own code computes in float32 and the error is above {TOL:g} (marked: a per-head norm's "
        f"weight gradient summed in float32 per rank, then over ranks). Every exact type is also "
        f"exported from its laid-out model in HF format and read back by `from_pretrained`: "
        f"{sum(r.get('export') == 'bit-exact' for r in rows)} of {sum(r['result'] == 'exact' for r in rows)} "
        f"bit-exact (any other is named in its row).",
        "",
        f"**{len(rows)} types:** " + ", ".join(f"{counts.get(k, 0)} {k}" for k in
                                               ("exact", "refused", "skipped", "wrong", "error")) + ".",
        f"Declaring a tensor-parallel plan: {len(decl)} ({sum(r['result'] == 'exact' for r in decl)} exact); "
        f"not declaring one: {len(rows) - len(decl)} "
        f"({sum(r['result'] == 'exact' for r in rows if not r.get('declared'))} exact). "
        f"Of the exact, {sum(bool(run_whole(r)) for r in rows if r['result'] == 'exact')} run modules the layout "
        f"cannot split whole (replicated on every rank on the hidden gathered over d2, their output sliced back), "
        f"named after the error and in the plan's notes.",
        "",
        "| type | class | plan declared | result | reason / max relative error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        detail = (f"{r['max_rel']:.1e}" + (" (float32 inside the model)" if r["max_rel"] > TOL else "")
                  + ("" if r.get("export", "bit-exact") == "bit-exact" else f"; export {r['export']}")
                  + (f"; run whole: {', '.join(run_whole(r))}" if run_whole(r) else "")) \
            if r["result"] == "exact" else r.get("reason", "").replace("|", "\\|")
        lines.append(f"| `{r['type']}` | {r.get('class', '')} | {'yes' if r.get('declared') else 'no'} | "
                     f"{r['result']} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    import platform

    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="all", help="comma-separated model types, or all")
    p.add_argument("--out", default="outputs/benchmarks/hf_coverage")
    p.add_argument("--doc", default=None, help="also write the markdown table here (e.g. docs/hf_coverage.md)")
    args = p.parse_args(argv)
    types = all_types() if args.types == "all" else args.types.split(",")
    t0 = time.perf_counter()
    rows = run(types)
    for r in rows:
        r["declared"] = declared(r["type"])
    meta = {"date": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__, "torch": torch.__version__,
            "machine": f"{platform.machine()} CPU, gloo", "wall_s": time.perf_counter() - t0, "tolerance": TOL}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_coverage.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    if args.doc:
        Path(args.doc).write_text(_doc(rows, meta))
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
        print(f"{r['type']:<28} {r['result']:<8} {r.get('reason', '')[:110]}")
    print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f"; wrote {out / 'hf_coverage.json'}")
    return 1 if counts.get("wrong") or counts.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
