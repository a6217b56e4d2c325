"""Canonical state -> a Hugging Face directory that AutoModelForCausalLM loads without remote code.

The class written is the model's family (families/for_config): GPT-2 style models (learned positions,
LayerNorm, plain MLP) become GPT2LMHeadModel; Llama style models (RoPE, RMSNorm, SwiGLU)
LlamaForCausalLM, Qwen2ForCausalLM when only the QKV projections carry a bias, Qwen3ForCausalLM with
q/k norms; MoE models MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM by their routing,
Multi-Latent Attention models DeepseekV3ForCausalLM; experts under the per-expert Hub names
transformers 4 and 5 both load. The family's record gives the names and config.json; this module
the tensor transforms every family shares. Megatron options no such class computes are refused with
the flag's name rather than exported into a model that would compute something else.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ... import families
from ...config import GPTConfig
from ...errors import require
from ...families.family import STACKED, Family, canonical_names, refuse_export
from ...io.transpose import transposed, transposed_cat
from ...io.safetensors_writer import Item, parse_size, write_sharded
from ...lazy import Const, Derived, LazyTensor, cat_shape
from ...state import Checkpoint, expected_names
from ...summary import WriteSummary, from_sharded
from ...vocab import resize_vocab
from ...write_options import WriteOptions
from ..megatron import args as megatron_args
from .stacked import stack

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "vocab.txt")


def config_dtype(dtype: torch.dtype) -> str:
    """The name config.json gives a torch dtype (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).replace("torch.", "")


# --- tensor transforms for export ----------------------------------------------------------

def _rotate_half_order(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from interleaved-pair order (0,1),(2,3).. to rotate-half order (evens, odds)."""
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    shaped = t.reshape(-1, head_dim, *t.shape[1:])
    return shaped[:, perm].reshape(t.shape)


def _export_tensors(cfg: GPTConfig, tensors: Dict[str, LazyTensor], family: Family) -> Dict[str, LazyTensor]:
    out = dict(tensors)
    if cfg.apply_layernorm_1p:  # zero-centred gamma: the norm computes (1 + w)
        for k in list(out):
            if k.endswith("norm.weight"):
                out[k] = Derived(lambda w: w + 1, [out[k]])
    if cfg.rotary_interleaved and cfg.position_embedding == "rope" and cfg.mla is None:  # DeepSeek: rope_interleave
        for k in list(out):  # q/k norm weights scale the same features: they follow the rows
            if any(f".attn.{x}." in k for x in ("q", "k", "q_norm", "k_norm")):
                out[k] = Derived(lambda w: _rotate_half_order(w, cfg.head_dim), [out[k]])
    if family.zero_biases:  # GPT-2 always has biases; a bias-free Megatron model has zero ones
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            for lin, rows in (("attn.q", cfg.q_size), ("attn.k", cfg.kv_size), ("attn.v", cfg.kv_size),
                              ("attn.out", cfg.hidden_size), ("mlp.up", cfg.ffn_hidden_size),
                              ("mlp.down", cfg.hidden_size)):
                name = f"{p}{lin}.bias"
                if name not in out:
                    out[name] = Const(torch.zeros(rows, dtype=out[p + lin + ".weight"].dtype))
    return out


def materialise(entry, tensors: Dict[str, LazyTensor]) -> Optional[LazyTensor]:
    """The HF tensor of one name-table entry (op, arg, families/family.py) built from canonical tensors; None if one is absent."""
    op, arg = entry
    names = canonical_names(entry)
    if not names or any(n not in tensors for n in names):
        return None
    parts = [tensors[n] for n in names]
    if op == "copy":
        return parts[0]
    if op in STACKED:  # GPT-OSS: a layer's experts in one tensor
        return stack(op, parts)
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


def hf_config(cfg: GPTConfig, family: Family, vocab: int, dtype: torch.dtype, ids: dict) -> dict:
    conf = family.write_config(cfg, vocab)
    conf.update(ids)
    conf["dtype"] = conf["torch_dtype"] = config_dtype(dtype)
    return conf


# --- the writer ----------------------------------------------------------------------------

def write_hf(ckpt: Checkpoint, out_dir: Path, opts: WriteOptions = WriteOptions(),
             progress: Optional[Callable[[int], None]] = None, warn: Callable[[str], None] = print,
             owns: Optional[Callable[[int], bool]] = None) -> WriteSummary:
    """Export ckpt as a Hugging Face model directory, as opts say (dtype, max_shard_size, tokenizer: the
    options the format table says it honours). owns(i) (torchrun): write only the safetensors shards i it
    owns; configs, index and tokenizer go with shard 0's owner."""
    cfg, dtype, tokenizer = ckpt.config, opts.dtype, opts.tokenizer
    not_computed = megatron_args.maths_not_computed(ckpt.source.args)
    if not_computed:
        raise refuse_export(", ".join(not_computed), "which ckptool's export does not compute")
    first = owns is None or owns(0)
    if not first:
        warn = lambda m: None  # noqa: E731 - the rank that owns shard 0 speaks for everyone
    family = families.for_config(cfg)
    arch = family.architecture
    max_bytes = parse_size(opts.max_shard_size)
    vocab = cfg.vocab_size
    if vocab is None:
        vocab = cfg.padded_vocab_size
        warn(f"true vocabulary size unknown: exporting all {vocab} embedding rows (give --true-vocab-size "
             "to trim the padding)")
    tensors = resize_vocab(ckpt.tensors, cfg, vocab)
    tensors = _export_tensors(cfg, tensors, family)
    missing = [n for n in expected_names(cfg) if n not in tensors]
    require(not missing, f"cannot export to Hugging Face: the model lacks {', '.join(missing[:3])}",
            "the checkpoint does not hold every tensor its config describes")
    items: List[Item] = []
    used = set()
    for hf_name, entry, group in family.names.expand(cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0):
        if hf_name == "lm_head.weight" and cfg.tied_embeddings:
            continue
        t = materialise(entry, tensors)
        if t is None:
            continue
        used.update(canonical_names(entry))
        if dtype is not None:
            t = t.to(dtype)
        items.append((hf_name, t, group))
    unplaced = [n for n in tensors if n not in used and not (n == "output.weight" and cfg.tied_embeddings)]
    require(not unplaced, f"cannot export to Hugging Face: {', '.join(unplaced[:3])} have no place in {arch}",
            "ckptool never leaves tensors out of an export")
    out_dtype = dtype or items[0][1].dtype
    out_dir = Path(out_dir)
    written = write_sharded(out_dir, items, max_bytes, progress, owns=owns)
    copied = []
    if first:
        ids = _token_ids(ckpt)
        conf = hf_config(cfg, family, vocab, out_dtype, ids)
        (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        gen = {"_from_model_config": True, **ids}
        (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        copied = copy_tokenizer(tokenizer, out_dir) if tokenizer else []
    return from_sharded("hf", written, tensors=len(items) if first else 0,  # a team's ranks: counted once
                        architecture=arch, vocab_size=vocab, dtype=config_dtype(out_dtype), tokenizer_files=copied)


def copy_tokenizer(src: str, out_dir: Path) -> List[str]:
    src_dir = Path(src)
    require(src_dir.is_dir(), f"--tokenizer {src}: not a directory")
    found = [p for p in src_dir.iterdir() if p.name in TOKENIZER_FILES and p.is_file()]
    require(bool(found), f"--tokenizer {src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...)",
            "pass the directory a tokenizer was saved to with save_pretrained")
    for p in found:
        shutil.copy2(p, out_dir / p.name)
    return sorted(p.name for p in found)
