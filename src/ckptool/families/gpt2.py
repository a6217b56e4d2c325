"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, a GeLU MLP, biases everywhere. Its Conv1D
layers store Linear weights transposed ([in, out]) and c_attn fuses q, k and v."""
from __future__ import annotations

from ..config import GPTConfig
from ..errors import require
from .family import Family, Names, refuse_export, vocab_fields

GLOBAL = {
    "transformer.wte.weight": ("copy", "embed.word"),
    "transformer.wpe.weight": ("copy", "embed.pos"),
    "transformer.ln_f.weight": ("copy", "final_norm.weight"),
    "transformer.ln_f.bias": ("copy", "final_norm.bias"),
    "lm_head.weight": ("copy", "output.weight"),  # only written for untied models
}
LAYER = {
    "ln_1.weight": ("copy", "attn_norm.weight"),
    "ln_1.bias": ("copy", "attn_norm.bias"),
    "attn.c_attn.weight": ("cat_T", ("attn.q.weight", "attn.k.weight", "attn.v.weight")),
    "attn.c_attn.bias": ("cat", ("attn.q.bias", "attn.k.bias", "attn.v.bias")),
    "attn.c_proj.weight": ("T", "attn.out.weight"),
    "attn.c_proj.bias": ("copy", "attn.out.bias"),
    "ln_2.weight": ("copy", "mlp_norm.weight"),
    "ln_2.bias": ("copy", "mlp_norm.bias"),
    "mlp.c_fc.weight": ("T", "mlp.up.weight"),
    "mlp.c_fc.bias": ("copy", "mlp.up.bias"),
    "mlp.c_proj.weight": ("T", "mlp.down.weight"),
    "mlp.c_proj.bias": ("copy", "mlp.down.bias"),
}
NAMES = Names(GLOBAL, LAYER, "transformer.h.{i}.", bare_prefix="transformer.")

# GPTConfig.activation <-> GPT2Config.activation_function (hf-and-peers.md 1.4: gelu is erf;
# gelu_new / gelu_fast / gelu_pytorch_tanh are the tanh approximation; relu2 is squared ReLU).
ACTIVATION_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "squared_relu": "relu2"}
ACTIVATION_IN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                 "gelu_pytorch_tanh": "gelu_tanh", "relu2": "squared_relu"}


def config_from_hf(family: Family, conf: dict, rows: int) -> GPTConfig:
    act = conf.get("activation_function", "gelu_new")
    require(act in ACTIVATION_IN, f"GPT-2 activation_function {act!r} is not supported",
            f"supported: {', '.join(ACTIVATION_IN)}")
    h = conf["n_embd"]
    return GPTConfig(num_layers=conf["n_layer"], hidden_size=h, num_attention_heads=conf["n_head"],
                     ffn_hidden_size=conf.get("n_inner") or 4 * h,
                     max_position_embeddings=conf.get("n_positions", conf.get("n_ctx", 1024)),
                     position_embedding="learned", normalization="layernorm",
                     norm_eps=conf.get("layer_norm_epsilon", 1e-5),
                     activation=ACTIVATION_IN[act], add_bias_linear=True, add_qkv_bias=True,
                     tied_embeddings=conf.get("tie_word_embeddings", True), **vocab_fields(conf, rows))


def config_json(family: Family, cfg: GPTConfig, vocab: int) -> dict:
    return {
        "architectures": [family.architecture], "model_type": family.model_type, "vocab_size": vocab,
        "n_positions": cfg.max_position_embeddings, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
        "activation_function": ACTIVATION_OUT[cfg.activation],
        "layer_norm_epsilon": cfg.norm_eps, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": cfg.tied_embeddings, "use_cache": True,
        # GPT2Config defaults both to 50256, wrong for any other vocabulary: say "unknown".
        "bos_token_id": None, "eos_token_id": None,
    }


def export_checks(cfg: GPTConfig) -> None:
    """What a learned-position model needs to be GPT2LMHeadModel."""
    if cfg.moe is not None or cfg.qk_layernorm:
        raise refuse_export("MoE layers" if cfg.moe is not None else "--qk-layernorm",
                            "with learned positions, which GPT2LMHeadModel does not have")
    require(cfg.normalization == "layernorm" and not cfg.gated,
            f"cannot export to Hugging Face: learned positions with {cfg.normalization} and {cfg.activation} "
            "match neither GPT-2 (LayerNorm, GeLU) nor Llama (RoPE, RMSNorm, SwiGLU)")
    require(cfg.num_query_groups == cfg.num_attention_heads,
            "cannot export to Hugging Face: GPT2LMHeadModel has no grouped-query attention (--num-query-groups)")
    require(cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size,
            "cannot export to Hugging Face: GPT2LMHeadModel needs kv_channels x heads = hidden size (--kv-channels)")


GPT2 = Family("gpt2", "GPT2LMHeadModel", NAMES, config_from_hf, config_json, export_kind="learned",
              selects=lambda cfg: True, export_checks=export_checks, zero_biases=True)
