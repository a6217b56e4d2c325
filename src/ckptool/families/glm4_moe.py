"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): Llama's names and grouped-query attention with partial RoPE (the first
partial_rotary_factor of each head rotated, rotate-half order), biases on q, k and v when attention_bias, optional
per-head q/k RMSNorms (use_qk_norm); the first first_k_dense_replace layers dense, then MoE layers routed as
DeepSeek-V3 routes (sigmoid scores, top-k steered by e_score_correction_bias, n_group / topk_group, norm_topk_prob,
routed_scaling_factor) with ungated shared experts (n_shared_experts expert-sized ones).

Read in transformers 5.24's models/glm4_moe (modeling_glm4_moe.py: Glm4MoeRotaryEmbedding, apply_rotary_pos_emb,
Glm4MoeAttention, Glm4MoeTopkRouter, Glm4MoeMoE; configuration_glm4_moe.py for the defaults used below). Its Hub
checkpoints keep experts per expert (conversion_mapping.py maps glm4_moe to qwen2_moe's fused form).

Multi-token prediction: GLM-4.5 releases carry num_nextn_predict_layers MTP layers as model.layers.{num_hidden_layers
+ k}, named as DeepSeek-V3's (enorm, hnorm, eh_proj, shared_head.norm and the embed_tokens / shared_head.head
copies beside a whole decoder layer; transformers' Glm4Moe ignores model.layers.92 / .46 on load, the 355B and
106B releases' MTP layers): families/mtp.py's table, read and written as for DeepSeek-V3.
"""
from __future__ import annotations

from ..config import GPTConfig, moe_layers_first_k_dense
from . import deepseek_v3, llama, moe, mtp, qwen_moe
from .family import Family, Names, refuse_export

ARCH = "Glm4MoeForCausalLM"
# configuration_glm4_moe.py defaults config.json may leave out
DEFAULTS = {"partial_rotary_factor": 0.5, "first_k_dense_replace": 1, "n_shared_experts": 1, "norm_topk_prob": True}


def _layers(conf: dict, n: int):
    return moe_layers_first_k_dense(n, conf.get("first_k_dense_replace", DEFAULTS["first_k_dense_replace"]))


def _shared(conf: dict) -> int:
    return conf["moe_intermediate_size"] * conf.get("n_shared_experts", DEFAULTS["n_shared_experts"])


def export_checks(cfg: GPTConfig) -> None:
    """Glm4MoeForCausalLM: DeepSeek-V3's routing (moe.biased_routing_refusals) with a shared expert always present,
    biases on q, k, v only (attention_bias; o_proj and the MLPs have none)."""
    m = cfg.moe
    for flag, present in moe.biased_routing_refusals(cfg) + (
            ("no shared expert", m.shared_ffn_hidden_size == 0),
            ("--add-bias-linear (biases beyond q, k and v)", cfg.add_bias_linear)):
        if present:
            raise refuse_export(flag, f"which {ARCH} does not compute")


def _fields(cfg: GPTConfig) -> dict:
    r = cfg.moe
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base, "partial_rotary_factor": cfg.rotary_percent}
    return {"n_routed_experts": r.num_experts, "num_experts_per_tok": r.top_k, "moe_intermediate_size": r.ffn_hidden_size,
            "n_shared_experts": r.shared_ffn_hidden_size // r.ffn_hidden_size, "routed_scaling_factor": r.scaling_factor,
            "norm_topk_prob": r.topk_norm, "n_group": r.num_groups, "topk_group": r.group_topk,
            "first_k_dense_replace": cfg.num_layers - len(r.layers), "use_qk_norm": cfg.qk_layernorm,
            "attention_bias": cfg.add_qkv_bias, "partial_rotary_factor": cfg.rotary_percent, "rope_parameters": rope,
            mtp.NEXTN_KEY: cfg.mtp_num_layers, "output_router_logits": False}


GLM4_MOE = Family(
    "glm4_moe", ARCH, Names(llama.GLOBAL, llama.LAYER, llama.LAYER_PREFIX, deepseek_v3.MOE, mtp=mtp.DEEPSEEK_MTP,
                            mtp_shared=mtp.DEEPSEEK_MTP_SHARED), llama.config_from_hf,
    llama.config_json(_fields), export_kind="moe_biased", selects=lambda cfg: True, export_checks=export_checks,
    fused_experts=qwen_moe.FUSED_EXPERTS, mtp_key=mtp.NEXTN_KEY, qkv_bias_only=True, qkv_bias_key=("attention_bias", False),
    qk_norm_key="use_qk_norm", partial_rotary=DEFAULTS["partial_rotary_factor"],
    moe=moe.MoeKeys(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", topk_norm_default=DEFAULTS["norm_topk_prob"],
                    layers=_layers, score="sigmoid", scaling="routed_scaling_factor", expert_bias=True,
                    groups=("n_group", "topk_group"), shared=_shared))
