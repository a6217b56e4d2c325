"""DeepSeek-V3 (DeepseekV3ForCausalLM): Multi-Latent Attention (q and kv through low-rank latents, RoPE on
a slice of each head, YaRN scaling), the first layers dense, then MoE layers with sigmoid, group-limited
routing steered by an expert bias and ungated shared experts."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import MLA, GPTConfig
from ..errors import require
from . import llama, moe, mtp, qwen_moe
from .family import Family, Names, refuse_export

ARCH = "DeepseekV3ForCausalLM"
LAYER = {k: v for k, v in llama.LAYER.items() if not k.startswith("self_attn.") and not k.endswith(".bias")}
for _hf, _c in (("q_proj", "q"), ("q_a_proj", "q_down"), ("q_a_layernorm", "q_down_norm"), ("q_b_proj", "q_up"),
                ("kv_a_proj_with_mqa", "kv_down"), ("kv_a_layernorm", "kv_down_norm"), ("kv_b_proj", "kv_up"),
                ("o_proj", "out")):
    LAYER[f"self_attn.{_hf}.weight"] = ("copy", f"attn.{_c}.weight")
MOE = {"mlp.gate.weight": ("copy", "mlp.router.weight"),
       "mlp.gate.e_score_correction_bias": ("copy", "mlp.router.expert_bias")}
for _m in ("gate", "up", "down"):
    MOE[f"mlp.experts.{{e}}.{_m}_proj.weight"] = ("copy", f"mlp.experts.{{e}}.{_m}.weight")
    MOE[f"mlp.shared_experts.{_m}_proj.weight"] = ("copy", f"mlp.shared.{_m}.weight")

# --- block FP8 (issue 30, fp8) ---
# DeepSeek-V3 / R1 as released store every Linear of the attention and the MLPs (dense, routed and shared
# experts: the "_proj" keys) as float8_e4m3fn + weight_scale_inv; the router (mlp.gate), its expert bias,
# the norms, embed_tokens and lm_head stay unquantized (the release's model.safetensors.index.json).
FP8_RELEASE = tuple(k for k in {**LAYER, **MOE} if "_proj" in k)


def mla_from_hf(conf: dict, model_type: str) -> Optional[MLA]:
    """DeepSeek's MLA sizes; transformers normalises the latents with its RMSNorm's default eps 1e-6."""
    require(conf.get("num_key_value_heads", conf["num_attention_heads"]) == conf["num_attention_heads"],
            f"{model_type} with num_key_value_heads != num_attention_heads is not supported (MLA has one kv per head)")
    return MLA(q_lora_rank=conf.get("q_lora_rank") or None, kv_lora_rank=conf["kv_lora_rank"],
               qk_nope_head_dim=conf["qk_nope_head_dim"], qk_rope_head_dim=conf["qk_rope_head_dim"],
               v_head_dim=conf["v_head_dim"], latent_norm_eps=1e-6)


def export_checks(cfg: GPTConfig) -> None:
    """DeepseekV3ForCausalLM: MLA, sigmoid group-limited routing with expert bias, ungated shared
    experts (a whole number of expert-sized ones), the first layers dense (all of them in a dense model:
    first_k_dense_replace = num_hidden_layers)."""
    for flag, present in moe.biased_routing_refusals(cfg) + (("--qk-layernorm", cfg.qk_layernorm),
                                    ("linear biases", cfg.add_bias_linear or cfg.add_qkv_bias)):
        if present:
            raise refuse_export(flag, f"which {ARCH} does not compute")


def _yarn_fields(cfg: GPTConfig) -> dict:
    """YaRN under rope_parameters (transformers 5) and rope_scaling (4), beside the theta."""
    y = cfg.rope_yarn
    if y is None:
        return {}
    scaling = {k: v for k, v in dataclasses.asdict(y).items() if v is not None}
    scaling["rope_type"] = "yarn"
    return {"rope_scaling": scaling, "rope_parameters": dict(scaling, rope_theta=cfg.rotary_base)}


def _fields(cfg: GPTConfig) -> dict:
    m, r = cfg.mla, cfg.moe
    # a dense model: every layer dense, no routing fields (transformers' defaults stand for a routing no layer runs)
    routing = {"first_k_dense_replace": cfg.num_layers} if r is None else {
        "n_routed_experts": r.num_experts, "num_experts_per_tok": r.top_k,
        "moe_intermediate_size": r.ffn_hidden_size, "n_shared_experts": r.shared_ffn_hidden_size // r.ffn_hidden_size,
        "routed_scaling_factor": r.scaling_factor, "norm_topk_prob": r.topk_norm,
        "n_group": r.num_groups, "topk_group": r.group_topk, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "first_k_dense_replace": cfg.num_layers - len(r.layers)}
    return {"head_dim": m.qk_rope_head_dim, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
            "qk_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": cfg.rotary_interleaved,
            **routing, mtp.NEXTN_KEY: cfg.mtp_num_layers, "attention_bias": False, **_yarn_fields(cfg)}


DEEPSEEK_V3 = Family(
    "deepseek_v3", ARCH, Names(llama.GLOBAL, LAYER, llama.LAYER_PREFIX, MOE, mtp=mtp.DEEPSEEK_MTP,
                               mtp_shared=mtp.DEEPSEEK_MTP_SHARED), llama.config_from_hf,
    llama.config_json(_fields), export_kind="mla", selects=lambda cfg: True, export_checks=export_checks,
    fused_experts=qwen_moe.FUSED_EXPERTS, mla=mla_from_hf, fp8_release=FP8_RELEASE, mtp_key=mtp.NEXTN_KEY,
    moe=moe.MoeKeys(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers=moe.first_k_dense_layers,
                    score="sigmoid", scaling="routed_scaling_factor", expert_bias=True, groups=("n_group", "topk_group"),
                    shared=lambda c: c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0),
                    refused={"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "moe_layer_freq": (1,)}))
