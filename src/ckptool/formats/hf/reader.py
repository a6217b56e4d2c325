"""Hugging Face model directories (GPT-2, the Llama family, Mixtral, Qwen MoE, DeepSeek-V3): reader.

A directory with config.json whose model_type is gpt2, llama, mistral, qwen2, qwen3, mixtral,
qwen2_moe, qwen3_moe or deepseek_v3, and weights in safetensors or torch .bin files, sharded (an
*.index.json) or not. Experts are read per expert (the Hub names) or fused 3-D (transformers >= 5's state_dict);
DeepSeek's block-FP8 weights and GPT-OSS's MXFP4 experts are dequantized to bf16. Tensors stay lazy: safetensors
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
from ...io.safetensors_header import read_safetensors_header
from ...io.torchfile import load_torch_file
from ...lazy import Derived, LazyTensor
from ...options import ReadOptions
from ...state import Checkpoint, SourceInfo, expected_names
from ...vocab import with_true_vocab_size
from .mxfp4 import dequantize_mxfp4
from .stacked import unstack
from .config import (  # noqa: F401 (looks_like, gpt_model_type, has_weights: this reader's interface)
    FORMAT, IGNORED_SUFFIXES, gpt_model_type, has_weights, looks_like, part_rows, read_supported_config,
    source_warnings, weight_files)


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
        from safetensors import safe_open
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

    entries = dequantize_fp8(entries, conf, path)
    entries = dequantize_mxfp4(entries, conf, path)
    if family.fused_experts:
        entries = unfuse_experts(entries, family, cfg)
    tensors: Dict[str, LazyTensor] = {}
    used = set()
    for hf_name, (op, arg), _group in family.names.expand(cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0):
        if hf_name not in entries:
            continue
        t = entries[hf_name]
        used.add(hf_name)
        if op == "copy":
            tensors[arg] = t
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
    if cfg.tied_embeddings:
        tensors.pop("output.weight", None)
    leftover = sorted(k for k in entries if k not in used and not k.endswith(IGNORED_SUFFIXES)
                      and not (cfg.tied_embeddings and k == "lm_head.weight"))
    beyond = [k for k in leftover if _layer_index(k) is not None and _layer_index(k) >= cfg.num_layers]
    require(not beyond, f"{path}: {', '.join(beyond[:3])} belong to layers past num_hidden_layers="
            f"{cfg.num_layers}: multi-token-prediction (MTP) layers are not supported",
            "ckptool never drops tensors; remove the MTP layers from the checkpoint first if you do not need them")
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


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_index(hf_name: str) -> Optional[int]:
    m = _LAYER_INDEX.search(hf_name)
    return int(m.group(1)) if m else None


FP8_SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def _dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block, dtype) -> torch.Tensor:
    rows, cols = w.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w.float() * scale).to(dtype)


def dequantize_fp8(entries: Dict[str, LazyTensor], conf: dict, path) -> Dict[str, LazyTensor]:
    """DeepSeek's FP8 weights (float8_e4m3fn, one float32 weight_scale_inv per block of
    weight_block_size, 128x128 by default) -> bf16, as DeepSeek's own fp8-to-bf16 cast computes
    them. The scales are consumed; a scale without its weight, or another FP8 layout, is refused."""
    scales = [k for k in entries if k.endswith(FP8_SCALE_SUFFIX)]
    if not scales:
        return entries
    quant = conf.get("quantization_config") or {}
    require(quant.get("quant_method", "fp8") == "fp8" and quant.get("fmt", "e4m3") == "e4m3",
            f"{path}: quantization {quant.get('quant_method')}/{quant.get('fmt')} is not supported",
            "ckptool dequantizes DeepSeek's block FP8 (e4m3, weight_scale_inv) only")
    block = tuple(quant.get("weight_block_size") or (128, 128))
    out = dict(entries)
    for key in scales:
        name = key[:-len(FP8_SCALE_SUFFIX)]
        w, s = out.get(name), out.pop(key)
        require(w is not None and w.dtype in FP8_DTYPES and len(w.shape) == 2,
                f"{path}: {key} scales no float8_e4m3fn matrix {name}", "the FP8 checkpoint is incomplete or not block FP8")
        want = tuple(-(-n // b) for n, b in zip(w.shape, block))
        require(tuple(s.shape) == want, f"{path}: {key} has shape {tuple(s.shape)}, expected {want} for "
                f"{tuple(w.shape)} in {block[0]}x{block[1]} blocks")
        out[name] = Derived(lambda x, y: _dequantize(x, y, block, torch.bfloat16), [w, s],
                            shape=w.shape, dtype=torch.bfloat16)
    fp8 = [k for k, t in out.items() if t.dtype in FP8_DTYPES]
    require(not fp8, f"{path}: FP8 tensors without a weight_scale_inv: {', '.join(fp8[:3])}",
            "ckptool dequantizes block FP8 weights that carry their scales")
    return out


def unfuse_experts(entries: Dict[str, LazyTensor], family: Family, cfg: GPTConfig) -> Dict[str, LazyTensor]:
    """transformers' fused 3-D expert tensors -> the per-expert Hub names (lazy; expert e reads only
    its own rows of a safetensors entry)."""
    out = dict(entries)
    for i in cfg.moe.layers if cfg.moe else ():
        p = family.names.layer_prefix.format(i=i)
        for suffix, (op, arg) in family.fused_experts.items():
            t = out.pop(p + suffix, None)
            if t is None:
                continue
            if op == "rename":
                out[p + arg] = t
                continue
            n = cfg.moe.num_experts
            require(len(t.shape) == 3 and t.shape[0] == n,
                    f"{p + suffix} has shape {tuple(t.shape)}, expected [{n} experts, out, in]")
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
    cfg, tensors = to_canonical(read_entries(path), conf, family.model_type, opts, path)
    ckpt = Checkpoint(cfg, tensors, SourceInfo(
        path=str(path), format=FORMAT, dialect=family.model_type, layout=Layout(1, 1),
        extra={"hf_config": conf}))
    for w in source_warnings(conf, family):
        ckpt.warn(w)
    return ckpt
