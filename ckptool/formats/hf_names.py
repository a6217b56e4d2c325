"""Hugging Face parameter names, one table per architecture, as data.

Each entry says how one HF tensor is made from canonical tensors (state.py):
  ("copy", name)            the same tensor
  ("T", name)               transposed: GPT-2's Conv1D stores Linear weights as [in, out]
  ("cat", names)            rows concatenated (GPT-2's c_attn bias is [q | k | v])
  ("cat_T", names)          rows concatenated then transposed (GPT-2's c_attn weight)
The reader applies the same table backwards (hf.py), so one table serves both directions.
Entries whose canonical tensors a model lacks (biases of a bias-free model, embed.pos of a RoPE
model) are skipped by the writer; the reader skips HF names absent from the files.
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
LLAMA_LAYER_PREFIX = "model.layers.{i}."

# family -> (global table, per-layer table, layer prefix)
FAMILIES = {
    "gpt2": (GPT2_GLOBAL, GPT2_LAYER, GPT2_LAYER_PREFIX),
    "llama": (LLAMA_GLOBAL, LLAMA_LAYER, LLAMA_LAYER_PREFIX),
}

# HF model_type -> (family, architecture class written/accepted)
MODEL_TYPES = {
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),
    "qwen2": ("llama", "Qwen2ForCausalLM"),
}

# GPTConfig.activation <-> GPT2Config.activation_function (hf-and-peers.md 1.4: gelu is erf;
# gelu_new / gelu_fast / gelu_pytorch_tanh are the tanh approximation; relu2 is squared ReLU).
GPT2_ACTIVATION_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "squared_relu": "relu2"}
GPT2_ACTIVATION_IN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                      "gelu_pytorch_tanh": "gelu_tanh", "relu2": "squared_relu"}


def canonical_names(entry: Entry) -> tuple:
    op, arg = entry
    return tuple(arg) if op in ("cat", "cat_T") else (arg,)


def expand(family: str, num_layers: int):
    """[(hf_name, entry, group)] for every possible tensor, in streaming order."""
    glob, layer, prefix = FAMILIES[family]
    out = []
    heads = [k for k in glob if canonical_names(glob[k])[0].startswith("embed.")]
    tails = [k for k in glob if k not in heads]
    for k in heads:
        out.append((k, glob[k], "embed"))
    for i in range(num_layers):
        for k, (op, arg) in layer.items():
            arg = tuple(f"layers.{i}.{a}" for a in arg) if op in ("cat", "cat_T") else f"layers.{i}.{arg}"
            out.append((prefix.format(i=i) + k, (op, arg), f"layer {i}"))
    for k in tails:
        out.append((k, glob[k], "head"))
    return out
