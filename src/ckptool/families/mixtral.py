"""Mixtral (MixtralForCausalLM): Llama's attention and names, every layer MoE (block_sparse_moe, experts
w1 / w3 / w2), softmax top-k always renormalised, no shared expert, no QKV bias."""
from __future__ import annotations

from ..config import GPTConfig
from . import llama, moe
from .family import Family, Names, refuse_export

ARCH = "MixtralForCausalLM"
MOE = {"block_sparse_moe.gate.weight": ("copy", "mlp.router.weight")}
for _hf, _c in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
    MOE[f"block_sparse_moe.experts.{{e}}.{_hf}.weight"] = ("copy", f"mlp.experts.{{e}}.{_c}.weight")
FUSED_EXPERTS = {"mlp.experts.gate_up_proj": ("halves", ("block_sparse_moe.experts.{e}.w1.weight",
                                                         "block_sparse_moe.experts.{e}.w3.weight")),
                 "mlp.experts.down_proj": ("each", "block_sparse_moe.experts.{e}.w2.weight"),
                 "mlp.gate.weight": ("rename", "block_sparse_moe.gate.weight")}


def _fields(cfg: GPTConfig) -> dict:
    return dict(num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
                intermediate_size=cfg.moe.ffn_hidden_size, router_jitter_noise=0.0,
                output_router_logits=False, sliding_window=None)


def _checks(cfg: GPTConfig) -> None:
    moe.check_qkv_bias(cfg, ARCH, False)
    if len(cfg.moe.layers) != cfg.num_layers:
        raise refuse_export(f"dense layers among MoE ones ({cfg.num_layers - len(cfg.moe.layers)} of {cfg.num_layers})",
                            f"and every {ARCH} layer is MoE")


MIXTRAL = Family("mixtral", ARCH, Names(llama.GLOBAL, llama.LAYER, llama.LAYER_PREFIX, MOE), llama.config_from_hf,
                 llama.config_json(_fields), export_kind="moe",
                 selects=lambda cfg: moe.routing_key(cfg) == (False, None, True), export_checks=_checks,
                 fused_experts=FUSED_EXPERTS, sliding_window_default=True,
                 moe=moe.MoeKeys(ffn="intermediate_size", topk_norm=True, layers=moe.every_layer))
