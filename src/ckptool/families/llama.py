"""The Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM): one name
scheme and one maths (RoPE, RMSNorm, SwiGLU), told apart by data: which biases (Qwen2: q, k and v only),
q/k norms (Qwen3), the config.json fields of each class. Mistral is read only (Llama is written for it).

The Llama-style config reader and writer here are shared by every RoPE family (mixtral.py, qwen_moe.py,
deepseek_v3.py), which add their MoE / MLA facts through the Family record."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from ..config import GPTConfig, Yarn
from ..errors import CkptError, require
from . import moe as moe_keys
from .family import Family, Names, refuse_export, vocab_fields

GLOBAL = {
    "model.embed_tokens.weight": ("copy", "embed.word"),
    "model.norm.weight": ("copy", "final_norm.weight"),
    "lm_head.weight": ("copy", "output.weight"),
}
LAYER = {
    "input_layernorm.weight": ("copy", "attn_norm.weight"),
    "post_attention_layernorm.weight": ("copy", "mlp_norm.weight"),
}
for _hf, _c in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "out")):
    for _p in ("weight", "bias"):
        LAYER[f"self_attn.{_hf}.{_p}"] = ("copy", f"attn.{_c}.{_p}")
for _m in ("gate", "up", "down"):
    for _p in ("weight", "bias"):
        LAYER[f"mlp.{_m}_proj.{_p}"] = ("copy", f"mlp.{_m}.{_p}")
for _n in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over each head of q and k, before RoPE
    LAYER[f"self_attn.{_n}.weight"] = ("copy", f"attn.{_n}.weight")
LAYER_PREFIX = "model.layers.{i}."
NAMES = Names(GLOBAL, LAYER, LAYER_PREFIX)


# --- config.json -> GPTConfig ------------------------------------------------------------------

def rope_from_hf(conf: dict, family: Family) -> Tuple[float, Optional[float], Optional[Yarn]]:
    """(theta, llama3 factor or None, Yarn or None) from rope_parameters (transformers 5) or
    rope_theta/rope_scaling (4). YaRN is read for MLA models only (DeepSeek-V3; megatron-core computes it for MLA only)."""
    params = dict(conf.get("rope_parameters") or {})
    scaling = conf.get("rope_scaling") or {}
    theta = params.get("rope_theta", conf.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    src = params if params.get("rope_type") not in (None, "default") else scaling
    if rtype == "default":
        return float(theta), None, None
    if rtype == "yarn" and family.mla is not None:
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


def _biases(conf: dict, family: Family) -> Tuple[bool, bool]:
    """(QKV bias, other linear biases) from config.json."""
    if family.qkv_bias_only:
        key, default = family.qkv_bias_key
        return bool(conf.get(key, default)), False
    attn_bias, mlp_bias = bool(conf.get("attention_bias", False)), bool(conf.get("mlp_bias", False))
    require(attn_bias == mlp_bias,
            f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: Megatron biases all linear layers or none "
            "(add_bias_linear), so this bias pattern has no Megatron equivalent")
    return attn_bias, attn_bias


def _rotary_percent(conf: dict, family: Family) -> float:
    """The share of each head RoPE rotates: partial_rotary_factor under rope_parameters (transformers 5) or at the top
    (4.x, GLM-4.5's released config.json), else the class's default; 1 for classes that rotate whole heads."""
    if family.partial_rotary is None:
        return 1.0
    params = conf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", conf.get("partial_rotary_factor", family.partial_rotary))
    require(0 < float(factor) <= 1, f"{family.model_type} partial_rotary_factor={factor} is not in (0, 1]")
    return float(factor)


def config_from_hf(family: Family, conf: dict, rows: int) -> GPTConfig:
    """A Llama-style config.json (every RoPE family) -> GPTConfig, with the family's MoE and MLA facts."""
    act = conf.get("hidden_act", "silu")
    require(act == "silu", f"{family.model_type} hidden_act {act!r} is not SwiGLU's silu",
            "only silu-gated MLPs map onto Megatron's --swiglu")
    qkv_bias, linear_bias = _biases(conf, family)
    theta, factor, yarn = rope_from_hf(conf, family)
    nh = conf["num_attention_heads"]
    qk_norm = bool(conf.get(family.qk_norm_key, False)) if family.qk_norm_key else family.qk_norm
    mla = family.mla(conf, family.model_type) if family.mla is not None else None
    return GPTConfig(num_layers=conf["num_hidden_layers"], hidden_size=conf["hidden_size"], num_attention_heads=nh,
                     num_query_groups=conf.get("num_key_value_heads") or nh,
                     head_dim=mla.qk_head_dim if mla else conf.get("head_dim"), mla=mla,
                     rotary_interleaved=bool(mla and conf.get("rope_interleave", True)), rope_yarn=yarn,
                     ffn_hidden_size=conf["intermediate_size"],
                     max_position_embeddings=conf.get("max_position_embeddings", 2048),
                     position_embedding="rope", rotary_base=theta, rope_scaling_factor=factor,
                     rotary_percent=_rotary_percent(conf, family),
                     normalization="rmsnorm", norm_eps=conf.get("rms_norm_eps", 1e-6), activation="swiglu",
                     add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm,
                     tied_embeddings=bool(conf.get("tie_word_embeddings", False)),
                     moe=moe_keys.moe_from_hf(conf, family), **vocab_fields(conf, rows))


# --- GPTConfig -> config.json ------------------------------------------------------------------

def check_rope(cfg: GPTConfig) -> None:
    """What every RoPE class ckptool writes (Llama's maths) needs of a RoPE model (the share of each head rotated:
    check_rotary_percent, once the class is chosen)."""
    if cfg.activation == "squared_relu":
        raise refuse_export("--squared-relu", "and LlamaForCausalLM's MLP is gated SiLU")
    require(cfg.gated, f"cannot export to Hugging Face: RoPE with a {cfg.activation} MLP is not Llama's SwiGLU",
            "LlamaForCausalLM needs --swiglu")
    require(cfg.normalization == "rmsnorm", "cannot export to Hugging Face: RoPE with LayerNorm is not Llama's "
            "RMSNorm", "LlamaForCausalLM needs --normalization RMSNorm")


def check_rotary_percent(cfg: GPTConfig, family: Family) -> None:
    """--rotary-percent below 1 only for a class with partial RoPE (GLM-4.5), else refused by name."""
    if cfg.position_embedding == "rope" and cfg.rotary_percent != 1.0 and family.partial_rotary is None:
        raise refuse_export(f"--rotary-percent {cfg.rotary_percent}", f"and {family.architecture} rotates the whole head")


def config_json(fields: Callable[[GPTConfig], dict]):
    """A config.json writer for a RoPE family: Llama's fields, then `fields(cfg)`, the class's own."""
    def write(family: Family, cfg: GPTConfig, vocab: int) -> dict:
        rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
        conf = {
            "architectures": [family.architecture], "model_type": family.model_type, "vocab_size": vocab,
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
        conf.update(fields(cfg))
        return conf
    return write


def _no_sliding_window(cfg: GPTConfig) -> dict:
    return dict(use_sliding_window=False, sliding_window=None)


def _qkv_bias_only(cfg: GPTConfig) -> bool:
    return cfg.add_qkv_bias and not cfg.add_bias_linear


def _qwen3_checks(cfg: GPTConfig) -> None:
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        raise refuse_export("--qk-layernorm with linear biases", "and Qwen3ForCausalLM biases q, k, v and out "
                            "together (attention_bias) and never its MLP")


LLAMA = Family("llama", "LlamaForCausalLM", NAMES, config_from_hf,
               config_json(lambda cfg: dict(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)),
               export_kind="dense", selects=lambda cfg: not cfg.qk_layernorm and not _qkv_bias_only(cfg))
MISTRAL = Family("mistral", "MistralForCausalLM", NAMES, config_from_hf, sliding_window_default=True)
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", NAMES, config_from_hf, config_json(_no_sliding_window),
               export_kind="dense", selects=lambda cfg: not cfg.qk_layernorm and _qkv_bias_only(cfg),
               qkv_bias_only=True)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", NAMES, config_from_hf,
               config_json(lambda cfg: dict(attention_bias=False, **_no_sliding_window(cfg))),
               export_kind="dense", selects=lambda cfg: cfg.qk_layernorm, export_checks=_qwen3_checks, qk_norm=True)
