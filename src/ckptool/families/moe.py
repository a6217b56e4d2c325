"""What the Mixture-of-Experts families share (mixtral.py, qwen_moe.py, deepseek_v3.py, glm4_moe.py): where a
config.json keeps the routing facts (MoeKeys, one per family, read by moe_from_hf) and, for export,
the routing the Mixtral / Qwen-MoE classes compute (check_routing, routing_key). Not a family itself."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

from ..config import GPTConfig, MoE, moe_layers_first_k_dense, moe_layers_qwen
from ..errors import require
from .family import refuse_export

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # the number of experts, by family


@dataclass(frozen=True)
class MoeKeys:
    """Where one family's config.json keeps the routing facts.

    ffn: the key of each routed expert's intermediate size; layers(config.json, num_layers): the MoE
    layers' indices; topk_norm: True when the class always renormalises the top-k weights, else the key
    that says; scaling / groups: the keys of the weights' scaling factor and of group-limited routing
    (num groups, best groups); shared(config.json): the shared expert's intermediate size;
    refused: config.json keys whose values the class may carry beyond what transformers computes: only
    the listed values pass."""
    ffn: str
    layers: Callable[[dict, int], Tuple[int, ...]]
    topk_norm: Union[bool, str]
    score: str = "softmax"
    scaling: Optional[str] = None
    expert_bias: bool = False
    groups: Optional[Tuple[str, str]] = None
    shared: Optional[Callable[[dict], int]] = None
    shared_gate: bool = False
    refused: Dict[str, tuple] = field(default_factory=dict)
    topk_norm_default: bool = False  # when config.json leaves topk_norm's key out (GLM-4.5's class: on)


def every_layer(conf: dict, n: int) -> Tuple[int, ...]:
    return tuple(range(n))


def qwen_layers(conf: dict, n: int) -> Tuple[int, ...]:
    return moe_layers_qwen(n, conf.get("decoder_sparse_step", 1), conf.get("mlp_only_layers") or [])


def first_k_dense_layers(conf: dict, n: int) -> Tuple[int, ...]:
    return moe_layers_first_k_dense(n, conf.get("first_k_dense_replace", 0))


def moe_from_hf(conf: dict, family) -> Optional[MoE]:
    """The MoE routing of a config.json by the family's MoeKeys; None for a dense model."""
    keys: Optional[MoeKeys] = family.moe
    if keys is None:
        return None
    model_type = family.model_type
    for key, allowed in keys.refused.items():
        require(conf.get(key, allowed[0]) in allowed, f"{model_type} {key}={conf.get(key)!r} is not supported",
                f"ckptool converts {key} {' / '.join(map(str, allowed))} (what transformers computes)")
    layers = keys.layers(conf, conf["num_hidden_layers"])
    if not layers:
        return None  # every layer dense (DeepSeek's first_k_dense_replace covering them all): a dense model
    experts = next((conf[k] for k in EXPERT_KEYS if conf.get(k)), None)
    require(experts is not None, f"{model_type} config.json gives no number of experts "
            f"({' / '.join(EXPERT_KEYS)})")
    norm = keys.topk_norm
    shared = keys.shared(conf) if keys.shared is not None else 0
    groups = [conf.get(k) or 1 for k in keys.groups] if keys.groups is not None else [1, 1]
    return MoE(num_experts=experts, top_k=conf.get("num_experts_per_tok", 2), ffn_hidden_size=conf[keys.ffn],
               layers=layers, score_function=keys.score,
               topk_norm=bool(conf.get(norm, keys.topk_norm_default)) if isinstance(norm, str) else norm,
               scaling_factor=float(conf.get(keys.scaling, 1.0)) if keys.scaling is not None else 1.0,
               expert_bias=keys.expert_bias, shared_ffn_hidden_size=shared,
               shared_gate=bool(shared) and keys.shared_gate,
               num_groups=groups[0], group_topk=groups[1])


# --- export: the routing Mixtral and the Qwen-MoE classes compute -------------------------------------

def check_routing(cfg: GPTConfig) -> None:
    """Routing no Mixtral / Qwen-MoE class computes, refused by its flag."""
    moe = cfg.moe
    for flag, present in (("--moe-router-score-function sigmoid", moe.score_function != "softmax"),
                          (f"--moe-router-topk-scaling-factor {moe.scaling_factor}", moe.scaling_factor != 1.0),
                          ("a router bias", moe.router_bias), ("--moe-router-enable-expert-bias", moe.expert_bias),
                          (f"group-limited routing ({moe.num_groups} groups)", moe.num_groups > 1),
                          ("--add-bias-linear", cfg.add_bias_linear)):
        if present:
            raise refuse_export(flag, "which no Mixtral / Qwen-MoE class computes")


def shared_kind(cfg: GPTConfig) -> Optional[str]:
    moe = cfg.moe
    return "gated" if moe.shared_gate else ("ungated" if moe.shared_ffn_hidden_size else None)


def routing_key(cfg: GPTConfig) -> tuple:
    """(q/k norms, shared expert, top-k renormalised): what tells the MoE classes apart."""
    return cfg.qk_layernorm, shared_kind(cfg), cfg.moe.topk_norm


def no_class(cfg: GPTConfig):
    key = routing_key(cfg)
    return refuse_export(f"MoE routing with q/k norms={key[0]}, shared expert={key[1] or 'none'}, top-k "
                         f"renormalised={key[2]}", "a combination Mixtral, Qwen2-MoE and Qwen3-MoE do not compute")


def biased_routing_refusals(cfg: GPTConfig) -> tuple:
    """((flag, present), ...): what DeepSeek-V3's routing (its classes and GLM-4.5's: sigmoid scores, top-k steered by
    e_score_correction_bias, group-limited, ungated shared experts a whole number of experts wide, the first layers
    dense) cannot express in cfg's MoE; () for a dense model."""
    m = cfg.moe
    return () if m is None else (
        ("--moe-router-score-function softmax", m.score_function != "sigmoid"),
        ("no expert bias (--moe-router-enable-expert-bias)", not m.expert_bias),
        ("a router bias", m.router_bias), ("a shared-expert gate", m.shared_gate),
        (f"a shared expert of {m.shared_ffn_hidden_size} (not a multiple of the expert size "
         f"{m.ffn_hidden_size})", m.shared_ffn_hidden_size % m.ffn_hidden_size != 0),
        (f"MoE layers {list(m.layers)} (not all layers after the first dense ones)",
         m.layers != tuple(range(cfg.num_layers - len(m.layers), cfg.num_layers))))


def check_qkv_bias(cfg: GPTConfig, arch: str, needs: bool) -> None:
    """The class always (needs) or never has a QKV bias."""
    if needs != cfg.add_qkv_bias:
        raise refuse_export(f"{'no ' if needs else ''}QKV bias (--add-qkv-bias)",
                            f"and {arch} {'always has' if needs else 'never has'} one")
