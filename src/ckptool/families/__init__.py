"""The Hugging Face model families ckptool converts, as data, and the only place that maps a config.json
(model_type / architectures) or a GPTConfig to its family. Torch-free.

Each module here holds everything one family of HF classes differs by (family.py: the Family record they
fill): gpt2.py, llama.py (Llama, Mistral, Qwen2, Qwen3), mixtral.py, qwen_moe.py (Qwen2-MoE, Qwen3-MoE),
deepseek_v3.py, gpt_oss.py; moe.py is what the MoE ones share. A new family with no new maths is one module and its
line in FAMILIES."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..config import GPTConfig
from . import deepseek_v3, gpt2, gpt_oss, llama, mixtral, moe, qwen_moe
from .family import Family, refuse_export

FAMILIES: Tuple[Family, ...] = (
    gpt2.GPT2, llama.LLAMA, llama.MISTRAL, llama.QWEN2, llama.QWEN3, mixtral.MIXTRAL,
    qwen_moe.QWEN2_MOE, qwen_moe.QWEN3_MOE, deepseek_v3.DEEPSEEK_V3, gpt_oss.GPT_OSS,
)
BY_MODEL_TYPE: Dict[str, Family] = {f.model_type: f for f in FAMILIES}

# Models ckptool recognises but does not convert yet, refused by name rather than misread.
REFUSED_MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2 (Multi-Latent Attention, group-limited routing)",
}
# export kind -> the check every family of that kind shares, before one is chosen
KIND_CHECKS = {"moe": moe.check_routing}
# export kind -> the error when no family of that kind selects the config
NO_FAMILY = {"moe": moe.no_class}


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
    """"learned" (GPT-2), "mla", "moe", "dense" (RoPE) or "gpt_oss"; CkptError for what no HF class computes."""
    if cfg.qk_layernorm and cfg.normalization != "rmsnorm":
        raise refuse_export("--qk-layernorm with LayerNorm", "and only Qwen3's RMSNorm q/k norms exist in transformers")
    if cfg.post_layernorm_residual:
        raise refuse_export("--apply-residual-connection-post-layernorm",
                            "a residual taken after the norm, which HF GPT-2/Llama do not do")
    if cfg.position_embedding == "learned":
        return "learned"
    if cfg.position_embedding != "rope":
        raise refuse_export("--position-embedding-type none", "and both HF architectures have positions")
    if gpt_oss.is_gpt_oss(cfg):  # GPT-OSS: sinks, sliding windows, quick GeGLU, YaRN; its class checks the rest
        return "gpt_oss"
    for flag, present in (("--window-size (sliding-window attention)", cfg.window is not None),
                          ("--glu-linear-offset / --activation-func-clamp-value",
                           cfg.glu_clamp is not None or cfg.glu_linear_offset != 0.0)):
        if present:
            raise refuse_export(flag, "which only GptOssForCausalLM computes, and this model is not GPT-OSS")
    llama.check_rope(cfg)
    if cfg.mla is not None:
        return "mla"
    if cfg.rope_yarn is not None:
        raise refuse_export("YaRN RoPE scaling without Multi-Latent Attention", "which ckptool exports for DeepSeek-V3 only")
    return "moe" if cfg.moe is not None else "dense"


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
    chosen[0].export_checks(cfg)
    return chosen[0]
