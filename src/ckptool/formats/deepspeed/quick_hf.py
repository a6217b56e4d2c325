"""Hugging Face models trained under DeepSpeed (formats/deepspeed/checkpoint.py's third kind) for inspect, without
torch: the engine's parameter names are the model's own, so the config comes from the config.json
beside the save (deepspeed_files.find_hf_config) and the canonical tensors from the HF name table
(the model's family record, families/) applied to shapes (quick/hf.canonical_shapes), as formats/hf.to_canonical
applies it to tensors.

The optimizer follows formats/deepspeed/optim.py on the same mapping: the master slot is every
canonical tensor in fp32 (a frozen parameter or buffer as its weight made fp32), a moment slot the
optimizer's own moments and fp32 zeros where it holds none; a param group's tensors are the canonical
tensors made from the parameters its flats hold (frozen ones are in none).

The callers here (formats/deepspeed/quick.py) pass what the pickles hold; NotQuick for what the full reader
refuses or computes: no config.json, a model type that is not a GPT, model-parallel ranks, FP8 or
fused-expert tensors, names or shapes that do not match config.json.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

from .files import find_hf_config
from ... import families
from ...state import ParamGroup
from ..hf.quick import COMPUTED_DTYPES, canonical_shapes
from ...quick.meta import TensorMeta
from ...quick.torch_pickle import NotQuick

MASTER_DTYPE = "float32"  # deepspeed_optim._slot_named makes every master fp32; _Zeros are fp32 too


def canonical(named: Dict[str, TensorMeta], tag_dir: Path) -> Tuple[object, Dict[str, TensorMeta], str, Dict[str, str]]:
    """(GPTConfig, canonical name -> TensorMeta in expected order, model_type, canonical name -> the
    engine parameter name it is made from) of one rank's engine names (deepspeed._read_hf_gpt)."""
    hf = find_hf_config(tag_dir, None)
    if hf is None:
        raise NotQuick("no config.json beside the checkpoint")
    family = families.of_hf_config(hf)
    if family is None:
        raise NotQuick("not a GPT ckptool reshards")  # the full reader says so (to-hf consolidates it)
    own = {(k[len("module."):] if k.startswith("module.") else k): k for k in named}
    full = family.names.with_full_names(own)  # HF name -> engine name
    entries = {hf_name: named[engine] for hf_name, engine in full.items()}
    if any(t.dtype in COMPUTED_DTYPES for t in entries.values()):
        raise NotQuick("FP8 tensors")
    cfg = family.read_config(hf, entries[family.names.word_embedding].shape[0])
    hf_of: Dict[str, str] = {}
    tensors = canonical_shapes(entries, family, cfg, hf_of)
    if tensors is None:
        raise NotQuick("the names or shapes do not match config.json")
    return cfg, tensors, family.model_type, {n: full[h] for n, h in hf_of.items()}


def slots(tensors: Dict[str, TensorMeta], sources: Dict[str, str], shared: Dict[str, str],
          held: Dict[str, Dict[str, TensorMeta]]) -> Dict[str, Dict[str, TensorMeta]]:
    """slot -> canonical name -> TensorMeta; held: moment -> engine name -> the optimizer's moment."""
    out = {"master": {n: TensorMeta(t.shape, MASTER_DTYPE) for n, t in tensors.items()}}
    for key, moments in held.items():
        out[key] = {}
        for n, t in tensors.items():
            owner = shared.get(sources[n], sources[n])
            out[key][n] = TensorMeta(t.shape, moments[owner].dtype if owner in moments else MASTER_DTYPE)
    return out


def param_groups(tensors: Dict[str, TensorMeta], sources: Dict[str, str], shared: Dict[str, str],
                 param_shapes: List[dict], stored: List[dict]) -> List[ParamGroup]:
    """deepspeed_optim._param_groups: each stored group with the canonical tensors made from the
    parameters of the flats it steps (ZeRO-1/2: one flat per group; ZeRO-3: its sub-group flats)."""
    flat_of = {name: f for f, names in enumerate(param_shapes) for name in names}
    by_flat: Dict[int, List[str]] = defaultdict(list)
    for n in tensors:
        owner = shared.get(sources[n], sources[n])
        if owner in flat_of:
            by_flat[flat_of[owner]].append(n)
    stored = stored or [{"params": [f]} for f in range(len(param_shapes))]
    listed = [f for g in stored for f in g.get("params", [])]
    if sorted(listed) != list(range(len(param_shapes))):
        raise NotQuick("the param groups do not step the flats param_shapes describes")
    order = {n: i for i, n in enumerate(tensors)}
    return [ParamGroup(sorted((n for f in g.get("params", []) for n in by_flat.get(f, [])), key=order.get),
                       {k: v for k, v in g.items() if k != "params"}) for g in stored]


def single_rank(named: Dict[int, dict]) -> dict:
    """The one model-parallel rank's names (the full reader reads HF models with data parallelism only)."""
    if len(named) != 1:
        raise NotQuick("Hugging Face names with model-parallel ranks")
    return named[0]
