"""Hugging Face model directories (GPT-2 and the Llama family): reader.

A directory with config.json whose model_type is gpt2, llama, mistral or qwen2, and weights in
safetensors or torch .bin files, sharded (an *.index.json) or not. Tensors stay lazy: safetensors
entries are read with safe_open when loaded; .bin files go through the safe lazy torch loader, never
plain torch.load. Names are mapped with the tables in hf_names.py; the writer is hf_writer.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch

from ..config import GPTConfig, Layout
from ..errors import CkptError, require
from ..io.safetensors_header import read_safetensors_header
from ..io.torchfile import load_torch_file
from ..lazy import Derived, LazyTensor
from ..options import ReadOptions
from ..state import Checkpoint, SourceInfo, expected_names
from . import hf_names
from .hf_names import MODEL_TYPES, expand

FORMAT = "hf"
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Buffers older transformers versions saved with the weights: recomputed by the model, never data.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _read_config(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None


def gpt_model_type(conf: dict) -> Optional[str]:
    mt = conf.get("model_type")
    if mt in MODEL_TYPES:
        return mt
    for arch in conf.get("architectures") or []:
        for key, (_, cls) in MODEL_TYPES.items():
            if arch == cls:
                return key
    return None


def has_weights(path) -> bool:
    """A weights file (or its index) transformers would load from this directory."""
    return any((Path(path) / f).is_file() for f in WEIGHT_FILES + WEIGHT_INDEXES)


def looks_like(path) -> bool:
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    if not has_weights(path) and (path / "latest_checkpointed_iteration.txt").is_file():
        return False  # a Megatron save dir with an HF config.json kept beside it: Megatron's to read
    conf = _read_config(path)
    return conf is not None and gpt_model_type(conf) is not None


# --- lazy tensors --------------------------------------------------------------------------

class SafetensorsTensor(LazyTensor):
    """One entry of a .safetensors file; narrow() on dim 0 reads only those rows."""

    def __init__(self, path: Path, key: str, shape, dtype: torch.dtype, rows=None):
        self.path, self.key, self.rows = path, key, rows
        self.shape = torch.Size(shape)
        self.dtype = dtype

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
                                 (base + start, base + start + length))


def _safetensors_entries(path: Path) -> Dict[str, LazyTensor]:
    # The header is validated (offsets tile the buffer, sizes match shapes) before anything is read.
    header = read_safetensors_header(path)
    return {name: SafetensorsTensor(path, name, e.shape, e.dtype) for name, e in header.tensors.items()}


def _bin_entries(path: Path) -> Dict[str, LazyTensor]:
    tree = load_torch_file(path)
    if isinstance(tree, dict) and "state_dict" in tree and isinstance(tree["state_dict"], dict):
        tree = tree["state_dict"]
    require(isinstance(tree, dict), f"{path}: holds no state dict")
    return {k: v for k, v in tree.items() if isinstance(v, LazyTensor)}


def weight_files(path: Path):
    for idx in WEIGHT_INDEXES:
        if (path / idx).is_file():
            try:
                weight_map = json.loads((path / idx).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CkptError(f"{path / idx}: unreadable index ({e})")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).is_file()]
            require(not missing, f"{path}: the index lists {', '.join(missing[:3])} but the file is missing",
                    "the download is incomplete")
            return [path / f for f in files]
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise CkptError(f"{path}: config.json but no model.safetensors / pytorch_model.bin (or their index)",
                    "pass a directory written by save_pretrained")


def read_entries(path: Path) -> Dict[str, LazyTensor]:
    entries: Dict[str, LazyTensor] = {}
    for f in weight_files(path):
        entries.update(_safetensors_entries(f) if f.suffix == ".safetensors" else _bin_entries(f))
    return entries


# --- config --------------------------------------------------------------------------------

def _rope(conf: dict):
    """(theta, llama3 factor or None) from rope_parameters (transformers 5) or rope_theta/rope_scaling (4)."""
    params = dict(conf.get("rope_parameters") or {})
    scaling = conf.get("rope_scaling") or {}
    theta = params.get("rope_theta", conf.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    src = params if params.get("rope_type") not in (None, "default") else scaling
    if rtype == "default":
        return float(theta), None
    if rtype == "llama3":
        want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in want.items():
            require(float(src.get(k, v)) == v, f"llama3 rope scaling with {k}={src.get(k)} is not supported",
                    f"ckptool's Megatron output uses {k}={v}")
        return float(theta), float(src["factor"])
    raise CkptError(f"rope scaling type {rtype!r} has no Megatron equivalent ckptool writes",
                    "only default and llama3 RoPE are converted")


def config_from_hf(conf: dict, rows: int, model_type: str) -> GPTConfig:
    family = MODEL_TYPES[model_type][0]
    true_vocab = conf.get("vocab_size")
    if true_vocab is None or true_vocab > rows:
        true_vocab = rows
    common = dict(padded_vocab_size=rows, vocab_size=true_vocab, vocab_size_source="config.json vocab_size")
    if family == "gpt2":
        act = conf.get("activation_function", "gelu_new")
        require(act in hf_names.GPT2_ACTIVATION_IN, f"GPT-2 activation_function {act!r} is not supported",
                f"supported: {', '.join(hf_names.GPT2_ACTIVATION_IN)}")
        h = conf["n_embd"]
        return GPTConfig(num_layers=conf["n_layer"], hidden_size=h, num_attention_heads=conf["n_head"],
                         ffn_hidden_size=conf.get("n_inner") or 4 * h,
                         max_position_embeddings=conf.get("n_positions", conf.get("n_ctx", 1024)),
                         position_embedding="learned", normalization="layernorm",
                         norm_eps=conf.get("layer_norm_epsilon", 1e-5),
                         activation=hf_names.GPT2_ACTIVATION_IN[act], add_bias_linear=True, add_qkv_bias=True,
                         tied_embeddings=conf.get("tie_word_embeddings", True), **common)
    act = conf.get("hidden_act", "silu")
    require(act == "silu", f"{model_type} hidden_act {act!r} is not SwiGLU's silu",
            "only silu-gated MLPs map onto Megatron's --swiglu")
    if model_type == "qwen2":
        qkv_bias, linear_bias = True, False
    else:
        attn_bias, mlp_bias = bool(conf.get("attention_bias", False)), bool(conf.get("mlp_bias", False))
        require(attn_bias == mlp_bias,
                f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: Megatron biases all linear layers or none "
                "(add_bias_linear), so this bias pattern has no Megatron equivalent")
        qkv_bias = linear_bias = attn_bias
    theta, factor = _rope(conf)
    nh = conf["num_attention_heads"]
    return GPTConfig(num_layers=conf["num_hidden_layers"], hidden_size=conf["hidden_size"], num_attention_heads=nh,
                     num_query_groups=conf.get("num_key_value_heads") or nh, head_dim=conf.get("head_dim"),
                     ffn_hidden_size=conf["intermediate_size"],
                     max_position_embeddings=conf.get("max_position_embeddings", 2048),
                     position_embedding="rope", rotary_base=theta, rope_scaling_factor=factor,
                     normalization="rmsnorm", norm_eps=conf.get("rms_norm_eps", 1e-6), activation="swiglu",
                     add_bias_linear=linear_bias, add_qkv_bias=qkv_bias,
                     tied_embeddings=bool(conf.get("tie_word_embeddings", False)), **common)


# --- the reader ----------------------------------------------------------------------------

def _part_rows(name: str, cfg: GPTConfig) -> int:
    return cfg.q_size if ".attn.q." in name else cfg.kv_size


def to_canonical(entries: Dict[str, LazyTensor], conf: dict, model_type: str, opts: ReadOptions, path):
    """(GPTConfig, {canonical name: lazy}) from HF-named tensors; also used for DeepSpeed runs of HF models."""
    family = MODEL_TYPES[model_type][0]
    if family == "gpt2" and not any(k.startswith("transformer.") for k in entries):
        # GPT2Model checkpoints (and the original openai-community/gpt2 files) omit the prefix.
        entries = {("transformer." + k if not k.startswith("lm_head.") else k): v for k, v in entries.items()}
    word_key = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    require(word_key in entries, f"{path}: no {word_key} in the weight files")
    cfg = config_from_hf(conf, entries[word_key].shape[0], model_type)
    if opts.true_vocab_size is not None:
        cfg = cfg.replace(vocab_size=opts.true_vocab_size, vocab_size_source="--true-vocab-size")
    if opts.overrides.get("activation"):
        cfg = cfg.replace(activation=opts.overrides["activation"])

    tensors: Dict[str, LazyTensor] = {}
    used = set()
    for hf_name, (op, arg), _group in expand(family, cfg.num_layers):
        if hf_name not in entries:
            continue
        t = entries[hf_name]
        used.add(hf_name)
        if op == "copy":
            tensors[arg] = t
        elif op == "T":
            tensors[arg] = Derived(lambda x: x.t(), [t])
        else:
            # memoised, so the parts share one read of the fused tensor inside a writer's load_scope
            # (a plain narrow of a tensor spread over ZeRO partitions would read it once per part)
            whole = Derived((lambda x: x.t()) if op == "cat_T" else (lambda x: x), [t], memo=True)
            start = 0
            for name in arg:
                n = _part_rows(name, cfg)
                tensors[name] = whole.narrow(0, start, n)
                start += n
            require(start == whole.shape[0], f"{hf_name} has {whole.shape[0]} rows, expected {start}")
    if cfg.tied_embeddings:
        tensors.pop("output.weight", None)
    leftover = sorted(k for k in entries if k not in used and not k.endswith(IGNORED_SUFFIXES)
                      and not (cfg.tied_embeddings and k == "lm_head.weight"))
    require(not leftover, f"{path}: tensors ckptool does not know how to map: {', '.join(leftover[:5])}",
            "this model has parts a Megatron GPT cannot hold")
    want = expected_names(cfg)
    missing = [n for n in want if n not in tensors]
    require(not missing, f"{path}: missing weights for {', '.join(missing[:5])}",
            "the weight files do not match config.json")
    return cfg, {n: tensors[n] for n in want}


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    opts = opts or ReadOptions()
    path = Path(path)
    conf = _read_config(path)
    require(conf is not None, f"{path / 'config.json'} is not readable JSON")
    model_type = gpt_model_type(conf)
    require(model_type is not None, f"{path}: model_type {conf.get('model_type')!r} is not one ckptool converts",
            f"supported: {', '.join(MODEL_TYPES)}")
    cfg, tensors = to_canonical(read_entries(path), conf, model_type, opts, path)
    ckpt = Checkpoint(cfg, tensors, SourceInfo(
        path=str(path), format=FORMAT, dialect=model_type, layout=Layout(1, 1),
        extra={"hf_config": conf}))
    if model_type == "mistral" and conf.get("sliding_window"):
        ckpt.warn(f"Mistral sliding_window={conf['sliding_window']} is dropped: Megatron attends over the "
                  "whole context (identical for sequences up to that length)")
    return ckpt
