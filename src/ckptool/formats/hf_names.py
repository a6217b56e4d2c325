"""Hugging Face parameter names, one table per architecture, as data.

Each entry says how one HF tensor is made from canonical tensors (state.py):
  ("copy", name)            the same tensor
  ("T", name)               transposed: GPT-2's Conv1D stores Linear weights as [in, out]
  ("cat", names)            rows concatenated (GPT-2's c_attn bias is [q | k | v])
  ("cat_T", names)          rows concatenated then transposed (GPT-2's c_attn weight)
The reader applies the same table backwards (hf.py), so one table serves both directions.
Entries whose canonical tensors a model lacks (biases of a bias-free model, embed.pos of a RoPE
model, the dense MLP of an MoE layer, the experts of a dense one) are skipped by the writer; the
reader skips HF names absent from the files. MoE tables carry an `{e}` axis (the global expert
index) beside the layer's; FUSED_EXPERTS says how transformers' in-memory 3-D expert tensors split
into the per-expert Hub names, which are what ckptool writes.
"""
from __future__ import annotations

from typing import Dict, Tuple

Entry = Tuple[str, object]

# --- GPT-2 (GPT2LMHeadModel) -----------------------------------------------------------------
GPT2_GLOBAL: Dict[str, Entry] = {
    "transformer.wte.weight": ("copy", "embed.word"),
    "transformer.wpe.weight": ("copy", "embed.pos"),
    "transformer.ln_f.weight": ("copy", "final_norm.weight"),
    "transformer.ln_f.bias": ("copy", "final_norm.bias"),
    "lm_head.weight": ("copy", "output.weight"),  # only written for untied models
}
GPT2_LAYER: Dict[str, Entry] = {
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
GPT2_LAYER_PREFIX = "transformer.h.{i}."

# --- Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM share names) --------
LLAMA_GLOBAL: Dict[str, Entry] = {
    "model.embed_tokens.weight": ("copy", "embed.word"),
    "model.norm.weight": ("copy", "final_norm.weight"),
    "lm_head.weight": ("copy", "output.weight"),
}
LLAMA_LAYER: Dict[str, Entry] = {
    "input_layernorm.weight": ("copy", "attn_norm.weight"),
    "post_attention_layernorm.weight": ("copy", "mlp_norm.weight"),
}
for _hf, _c in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "out")):
    for _p in ("weight", "bias"):
        LLAMA_LAYER[f"self_attn.{_hf}.{_p}"] = ("copy", f"attn.{_c}.{_p}")
for _m in ("gate", "up", "down"):
    for _p in ("weight", "bias"):
        LLAMA_LAYER[f"mlp.{_m}_proj.{_p}"] = ("copy", f"mlp.{_m}.{_p}")
for _n in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over each head of q and k, before RoPE
    LLAMA_LAYER[f"self_attn.{_n}.weight"] = ("copy", f"attn.{_n}.weight")
LLAMA_LAYER_PREFIX = "model.layers.{i}."

# --- DeepSeek-V3 (DeepseekV3ForCausalLM): Multi-Latent Attention, dense MLP in the first layers -----
DEEPSEEK_LAYER: Dict[str, Entry] = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("self_attn.")
                                    and not k.endswith(".bias")}
for _hf, _c in (("q_proj", "q"), ("q_a_proj", "q_down"), ("q_a_layernorm", "q_down_norm"), ("q_b_proj", "q_up"),
                ("kv_a_proj_with_mqa", "kv_down"), ("kv_a_layernorm", "kv_down_norm"), ("kv_b_proj", "kv_up"),
                ("o_proj", "out")):
    DEEPSEEK_LAYER[f"self_attn.{_hf}.weight"] = ("copy", f"attn.{_c}.weight")

# --- MoE layers: router, experts ({e}), shared expert and its gate --------------------------
MIXTRAL_MOE: Dict[str, Entry] = {"block_sparse_moe.gate.weight": ("copy", "mlp.router.weight")}
for _hf, _c in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
    MIXTRAL_MOE[f"block_sparse_moe.experts.{{e}}.{_hf}.weight"] = ("copy", f"mlp.experts.{{e}}.{_c}.weight")
QWEN_MOE: Dict[str, Entry] = {"mlp.gate.weight": ("copy", "mlp.router.weight"),
                              "mlp.shared_expert_gate.weight": ("copy", "mlp.shared_gate.weight")}
for _m in ("gate", "up", "down"):
    QWEN_MOE[f"mlp.experts.{{e}}.{_m}_proj.weight"] = ("copy", f"mlp.experts.{{e}}.{_m}.weight")
    QWEN_MOE[f"mlp.shared_expert.{_m}_proj.weight"] = ("copy", f"mlp.shared.{_m}.weight")
DEEPSEEK_MOE: Dict[str, Entry] = {"mlp.gate.weight": ("copy", "mlp.router.weight"),
                                  "mlp.gate.e_score_correction_bias": ("copy", "mlp.router.expert_bias")}
for _m in ("gate", "up", "down"):
    DEEPSEEK_MOE[f"mlp.experts.{{e}}.{_m}_proj.weight"] = ("copy", f"mlp.experts.{{e}}.{_m}.weight")
    DEEPSEEK_MOE[f"mlp.shared_experts.{_m}_proj.weight"] = ("copy", f"mlp.shared.{_m}.weight")

# transformers >= 5 holds a layer's experts fused (what a raw state_dict holds); per layer suffix:
#   ("halves", (a, b))  [E, 2I, h]: rows [:I] of expert e are Hub name a, rows [I:] are b
#   ("each", a)         [E, ...]: expert e's slice is Hub name a
#   ("rename", a)       the same tensor under Hub name a
FUSED_EXPERTS = {
    "mixtral": {"mlp.experts.gate_up_proj": ("halves", ("block_sparse_moe.experts.{e}.w1.weight",
                                                        "block_sparse_moe.experts.{e}.w3.weight")),
                "mlp.experts.down_proj": ("each", "block_sparse_moe.experts.{e}.w2.weight"),
                "mlp.gate.weight": ("rename", "block_sparse_moe.gate.weight")},
    "qwen_moe": {"mlp.experts.gate_up_proj": ("halves", ("mlp.experts.{e}.gate_proj.weight",
                                                         "mlp.experts.{e}.up_proj.weight")),
                 "mlp.experts.down_proj": ("each", "mlp.experts.{e}.down_proj.weight")},
}
FUSED_EXPERTS["deepseek"] = FUSED_EXPERTS["qwen_moe"]

# family -> (global table, per-layer table, MoE-layer table, layer prefix)
FAMILIES = {
    "gpt2": (GPT2_GLOBAL, GPT2_LAYER, {}, GPT2_LAYER_PREFIX),
    "llama": (LLAMA_GLOBAL, LLAMA_LAYER, {}, LLAMA_LAYER_PREFIX),
    "mixtral": (LLAMA_GLOBAL, LLAMA_LAYER, MIXTRAL_MOE, LLAMA_LAYER_PREFIX),
    "qwen_moe": (LLAMA_GLOBAL, LLAMA_LAYER, QWEN_MOE, LLAMA_LAYER_PREFIX),
    "deepseek": (LLAMA_GLOBAL, DEEPSEEK_LAYER, DEEPSEEK_MOE, LLAMA_LAYER_PREFIX),
}

# HF model_type -> (family, architecture class written/accepted)
MODEL_TYPES = {
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),
    "qwen2": ("llama", "Qwen2ForCausalLM"),
    "qwen3": ("llama", "Qwen3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("deepseek", "DeepseekV3ForCausalLM"),
}

# Models ckptool recognises but does not convert yet, refused by name rather than misread.
REFUSED_MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2 (Multi-Latent Attention, group-limited routing)",
}

# GPTConfig.activation <-> GPT2Config.activation_function (hf-and-peers.md 1.4: gelu is erf;
# gelu_new / gelu_fast / gelu_pytorch_tanh are the tanh approximation; relu2 is squared ReLU).
GPT2_ACTIVATION_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "squared_relu": "relu2"}
GPT2_ACTIVATION_IN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                      "gelu_pytorch_tanh": "gelu_tanh", "relu2": "squared_relu"}


def canonical_names(entry: Entry) -> tuple:
    op, arg = entry
    return tuple(arg) if op in ("cat", "cat_T") else (arg,)


def _rows(table: Dict[str, Entry], num_experts: int):
    """The table with its {e} axis expanded to experts 0 .. num_experts - 1."""
    for k, entry in table.items():
        for e in range(num_experts) if "{e}" in k else (None,):
            yield k.replace("{e}", str(e)), entry if e is None else (entry[0], entry[1].replace("{e}", str(e)))


def expand(family: str, num_layers: int, num_experts: int = 0):
    """[(hf_name, entry, group)] for every possible tensor, in streaming order."""
    glob, layer, moe, prefix = FAMILIES[family]
    out = []
    heads = [k for k in glob if canonical_names(glob[k])[0].startswith("embed.")]
    tails = [k for k in glob if k not in heads]
    for k in heads:
        out.append((k, glob[k], "embed"))
    for i in range(num_layers):
        for k, (op, arg) in list(layer.items()) + list(_rows(moe, num_experts)):
            arg = tuple(f"layers.{i}.{a}" for a in arg) if op in ("cat", "cat_T") else f"layers.{i}.{arg}"
            out.append((prefix.format(i=i) + k, (op, arg), f"layer {i}"))
    for k in tails:
        out.append((k, glob[k], "head"))
    return out
