"""GPT-OSS (GptOssForCausalLM, transformers 5.24 models/gpt_oss): Llama's attention with biases on q, k, v and o,
a learned softmax sink per head (self_attn.sinks), sliding-window layers alternating with full ones
(config.json layer_types, sliding_window), YaRN RoPE; every layer MoE: a router with a bias whose top-k LOGITS are
softmaxed among themselves, experts with biases computing a clamped quick GeGLU
(gate = min(gate, limit), up = clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1)).

transformers keeps a layer's experts stacked ([E, ...], the only form on the Hub): gate_up_proj [E, H, 2F] (x @ W,
gate and up INTERLEAVED in its columns: gate f at 2f, up f at 2f + 1), gate_up_proj_bias [E, 2F] (interleaved
alike), down_proj [E, F, H], down_proj_bias [E, H] (GptOssExperts.__init__ and _apply_gate). The released
checkpoints hold the expert weights in MXFP4 (*_blocks, *_scales: formats/hf/mxfp4.py), dequantized on read."""
from __future__ import annotations

from typing import Optional

from ..config import GPTConfig, MoE, Yarn
from ..errors import CkptError, require
from . import llama
from .family import Family, Names, refuse_export, vocab_fields

ARCH = "GptOssForCausalLM"
MEGATRON_QUICK_GELU_ALPHA = 1.702  # megatron-core activations.quick_gelu's fixed sigmoid gain
GLU_LINEAR_OFFSET = 1.0  # GptOssExperts._apply_gate: (up + 1)
SLIDING, FULL = "sliding_attention", "full_attention"

LAYER = {k: v for k, v in llama.LAYER.items() if k.startswith(("self_attn.q_proj", "self_attn.k_proj",
                                                                 "self_attn.v_proj", "self_attn.o_proj"))}
LAYER.update({"input_layernorm.weight": ("copy", "attn_norm.weight"),
              "post_attention_layernorm.weight": ("copy", "mlp_norm.weight"),
              "self_attn.sinks": ("copy", "attn.sinks")})
# the stacked expert tensors (formats/hf/stacked.py: what each op does); {e}: the global expert
MOE = {"mlp.router.weight": ("copy", "mlp.router.weight"), "mlp.router.bias": ("copy", "mlp.router.bias"),
       "mlp.experts.gate_up_proj": ("stack_glu_T", ("mlp.experts.{e}.gate.weight", "mlp.experts.{e}.up.weight")),
       "mlp.experts.gate_up_proj_bias": ("stack_glu", ("mlp.experts.{e}.gate.bias", "mlp.experts.{e}.up.bias")),
       "mlp.experts.down_proj": ("stack_T", ("mlp.experts.{e}.down.weight",)),
       "mlp.experts.down_proj_bias": ("stack", ("mlp.experts.{e}.down.bias",))}
NAMES = Names(llama.GLOBAL, LAYER, llama.LAYER_PREFIX, MOE)


def layer_types(conf: dict) -> list:
    """config.json's layer_types, else GptOssConfig's default: layer i sliding when i is even."""
    n = conf["num_hidden_layers"]
    kinds = conf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    require(len(kinds) == n and set(kinds) <= {SLIDING, FULL},
            f"gpt_oss layer_types {kinds} is not one of {SLIDING} / {FULL} per layer")
    return kinds


def yarn_from_hf(conf: dict) -> Optional[Yarn]:
    """YaRN from rope_parameters (transformers 5) or rope_scaling (4); None for plain RoPE."""
    params = dict(conf.get("rope_scaling") or {}, **(conf.get("rope_parameters") or {}))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    require(kind == "yarn", f"gpt_oss rope type {kind!r} is not supported", "ckptool converts default and yarn RoPE")
    opt = {k: params[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
           if params.get(k) is not None}
    return Yarn(factor=float(params["factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]), **opt)


def config_from_hf(family: Family, conf: dict, rows: int) -> GPTConfig:
    """config.json -> GPTConfig; what Megatron cannot compute (another alpha, biases on some linears only) refused."""
    alpha = float(conf.get("swiglu_alpha", MEGATRON_QUICK_GELU_ALPHA))
    require(alpha == MEGATRON_QUICK_GELU_ALPHA, f"gpt_oss swiglu_alpha={alpha} is not supported",
            f"megatron-core's quick GeGLU has the fixed gain {MEGATRON_QUICK_GELU_ALPHA}")
    require(conf.get("attention_bias", True), "gpt_oss attention_bias=false with biased experts and router: "
            "Megatron biases every linear layer or none (--add-bias-linear)")
    n = conf["num_hidden_layers"]
    kinds = layer_types(conf)
    window = conf.get("sliding_window")
    sliding = tuple(i for i, k in enumerate(kinds) if k == SLIDING) if window else ()
    params = dict(conf.get("rope_scaling") or {}, **(conf.get("rope_parameters") or {}))
    theta = params.get("rope_theta", conf.get("rope_theta", 150000.0))
    return GPTConfig(
        num_layers=n, hidden_size=conf["hidden_size"], num_attention_heads=conf["num_attention_heads"],
        num_query_groups=conf.get("num_key_value_heads") or conf["num_attention_heads"],
        head_dim=conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"],
        ffn_hidden_size=conf["intermediate_size"], max_position_embeddings=conf.get("max_position_embeddings", 131072),
        position_embedding="rope", rotary_base=float(theta), normalization="rmsnorm",
        norm_eps=float(conf.get("rms_norm_eps", 1e-5)), activation="quick_geglu", add_bias_linear=True,
        add_qkv_bias=True, tied_embeddings=bool(conf.get("tie_word_embeddings", False)), rope_yarn=yarn_from_hf(conf),
        attn_sinks=True, sliding_window=int(window) if sliding else None, local_layers=sliding or (),
        glu_clamp=float(conf.get("swiglu_limit", 7.0)), glu_linear_offset=GLU_LINEAR_OFFSET,
        # the released config.json says experts_per_token beside (or instead of) transformers' num_experts_per_tok
        moe=MoE(num_experts=conf["num_local_experts"],
                top_k=conf.get("num_experts_per_tok") or conf.get("experts_per_token") or 4,
                ffn_hidden_size=conf["intermediate_size"], layers=tuple(range(n)), topk_norm=True, router_bias=True),
        **vocab_fields(conf, rows))


def is_gpt_oss(cfg: GPTConfig) -> bool:
    """The maths only GPT-OSS has among the classes ckptool writes: sinks or a clamped / offset quick GeGLU."""
    return cfg.attn_sinks or cfg.activation == "quick_geglu"


def export_checks(cfg: GPTConfig) -> None:
    """GptOssForCausalLM computes exactly: sinks, clamped quick GeGLU with offset 1, every layer MoE with biased
    router and experts, softmax over the top-k logits, biases everywhere, RMSNorm, whole-head RoPE."""
    m = cfg.moe
    wrong = (("no attention sinks (--softmax-type learnable)", not cfg.attn_sinks),
             (f"--{cfg.activation.replace('_', '-')} (not --quick-geglu)", cfg.activation != "quick_geglu"),
             (f"--glu-linear-offset {cfg.glu_linear_offset}", cfg.glu_linear_offset != GLU_LINEAR_OFFSET),
             ("no --activation-func-clamp-value", cfg.glu_clamp is None),
             ("a dense model", m is None),
             ("dense layers among MoE ones", m is not None and len(m.layers) != cfg.num_layers),
             ("routing other than softmax over the top-k logits", m is not None and (
                 m.score_function != "softmax" or not m.topk_norm or m.scaling_factor != 1.0 or m.expert_bias
                 or m.num_groups > 1)),
             ("a shared expert", m is not None and m.shared_ffn_hidden_size > 0),
             ("no linear biases (--disable-bias-linear)", not cfg.add_bias_linear),
             ("--qk-layernorm", cfg.qk_layernorm), ("--rotary-interleaved", cfg.rotary_interleaved),
             ("Multi-Latent Attention", cfg.mla is not None), ("--apply-layernorm-1p", cfg.apply_layernorm_1p),
             ("tied embeddings", cfg.tied_embeddings))
    for flag, present in wrong:
        if present:
            raise refuse_export(flag, f"which {ARCH} does not compute")
    if cfg.moe.ffn_hidden_size != cfg.ffn_hidden_size:
        raise CkptError(f"cannot export to Hugging Face: {ARCH} has one intermediate_size, the model's experts "
                        f"{cfg.moe.ffn_hidden_size} and its dense MLP size {cfg.ffn_hidden_size} differ",
                        "keep it in Megatron format")


def _layer_types(cfg: GPTConfig) -> list:
    return [SLIDING if cfg.window_of(i) is not None else FULL for i in range(cfg.num_layers)]


def config_json(family: Family, cfg: GPTConfig, vocab: int) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_yarn is not None:
        y = cfg.rope_yarn
        rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings, "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow, "truncate": y.truncate,
                **{k: getattr(y, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                   if getattr(y, k) is not None}}
    return {"architectures": [family.architecture], "model_type": family.model_type, "vocab_size": vocab,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.moe.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": rope, "tie_word_embeddings": False, "attention_bias": True, "attention_dropout": 0.0,
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
            "swiglu_alpha": MEGATRON_QUICK_GELU_ALPHA, "swiglu_limit": cfg.glu_clamp,
            "sliding_window": cfg.sliding_window, "layer_types": _layer_types(cfg), "output_router_logits": False,
            "initializer_range": 0.02, "use_cache": True}


GPT_OSS = Family("gpt_oss", ARCH, NAMES, config_from_hf, config_json, export_kind="gpt_oss",
                 selects=lambda cfg: True, export_checks=export_checks)
