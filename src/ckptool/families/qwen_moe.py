"""Qwen2-MoE and Qwen3-MoE (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM): Llama's attention and names; MoE
layers chosen by decoder_sparse_step and mlp_only_layers; softmax routing, top-k renormalised when
norm_topk_prob. Qwen2-MoE: QKV bias and a shared expert behind a sigmoid gate; Qwen3-MoE: q/k norms."""
from __future__ import annotations

from ..config import GPTConfig
from . import llama, moe
from .family import Family, Names

MOE = {"mlp.gate.weight": ("copy", "mlp.router.weight"),
       "mlp.shared_expert_gate.weight": ("copy", "mlp.shared_gate.weight")}
for _m in ("gate", "up", "down"):
    MOE[f"mlp.experts.{{e}}.{_m}_proj.weight"] = ("copy", f"mlp.experts.{{e}}.{_m}.weight")
    MOE[f"mlp.shared_expert.{_m}_proj.weight"] = ("copy", f"mlp.shared.{_m}.weight")
NAMES = Names(llama.GLOBAL, llama.LAYER, llama.LAYER_PREFIX, MOE)
FUSED_EXPERTS = {"mlp.experts.gate_up_proj": ("halves", ("mlp.experts.{e}.gate_proj.weight",
                                                         "mlp.experts.{e}.up_proj.weight")),
                 "mlp.experts.down_proj": ("each", "mlp.experts.{e}.down_proj.weight")}


def sparse_layers(cfg: GPTConfig) -> dict:
    """decoder_sparse_step and mlp_only_layers that give exactly cfg.moe.layers (fewest exceptions)."""
    n, layers = cfg.num_layers, set(cfg.moe.layers)
    best = None
    for step in range(1, n + 1):
        hit = {i for i in range(n) if (i + 1) % step == 0}
        if layers <= hit and (best is None or len(hit - layers) < len(best[1])):
            best = (step, sorted(hit - layers))
    return {"decoder_sparse_step": best[0], "mlp_only_layers": best[1]}


def _fields(cfg: GPTConfig) -> dict:
    m = cfg.moe
    return {"num_experts": m.num_experts, "num_experts_per_tok": m.top_k, "norm_topk_prob": m.topk_norm,
            "moe_intermediate_size": m.ffn_hidden_size, "output_router_logits": False,
            "use_sliding_window": False, "sliding_window": None,
            **sparse_layers(cfg)}


def _qwen2_fields(cfg: GPTConfig) -> dict:
    return dict(_fields(cfg), qkv_bias=True, shared_expert_intermediate_size=cfg.moe.shared_ffn_hidden_size)


QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", NAMES, llama.config_from_hf, llama.config_json(_qwen2_fields),
                   export_kind="moe", selects=lambda cfg: moe.routing_key(cfg)[:2] == (False, "gated"),
                   export_checks=lambda cfg: moe.check_qkv_bias(cfg, "Qwen2MoeForCausalLM", True),
                   fused_experts=FUSED_EXPERTS, qkv_bias_only=True,
                   moe=moe.MoeKeys(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers=moe.qwen_layers,
                                   shared=lambda c: c.get("shared_expert_intermediate_size") or 0, shared_gate=True))
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", NAMES, llama.config_from_hf,
                   llama.config_json(lambda cfg: dict(_fields(cfg), attention_bias=False)),
                   export_kind="moe", selects=lambda cfg: moe.routing_key(cfg)[:2] == (True, None),
                   export_checks=lambda cfg: moe.check_qkv_bias(cfg, "Qwen3MoeForCausalLM", False),
                   fused_experts=FUSED_EXPERTS, qk_norm=True,
                   moe=moe.MoeKeys(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers=moe.qwen_layers))
