"""Canonical state -> a Hugging Face directory that AutoModelForCausalLM loads without remote code.

GPT-2 style models (learned positions, LayerNorm, plain MLP) become GPT2LMHeadModel; Llama style
models (RoPE, RMSNorm, SwiGLU) become LlamaForCausalLM, or Qwen2ForCausalLM when only the QKV
projections carry a bias. Megatron options no such class computes are refused with the flag's
name rather than exported into a model that would compute something else.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..config import GPTConfig
from ..errors import CkptError, require
from ..io.transpose import transposed, transposed_cat
from ..io.safetensors_writer import Item, parse_size, write_sharded
from ..lazy import Const, Derived, LazyTensor, cat_shape
from ..state import Checkpoint
from ..vocab import resize_vocab
from . import hf_names
from .hf_names import expand

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "vocab.txt")
def config_dtype(dtype: torch.dtype) -> str:
    """The name config.json gives a torch dtype (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).replace("torch.", "")


def _refuse(flag: str, why: str) -> CkptError:
    return CkptError(f"cannot export to Hugging Face: the model uses {flag}, {why}",
                     "no transformers architecture computes this exactly; keep it in Megatron format")


def choose_architecture(cfg: GPTConfig) -> Tuple[str, str]:
    """(model_type, architecture class) for cfg, or CkptError naming the flag that prevents it."""
    if cfg.qk_layernorm:
        raise _refuse("--qk-layernorm", "which neither GPT2LMHeadModel nor LlamaForCausalLM applies")
    if cfg.post_layernorm_residual:
        raise _refuse("--apply-residual-connection-post-layernorm",
                      "a residual taken after the norm, which HF GPT-2/Llama do not do")
    if cfg.position_embedding == "learned":
        require(cfg.normalization == "layernorm" and not cfg.gated,
                f"cannot export to Hugging Face: learned positions with {cfg.normalization} and {cfg.activation} "
                "match neither GPT-2 (LayerNorm, GeLU) nor Llama (RoPE, RMSNorm, SwiGLU)")
        require(cfg.num_query_groups == cfg.num_attention_heads,
                "cannot export to Hugging Face: GPT2LMHeadModel has no grouped-query attention (--num-query-groups)")
        require(cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size,
                "cannot export to Hugging Face: GPT2LMHeadModel needs kv_channels x heads = hidden size (--kv-channels)")
        return "gpt2", "GPT2LMHeadModel"
    if cfg.position_embedding != "rope":
        raise _refuse("--position-embedding-type none", "and both HF architectures have positions")
    if cfg.rotary_percent != 1.0:
        raise _refuse(f"--rotary-percent {cfg.rotary_percent}", "and LlamaForCausalLM rotates the whole head")
    if cfg.activation == "squared_relu":
        raise _refuse("--squared-relu", "and LlamaForCausalLM's MLP is gated SiLU")
    require(cfg.gated, f"cannot export to Hugging Face: RoPE with a {cfg.activation} MLP is not Llama's SwiGLU",
            "LlamaForCausalLM needs --swiglu")
    require(cfg.normalization == "rmsnorm", "cannot export to Hugging Face: RoPE with LayerNorm is not Llama's "
            "RMSNorm", "LlamaForCausalLM needs --normalization RMSNorm")
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return "qwen2", "Qwen2ForCausalLM"
    return "llama", "LlamaForCausalLM"


# --- tensor transforms for export ----------------------------------------------------------

def _rotate_half_order(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from interleaved-pair order (0,1),(2,3).. to rotate-half order (evens, odds)."""
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    shaped = t.reshape(-1, head_dim, *t.shape[1:])
    return shaped[:, perm].reshape(t.shape)


def _export_tensors(cfg: GPTConfig, tensors: Dict[str, LazyTensor], model_type: str) -> Dict[str, LazyTensor]:
    out = dict(tensors)
    if cfg.apply_layernorm_1p:  # zero-centred gamma: the norm computes (1 + w)
        for k in list(out):
            if k.endswith("norm.weight"):
                out[k] = Derived(lambda w: w + 1, [out[k]])
    if cfg.rotary_interleaved and cfg.position_embedding == "rope":
        for k in list(out):
            if ".attn.q." in k or ".attn.k." in k:
                out[k] = Derived(lambda w: _rotate_half_order(w, cfg.head_dim), [out[k]])
    if model_type == "gpt2":  # GPT-2 always has biases; a bias-free Megatron model has zero ones
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            for lin, rows in (("attn.q", cfg.q_size), ("attn.k", cfg.kv_size), ("attn.v", cfg.kv_size),
                              ("attn.out", cfg.hidden_size), ("mlp.up", cfg.ffn_hidden_size),
                              ("mlp.down", cfg.hidden_size)):
                name = f"{p}{lin}.bias"
                if name not in out:
                    out[name] = Const(torch.zeros(rows, dtype=out[p + lin + ".weight"].dtype))
    return out


def _materialise(entry, tensors: Dict[str, LazyTensor]) -> Optional[LazyTensor]:
    op, arg = entry
    names = hf_names.canonical_names(entry)
    if any(n not in tensors for n in names):
        return None
    parts = [tensors[n] for n in names]
    if op == "copy":
        return parts[0]
    # shapes stated, not found by running the function on meta tensors (cat on meta imports
    # torch._dynamo, seconds of start-up); transposes run in parallel blocks (io/transpose.py)
    rows = cat_shape([p.shape for p in parts], 0)
    if op == "T":
        return Derived(transposed, parts, shape=(rows[1], rows[0]), dtype=parts[0].dtype)
    if op == "cat":
        return Derived(lambda *xs: torch.cat(xs, 0), parts, shape=rows, dtype=parts[0].dtype)
    return Derived(lambda *xs: transposed_cat(xs), parts, shape=(rows[1], rows[0]), dtype=parts[0].dtype)


# --- config.json ---------------------------------------------------------------------------

def _token_ids(ckpt: Checkpoint) -> dict:
    src = ckpt.source.extra.get("hf_config") or {}
    ids = {k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if src.get(k) is not None}
    if not ids and ckpt.config.vocab_size == 50257:  # the GPT-2 BPE vocabulary: <|endoftext|> is 50256
        ids = {"bos_token_id": 50256, "eos_token_id": 50256}
    return ids


def hf_config(cfg: GPTConfig, model_type: str, arch: str, vocab: int, dtype: torch.dtype, ids: dict) -> dict:
    dstr = config_dtype(dtype)
    if model_type == "gpt2":
        conf = {
            "architectures": [arch], "model_type": "gpt2", "vocab_size": vocab,
            "n_positions": cfg.max_position_embeddings, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "activation_function": hf_names.GPT2_ACTIVATION_OUT[cfg.activation],
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": 0.02,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "tie_word_embeddings": cfg.tied_embeddings, "use_cache": True,
            # GPT2Config defaults both to 50256, wrong for any other vocabulary: say "unknown".
            "bos_token_id": None, "eos_token_id": None,
        }
    else:
        rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
        conf = {
            "architectures": [arch], "model_type": model_type, "vocab_size": vocab,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            # transformers >= 5 reads rope_parameters; 4.x reads rope_theta (+ rope_scaling).
            "rope_theta": cfg.rotary_base, "rope_parameters": rope,
            "tie_word_embeddings": cfg.tied_embeddings, "initializer_range": 0.02,
            "attention_dropout": 0.0, "use_cache": True,
        }
        if cfg.rope_scaling_factor:
            scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
            rope.update(scaling)
            conf["rope_scaling"] = scaling
        if model_type == "llama":
            conf.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
        else:
            conf.update(use_sliding_window=False, sliding_window=None)
    conf.update(ids)
    conf["dtype"] = conf["torch_dtype"] = dstr
    return conf


# --- the writer ----------------------------------------------------------------------------

def write_hf(ckpt: Checkpoint, out_dir: Path, dtype: Optional[torch.dtype] = None, max_shard_size="5GB",
             tokenizer: Optional[str] = None, progress: Optional[Callable[[int], None]] = None,
             warn: Callable[[str], None] = print, owns: Optional[Callable[[int], bool]] = None) -> dict:
    """owns(i) (torchrun): write only the safetensors shards i it owns; configs, index and
    tokenizer go with shard 0's owner."""
    cfg = ckpt.config
    first = owns is None or owns(0)
    if not first:
        warn = lambda m: None  # noqa: E731 - the rank that owns shard 0 speaks for everyone
    model_type, arch = choose_architecture(cfg)
    max_bytes = parse_size(max_shard_size)
    vocab = cfg.vocab_size
    if vocab is None:
        vocab = cfg.padded_vocab_size
        warn(f"true vocabulary size unknown: exporting all {vocab} embedding rows (give --true-vocab-size "
             "to trim the padding)")
    tensors = resize_vocab(ckpt.tensors, cfg, vocab)
    tensors = _export_tensors(cfg, tensors, model_type)
    family = hf_names.MODEL_TYPES[model_type][0]
    items: List[Item] = []
    for hf_name, entry, group in expand(family, cfg.num_layers):
        if hf_name == "lm_head.weight" and cfg.tied_embeddings:
            continue
        t = _materialise(entry, tensors)
        if t is None:
            continue
        if dtype is not None:
            t = t.to(dtype)
        items.append((hf_name, t, group))
    out_dtype = dtype or items[0][1].dtype
    out_dir = Path(out_dir)
    summary = write_sharded(out_dir, items, max_bytes, progress, owns=owns)
    copied = []
    if first:
        ids = _token_ids(ckpt)
        conf = hf_config(cfg, model_type, arch, vocab, out_dtype, ids)
        (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        gen = {"_from_model_config": True, **ids}
        (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        copied = copy_tokenizer(tokenizer, out_dir) if tokenizer else []
    summary.update(architecture=arch, vocab_size=vocab, dtype=config_dtype(out_dtype),
                   tokenizer_files=copied)
    return summary


def copy_tokenizer(src: str, out_dir: Path) -> List[str]:
    src_dir = Path(src)
    require(src_dir.is_dir(), f"--tokenizer {src}: not a directory")
    found = [p for p in src_dir.iterdir() if p.name in TOKENIZER_FILES and p.is_file()]
    require(bool(found), f"--tokenizer {src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...)",
            "pass the directory a tokenizer was saved to with save_pretrained")
    for p in found:
        shutil.copy2(p, out_dir / p.name)
    return sorted(p.name for p in found)
