"""The Hugging Face model families ckptool converts, as data, and the only place that maps a config.json
(model_type / architectures) or a GPTConfig to its family. Torch-free.

Each module here holds everything one family of HF classes differs by (family.py: the Family record they
fill): gpt2.py, llama.py (Llama, Mistral, Qwen2, Qwen3), mixtral.py, qwen_moe.py (Qwen2-MoE, Qwen3-MoE),
deepseek_v3.py, glm4_moe.py (GLM-4.5 / 4.6), gemma.py (Gemma 2, Gemma 3 text), gpt_oss.py; moe.py is what the MoE ones share. A new family with no new maths is one module and its
line in FAMILIES."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..config import GPTConfig
from . import deepseek_v3, gemma, glm4_moe, gpt2, gpt_oss, llama, mixtral, moe, qwen_moe
from .family import Family, refuse_export

FAMILIES: Tuple[Family, ...] = (
    gpt2.GPT2, llama.LLAMA, llama.MISTRAL, llama.QWEN2, llama.QWEN3, mixtral.MIXTRAL,
    qwen_moe.QWEN2_MOE, qwen_moe.QWEN3_MOE, deepseek_v3.DEEPSEEK_V3, glm4_moe.GLM4_MOE, gemma.GEMMA2, gemma.GEMMA3,
    gpt_oss.GPT_OSS,
)
BY_MODEL_TYPE: Dict[str, Family] = {f.model_type: f for f in FAMILIES}

# Models ckptool recognises but does not convert yet, refused by name rather than misread.
REFUSED_MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2 (Multi-Latent Attention, group-limited routing)",
    # its text model converts alone (model_type gemma3_text, Gemma3ForCausalLM); the SigLIP vision tower and the
    # multimodal projector are nothing a GPT holds
    "gemma3": "Gemma 3 multimodal (Gemma3ForConditionalGeneration: its vision tower is no part of a GPT; save the "
              "text model alone as Gemma3ForCausalLM, model_type gemma3_text, and convert that)",
    # MTP (issue 30): Qwen3-Next and Qwen3.5 ship MTP layers under their own names (mtp.fc, mtp.pre_fc_norm_embedding
    # / _hidden, mtp.layers.{k}.*, mtp.norm), but their decoders mix Gated DeltaNet linear-attention layers with
    # gated full attention (transformers' qwen3_next / qwen3_5 / qwen3_5_moe), which no GPT family of ckptool has
    **{mt: f"{name} (model_type {mt}: Gated DeltaNet linear-attention layers beside gated full attention, and its "
           "multi-token-prediction layers mtp.*)" for mt, name in (
        ("qwen3_next", "Qwen3-Next"), ("qwen3_5", "Qwen3.5"), ("qwen3_5_text", "Qwen3.5"),
        ("qwen3_5_moe", "Qwen3.5 MoE"), ("qwen3_5_moe_text", "Qwen3.5 MoE"))},
}
# export kind -> the check every family of that kind shares, before one is chosen
KIND_CHECKS = {"moe": moe.check_routing, "gemma": gemma.check_export}
# export kind -> the error when no family of that kind selects the config
# ("moe_biased": MoE routing steered by an expert bias (DeepSeek-V3's, on grouped-query attention): GLM-4.5's class)
NO_FAMILY = {"moe": moe.no_class, "moe_biased": moe.no_class, "gemma": gemma.no_class}


def for_model_type(model_type: str) -> Family:
    return BY_MODEL_TYPE[model_type]


def of_hf_config(conf: dict) -> Optional[Family]:
    """The family of a config.json: by model_type, else by a class in architectures; None if neither."""
    if conf.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[conf["model_type"]]
    for arch in conf.get("architectures") or []:
        for f in FAMILIES:
            if arch == f.architecture:
                return f
    return None


def moe_model_types() -> Tuple[str, ...]:
    return tuple(f.model_type for f in FAMILIES if f.names.moe)


def _export_kind(cfg: GPTConfig) -> str:
    """"learned" (GPT-2), "mla", "moe_biased" (an expert bias steers the routing), "moe", "gemma", "gpt_oss" or
    "dense" (RoPE); CkptError for what no HF class computes."""
    # GPT-OSS first: its sliding windows are Gemma's too, its sinks and clamped GLU only its own
    if gpt_oss.is_gpt_oss(cfg):  # its class checks the rest (export_checks)
        return "gpt_oss"
    if gemma.uses_gemma_maths(cfg):  # checked whole by gemma.check_export (KIND_CHECKS)
        return "gemma"
    if cfg.qk_layernorm and cfg.normalization != "rmsnorm":
        raise refuse_export("--qk-layernorm with LayerNorm", "and only Qwen3's RMSNorm q/k norms exist in transformers")
    if cfg.post_layernorm_residual:
        raise refuse_export("--apply-residual-connection-post-layernorm",
                            "a residual taken after the norm, which HF GPT-2/Llama do not do")
    if cfg.position_embedding == "learned":
        return "learned"
    if cfg.position_embedding != "rope":
        raise refuse_export("--position-embedding-type none", "and both HF architectures have positions")
    if cfg.glu_clamp is not None or cfg.glu_linear_offset != 0.0:
        raise refuse_export("--glu-linear-offset / --activation-func-clamp-value",
                            "which only GptOssForCausalLM computes, and this model is not GPT-OSS")
    llama.check_rope(cfg)
    if cfg.mla is not None:
        return "mla"
    if cfg.rope_yarn is not None:
        raise refuse_export("YaRN RoPE scaling without Multi-Latent Attention", "which ckptool exports for DeepSeek-V3 only")
    if cfg.moe is None:
        return "dense"
    return "moe_biased" if cfg.moe.expert_bias else "moe"


def for_config(cfg: GPTConfig) -> Family:
    """The family whose class computes cfg, or CkptError naming the flag that prevents it."""
    kind = _export_kind(cfg)
    if kind in KIND_CHECKS:
        KIND_CHECKS[kind](cfg)
    chosen = [f for f in FAMILIES if f.config_json is not None and f.export_kind == kind and f.selects(cfg)]
    if not chosen:
        raise NO_FAMILY[kind](cfg)
    if len(chosen) > 1:  # a table error, not bad input: selects must not overlap within a kind
        raise RuntimeError(f"families {[f.model_type for f in chosen]} all select this model")
    llama.check_rotary_percent(cfg, chosen[0])
    chosen[0].export_checks(cfg)
    return chosen[0]
