"""Hugging Face GPT-2 / Llama parameter names -> canonical names, for HF models trained under DeepSpeed.

A minimal table of our own (the HF engineer's formats/hf.py was not on this branch; once merged,
this can defer to its tables). GPT-2's Conv1D stores weights as [in, out], so they are transposed,
and c_attn holds [q | k | v]. Llama names map one to one.
"""
from __future__ import annotations

import re
from typing import Dict

from ..config import GPTConfig
from ..errors import CkptError
from ..lazy import Derived, LazyTensor

GPT2_GLOBALS = {
    "transformer.wte.weight": "embed.word", "transformer.wpe.weight": "embed.pos",
    "transformer.ln_f.weight": "final_norm.weight", "transformer.ln_f.bias": "final_norm.bias",
}
# per layer: hf suffix -> (canonical suffix, transpose?)
GPT2_LAYER = {
    "ln_1.weight": ("attn_norm.weight", False), "ln_1.bias": ("attn_norm.bias", False),
    "attn.c_proj.weight": ("attn.out.weight", True), "attn.c_proj.bias": ("attn.out.bias", False),
    "ln_2.weight": ("mlp_norm.weight", False), "ln_2.bias": ("mlp_norm.bias", False),
    "mlp.c_fc.weight": ("mlp.up.weight", True), "mlp.c_fc.bias": ("mlp.up.bias", False),
    "mlp.c_proj.weight": ("mlp.down.weight", True), "mlp.c_proj.bias": ("mlp.down.bias", False),
}
GPT2_LAYER_RE = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")
GPT2_IGNORED = ("lm_head.weight",)  # tied to wte
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def gpt2_config(hf: dict, rows: int) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise CkptError(f"GPT-2 activation_function {act!r} is not supported",
                        f"ckptool reads {', '.join(GPT2_ACTIVATIONS)}")
    hidden = hf["n_embd"]
    return GPTConfig(num_layers=hf["n_layer"], hidden_size=hidden, num_attention_heads=hf["n_head"],
                     ffn_hidden_size=hf.get("n_inner") or 4 * hidden, padded_vocab_size=rows,
                     vocab_size=hf.get("vocab_size"), vocab_size_source="config.json vocab_size",
                     max_position_embeddings=hf["n_positions"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                     activation=GPT2_ACTIVATIONS[act], tied_embeddings=hf.get("tie_word_embeddings", True))


def _t(x: LazyTensor) -> LazyTensor:
    return Derived(lambda t: t.t().contiguous(), [x])


def gpt2_to_canonical(named: Dict[str, LazyTensor], cfg: GPTConfig) -> Dict[str, LazyTensor]:
    out: Dict[str, LazyTensor] = {}
    h = cfg.hidden_size
    for name, t in named.items():
        if name in GPT2_GLOBALS:
            out[GPT2_GLOBALS[name]] = t
            continue
        if name in GPT2_IGNORED:
            continue
        m = GPT2_LAYER_RE.match(name)
        if not m:
            raise CkptError(f"unexpected GPT-2 parameter {name!r}", "ckptool reads GPT2LMHeadModel / GPT2Model")
        i, rest = int(m.group(1)), m.group(2)
        p = f"layers.{i}."
        if rest in ("attn.c_attn.weight", "attn.c_attn.bias"):
            kind = rest.rsplit(".", 1)[1]
            full = _t(t) if kind == "weight" else t
            for j, part in enumerate("qkv"):
                out[f"{p}attn.{part}.{kind}"] = full.narrow(0, j * h, h)
        elif rest in GPT2_LAYER:
            canon, transpose = GPT2_LAYER[rest]
            out[p + canon] = _t(t) if transpose else t
        elif rest in ("attn.bias", "attn.masked_bias"):  # old causal-mask buffers
            continue
        else:
            raise CkptError(f"unexpected GPT-2 parameter {name!r}", "ckptool reads GPT2LMHeadModel / GPT2Model")
    return out


# --- Llama (LlamaForCausalLM) ------------------------------------------------------------------
LLAMA_GLOBALS = {"model.embed_tokens.weight": "embed.word", "model.norm.weight": "final_norm.weight",
                 "lm_head.weight": "output.weight"}
LLAMA_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight"}
for _hf, _c in (("self_attn.q_proj", "attn.q"), ("self_attn.k_proj", "attn.k"), ("self_attn.v_proj", "attn.v"),
                ("self_attn.o_proj", "attn.out"), ("mlp.gate_proj", "mlp.gate"), ("mlp.up_proj", "mlp.up"),
                ("mlp.down_proj", "mlp.down")):
    for _p in ("weight", "bias"):
        LLAMA_LAYER[f"{_hf}.{_p}"] = f"{_c}.{_p}"
LLAMA_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def llama_config(hf: dict, rows: int) -> GPTConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CkptError(f"Llama hidden_act {act!r} is not SwiGLU's silu", "ckptool converts SwiGLU Llama models")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CkptError("Llama rope scaling is not supported for DeepSpeed-trained HF models",
                        "convert the consolidated model with `ckptool to-hf` and read that")
    bias = bool(hf.get("attention_bias", False))
    nh = hf["num_attention_heads"]
    return GPTConfig(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=nh,
                     num_query_groups=hf.get("num_key_value_heads") or nh, head_dim=hf.get("head_dim"),
                     ffn_hidden_size=hf["intermediate_size"], padded_vocab_size=rows,
                     vocab_size=hf.get("vocab_size"), vocab_size_source="config.json vocab_size",
                     max_position_embeddings=hf.get("max_position_embeddings", 2048), position_embedding="rope",
                     rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                     normalization="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                     add_bias_linear=bias and bool(hf.get("mlp_bias", False)), add_qkv_bias=bias,
                     tied_embeddings=bool(hf.get("tie_word_embeddings", False)))


def llama_to_canonical(named: Dict[str, LazyTensor], cfg: GPTConfig) -> Dict[str, LazyTensor]:
    out: Dict[str, LazyTensor] = {}
    for name, t in named.items():
        if name in LLAMA_GLOBALS:
            if not (name == "lm_head.weight" and cfg.tied_embeddings):
                out[LLAMA_GLOBALS[name]] = t
            continue
        m = LLAMA_LAYER_RE.match(name)
        if not m or m.group(2) not in LLAMA_LAYER:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise CkptError(f"unexpected Llama parameter {name!r}", "ckptool reads LlamaForCausalLM")
        out[f"layers.{m.group(1)}.{LLAMA_LAYER[m.group(2)]}"] = t
    return out


# model_type -> (word-embedding name, config builder, name mapper)
HF_GPT_FAMILIES = {
    "gpt2": ("transformer.wte.weight", gpt2_config, gpt2_to_canonical),
    "llama": ("model.embed_tokens.weight", llama_config, llama_to_canonical),
}
