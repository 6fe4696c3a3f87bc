"""Hugging Face checkpoints in and out of a sharded model (real weights).

* :func:`safetensors_reader` — a reader of a local HF checkpoint directory (``config.json``
  plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``): tensors by the
  model's parameter names, as lazy safetensors slices, so each rank reads only its blocks
  (:func:`~atp_pipeline.parallel.dense.load_dense`). Names saved without the base model's
  prefix (GPT-2's ``h.0...`` for ``transformer.h.0...``) are found too.
* :func:`export_pretrained` — the sharded model gathered into the dense model's names and
  layouts (:func:`~atp_pipeline.parallel.dense.dense_tensors`) and written by transformers'
  own ``save_pretrained`` on global rank 0, loadable by ``AutoModelForCausalLM.from_pretrained``
  (a model built on a sub-config that ``AutoModelForCausalLM`` does not map, a multimodal
  model's text decoder, is written under the config class it maps to that model class).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel.dense import dense_tensors


def safetensors_reader(path: str, model: nn.Module) -> Callable[[str], Optional[Any]]:
    """``name -> safetensors slice`` (or None) of the checkpoint in directory ``path``, by the
    parameter names of ``model``: checkpoint keys are renamed as transformers' own loading
    renames them (its per-family ``WeightRenaming``s, e.g. GPT-NeoX's ``embed_out`` ->
    ``lm_head``); a key saved without the base model's prefix is found too. A checkpoint
    needing a conversion other than a renaming (experts saved one by one) is loaded whole by
    transformers instead (:func:`_converted_reader`)."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_converters, apply_renamings

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    elif (root / "model.safetensors").exists():
        single = root / "model.safetensors"
        with safe_open(str(single), framework="pt") as f:
            files = {k: single for k in f.keys()}
    else:
        raise ConfigError(f"model.pretrained={path}: no model.safetensors or model.safetensors.index.json there")
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    stored: Dict[str, str] = {}
    for key in files:
        if apply_converters(key, converters)[1] is not None:
            return _converted_reader(path, model)
        stored[apply_renamings(key, renamings)] = key
    prefix = getattr(model, "base_model_prefix", "")
    handles: Dict[Path, Any] = {}

    def read(name: str) -> Optional[Any]:
        for want in (name, name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None):
            key = stored.get(want) if want is not None else None
            if key is not None:
                f = files[key]
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt")
                return handles[f].get_slice(key)
        return None

    return read


def _converted_reader(path: str, model: nn.Module) -> Callable[[str], Optional[Any]]:
    """A checkpoint whose tensors transformers converts on loading (not just renames: a mixture
    of experts saved one expert at a time, fused into 3-D tensors in memory): loaded whole by
    transformers' own ``from_pretrained`` on this rank (on the CPU, in the model's dtype), then
    read by name — every rank reads the whole checkpoint, not only its blocks."""
    from transformers import AutoModelForCausalLM

    try:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        dense = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise ConfigError(f"model.pretrained={path}: transformers could not load it: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if type(dense) is not type(model):
        raise ConfigError(f"model.pretrained={path}: transformers loads a {type(dense).__name__}, not the "
                          f"{type(model).__name__} being laid out")
    state = dense.state_dict()
    return lambda name: state.get(name)


def export_pretrained(model: nn.Module, out_dir: str) -> Optional[Path]:
    """Write the sharded transformers ``model`` to ``out_dir`` in HF format (collective: every
    rank calls it; global rank 0 writes). Returns the directory on rank 0."""
    state = dense_tensors(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        dense = type(model)(model.config.__class__.from_dict(_plain_config(model)))
    missing, unexpected = dense.load_state_dict({k: v.cpu() for k, v in state.items()}, strict=False, assign=True)
    dense.tie_weights()
    left = [n for n, p in dense.named_parameters() if p.is_meta]
    if left or unexpected:
        raise ConfigError(f"export: {type(model).__name__} state does not match its dense model "
                          f"(missing {left[:3]}, unexpected {unexpected[:3]})")
    out = Path(out_dir)
    dense.save_pretrained(str(out))
    outer = _causal_lm_config(dense)
    if outer is not None:
        outer.save_pretrained(str(out))  # (config.json only: the weights are the decoder's, by its names)
    return out


def _causal_lm_config(model: nn.Module) -> Optional[Any]:
    """The config ``AutoModelForCausalLM.from_pretrained`` builds ``model``'s class from, where
    ``model.config``'s own class is not one it maps (Emu3's or Mllama's text decoder, built on
    the text sub-config): the config class mapped to ``type(model)`` holding ``model.config`` as
    its sub-config of that class (transformers builds the class on that sub-config again). None
    where ``model.config`` is mapped as it is, or no mapped config holds it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    mapped = [c for c, m in MODEL_FOR_CAUSAL_LM_MAPPING.items() if m is type(model)]
    if not mapped or type(model.config) in mapped:
        return None
    for cls in mapped:
        key = next((k for k, v in (getattr(cls, "sub_configs", None) or {}).items() if v is type(model.config)), None)
        if key is not None:
            outer = cls(**{key: model.config.to_dict()})
            outer.architectures = [type(model).__name__]
            return outer
    return None


def _plain_config(model: nn.Module) -> Dict[str, Any]:
    """The model's config as a dict, without ATP's attention implementation (set on copies
    inside the attention modules only, but checked here too)."""
    d = model.config.to_dict()
    if d.get("_attn_implementation") == "atp":
        d.pop("_attn_implementation")
    return d
