"""Hugging Face model directories (GPT-2, the Llama family, Mixtral, Qwen MoE, DeepSeek-V3): reader.

A directory with config.json whose model_type is gpt2, llama, mistral, qwen2, qwen3, mixtral,
qwen2_moe, qwen3_moe or deepseek_v3, and weights in safetensors or torch .bin files, sharded (an
*.index.json) or not. Experts are read per expert (the Hub names) or fused 3-D (transformers >= 5's state_dict);
DeepSeek's block-FP8 weights are dequantized to bf16. Tensors stay lazy: safetensors
entries are read with safe_open when loaded; .bin files go through the safe lazy torch loader, never
plain torch.load. Names are mapped with the tables in hf_names.py; the writer is hf_writer.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

import torch

from ..config import MLA, GPTConfig, Layout, MoE, Yarn, moe_layers_first_k_dense, moe_layers_qwen
from ..errors import CkptError, require
from ..io.safetensors_header import read_safetensors_header
from ..io.torchfile import load_torch_file
from ..lazy import Derived, LazyTensor
from ..options import ReadOptions
from ..state import Checkpoint, SourceInfo, expected_names
from ..vocab import with_true_vocab_size
from . import hf_names
from .hf_names import FUSED_EXPERTS, MODEL_TYPES, REFUSED_MODEL_TYPES, expand

FORMAT = "hf"
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Buffers older transformers versions saved with the weights: recomputed by the model, never data.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _read_config(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None


def gpt_model_type(conf: dict) -> Optional[str]:
    mt = conf.get("model_type")
    if mt in MODEL_TYPES:
        return mt
    for arch in conf.get("architectures") or []:
        for key, (_, cls) in MODEL_TYPES.items():
            if arch == cls:
                return key
    return None


def refused_model(conf: dict) -> Optional[str]:
    """What ckptool recognises in this config and does not convert yet, or None."""
    mt = conf.get("model_type")
    if mt in REFUSED_MODEL_TYPES:
        return f"{REFUSED_MODEL_TYPES[mt]} is not supported yet"
    if gpt_model_type(conf) is None and any(conf.get(k) for k in MOE_EXPERT_KEYS):
        return (f"Mixture-of-Experts model_type {mt!r} is not supported (ckptool converts "
                f"{', '.join(t for t, (f, _) in MODEL_TYPES.items() if f in FUSED_EXPERTS)})")
    return None


def has_weights(path) -> bool:
    """A weights file (or its index) transformers would load from this directory."""
    return any((Path(path) / f).is_file() for f in WEIGHT_FILES + WEIGHT_INDEXES)


def looks_like(path) -> bool:
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    if not has_weights(path) and (path / "latest_checkpointed_iteration.txt").is_file():
        return False  # a Megatron save dir with an HF config.json kept beside it: Megatron's to read
    conf = _read_config(path)
    return conf is not None and (gpt_model_type(conf) is not None or refused_model(conf) is not None)


# --- lazy tensors --------------------------------------------------------------------------

class SafetensorsTensor(LazyTensor):
    """One entry of a .safetensors file; narrow() on dim 0 reads only those rows."""

    def __init__(self, path: Path, key: str, shape, dtype: torch.dtype, rows=None):
        self.path, self.key, self.rows = path, key, rows
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def load(self) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(str(self.path), framework="pt") as f:
            if self.rows is None:
                return f.get_tensor(self.key)
            return f.get_slice(self.key)[self.rows[0]:self.rows[1]]

    def narrow(self, dim, start, length):
        if dim != 0:
            return super().narrow(dim, start, length)
        base = self.rows[0] if self.rows else 0
        return SafetensorsTensor(self.path, self.key, (length,) + tuple(self.shape[1:]), self.dtype,
                                 (base + start, base + start + length))


def _safetensors_entries(path: Path) -> Dict[str, LazyTensor]:
    # The header is validated (offsets tile the buffer, sizes match shapes) before anything is read.
    header = read_safetensors_header(path)
    return {name: SafetensorsTensor(path, name, e.shape, e.dtype) for name, e in header.tensors.items()}


def _bin_entries(path: Path) -> Dict[str, LazyTensor]:
    tree = load_torch_file(path)
    if isinstance(tree, dict) and "state_dict" in tree and isinstance(tree["state_dict"], dict):
        tree = tree["state_dict"]
    require(isinstance(tree, dict), f"{path}: holds no state dict")
    return {k: v for k, v in tree.items() if isinstance(v, LazyTensor)}


def weight_files(path: Path):
    for idx in WEIGHT_INDEXES:
        if (path / idx).is_file():
            try:
                weight_map = json.loads((path / idx).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CkptError(f"{path / idx}: unreadable index ({e})")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).is_file()]
            require(not missing, f"{path}: the index lists {', '.join(missing[:3])} but the file is missing",
                    "the download is incomplete")
            return [path / f for f in files]
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise CkptError(f"{path}: config.json but no model.safetensors / pytorch_model.bin (or their index)",
                    "pass a directory written by save_pretrained")


def read_entries(path: Path) -> Dict[str, LazyTensor]:
    entries: Dict[str, LazyTensor] = {}
    for f in weight_files(path):
        entries.update(_safetensors_entries(f) if f.suffix == ".safetensors" else _bin_entries(f))
    return entries


# --- config --------------------------------------------------------------------------------

def _rope(conf: dict, model_type: str):
    """(theta, llama3 factor or None, Yarn or None) from rope_parameters (transformers 5) or
    rope_theta/rope_scaling (4). YaRN is read for MLA models only (DeepSeek-V3; no Megatron output)."""
    params = dict(conf.get("rope_parameters") or {})
    scaling = conf.get("rope_scaling") or {}
    theta = params.get("rope_theta", conf.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    src = params if params.get("rope_type") not in (None, "default") else scaling
    if rtype == "default":
        return float(theta), None, None
    if rtype == "yarn" and model_type in MLA_MODEL_TYPES:
        opt = {k: src[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                   "truncate") if src.get(k) is not None}
        return float(theta), None, Yarn(factor=float(src["factor"]),
                                        original_max_position_embeddings=int(src["original_max_position_embeddings"]),
                                        **opt)
    if rtype == "llama3":
        want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in want.items():
            require(float(src.get(k, v)) == v, f"llama3 rope scaling with {k}={src.get(k)} is not supported",
                    f"ckptool's Megatron output uses {k}={v}")
        return float(theta), float(src["factor"]), None
    raise CkptError(f"rope scaling type {rtype!r} has no Megatron equivalent ckptool writes",
                    "only default and llama3 RoPE are converted")


def config_from_hf(conf: dict, rows: int, model_type: str) -> GPTConfig:
    family = MODEL_TYPES[model_type][0]
    true_vocab = conf.get("vocab_size")
    if true_vocab is None or true_vocab > rows:
        true_vocab = rows
    common = dict(padded_vocab_size=rows, vocab_size=true_vocab, vocab_size_source="config.json vocab_size")
    if family == "gpt2":
        act = conf.get("activation_function", "gelu_new")
        require(act in hf_names.GPT2_ACTIVATION_IN, f"GPT-2 activation_function {act!r} is not supported",
                f"supported: {', '.join(hf_names.GPT2_ACTIVATION_IN)}")
        h = conf["n_embd"]
        return GPTConfig(num_layers=conf["n_layer"], hidden_size=h, num_attention_heads=conf["n_head"],
                         ffn_hidden_size=conf.get("n_inner") or 4 * h,
                         max_position_embeddings=conf.get("n_positions", conf.get("n_ctx", 1024)),
                         position_embedding="learned", normalization="layernorm",
                         norm_eps=conf.get("layer_norm_epsilon", 1e-5),
                         activation=hf_names.GPT2_ACTIVATION_IN[act], add_bias_linear=True, add_qkv_bias=True,
                         tied_embeddings=conf.get("tie_word_embeddings", True), **common)
    act = conf.get("hidden_act", "silu")
    require(act == "silu", f"{model_type} hidden_act {act!r} is not SwiGLU's silu",
            "only silu-gated MLPs map onto Megatron's --swiglu")
    if model_type in QKV_BIAS_ONLY:
        qkv_bias, linear_bias = bool(conf.get("qkv_bias", True)), False
    else:
        attn_bias, mlp_bias = bool(conf.get("attention_bias", False)), bool(conf.get("mlp_bias", False))
        require(attn_bias == mlp_bias,
                f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: Megatron biases all linear layers or none "
                "(add_bias_linear), so this bias pattern has no Megatron equivalent")
        qkv_bias = linear_bias = attn_bias
    theta, factor, yarn = _rope(conf, model_type)
    nh = conf["num_attention_heads"]
    mla = mla_from_hf(conf, model_type)
    return GPTConfig(num_layers=conf["num_hidden_layers"], hidden_size=conf["hidden_size"], num_attention_heads=nh,
                     num_query_groups=conf.get("num_key_value_heads") or nh,
                     head_dim=mla.qk_head_dim if mla else conf.get("head_dim"), mla=mla,
                     rotary_interleaved=bool(mla and conf.get("rope_interleave", True)), rope_yarn=yarn,
                     ffn_hidden_size=conf["intermediate_size"],
                     max_position_embeddings=conf.get("max_position_embeddings", 2048),
                     position_embedding="rope", rotary_base=theta, rope_scaling_factor=factor,
                     normalization="rmsnorm", norm_eps=conf.get("rms_norm_eps", 1e-6), activation="swiglu",
                     add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, qk_layernorm=model_type in QK_NORM,
                     tied_embeddings=bool(conf.get("tie_word_embeddings", False)),
                     moe=moe_from_hf(conf, model_type), **common)


QKV_BIAS_ONLY = ("qwen2", "qwen2_moe")  # biases on q, k and v only (Qwen2-MoE: config qkv_bias, default on)
QK_NORM = ("qwen3", "qwen3_moe")  # RMSNorm over each head of q and k before RoPE
MOE_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

# model_type -> where config.json keeps the routing facts. Mixtral always renormalises the top-k
# weights; the others when norm_topk_prob. Which layers are MoE: MOE_LAYER_RULES.
MOE_CONFIG = {
    "mixtral": dict(ffn="intermediate_size", topk_norm=True, layers="all"),
    "qwen2_moe": dict(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers="qwen",
                      shared=lambda c: c.get("shared_expert_intermediate_size") or 0, shared_gate=True),
    "qwen3_moe": dict(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers="qwen"),
    "deepseek_v3": dict(ffn="moe_intermediate_size", topk_norm="norm_topk_prob", layers="first_k_dense",
                        score="sigmoid", scaling="routed_scaling_factor", expert_bias=True,
                        groups=("n_group", "topk_group"),
                        shared=lambda c: c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0)),
}
MOE_LAYER_RULES = {
    "all": lambda c, n: tuple(range(n)),
    "qwen": lambda c, n: moe_layers_qwen(n, c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []),
    "first_k_dense": lambda c, n: moe_layers_first_k_dense(n, c.get("first_k_dense_replace", 0)),
}
# config.json values a family may carry beyond what transformers' class computes: only these pass
MOE_REFUSED_VALUES = {"deepseek_v3": {"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",),
                                      "moe_layer_freq": (1,)}}


def moe_from_hf(conf: dict, model_type: str) -> Optional[MoE]:
    spec = MOE_CONFIG.get(model_type)
    if spec is None:
        return None
    for key, allowed in MOE_REFUSED_VALUES.get(model_type, {}).items():
        require(conf.get(key, allowed[0]) in allowed, f"{model_type} {key}={conf.get(key)!r} is not supported",
                f"ckptool converts {key} {' / '.join(map(str, allowed))} (what transformers computes)")
    experts = next((conf[k] for k in MOE_EXPERT_KEYS if conf.get(k)), None)
    require(experts is not None, f"{model_type} config.json gives no number of experts "
            f"({' / '.join(MOE_EXPERT_KEYS)})")
    norm = spec["topk_norm"]
    shared = spec["shared"](conf) if "shared" in spec else 0
    groups = [conf.get(k) or 1 for k in spec["groups"]] if "groups" in spec else [1, 1]
    return MoE(num_experts=experts, top_k=conf.get("num_experts_per_tok", 2), ffn_hidden_size=conf[spec["ffn"]],
               layers=MOE_LAYER_RULES[spec["layers"]](conf, conf["num_hidden_layers"]),
               score_function=spec.get("score", "softmax"),
               topk_norm=bool(conf.get(norm, False)) if isinstance(norm, str) else norm,
               scaling_factor=float(conf.get(spec["scaling"], 1.0)) if "scaling" in spec else 1.0,
               expert_bias=spec.get("expert_bias", False), shared_ffn_hidden_size=shared,
               shared_gate=bool(shared) and spec.get("shared_gate", False),
               num_groups=groups[0], group_topk=groups[1])


MLA_MODEL_TYPES = ("deepseek_v3",)


def mla_from_hf(conf: dict, model_type: str) -> Optional[MLA]:
    """DeepSeek's MLA sizes; transformers normalises the latents with its RMSNorm's default eps 1e-6."""
    if model_type not in MLA_MODEL_TYPES:
        return None
    require(conf.get("num_key_value_heads", conf["num_attention_heads"]) == conf["num_attention_heads"],
            f"{model_type} with num_key_value_heads != num_attention_heads is not supported (MLA has one kv per head)")
    return MLA(q_lora_rank=conf.get("q_lora_rank") or None, kv_lora_rank=conf["kv_lora_rank"],
               qk_nope_head_dim=conf["qk_nope_head_dim"], qk_rope_head_dim=conf["qk_rope_head_dim"],
               v_head_dim=conf["v_head_dim"], latent_norm_eps=1e-6)


# --- the reader ----------------------------------------------------------------------------

def _part_rows(name: str, cfg: GPTConfig) -> int:
    return cfg.q_size if ".attn.q." in name else cfg.kv_size


def to_canonical(entries: Dict[str, LazyTensor], conf: dict, model_type: str, opts: ReadOptions, path):
    """(GPTConfig, {canonical name: lazy}) from HF-named tensors; also used for DeepSpeed runs of HF models."""
    family = MODEL_TYPES[model_type][0]
    if family == "gpt2" and not any(k.startswith("transformer.") for k in entries):
        # GPT2Model checkpoints (and the original openai-community/gpt2 files) omit the prefix.
        entries = {("transformer." + k if not k.startswith("lm_head.") else k): v for k, v in entries.items()}
    word_key = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    require(word_key in entries, f"{path}: no {word_key} in the weight files")
    cfg = with_true_vocab_size(config_from_hf(conf, entries[word_key].shape[0], model_type),
                               opts.true_vocab_size, entries[word_key].shape[0])
    if opts.overrides.get("activation"):
        cfg = cfg.replace(activation=opts.overrides["activation"])

    entries = dequantize_fp8(entries, conf, path)
    if family in FUSED_EXPERTS:
        entries = unfuse_experts(entries, family, cfg)
    tensors: Dict[str, LazyTensor] = {}
    used = set()
    for hf_name, (op, arg), _group in expand(family, cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0):
        if hf_name not in entries:
            continue
        t = entries[hf_name]
        used.add(hf_name)
        if op == "copy":
            tensors[arg] = t
        elif op == "T":
            tensors[arg] = Derived(lambda x: x.t(), [t])
        else:
            whole = Derived(lambda x: x.t(), [t], memo=True) if op == "cat_T" else t
            start = 0
            for name in arg:
                n = _part_rows(name, cfg)
                tensors[name] = whole.narrow(0, start, n)
                start += n
            require(start == whole.shape[0], f"{hf_name} has {whole.shape[0]} rows, expected {start}")
    if cfg.tied_embeddings:
        tensors.pop("output.weight", None)
    leftover = sorted(k for k in entries if k not in used and not k.endswith(IGNORED_SUFFIXES)
                      and not (cfg.tied_embeddings and k == "lm_head.weight"))
    beyond = [k for k in leftover if _layer_index(k) is not None and _layer_index(k) >= cfg.num_layers]
    require(not beyond, f"{path}: {', '.join(beyond[:3])} belong to layers past num_hidden_layers="
            f"{cfg.num_layers}: multi-token-prediction (MTP) layers are not supported",
            "ckptool never drops tensors; remove the MTP layers from the checkpoint first if you do not need them")
    require(not leftover, f"{path}: tensors ckptool does not know how to map: {', '.join(leftover[:5])}",
            "this model has parts a Megatron GPT cannot hold" if cfg.moe is None else
            f"an expert index past num_experts={cfg.moe.num_experts}, or an expert module ckptool does not know")
    want = expected_names(cfg)
    unexpected = [n for n in tensors if n not in set(want)]
    require(not unexpected, f"{path}: the files hold {', '.join(unexpected[:3])}, which the model config.json "
            "describes does not have", "ckptool never drops tensors; check config.json against the weights")
    missing = [n for n in want if n not in tensors]
    require(not missing, f"{path}: missing weights for {', '.join(missing[:5])}",
            "the weight files do not match config.json")
    return cfg, {n: tensors[n] for n in want}


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_index(hf_name: str) -> Optional[int]:
    m = _LAYER_INDEX.search(hf_name)
    return int(m.group(1)) if m else None


FP8_SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def _dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block, dtype) -> torch.Tensor:
    rows, cols = w.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w.float() * scale).to(dtype)


def dequantize_fp8(entries: Dict[str, LazyTensor], conf: dict, path) -> Dict[str, LazyTensor]:
    """DeepSeek's FP8 weights (float8_e4m3fn, one float32 weight_scale_inv per block of
    weight_block_size, 128x128 by default) -> bf16, as DeepSeek's own fp8-to-bf16 cast computes
    them. The scales are consumed; a scale without its weight, or another FP8 layout, is refused."""
    scales = [k for k in entries if k.endswith(FP8_SCALE_SUFFIX)]
    if not scales:
        return entries
    quant = conf.get("quantization_config") or {}
    require(quant.get("quant_method", "fp8") == "fp8" and quant.get("fmt", "e4m3") == "e4m3",
            f"{path}: quantization {quant.get('quant_method')}/{quant.get('fmt')} is not supported",
            "ckptool dequantizes DeepSeek's block FP8 (e4m3, weight_scale_inv) only")
    block = tuple(quant.get("weight_block_size") or (128, 128))
    out = dict(entries)
    for key in scales:
        name = key[:-len(FP8_SCALE_SUFFIX)]
        w, s = out.get(name), out.pop(key)
        require(w is not None and w.dtype in FP8_DTYPES and len(w.shape) == 2,
                f"{path}: {key} scales no float8_e4m3fn matrix {name}", "the FP8 checkpoint is incomplete or not block FP8")
        want = tuple(-(-n // b) for n, b in zip(w.shape, block))
        require(tuple(s.shape) == want, f"{path}: {key} has shape {tuple(s.shape)}, expected {want} for "
                f"{tuple(w.shape)} in {block[0]}x{block[1]} blocks")
        out[name] = Derived(lambda x, y: _dequantize(x, y, block, torch.bfloat16), [w, s],
                            shape=w.shape, dtype=torch.bfloat16)
    fp8 = [k for k, t in out.items() if t.dtype in FP8_DTYPES]
    require(not fp8, f"{path}: FP8 tensors without a weight_scale_inv: {', '.join(fp8[:3])}",
            "ckptool dequantizes block FP8 weights that carry their scales")
    return out


def unfuse_experts(entries: Dict[str, LazyTensor], family: str, cfg: GPTConfig) -> Dict[str, LazyTensor]:
    """transformers' fused 3-D expert tensors -> the per-expert Hub names (lazy; expert e reads only
    its own rows of a safetensors entry)."""
    _, _, _, prefix = hf_names.FAMILIES[family]
    out = dict(entries)
    for i in cfg.moe.layers if cfg.moe else ():
        p = prefix.format(i=i)
        for suffix, (op, arg) in FUSED_EXPERTS[family].items():
            t = out.pop(p + suffix, None)
            if t is None:
                continue
            if op == "rename":
                out[p + arg] = t
                continue
            n = cfg.moe.num_experts
            require(len(t.shape) == 3 and t.shape[0] == n,
                    f"{p + suffix} has shape {tuple(t.shape)}, expected [{n} experts, out, in]")
            for e in range(n):
                one = Derived(lambda x: x[0], [t.narrow(0, e, 1)])
                if op == "each":
                    out[p + arg.format(e=e)] = one
                else:
                    half = one.shape[0] // 2
                    out[p + arg[0].format(e=e)] = one.narrow(0, 0, half)
                    out[p + arg[1].format(e=e)] = one.narrow(0, half, half)
    return out


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    opts = opts or ReadOptions()
    path = Path(path)
    conf = _read_config(path)
    require(conf is not None, f"{path / 'config.json'} is not readable JSON")
    model_type = gpt_model_type(conf)
    require(refused_model(conf) is None, f"{path}: {refused_model(conf)}",
            "ckptool refuses what it cannot convert exactly rather than leave parts out")
    require(model_type is not None, f"{path}: model_type {conf.get('model_type')!r} is not one ckptool converts",
            f"supported: {', '.join(MODEL_TYPES)}")
    cfg, tensors = to_canonical(read_entries(path), conf, model_type, opts, path)
    ckpt = Checkpoint(cfg, tensors, SourceInfo(
        path=str(path), format=FORMAT, dialect=model_type, layout=Layout(1, 1),
        extra={"hf_config": conf}))
    if conf.get("sliding_window") and conf.get("use_sliding_window", model_type in ("mistral", "mixtral")):
        ckpt.warn(f"{model_type} sliding_window={conf['sliding_window']} is dropped: Megatron attends over the "
                  "whole context (identical for sequences up to that length)")
    return ckpt
