"""Canonical state -> a Hugging Face directory that AutoModelForCausalLM loads without remote code.

The class written is the model's family (families/for_config): GPT-2 style models (learned positions,
LayerNorm, plain MLP) become GPT2LMHeadModel; Llama style models (RoPE, RMSNorm, SwiGLU)
LlamaForCausalLM, Qwen2ForCausalLM when only the QKV projections carry a bias, Qwen3ForCausalLM with
q/k norms; MoE models MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM by their routing,
Glm4MoeForCausalLM when an expert bias steers it (DeepSeek-V3's routing on grouped-query attention, partial RoPE),
Multi-Latent Attention models DeepseekV3ForCausalLM; experts as the Hugging Face source stored them (per expert
under the Hub names transformers 4 and 5 both load, or transformers 5's fused 3-D tensors), or as --experts says. The family's record gives the names and config.json; this module
the tensor transforms every family shares. Megatron options no such class computes are refused with
the flag's name rather than exported into a model that would compute something else.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

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
from . import fp8
from .config import fused_shape
from .quant import RELEASE
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
    if cfg.apply_layernorm_1p and not family.zero_centred_norms:  # zero-centred gamma: the norm computes (1 + w)
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
    if op in ("copy", "same"):  # "same": an MTP layer's copy of a main-model tensor (families/mtp.py)
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

def token_ids(ckpt: Checkpoint) -> dict:
    src = ckpt.source.extra.get("hf_config") or {}
    ids = {k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if src.get(k) is not None}
    if not ids and ckpt.config.vocab_size == 50257:  # the GPT-2 BPE vocabulary: <|endoftext|> is 50256
        ids = {"bos_token_id": 50256, "eos_token_id": 50256}
    return ids


def hf_config(cfg: GPTConfig, family: Family, vocab: int, dtype: torch.dtype, ids: dict, fp8: bool = False) -> dict:
    conf = family.write_config(cfg, vocab)
    conf.update(ids)
    conf["dtype"] = conf["torch_dtype"] = config_dtype(dtype)  # with fp8: the unquantized tensors' dtype
    if fp8:
        conf["quantization_config"] = RELEASE.config_json()
    return conf


# --- the writer ----------------------------------------------------------------------------

def _target_family(cfg: GPTConfig, opts: WriteOptions) -> Family:
    """The HF class written for cfg (families.for_config); --fp8 only for a family released in block FP8."""
    family = families.for_config(cfg)
    require(not opts.fp8 or family.fp8_release, f"--fp8 stores the Linear weights in block FP8; "
            f"{family.architecture} is not released in block FP8",
            "leave --fp8 out (ckptool writes block FP8 for DeepseekV3ForCausalLM)")
    return family


def write_hf(ckpt: Checkpoint, out_dir: Path, opts: WriteOptions = WriteOptions(),
             progress: Optional[Callable[[int], None]] = None, warn: Callable[[str], None] = print,
             owns: Optional[Callable[[int], bool]] = None) -> WriteSummary:
    """Export ckpt as a Hugging Face model directory, as opts say (dtype, max_shard_size, tokenizer, experts,
    fp8: the options the format table says it honours; fp8 stores the Linear weights the family releases in
    block FP8 so, with their scales and config.json's quantization_config: fp8.py). owns(i) (torchrun):
    write only the safetensors shards i it owns; configs, index and tokenizer go with shard 0's owner."""
    cfg, dtype, tokenizer = ckpt.config, opts.dtype, opts.tokenizer
    first = owns is None or owns(0)
    if not first:
        warn = lambda m: None  # noqa: E731 - the rank that owns shard 0 speaks for everyone
    family, vocab, items = hf_items(ckpt, dtype, warn, _target_family(ckpt.config, opts))
    if experts_written(ckpt, opts) == "fused":
        items = fuse_experts(items, family, cfg)
    out_dtype = dtype or items[0][1].dtype
    if opts.fp8:  # after out_dtype: config.json's dtype is the unquantized tensors' (embeddings, norms)
        items = fp8.quantized_items(items, family)
    out_dir = Path(out_dir)
    written = write_sharded(out_dir, items, parse_size(opts.max_shard_size), progress, owns=owns)
    copied = []
    if first:
        ids = token_ids(ckpt)
        conf = hf_config(cfg, family, vocab, out_dtype, ids, fp8=opts.fp8)
        (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        gen = {"_from_model_config": True, **ids}
        (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        copied = copy_tokenizer(tokenizer, out_dir) if tokenizer else []
    return from_sharded("hf", written, tensors=len(items) if first else 0,  # a team's ranks: counted once
                        architecture=family.architecture, vocab_size=vocab, dtype=config_dtype(out_dtype),
                        tokenizer_files=copied, quantization=RELEASE.label() if opts.fp8 else None)


def hf_items(ckpt: Checkpoint, dtype: Optional[torch.dtype], warn: Callable[[str], None],
             family: Optional[Family] = None) -> Tuple[Family, int, List[Item]]:
    """(the family written, the vocabulary exported, [(HF name, lazy tensor, group)] in streaming order): every
    tensor of ckpt under the Hugging Face names of its family (the HF writer's, and the DCP writer's); family:
    the class written (default: families.for_config's)."""
    cfg = ckpt.config
    not_computed = megatron_args.maths_not_computed(ckpt.source.args)
    if not_computed:
        raise refuse_export(", ".join(not_computed), "which ckptool's export does not compute")
    family = family or families.for_config(cfg)
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
    require(not cfg.mtp_num_layers or family.names.mtp, f"cannot export to Hugging Face: the model has "
            f"{cfg.mtp_num_layers} multi-token-prediction (MTP) layers and {family.architecture} has no place for them",
            "give --drop-mtp to export without them (the main model's logits do not depend on them)")
    for hf_name, entry, group in family.names.expand(cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0,
                                                     cfg.mtp_num_layers):
        if hf_name == "lm_head.weight" and cfg.tied_embeddings:
            continue
        if entry == ("same", "output.weight") and cfg.tied_embeddings:
            entry = ("same", "embed.word")  # a tied model's head is its embedding
        t = materialise(entry, tensors)
        if t is None:
            continue
        used.update(canonical_names(entry))
        if dtype is not None:
            t = t.to(dtype)
        items.append((hf_name, t, group))
    unplaced = [n for n in tensors if n not in used and not (n == "output.weight" and cfg.tied_embeddings)]
    require(not unplaced, f"cannot export to Hugging Face: {', '.join(unplaced[:3])} have no place in "
            f"{family.architecture}", "ckptool never leaves tensors out of an export")
    return family, vocab, items


# --- MoE experts: per expert (the Hub names) or fused 3-D (config.py says which families hold which) ------

def experts_written(ckpt: Checkpoint, opts: WriteOptions) -> Optional[str]:
    """The experts' form written: --experts, else the Hugging Face source's (SourceInfo.hf_experts), else per expert
    (what the Hub holds and transformers 4 and 5 both load); None for a model without experts."""
    if ckpt.config.moe is None:
        require(opts.experts is None, f"--experts {opts.experts}: the model has no MoE layers",
                "leave --experts out for a dense model")
        return None
    return opts.experts or ckpt.source.hf_experts or "per-expert"


def fuse_experts(items: List[Item], family: Family, cfg: GPTConfig) -> List[Item]:
    """items with each MoE layer's per-expert tensors replaced by the family's fused ones (fused_experts: gate_up
    [E, 2I, h] as each expert's gate rows then its up rows, down [E, h, I]; Mixtral's router renamed), in place of the
    layer's first expert tensor."""
    by_name = {name: t for name, t, _ in items}
    made: Dict[str, Item] = {}  # the per-expert name whose place a fused tensor takes -> the fused item
    consumed = set()
    for i in cfg.moe.layers:
        p = family.names.layer_prefix.format(i=i)
        for suffix, (op, arg) in family.fused_experts.items():
            parts = [p + arg] if op == "rename" else [p + a.format(e=e) for e in range(cfg.moe.num_experts)
                                                       for a in (arg if op == "halves" else (arg,))]
            consumed.update(parts)
            tensors = [by_name[n] for n in parts]
            made[parts[0]] = (p + suffix, tensors[0] if op == "rename" else _stacked(tensors, op, cfg), f"layer {i}")
    return [made[name] if name in made else (name, t, g) for name, t, g in items
            if name in made or name not in consumed]


def _stacked(tensors: List[LazyTensor], op: str, cfg: GPTConfig) -> LazyTensor:
    """The experts' tensors (for "halves" each expert's gate then up) as one [E, out, in] tensor."""
    def stacked(*xs):
        if op == "halves":
            xs = [torch.cat(xs[k:k + 2], 0) for k in range(0, len(xs), 2)]
        return torch.stack(xs, 0)
    return Derived(stacked, tensors, shape=fused_shape(op, cfg), dtype=tensors[0].dtype)


def copy_tokenizer(src: str, out_dir: Path) -> List[str]:
    src_dir = Path(src)
    require(src_dir.is_dir(), f"--tokenizer {src}: not a directory")
    found = [p for p in src_dir.iterdir() if p.name in TOKENIZER_FILES and p.is_file()]
    require(bool(found), f"--tokenizer {src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...)",
            "pass the directory a tokenizer was saved to with save_pretrained")
    for p in found:
        shutil.copy2(p, out_dir / p.name)
    return sorted(p.name for p in found)
