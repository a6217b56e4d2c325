"""Hugging Face model directories (GPT-2, the Llama family, Mixtral, Qwen MoE, DeepSeek-V3, GLM-4.5): reader.

A directory with config.json whose model_type is gpt2, llama, mistral, qwen2, qwen3, mixtral,
qwen2_moe, qwen3_moe, deepseek_v3, glm4_moe, gpt_oss, gemma2 or gemma3_text, and weights in safetensors or torch .bin
files, sharded (an *.index.json) or not. Experts are read per expert (the Hub names) or fused 3-D (transformers >= 5's
state_dict), the form recorded in SourceInfo.hf_experts for the writer, or stacked as GPT-OSS stores them
(stacked.py); block-FP8 weights (DeepSeek-V3 / R1 as released, fp8.py) and GPT-OSS's MXFP4 experts (mxfp4.py) are
dequantized lazily to bf16. Tensors stay lazy: safetensors
entries are read with safe_open when loaded; .bin files go through the safe lazy torch loader, never
plain torch.load. Names, config.json and fused experts come from the model's family record
(families/); the writer is hf/writer.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

import torch

from ... import families
from ...config import GPTConfig, Layout
from ...errors import require
from ...families.family import STACKED, Family
from ...families.mtp import layers_held as mtp_layers_held
from ...io.safetensors_header import read_safetensors_header
from ...io.torchfile import load_torch_file
from ...lazy import Derived, LazyTensor
from ...options import ReadOptions
from ...state import Checkpoint, SourceInfo, expected_names
from ...vocab import with_true_vocab_size
from . import fp8
from .mxfp4 import dequantize_mxfp4
from .stacked import unstack
from .config import (  # noqa: F401 (looks_like, gpt_model_type, has_weights: this reader's interface)
    FORMAT, IGNORED_SUFFIXES, experts_form, fused_shape, gpt_model_type, has_weights, looks_like, part_rows,
    read_supported_config, source_warnings, weight_files)
from .quant import quantization_doc, storage_label
from safetensors import safe_open


# --- lazy tensors --------------------------------------------------------------------------

class SafetensorsTensor(LazyTensor):
    """One entry of a .safetensors file; narrow() on dim 0 reads only those rows.

    start: the file offset of the entry's first byte (from the validated header), so read-ahead
    (io/prefetch.py) can ask the kernel for the bytes a load will read."""

    def __init__(self, path: Path, key: str, shape, dtype: torch.dtype, rows=None, start: Optional[int] = None):
        self.path, self.key, self.rows, self.start = path, key, rows, start
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def file_ranges(self) -> list:
        """[(path, offset, length)] of the bytes load() reads: the entry, or its rows."""
        if self.start is None:
            return []
        row_bytes = self.nbytes // self.shape[0] if len(self.shape) and self.shape[0] else 0
        first = self.rows[0] if self.rows else 0
        return [(str(self.path), self.start + first * row_bytes, self.nbytes)]

    def load(self) -> torch.Tensor:
        with safe_open(str(self.path), framework="pt") as f:
            if self.rows is None:
                return f.get_tensor(self.key)
            return f.get_slice(self.key)[self.rows[0]:self.rows[1]]

    def narrow(self, dim, start, length):
        if dim != 0:
            return super().narrow(dim, start, length)
        base = self.rows[0] if self.rows else 0
        return SafetensorsTensor(self.path, self.key, (length,) + tuple(self.shape[1:]), self.dtype,
                                 (base + start, base + start + length), self.start)


def _safetensors_entries(path: Path) -> Dict[str, LazyTensor]:
    # The header is validated (offsets tile the buffer, sizes match shapes) before anything is read.
    header = read_safetensors_header(path)
    return {name: SafetensorsTensor(path, name, e.shape, e.dtype, start=e.start) for name, e in header.tensors.items()}


def _bin_entries(path: Path) -> Dict[str, LazyTensor]:
    tree = load_torch_file(path)
    if isinstance(tree, dict) and "state_dict" in tree and isinstance(tree["state_dict"], dict):
        tree = tree["state_dict"]
    require(isinstance(tree, dict), f"{path}: holds no state dict")
    return {k: v for k, v in tree.items() if isinstance(v, LazyTensor)}


def read_entries(path: Path) -> Dict[str, LazyTensor]:
    entries: Dict[str, LazyTensor] = {}
    for f in weight_files(path):
        entries.update(_safetensors_entries(f) if f.suffix == ".safetensors" else _bin_entries(f))
    return entries


# --- the reader ----------------------------------------------------------------------------

def to_canonical(entries: Dict[str, LazyTensor], conf: dict, model_type: str, opts: ReadOptions, path):
    """(GPTConfig, {canonical name: lazy}) from HF-named tensors; also used for DeepSpeed runs of HF models."""
    family = families.for_model_type(model_type)
    entries = family.names.with_full_names(entries)
    word_key = family.names.word_embedding
    require(word_key in entries, f"{path}: no {word_key} in the weight files")
    cfg = with_true_vocab_size(family.read_config(conf, entries[word_key].shape[0]),
                               opts.true_vocab_size, entries[word_key].shape[0])
    if opts.overrides.get("activation"):
        cfg = cfg.replace(activation=opts.overrides["activation"])

    entries = fp8.dequantize_entries(entries, conf, path)  # block FP8 (DeepSeek-V3 as released) -> bf16
    entries = dequantize_mxfp4(entries, conf, path)  # GPT-OSS's MXFP4 experts -> bf16
    cfg = cfg.replace(mtp_num_layers=mtp_layers_held(entries, conf, family, cfg.num_layers))
    if family.fused_experts:
        entries = unfuse_experts(entries, family, cfg)
    tensors, used, copies = _apply_names(entries, family, cfg)
    if cfg.tied_embeddings:
        tensors.pop("output.weight", None)
    _check_copies(copies, entries, tensors, path)
    leftover = sorted(k for k in entries if k not in used and not k.endswith(IGNORED_SUFFIXES)
                      and not (cfg.tied_embeddings and k == "lm_head.weight"))
    beyond = [k for k in leftover if _layer_index(k) is not None and _layer_index(k) >= cfg.all_layers]
    require(not beyond, f"{path}: {', '.join(beyond[:3])} belong to layers past num_hidden_layers="
            f"{cfg.num_layers}" + (f" and its {cfg.mtp_num_layers} MTP layers" if cfg.mtp_num_layers else "")
            + ": multi-token-prediction (MTP) layers config.json does not declare"
            + (f" ({family.mtp_key})" if family.mtp_key else f"; {family.architecture} has none in ckptool"),
            "ckptool never drops tensors: set the number of MTP layers in config.json, or remove those layers")
    require(not leftover, f"{path}: tensors ckptool does not know how to map: {', '.join(leftover[:5])}",
            "this model has parts a Megatron GPT cannot hold" if cfg.moe is None else
            f"an expert index past num_experts={cfg.moe.num_experts}, or an expert module ckptool does not know")
    want = expected_names(cfg)
    unexpected = [n for n in tensors if n not in set(want)]
    require(not unexpected, f"{path}: the files hold {', '.join(unexpected[:3])}, which the model config.json "
            "describes does not have", "ckptool never drops tensors; check config.json against the weights")
    missing = [n for n in want if n not in tensors]
    require(not missing, f"{path}: missing weights for {', '.join(missing[:5])}",
            "the weight files do not match config.json")
    return cfg, {n: tensors[n] for n in want}


def _apply_names(entries: Dict[str, LazyTensor], family: Family, cfg: GPTConfig):
    """(canonical tensors, the HF names used, the MTP layers' copies of main-model tensors to check) by the family's
    name table applied backwards."""
    tensors: Dict[str, LazyTensor] = {}
    used, copies = set(), []
    for hf_name, (op, arg), _group in family.names.expand(cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0,
                                                          cfg.mtp_num_layers):
        if hf_name not in entries:
            continue
        t = entries[hf_name]
        used.add(hf_name)
        if op == "copy":
            tensors[arg] = t
        elif op == "same":  # an MTP layer's copy of a main-model tensor: checked below, once that one is read
            copies.append((hf_name, arg))
        elif op in STACKED:  # GPT-OSS: a layer's experts in one tensor
            tensors.update(unstack(op, hf_name, t, arg))
        elif op == "T":
            tensors[arg] = Derived(lambda x: x.t(), [t])
        else:
            # memoised, so the parts share one read of the fused tensor inside a writer's load_scope
            # (a plain narrow of a tensor spread over ZeRO partitions would read it once per part)
            whole = Derived((lambda x: x.t()) if op == "cat_T" else (lambda x: x), [t], memo=True)
            start = 0
            for name in arg:
                n = part_rows(name, cfg)
                tensors[name] = whole.narrow(0, start, n)
                start += n
            require(start == whole.shape[0], f"{hf_name} has {whole.shape[0]} rows, expected {start}")
    return tensors, used, copies


def _check_copies(copies, entries: Dict[str, LazyTensor], tensors: Dict[str, LazyTensor], path) -> None:
    """An MTP layer's copies of the embedding and the head (families/mtp.py) must equal the main model's: the
    canonical state keeps one tensor, so a copy that differs would be lost. Read and compared here (two
    vocabulary-sized reads per copy, once per conversion)."""
    for hf_name, name in copies:
        main = tensors.get(name) if name in tensors else tensors.get("embed.word")  # a tied head is the embedding
        copy = entries[hf_name]
        same = main is not None and tuple(main.shape) == tuple(copy.shape) and torch.equal(main.load(), copy.load())
        require(same, f"{path}: {hf_name} differs from the main model's {name}: the MTP layer's own copy is not "
                "the shared one", "ckptool keeps one embedding and one head (as megatron-core shares them); "
                "a checkpoint whose MTP copies differ cannot be converted without losing one")


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_index(hf_name: str) -> Optional[int]:
    m = _LAYER_INDEX.search(hf_name)
    return int(m.group(1)) if m else None


def unfuse_experts(entries: Dict[str, LazyTensor], family: Family, cfg: GPTConfig) -> Dict[str, LazyTensor]:
    """transformers' fused 3-D expert tensors -> the per-expert Hub names (lazy; expert e reads only
    its own rows of a safetensors entry)."""
    out = dict(entries)
    for i in [i for i in range(cfg.all_layers) if cfg.is_moe_layer(i)]:  # the MTP layers' experts too
        p = family.names.layer_prefix.format(i=i)
        for suffix, (op, arg) in family.fused_experts.items():
            t = out.pop(p + suffix, None)
            if t is None:
                continue
            if op == "rename":
                out[p + arg] = t
                continue
            n = cfg.moe.num_experts
            want = fused_shape(op, cfg)
            require(tuple(t.shape) == want, f"{p + suffix} has shape {tuple(t.shape)}, expected {list(want)} "
                    "([experts, out, in], gate rows before up rows)",
                    "ckptool reads transformers' fused experts as its Glm4Moe / Qwen2-MoE / Mixtral modules hold them")
            for e in range(n):
                one = Derived(lambda x: x[0], [t.narrow(0, e, 1)])
                if op == "each":
                    out[p + arg.format(e=e)] = one
                else:
                    half = one.shape[0] // 2
                    out[p + arg[0].format(e=e)] = one.narrow(0, 0, half)
                    out[p + arg[1].format(e=e)] = one.narrow(0, half, half)
    return out


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    opts = opts or ReadOptions()
    path = Path(path)
    conf, family = read_supported_config(path)
    entries = read_entries(path)
    cfg, tensors = to_canonical(entries, conf, family.model_type, opts, path)
    quantization = quantization_doc(fp8.stored(entries), conf, path)
    ckpt = Checkpoint(cfg, tensors, SourceInfo(
        path=str(path), format=FORMAT, dialect=family.model_type, layout=Layout(1, 1),
        storage=storage_label(quantization) if quantization else "",
        extra={"hf_config": conf, "quantization": quantization}, hf_experts=experts_form(entries, family, cfg)))
    for w in source_warnings(conf, family):
        ckpt.warn(w)
    return ckpt
