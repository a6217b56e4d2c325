"""torchtitan's own parameter names <-> Hugging Face's, as one table, and its RoPE row order.

Facts from torchtitan's state-dict adapters and modules, in two eras, both read; the current one is written:
  - pytorch/torchtitan b5bcd76 (2026; torchtitan/models/llama3/state_dict_adapter.py, models/qwen3/
    state_dict_adapter.py, models/common/moe.py GroupedExperts / MoE): tok_embeddings, layers.N.attention.
    qkv_linear.wq/wk/wv, attention.wo, attention.q_norm/k_norm, attention_norm, ffn_norm, feed_forward.w1 (gate) /
    w3 (up) / w2 (down), norm, lm_head (Llama3 and Qwen3 alike); MoE: moe.router.gate, a layer's experts FUSED as
    moe.routed_experts.inner_experts.w1_EFD / w3_EFD [E, ffn, hidden] and w2_EDF [E, hidden, ffn] (no ".weight"),
    the load-balancing buffers moe.expert_bias_E (persistent, saved) and moe.tokens_per_expert_E (not persistent);
    shared experts (moe.shared_experts.w1/w2/w3.weight) only in models ckptool has no torchtitan table for
    (DeepSeek-V3 and others: refused below by model type);
  - earlier (llama3/state_dict_adapter.py at 06a7a23, qwen3/state_dict_adapter.py at 0310b49, common/moe/moe.py
    at 0646ba4): attention.wq/wk/wv, output, experts as moe.experts.w1 / w3 / w2, buffers moe.expert_bias /
    moe.tokens_per_expert (moe.router.expert_bias before that);
  - torchtitan's Llama3 rotates interleaved pairs (complex RoPE), so its adapter permutes the rows of wq and
    wk per head (to_hf: view(heads, d/2, 2, in).transpose(1, 2)); its Qwen3 rotates halves as HF does and
    permutes nothing. The rows of an optimizer moment follow its weight's, so slots are permuted the same;
  - the router's aux-loss-free `expert_bias` buffer (load_balance_coeff) has no place in a Hugging Face
    Qwen3-MoE: dropped when it is all zeros (never moved), refused otherwise; `tokens_per_expert` is a counter.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, Iterable, List, Tuple

import torch

from ...errors import CkptError, require
from ...lazy import Const, Derived, LazyTensor

# Each table lists the current name (b5bcd76) first: the writer names what the first entry says.
GLOBAL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
          "lm_head.weight": "lm_head.weight", "output.weight": "lm_head.weight"}
LAYER = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "moe.router.gate.weight": "mlp.gate.weight",
}
EXPERTS = {"moe.routed_experts.inner_experts.w1_EFD": "mlp.experts.{e}.gate_proj.weight",
           "moe.routed_experts.inner_experts.w3_EFD": "mlp.experts.{e}.up_proj.weight",
           "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.{e}.down_proj.weight",
           "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight", "moe.experts.w3": "mlp.experts.{e}.up_proj.weight",
           "moe.experts.w2": "mlp.experts.{e}.down_proj.weight"}
EXPERT_BIAS = ("moe.expert_bias_E", "moe.expert_bias", "moe.router.expert_bias")
ROUTER = "mlp.gate.weight"  # the HF router, [E, hidden]
COUNTERS = ("moe.tokens_per_expert_E", "moe.tokens_per_expert", "moe.router.tokens_per_expert")
# what the writer names (the first torchtitan name of each HF name above: the current one)
WRITE_GLOBAL = {hf: titan for titan, hf in reversed(list(GLOBAL.items()))}
WRITE_LAYER = {hf: titan for titan, hf in reversed(list(LAYER.items()))}
WRITE_EXPERTS = {hf: titan for titan, hf in reversed(list(EXPERTS.items()))}
# model_type -> whether torchtitan's model of it permutes wq / wk rows (its adapter's _permute)
PERMUTES = {"llama": True, "qwen3": False, "qwen3_moe": False}
PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _heads(conf: dict, hf_suffix: str) -> int:
    nh = conf["num_attention_heads"]
    return nh if hf_suffix == PERMUTED[0] else (conf.get("num_key_value_heads") or nh)


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's interleaved-pair rows of each head -> HF's rotate-half rows (the adapter's to_hf)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def to_titan_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half rows of each head -> torchtitan's interleaved pairs (the adapter's from_hf)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def permutes(model_type: str) -> bool:
    require(model_type in PERMUTES, f"torchtitan names for a {model_type} model: ckptool knows torchtitan's "
            f"{', '.join(sorted(PERMUTES))} models only", "convert it with torchtitan's own to_hf first")
    return PERMUTES[model_type]


def _row_order(conf: dict, hf_suffix: str, model_type: str, fn: Callable) -> Callable:
    if hf_suffix in PERMUTED and permutes(model_type):
        heads = _heads(conf, hf_suffix)
        return lambda t: Derived(lambda w: fn(w, heads), [t], shape=t.shape, dtype=t.dtype)
    return lambda t: t


def to_hf(entries: Dict[str, LazyTensor], conf: dict, model_type: str, warn: Callable[[str], None],
          where: str) -> Dict[str, LazyTensor]:
    """torchtitan-named tensors (a model's weights, or one optimizer slot keyed the same) under HF names, in
    HF's row order; fused experts as each expert's own HF tensor (a region of the stored one: read alone)."""
    permutes(model_type)
    out: Dict[str, LazyTensor] = {}
    for key, t in entries.items():
        if key in GLOBAL:
            out[GLOBAL[key]] = t
            continue
        m = LAYER_KEY.match(key)
        rest = m.group(2) if m else None
        if rest in LAYER:
            out[f"model.layers.{m.group(1)}.{LAYER[rest]}"] = _row_order(conf, LAYER[rest], model_type, to_hf_rows)(t)
        elif rest in EXPERTS:
            for e in range(t.shape[0]):
                one = Derived(lambda x: x[0], [t.narrow(0, e, 1)], shape=t.shape[1:], dtype=t.dtype)
                out[f"model.layers.{m.group(1)}.{EXPERTS[rest].format(e=e)}"] = one
        elif rest in EXPERT_BIAS:
            _drop_zero_bias(key, t, warn, where)
        elif rest not in COUNTERS:
            out[key] = t  # left for the HF mapping's own check, which names what it cannot place
    return out


def _drop_zero_bias(key: str, t: LazyTensor, warn, where: str) -> None:
    if bool(torch.count_nonzero(t.load())):
        raise CkptError(f"{where}: {key} holds torchtitan's load-balancing expert bias, which moved during "
                        "training and changes which experts are chosen; a Hugging Face Qwen3-MoE has no such bias",
                        "ckptool does not convert a model whose routing it cannot reproduce")
    warn(f"{key}: torchtitan's load-balancing expert bias is all zeros (it never moved); dropped")


def from_hf(items: Iterable[Tuple[str, LazyTensor]], conf: dict, model_type: str) -> List[Tuple[str, LazyTensor]]:
    """(HF name, tensor) -> (torchtitan name, tensor in its row order); experts stay per expert under
    (fused name, expert index) as `name@e`, for the writer to place at index e of the fused tensor."""
    out = []
    for name, t in items:
        if name in WRITE_GLOBAL:
            out.append((WRITE_GLOBAL[name], t))
            continue
        m = HF_LAYER_KEY.match(name)
        require(m is not None, f"internal: {name} has no torchtitan name")
        i, rest = m.group(1), m.group(2)
        expert = re.match(r"^mlp\.experts\.(\d+)\.(.+)$", rest)
        if expert:
            fused = next(v for k, v in WRITE_EXPERTS.items() if k.format(e=expert.group(1)) == rest)
            out.append((f"layers.{i}.{fused}@{expert.group(1)}", t))
            continue
        require(rest in WRITE_LAYER, f"{name} has no torchtitan name", "write the default (HF) names")
        out.append((f"layers.{i}.{WRITE_LAYER[rest]}", _row_order(conf, rest, model_type, to_titan_rows)(t)))
        if rest == ROUTER:  # the MoE's persistent load-balancing buffer, which its state dict (and dcp.load) asks for:
            # zeros route as a Hugging Face model without one does (fp32, as torchtitan registers it)
            out.append((f"layers.{i}.{EXPERT_BIAS[0]}", Const(torch.zeros(t.shape[0], dtype=torch.float32))))
    return out
