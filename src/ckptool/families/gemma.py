"""Gemma 2 and Gemma 3 text models (Gemma2ForCausalLM, Gemma3ForCausalLM: model_type gemma3_text), issue 32.

Their maths beside Llama's (transformers 5 models/gemma2/modeling_gemma2.py, models/gemma3/modeling_gemma3.py):
RMSNorm weights stored zero-centred and applied as (1 + w) (GPTConfig.apply_layernorm_1p: the stored values
are kept bit-exact); the embedding times sqrt(hidden_size); GeGLU (gelu_pytorch_tanh(gate) * up); four norms a
layer: input, post-attention (the attention's output, before the residual add), pre- and post-feed-forward
(post_norms: the canonical attn_post_norm / mlp_post_norm); scores scaled by query_pre_attn_scalar ** -0.5;
sliding-window layers (config.json layer_types; Gemma 2 alternates from layer 0, Gemma 3 makes every sixth
full); soft-capping of scores and logits (Gemma 2; Gemma 3 may set them too); Gemma 3's q/k norms, its own
RoPE base for the local layers (rope_local_base_freq) and linear RoPE scaling of the global ones. Tied
embeddings by default. Torch-free.

Gemma 3's multimodal checkpoints (model_type gemma3, Gemma3ForConditionalGeneration) are refused by name in
families/__init__.py: their vision tower is nothing a GPT holds; the text model converts on its own.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..config import GPTConfig
from ..errors import CkptError, require
from . import llama
from .family import Family, Names, refuse_export, vocab_fields

LAYER = {
    "input_layernorm.weight": ("copy", "attn_norm.weight"),
    # unlike Llama's, Gemma's post_attention_layernorm norms the attention's output; pre_feedforward_layernorm is
    # the MLP's input norm
    "post_attention_layernorm.weight": ("copy", "attn_post_norm.weight"),
    "pre_feedforward_layernorm.weight": ("copy", "mlp_norm.weight"),
    "post_feedforward_layernorm.weight": ("copy", "mlp_post_norm.weight"),
}
# the projections (no biases) and Gemma 3's q/k norms have Llama's (and Qwen3's) names
LAYER.update({k: v for k, v in llama.LAYER.items() if k.startswith(("self_attn.", "mlp.")) and k.endswith(".weight")})
NAMES = Names(llama.GLOBAL, LAYER, llama.LAYER_PREFIX)

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = "gelu_pytorch_tanh"  # the only activation both classes are released with; exactly torch's tanh GeLU


# --- config.json -> GPTConfig --------------------------------------------------------------------------

def _layer_types(conf: dict, num_layers: int, pattern: int) -> list:
    """config.json's layer_types, else the class's default: sliding unless (i + 1) % pattern == 0 (Gemma 2's
    pattern 2; Gemma 3's sliding_window_pattern, 6 by default)."""
    types = conf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    require(len(types) == num_layers and set(types) <= {SLIDING, FULL},
            f"layer_types {types} is not one of {SLIDING!r} / {FULL!r} per layer of {num_layers}")
    return types


def _window(conf: dict, types: list) -> dict:
    """sliding_window and local_layers (none when config.json gives no window)."""
    window = conf.get("sliding_window")
    local = tuple(i for i, t in enumerate(types) if t == SLIDING)
    if window is None or not local:
        return {}
    return dict(sliding_window=int(window), local_layers=local)


def _rope(conf: dict, model_type: str) -> Tuple[float, Optional[float], Optional[float]]:
    """(global theta, local theta or None, linear factor or None) from rope_parameters (transformers 5: per layer
    type for Gemma 3) or rope_theta / rope_local_base_freq / rope_scaling (4.x)."""
    params = dict(conf.get("rope_parameters") or {})
    full = dict(params.get(FULL, params))
    local = dict(params.get(SLIDING, {}))
    full.update({k: v for k, v in (conf.get("rope_scaling") or {}).items() if k not in full})
    theta = float(full.get("rope_theta", conf.get("rope_theta", 10000.0 if model_type == "gemma2" else 1e6)))
    rtype = full.get("rope_type") or full.get("type") or "default"
    if rtype not in ("default", "linear") or local.get("rope_type", "default") != "default":
        raise CkptError(f"{model_type} rope type {rtype!r} / {local.get('rope_type')!r} is not converted",
                        "ckptool computes Gemma's default RoPE and Gemma 3's linear scaling of its global layers")
    factor = float(full["factor"]) if rtype == "linear" and float(full.get("factor", 1.0)) != 1.0 else None
    if model_type == "gemma2":
        return theta, None, factor
    local_theta = float(local.get("rope_theta", conf.get("rope_local_base_freq", 10000.0)))
    return theta, local_theta, factor


def config_from_hf(family: Family, conf: dict, rows: int) -> GPTConfig:
    act = conf.get("hidden_activation") or conf.get("hidden_act") or GELU_TANH
    require(act == GELU_TANH, f"{family.model_type} hidden_activation {act!r} is not {GELU_TANH!r}",
            "ckptool computes Gemma's gated tanh GeLU")
    require(not conf.get("attention_bias"), f"{family.model_type} with attention_bias: Megatron biases all linear "
            "layers or none, and Gemma's MLP has none")
    if conf.get("use_bidirectional_attention"):
        raise CkptError(f"{family.model_type} with use_bidirectional_attention (an embedding model, not causal)",
                        "ckptool converts causal language models only")
    nh, layers = conf["num_attention_heads"], conf["num_hidden_layers"]
    theta, local_theta, factor = _rope(conf, family.model_type)
    pattern = 2 if family.model_type == "gemma2" else int(conf.get("sliding_window_pattern", 6))
    return GPTConfig(num_layers=layers, hidden_size=conf["hidden_size"], num_attention_heads=nh,
                     num_query_groups=conf.get("num_key_value_heads") or nh, head_dim=conf.get("head_dim", 256),
                     ffn_hidden_size=conf["intermediate_size"],
                     max_position_embeddings=conf.get("max_position_embeddings", 8192), position_embedding="rope",
                     rotary_base=theta, normalization="rmsnorm", norm_eps=conf.get("rms_norm_eps", 1e-6),
                     activation="geglu", add_bias_linear=False, add_qkv_bias=False, apply_layernorm_1p=True,
                     qk_layernorm=family.qk_norm, tied_embeddings=bool(conf.get("tie_word_embeddings", True)),
                     embedding_scale=True, post_norms=True,
                     query_pre_attn_scalar=float(conf.get("query_pre_attn_scalar", 256)),
                     attn_softcap=_cap(conf.get("attn_logit_softcapping", family.softcap_defaults[0])),
                     final_softcap=_cap(conf.get("final_logit_softcapping", family.softcap_defaults[1])),
                     rotary_base_local=local_theta, rope_linear_factor=factor,
                     **_window(conf, _layer_types(conf, layers, pattern)), **vocab_fields(conf, rows))


def _cap(value) -> Optional[float]:
    return float(value) if value else None


def whole(value: float):
    """An int where the value is one: transformers 5's Gemma configs type query_pre_attn_scalar as int (strictly)."""
    return int(value) if float(value).is_integer() else value


# --- GPTConfig -> config.json, export --------------------------------------------------------------------

def _rope_json(cfg: GPTConfig, family: Family) -> dict:
    """rope_parameters (transformers 5; per layer type for Gemma 3) and the 4.x fields saying the same."""
    full = {"rope_type": "linear", "factor": cfg.rope_linear_factor} if cfg.rope_linear_factor else {"rope_type": "default"}
    full["rope_theta"] = cfg.rotary_base
    if not family.qk_norm:  # Gemma 2: one RoPE
        return dict(rope_parameters=full, rope_theta=cfg.rotary_base)
    local = cfg.rotary_base_local or cfg.rotary_base
    out = dict(rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}},
               rope_theta=cfg.rotary_base, rope_local_base_freq=local)
    if cfg.rope_linear_factor:
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_linear_factor}
    return out


def config_json(family: Family, cfg: GPTConfig, vocab: int) -> dict:
    conf = {
        "architectures": [family.architecture], "model_type": family.model_type, "vocab_size": vocab,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim, "hidden_activation": GELU_TANH, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tied_embeddings, "attention_bias": False,
        # Megatron's default scale 1/sqrt(head_dim) is Gemma's with query_pre_attn_scalar = head_dim
        "query_pre_attn_scalar": whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap,
        # written per layer: Megatron's window_attn_skip_freq may be any pattern, and the class default is not it
        "sliding_window": cfg.sliding_window,
        "layer_types": [SLIDING if cfg.is_local_layer(i) else FULL for i in range(cfg.num_layers)],
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
    }
    conf.update(_rope_json(cfg, family))
    return conf


# what only a Gemma class computes among those ckptool writes, by the Megatron args that say it (GEMMA_ARGS)
GEMMA_ONLY = (
    (lambda c: c.post_norms, "post-attention / post-MLP norms (ckptool_post_norms)"),
    (lambda c: c.sliding_window and not c.attn_sinks, "--window-size (sliding-window attention)"),  # with sinks: GPT-OSS
    (lambda c: c.embedding_scale, "sqrt(hidden) embedding scaling (ckptool_embedding_scale)"),
    (lambda c: c.activation == "geglu", "a GeGLU MLP (gated_linear_unit with openai_gelu)"),
    (lambda c: c.attn_softcap or c.final_softcap, "soft-capping (attn_logit_softcapping, final_logit_softcapping)"),
    (lambda c: c.query_pre_attn_scalar, "--softmax-scale (query_pre_attn_scalar)"),
    (lambda c: c.rotary_base_local or c.rope_linear_factor,
     "Gemma 3's RoPE (ckptool_rotary_base_local, ckptool_rope_linear_factor)"),
)


def uses_gemma_maths(cfg: GPTConfig) -> bool:
    """Whether cfg computes something only a Gemma class computes (families/__init__.py: the export kind)."""
    return any(holds(cfg) for holds, _ in GEMMA_ONLY)


# what every Gemma class computes, with the Megatron flag that says it: (holds for cfg, flag, why not)
_GEMMA_NEEDS = (
    (lambda c: c.embedding_scale, "a model without Gemma's sqrt(hidden) embedding scaling", "which Gemma has"),
    (lambda c: c.activation == "geglu", "an MLP that is not GeGLU", "and Gemma's is gated tanh GeLU"),
    (lambda c: c.normalization == "rmsnorm" and c.apply_layernorm_1p, "norms other than zero-centred RMSNorm "
     "(--apply-layernorm-1p --normalization RMSNorm)", "and Gemma's are"),
    (lambda c: not c.add_bias_linear and not c.add_qkv_bias, "linear biases", "and Gemma has none"),
    (lambda c: c.moe is None and c.mla is None, "MoE or Multi-Latent Attention", "which no Gemma class has"),
    (lambda c: c.position_embedding == "rope" and c.rotary_percent == 1.0 and not c.rotary_interleaved
     and not c.rope_scaling_factor and c.rope_yarn is None,
     "positions other than RoPE on whole heads, halves rotated", "as Gemma has them"),
    (lambda c: not c.post_layernorm_residual, "--apply-residual-connection-post-layernorm", "which Gemma does not do"),
)


def check_export(cfg: GPTConfig) -> None:
    """Every Gemma class's maths, refused by the flag that departs from it (KIND_CHECKS); a model that is no Gemma
    (no post norms) by the first Gemma-only thing it computes: a Llama with a sliding window is not a Gemma."""
    if not cfg.post_norms:
        flag = next(flag for holds, flag in GEMMA_ONLY if holds(cfg))
        raise refuse_export(flag, "which of the classes ckptool writes only Gemma2/3ForCausalLM compute, and this "
                            "model is no Gemma (it has no post-attention / post-MLP norms)")
    for holds, flag, why in _GEMMA_NEEDS:
        if not holds(cfg):
            raise refuse_export(flag, why)


def no_class(cfg: GPTConfig) -> CkptError:
    return refuse_export("Gemma's maths in a combination neither Gemma2ForCausalLM nor Gemma3ForCausalLM has",
                         "(Gemma 2 has no q/k norms and one RoPE base)")


def _gemma2_selects(cfg: GPTConfig) -> bool:
    return not cfg.qk_layernorm and not cfg.rotary_base_local and not cfg.rope_linear_factor


GEMMA2 = Family("gemma2", "Gemma2ForCausalLM", NAMES, config_from_hf, config_json, export_kind="gemma",
                selects=_gemma2_selects, zero_centred_norms=True, softcap_defaults=(50.0, 30.0))
GEMMA3 = Family("gemma3_text", "Gemma3ForCausalLM", NAMES, config_from_hf, config_json, export_kind="gemma",
                selects=lambda cfg: cfg.qk_layernorm, qk_norm=True, zero_centred_norms=True)
