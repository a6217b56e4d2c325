"""Hugging Face model directories for inspect, without torch: config.json gives the GPTConfig
(its family's record, families/, as the reader reads it) and the safetensors headers every tensor's
name, shape and dtype (io/safetensors_header.py, the reader's own parser); the family's name table
maps them to canonical names as the reader does, on shapes alone.

Block-FP8 weights (DeepSeek-V3 / R1 as released) and MXFP4 experts (GPT-OSS as released) read as the bf16
tensors the reader makes of them, their scales consumed (quant.py's checks, shared with the reader). Fused 3-D
experts (transformers 5) and GPT-OSS's stacked ones are split into each expert's shapes here as the reader splits
the tensors. None (the full reader answers) for
pytorch_model.bin weights, other FP8 tensors (their canonical form needs the reader's arithmetic), or files
that do not match config.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from ...config import Layout
from ...errors import CkptError
from ...families.family import STACKED, Family, canonical_names, stacked_part_shape
from ...families.mtp import layers_held as mtp_layers_held
from . import config as hf_config
from . import quant
from ...io.safetensors_header import read_safetensors_header
from ...state import Checkpoint, SourceInfo, expected_names
from ...quick.meta import TensorMeta

# Dtypes whose canonical form the quick path cannot state: FP8 left after the block-FP8 weights
# (read as bf16, as the reader reads them) means a checkpoint the full reader refuses.
COMPUTED_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def read(path: Path, format_name: str) -> Optional[Checkpoint]:
    try:
        return _checkpoint(path, format_name)
    except (CkptError, OSError, LookupError, ValueError, TypeError):
        return None  # the full reader reports what is wrong, as it always has


def _checkpoint(path: Path, format_name: str) -> Optional[Checkpoint]:
    conf, family = hf_config.read_supported_config(path)
    files = hf_config.weight_files(path)
    if any(f.suffix != ".safetensors" for f in files):
        return None  # .bin files are torch pickles
    entries: Dict[str, TensorMeta] = {}
    for f in files:
        for name, e in read_safetensors_header(f).tensors.items():
            entries[name] = TensorMeta(e.shape, e.dtype_name)
    quantization = quant.quantization_doc({k: (t.shape, t.dtype) for k, t in entries.items()}, conf, path)
    entries = _dequantized(entries, conf, path)
    if any(t.dtype in COMPUTED_DTYPES for t in entries.values()):
        return None
    entries = family.names.with_full_names(entries)
    cfg = family.read_config(conf, entries[family.names.word_embedding].shape[0])
    cfg = cfg.replace(mtp_num_layers=mtp_layers_held(entries, conf, family, cfg.num_layers))
    experts = hf_config.experts_form(entries, family, cfg)
    tensors = canonical_shapes(unfused_shapes(entries, family, cfg), family, cfg)
    if tensors is None:
        return None
    ckpt = Checkpoint(cfg, tensors, SourceInfo(
        path=str(path), format=format_name, dialect=family.model_type, layout=Layout(1, 1),
        storage=quant.storage_label(quantization) if quantization else "",
        extra={"hf_config": conf, "quantization": quantization}, hf_experts=experts))
    for w in hf_config.source_warnings(conf, family):
        ckpt.warn(w)
    return ckpt


def _dequantized(entries: Dict[str, TensorMeta], conf: dict, path: Path) -> Dict[str, TensorMeta]:
    """Block-FP8 weights and MXFP4 experts as the reader reads them (bf16: fp8.py, mxfp4.py), their scales consumed;
    called once quant.quantization_doc accepted the pairs (a bad pair raised, and the full reader reports it)."""
    scales = [k for k in entries if k.endswith(quant.SCALE_SUFFIX)]
    out = {k: t for k, t in entries.items() if k not in scales}
    for key in scales:
        name = key[:-len(quant.SCALE_SUFFIX)]
        out[name] = TensorMeta(out[name].shape, "bfloat16")
    for name, blocks, scales_key in quant.mxfp4_pairs({k: (t.shape, t.dtype) for k, t in out.items()}, conf, path):
        del out[scales_key]
        out[name] = TensorMeta(quant.mxfp4_shape(tuple(out.pop(blocks).shape)), "bfloat16")
    return out


def unfused_shapes(entries: Dict[str, TensorMeta], family: Family, cfg) -> Dict[str, TensorMeta]:
    """entries with fused 3-D experts ([E, 2I, h] gate_up, [E, h, I] down) as each expert's Hub-named shapes, as
    reader.unfuse_experts splits the tensors; a fused tensor of another shape stays (canonical_shapes then
    answers None and the reader names it)."""
    out = dict(entries)
    for i in cfg.moe.layers if cfg.moe else ():
        p = family.names.layer_prefix.format(i=i)
        for suffix, (op, arg) in family.fused_experts.items():
            t = out.get(p + suffix)
            if t is None or (op != "rename" and tuple(t.shape) != hf_config.fused_shape(op, cfg)):
                continue
            del out[p + suffix]
            names = [arg] if op == "rename" else [a.format(e=e) for e in range(cfg.moe.num_experts)
                                                  for a in (arg if op == "halves" else (arg,))]
            shape = {"rename": t.shape, "each": t.shape[1:], "halves": (t.shape[1] // 2,) + tuple(t.shape[2:])}[op]
            out.update((p + n, TensorMeta(tuple(shape), t.dtype)) for n in names)
    return out


def canonical_shapes(entries: Dict[str, TensorMeta], family: Family, cfg,
                     sources: Optional[Dict[str, str]] = None) -> Optional[Dict[str, TensorMeta]]:
    """The family's name table applied to shapes, as the reader applies it to tensors; None unless every
    stored tensor maps and every canonical tensor of cfg is found (the reader's own checks).
    sources, if given, gets each canonical name's HF name (several share a fused one)."""
    tensors: Dict[str, TensorMeta] = {}
    used = set()
    for hf_name, (op, arg), _group in family.names.expand(cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0,
                                                          cfg.mtp_num_layers):
        t = entries.get(hf_name)
        if t is None:
            continue
        used.add(hf_name)
        if op == "same":  # an MTP layer's copy of a main-model tensor (the full reader checks it equal)
            continue
        if sources is not None:
            sources.update((n, hf_name) for n in canonical_names((op, arg)))
        shape = t.shape[::-1] if op in ("T", "cat_T") else t.shape
        if op in ("copy", "T"):
            tensors[arg] = TensorMeta(shape, t.dtype)
            continue
        if op in STACKED:  # GPT-OSS: a layer's experts stacked in one tensor, each expert's parts split from it
            dims, per = (3 if op.endswith("_T") else 2), STACKED[op]
            if len(shape) != dims or shape[0] * per != len(arg) or shape[dims - 1] % per:
                return None  # stacked.unstack's refusals, which the full reader reports
            tensors.update((name, TensorMeta(stacked_part_shape(op, tuple(shape)), t.dtype)) for name in arg)
            continue
        start = 0
        for name in arg:
            n = hf_config.part_rows(name, cfg)
            tensors[name] = TensorMeta((n,) + shape[1:], t.dtype)
            start += n
        if start != shape[0]:
            return None
    if cfg.tied_embeddings:
        tensors.pop("output.weight", None)
    leftover = [k for k in entries if k not in used and not k.endswith(hf_config.IGNORED_SUFFIXES)
                and not (cfg.tied_embeddings and k == "lm_head.weight")]
    want = expected_names(cfg)
    if leftover or set(tensors) != set(want):
        return None  # fused experts, MTP layers, or files that disagree with config.json
    return {n: tensors[n] for n in want}
