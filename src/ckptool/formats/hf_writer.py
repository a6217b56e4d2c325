"""Canonical state -> a Hugging Face directory that AutoModelForCausalLM loads without remote code.

GPT-2 style models (learned positions, LayerNorm, plain MLP) become GPT2LMHeadModel; Llama style
models (RoPE, RMSNorm, SwiGLU) become LlamaForCausalLM, Qwen2ForCausalLM when only the QKV
projections carry a bias, Qwen3ForCausalLM with q/k norms; MoE models become MixtralForCausalLM,
Qwen2MoeForCausalLM or Qwen3MoeForCausalLM by their routing (MOE_ARCHITECTURES), Multi-Latent
Attention models DeepseekV3ForCausalLM; experts under the per-expert Hub names transformers 4 and 5
both load. Megatron options no such class computes
are refused with the flag's name rather than exported into a model that would compute something else.
"""
from __future__ import annotations

import dataclasses
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
from ..state import Checkpoint, expected_names
from ..summary import WriteSummary, from_sharded
from ..vocab import resize_vocab
from ..write_options import WriteOptions
from . import hf_names, megatron_args
from .hf_names import expand

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "vocab.txt")
def config_dtype(dtype: torch.dtype) -> str:
    """The name config.json gives a torch dtype (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).replace("torch.", "")


def _refuse(flag: str, why: str) -> CkptError:
    return CkptError(f"cannot export to Hugging Face: the model uses {flag}, {why}",
                     "no transformers architecture computes this exactly; keep it in Megatron format")


# MoE classes by (q/k norms, shared expert, top-k renormalised) -> (model_type, class, needs):
# needs lists what else the class fixes: QKV bias or not, whether every layer must be MoE.
MOE_ARCHITECTURES = {
    (False, None, True): ("mixtral", "MixtralForCausalLM", dict(qkv_bias=False, all_layers=True)),
    (True, None, True): ("qwen3_moe", "Qwen3MoeForCausalLM", dict(qkv_bias=False)),
    (True, None, False): ("qwen3_moe", "Qwen3MoeForCausalLM", dict(qkv_bias=False)),
    (False, "gated", True): ("qwen2_moe", "Qwen2MoeForCausalLM", dict(qkv_bias=True)),
    (False, "gated", False): ("qwen2_moe", "Qwen2MoeForCausalLM", dict(qkv_bias=True)),
}


def _mla_architecture(cfg: GPTConfig) -> Tuple[str, str]:
    """DeepseekV3ForCausalLM: MLA, sigmoid group-limited routing with expert bias, ungated shared
    experts (a whole number of expert-sized ones), the first layers dense (all of them in a dense model:
    first_k_dense_replace = num_hidden_layers)."""
    moe, arch = cfg.moe, "DeepseekV3ForCausalLM"
    routing = () if moe is None else (
        ("--moe-router-score-function softmax", moe.score_function != "sigmoid"),
        ("no expert bias (--moe-router-enable-expert-bias)", not moe.expert_bias),
        ("a router bias", moe.router_bias), ("a shared-expert gate", moe.shared_gate),
        (f"a shared expert of {moe.shared_ffn_hidden_size} (not a multiple of the expert size "
         f"{moe.ffn_hidden_size})", moe.shared_ffn_hidden_size % moe.ffn_hidden_size != 0),
        (f"MoE layers {list(moe.layers)} (not all layers after the first dense ones)",
         moe.layers != tuple(range(cfg.num_layers - len(moe.layers), cfg.num_layers))))
    for flag, present in routing + (("--qk-layernorm", cfg.qk_layernorm),
                                    ("linear biases", cfg.add_bias_linear or cfg.add_qkv_bias)):
        if present:
            raise _refuse(flag, f"which {arch} does not compute")
    return "deepseek_v3", arch


def _moe_architecture(cfg: GPTConfig) -> Tuple[str, str]:
    moe = cfg.moe
    for flag, present in (("--moe-router-score-function sigmoid", moe.score_function != "softmax"),
                          (f"--moe-router-topk-scaling-factor {moe.scaling_factor}", moe.scaling_factor != 1.0),
                          ("a router bias", moe.router_bias), ("--moe-router-enable-expert-bias", moe.expert_bias),
                          (f"group-limited routing ({moe.num_groups} groups)", moe.num_groups > 1),
                          ("--add-bias-linear", cfg.add_bias_linear)):
        if present:
            raise _refuse(flag, "which no Mixtral / Qwen-MoE class computes")
    shared = "gated" if moe.shared_gate else ("ungated" if moe.shared_ffn_hidden_size else None)
    key = (cfg.qk_layernorm, shared, moe.topk_norm)
    if key not in MOE_ARCHITECTURES:
        raise _refuse(f"MoE routing with q/k norms={key[0]}, shared expert={shared or 'none'}, top-k "
                      f"renormalised={key[2]}", "a combination Mixtral, Qwen2-MoE and Qwen3-MoE do not compute")
    model_type, arch, needs = MOE_ARCHITECTURES[key]
    if needs["qkv_bias"] != cfg.add_qkv_bias:
        raise _refuse(f"{'no ' if needs['qkv_bias'] else ''}QKV bias (--add-qkv-bias)",
                      f"and {arch} {'always has' if needs['qkv_bias'] else 'never has'} one")
    if needs.get("all_layers") and len(moe.layers) != cfg.num_layers:
        raise _refuse(f"dense layers among MoE ones ({cfg.num_layers - len(moe.layers)} of {cfg.num_layers})",
                      f"and every {arch} layer is MoE")
    return model_type, arch


def choose_architecture(cfg: GPTConfig) -> Tuple[str, str]:
    """(model_type, architecture class) for cfg, or CkptError naming the flag that prevents it."""
    if cfg.qk_layernorm and cfg.normalization != "rmsnorm":
        raise _refuse("--qk-layernorm with LayerNorm", "and only Qwen3's RMSNorm q/k norms exist in transformers")
    if cfg.post_layernorm_residual:
        raise _refuse("--apply-residual-connection-post-layernorm",
                      "a residual taken after the norm, which HF GPT-2/Llama do not do")
    if cfg.position_embedding == "learned":
        if cfg.moe is not None or cfg.qk_layernorm:
            raise _refuse("MoE layers" if cfg.moe is not None else "--qk-layernorm",
                          "with learned positions, which GPT2LMHeadModel does not have")
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
    if cfg.mla is not None:
        return _mla_architecture(cfg)
    if cfg.rope_yarn is not None:
        raise _refuse("YaRN RoPE scaling without Multi-Latent Attention", "which ckptool exports for DeepSeek-V3 only")
    if cfg.moe is not None:
        return _moe_architecture(cfg)
    if cfg.qk_layernorm:
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            raise _refuse("--qk-layernorm with linear biases", "and Qwen3ForCausalLM biases q, k, v and out "
                          "together (attention_bias) and never its MLP")
        return "qwen3", "Qwen3ForCausalLM"
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
    if cfg.rotary_interleaved and cfg.position_embedding == "rope" and cfg.mla is None:  # DeepSeek: rope_interleave
        for k in list(out):  # q/k norm weights scale the same features: they follow the rows
            if any(f".attn.{x}." in k for x in ("q", "k", "q_norm", "k_norm")):
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


def materialise(entry, tensors: Dict[str, LazyTensor]) -> Optional[LazyTensor]:
    """The HF tensor of one hf_names entry (op, arg) built from canonical tensors; None if one is absent."""
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
        conf.update(FAMILY_FIELDS[model_type](cfg))
    conf.update(ids)
    conf["dtype"] = conf["torch_dtype"] = dstr
    return conf


def _qwen_moe_layers(cfg: GPTConfig) -> dict:
    """decoder_sparse_step and mlp_only_layers that give exactly cfg.moe.layers (fewest exceptions)."""
    n, moe = cfg.num_layers, set(cfg.moe.layers)
    best = None
    for step in range(1, n + 1):
        hit = {i for i in range(n) if (i + 1) % step == 0}
        if moe <= hit and (best is None or len(hit - moe) < len(best[1])):
            best = (step, sorted(hit - moe))
    return {"decoder_sparse_step": best[0], "mlp_only_layers": best[1]}


def _moe_fields(cfg: GPTConfig) -> dict:
    moe = cfg.moe
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.topk_norm,
            "moe_intermediate_size": moe.ffn_hidden_size, "output_router_logits": False,
            "use_sliding_window": False, "sliding_window": None,
            **_qwen_moe_layers(cfg)}


# model_type -> the config.json fields of that class beyond the Llama ones
FAMILY_FIELDS = {
    "llama": lambda cfg: dict(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear),
    "qwen2": lambda cfg: dict(use_sliding_window=False, sliding_window=None),
    "qwen3": lambda cfg: dict(attention_bias=False, use_sliding_window=False, sliding_window=None),
    "mixtral": lambda cfg: dict(num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
                                intermediate_size=cfg.moe.ffn_hidden_size, router_jitter_noise=0.0,
                                output_router_logits=False, sliding_window=None),
    "qwen2_moe": lambda cfg: dict(_moe_fields(cfg), qkv_bias=True,
                                  shared_expert_intermediate_size=cfg.moe.shared_ffn_hidden_size),
    "qwen3_moe": lambda cfg: dict(_moe_fields(cfg), attention_bias=False),
    "deepseek_v3": lambda cfg: _deepseek_fields(cfg),
}


def _deepseek_fields(cfg: GPTConfig) -> dict:
    m, moe = cfg.mla, cfg.moe
    # a dense model: every layer dense, no routing fields (transformers' defaults stand for a routing no layer runs)
    routing = {"first_k_dense_replace": cfg.num_layers} if moe is None else {
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.ffn_hidden_size, "n_shared_experts": moe.shared_ffn_hidden_size // moe.ffn_hidden_size,
        "routed_scaling_factor": moe.scaling_factor, "norm_topk_prob": moe.topk_norm,
        "n_group": moe.num_groups, "topk_group": moe.group_topk, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "first_k_dense_replace": cfg.num_layers - len(moe.layers)}
    return {"head_dim": m.qk_rope_head_dim, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "qk_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": cfg.rotary_interleaved,
            **routing, "num_nextn_predict_layers": 0, "attention_bias": False, **_yarn_fields(cfg)}


def _yarn_fields(cfg: GPTConfig) -> dict:
    """YaRN under rope_parameters (transformers 5) and rope_scaling (4), beside the theta."""
    y = cfg.rope_yarn
    if y is None:
        return {}
    scaling = {k: v for k, v in dataclasses.asdict(y).items() if v is not None}
    scaling["rope_type"] = "yarn"
    return {"rope_scaling": scaling, "rope_parameters": dict(scaling, rope_theta=cfg.rotary_base)}


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
        raise _refuse(", ".join(not_computed), "which ckptool's export does not compute")
    first = owns is None or owns(0)
    if not first:
        warn = lambda m: None  # noqa: E731 - the rank that owns shard 0 speaks for everyone
    model_type, arch = choose_architecture(cfg)
    max_bytes = parse_size(opts.max_shard_size)
    vocab = cfg.vocab_size
    if vocab is None:
        vocab = cfg.padded_vocab_size
        warn(f"true vocabulary size unknown: exporting all {vocab} embedding rows (give --true-vocab-size "
             "to trim the padding)")
    tensors = resize_vocab(ckpt.tensors, cfg, vocab)
    tensors = _export_tensors(cfg, tensors, model_type)
    family = hf_names.MODEL_TYPES[model_type][0]
    missing = [n for n in expected_names(cfg) if n not in tensors]
    require(not missing, f"cannot export to Hugging Face: the model lacks {', '.join(missing[:3])}",
            "the checkpoint does not hold every tensor its config describes")
    items: List[Item] = []
    used = set()
    for hf_name, entry, group in expand(family, cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0):
        if hf_name == "lm_head.weight" and cfg.tied_embeddings:
            continue
        t = materialise(entry, tensors)
        if t is None:
            continue
        used.update(hf_names.canonical_names(entry))
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
        conf = hf_config(cfg, model_type, arch, vocab, out_dtype, ids)
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
