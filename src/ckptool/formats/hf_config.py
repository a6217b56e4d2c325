"""Hugging Face model directories: what config.json says, read without torch.

Detection (looks_like), the weight files a directory holds, and config.json -> GPTConfig
(sizes, RoPE, MoE routing, MLA), as the reader (hf.py) and the torch-free quick inspect
(quick_inspect.py) both need them. Nothing here touches tensors, so nothing here imports torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from ..config import MLA, GPTConfig, MoE, Yarn, moe_layers_first_k_dense, moe_layers_qwen
from ..errors import CkptError, require
from . import hf_names
from .hf_names import FUSED_EXPERTS, MODEL_TYPES, REFUSED_MODEL_TYPES

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


def refused_model(conf: dict) -> Optional[str]:
    """What ckptool recognises in this config and does not convert yet, or None."""
    mt = conf.get("model_type")
    if mt in REFUSED_MODEL_TYPES:
        return f"{REFUSED_MODEL_TYPES[mt]} is not supported yet"
    if gpt_model_type(conf) is None and any(conf.get(k) for k in MOE_EXPERT_KEYS):
        return (f"Mixture-of-Experts model_type {mt!r} is not supported (ckptool converts "
                f"{', '.join(t for t, (f, _) in MODEL_TYPES.items() if f in FUSED_EXPERTS)})")
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
    return conf is not None and (gpt_model_type(conf) is not None or refused_model(conf) is not None)


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



# --- config.json -> GPTConfig --------------------------------------------------------------------------------

def _rope(conf: dict, model_type: str):
    """(theta, llama3 factor or None, Yarn or None) from rope_parameters (transformers 5) or
    rope_theta/rope_scaling (4). YaRN is read for MLA models only (DeepSeek-V3; megatron-core computes it for MLA only)."""
    params = dict(conf.get("rope_parameters") or {})
    scaling = conf.get("rope_scaling") or {}
    theta = params.get("rope_theta", conf.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    src = params if params.get("rope_type") not in (None, "default") else scaling
    if rtype == "default":
        return float(theta), None, None
    if rtype == "yarn" and model_type in MLA_MODEL_TYPES:
        opt = {k: src[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                   "truncate") if src.get(k) is not None}
        return float(theta), None, Yarn(factor=float(src["factor"]),
                                        original_max_position_embeddings=int(src["original_max_position_embeddings"]),
                                        **opt)
    if rtype == "llama3":
        want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in want.items():
            require(float(src.get(k, v)) == v, f"llama3 rope scaling with {k}={src.get(k)} is not supported",
                    f"ckptool's Megatron output uses {k}={v}")
        return float(theta), float(src["factor"]), None
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
    if model_type in QKV_BIAS_ONLY:
        qkv_bias, linear_bias = bool(conf.get("qkv_bias", True)), False
    else:
        attn_bias, mlp_bias = bool(conf.get("attention_bias", False)), bool(conf.get("mlp_bias", False))
        require(attn_bias == mlp_bias,
                f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: Megatron biases all linear layers or none "
                "(add_bias_linear), so this bias pattern has no Megatron equivalent")
        qkv_bias = linear_bias = attn_bias
    theta, factor, yarn = _rope(conf, model_type)
    nh = conf["num_attention_heads"]
    mla = mla_from_hf(conf, model_type)
    return GPTConfig(num_layers=conf["num_hidden_layers"], hidden_size=conf["hidden_size"], num_attention_heads=nh,
                     num_query_groups=conf.get("num_key_value_heads") or nh,
                     head_dim=mla.qk_head_dim if mla else conf.get("head_dim"), mla=mla,
                     rotary_interleaved=bool(mla and conf.get("rope_interleave", True)), rope_yarn=yarn,
                     ffn_hidden_size=conf["intermediate_size"],
                     max_position_embeddings=conf.get("max_position_embeddings", 2048),
                     position_embedding="rope", rotary_base=theta, rope_scaling_factor=factor,
                     normalization="rmsnorm", norm_eps=conf.get("rms_norm_eps", 1e-6), activation="swiglu",
                     add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, qk_layernorm=model_type in QK_NORM,
                     tied_embeddings=bool(conf.get("tie_word_embeddings", False)),
                     moe=moe_from_hf(conf, model_type), **common)


QKV_BIAS_ONLY = ("qwen2", "qwen2_moe")  # biases on q, k and v only (Qwen2-MoE: config qkv_bias, default on)
QK_NORM = ("qwen3", "qwen3_moe")  # RMSNorm over each head of q and k before RoPE
MOE_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

# model_type -> where config.json keeps the routing facts. Mixtral always renormalises the top-k
# weights; the others when norm_topk_prob. Which layers are MoE: MOE_LAYER_RULES.
MOE_CONFIG = {
    "mixtral": dict(ffn="intermediate_size", topk_norm=True, layers="all"),
    "qwen2_moe": dict(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers="qwen",
                      shared=lambda c: c.get("shared_expert_intermediate_size") or 0, shared_gate=True),
    "qwen3_moe": dict(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers="qwen"),
    "deepseek_v3": dict(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers="first_k_dense",
                        score="sigmoid", scaling="routed_scaling_factor", expert_bias=True,
                        groups=("n_group", "topk_group"),
                        shared=lambda c: c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0)),
}
MOE_LAYER_RULES = {
    "all": lambda c, n: tuple(range(n)),
    "qwen": lambda c, n: moe_layers_qwen(n, c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []),
    "first_k_dense": lambda c, n: moe_layers_first_k_dense(n, c.get("first_k_dense_replace", 0)),
}
# config.json values a family may carry beyond what transformers' class computes: only these pass
MOE_REFUSED_VALUES = {"deepseek_v3": {"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",),
                                      "moe_layer_freq": (1,)}}


def moe_from_hf(conf: dict, model_type: str) -> Optional[MoE]:
    spec = MOE_CONFIG.get(model_type)
    if spec is None:
        return None
    for key, allowed in MOE_REFUSED_VALUES.get(model_type, {}).items():
        require(conf.get(key, allowed[0]) in allowed, f"{model_type} {key}={conf.get(key)!r} is not supported",
                f"ckptool converts {key} {' / '.join(map(str, allowed))} (what transformers computes)")
    layers = MOE_LAYER_RULES[spec["layers"]](conf, conf["num_hidden_layers"])
    if not layers:
        return None  # every layer dense (DeepSeek's first_k_dense_replace covering them all): a dense model
    experts = next((conf[k] for k in MOE_EXPERT_KEYS if conf.get(k)), None)
    require(experts is not None, f"{model_type} config.json gives no number of experts "
            f"({' / '.join(MOE_EXPERT_KEYS)})")
    norm = spec["topk_norm"]
    shared = spec["shared"](conf) if "shared" in spec else 0
    groups = [conf.get(k) or 1 for k in spec["groups"]] if "groups" in spec else [1, 1]
    return MoE(num_experts=experts, top_k=conf.get("num_experts_per_tok", 2), ffn_hidden_size=conf[spec["ffn"]],
               layers=layers,
               score_function=spec.get("score", "softmax"),
               topk_norm=bool(conf.get(norm, False)) if isinstance(norm, str) else norm,
               scaling_factor=float(conf.get(spec["scaling"], 1.0)) if "scaling" in spec else 1.0,
               expert_bias=spec.get("expert_bias", False), shared_ffn_hidden_size=shared,
               shared_gate=bool(shared) and spec.get("shared_gate", False),
               num_groups=groups[0], group_topk=groups[1])


MLA_MODEL_TYPES = ("deepseek_v3",)


def mla_from_hf(conf: dict, model_type: str) -> Optional[MLA]:
    """DeepSeek's MLA sizes; transformers normalises the latents with its RMSNorm's default eps 1e-6."""
    if model_type not in MLA_MODEL_TYPES:
        return None
    require(conf.get("num_key_value_heads", conf["num_attention_heads"]) == conf["num_attention_heads"],
            f"{model_type} with num_key_value_heads != num_attention_heads is not supported (MLA has one kv per head)")
    return MLA(q_lora_rank=conf.get("q_lora_rank") or None, kv_lora_rank=conf["kv_lora_rank"],
               qk_nope_head_dim=conf["qk_nope_head_dim"], qk_rope_head_dim=conf["qk_rope_head_dim"],
               v_head_dim=conf["v_head_dim"], latent_norm_eps=1e-6)


def read_supported_config(path: Path):
    """(config.json as a dict, model_type) of a directory ckptool converts; CkptError otherwise."""
    conf = _read_config(path)
    require(conf is not None, f"{path / 'config.json'} is not readable JSON")
    model_type = gpt_model_type(conf)
    require(refused_model(conf) is None, f"{path}: {refused_model(conf)}",
            "ckptool refuses what it cannot convert exactly rather than leave parts out")
    require(model_type is not None, f"{path}: model_type {conf.get('model_type')!r} is not one ckptool converts",
            f"supported: {', '.join(MODEL_TYPES)}")
    return conf, model_type


def source_warnings(conf: dict, model_type: str) -> List[str]:
    """What reading this model into a Megatron GPT changes, said once per checkpoint."""
    if conf.get("sliding_window") and conf.get("use_sliding_window", model_type in ("mistral", "mixtral")):
        return [f"{model_type} sliding_window={conf['sliding_window']} is dropped: Megatron attends over the "
                "whole context (identical for sequences up to that length)"]
    return []


# --- names and rows shared by the reader and quick inspect ---------------------------------------

def with_full_names(entries: dict, family: str) -> dict:
    """GPT2Model checkpoints (and the original openai-community/gpt2 files) omit the "transformer."
    prefix; put it back so one name table serves both."""
    if family == "gpt2" and not any(k.startswith("transformer.") for k in entries):
        return {("transformer." + k if not k.startswith("lm_head.") else k): v for k, v in entries.items()}
    return entries


def word_embedding_key(family: str) -> str:
    return "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"


def part_rows(name: str, cfg: GPTConfig) -> int:
    """Rows of one canonical part (q, k or v) of a fused HF tensor ("cat" / "cat_T" in hf_names)."""
    return cfg.q_size if ".attn.q." in name else cfg.kv_size
