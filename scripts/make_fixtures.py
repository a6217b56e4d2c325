#!/usr/bin/env python3
"""Deterministic generator of small Megatron-LM ``torch``-format checkpoints in every key dialect.

This file is the *oracle* that ckptool's readers are tested against.  It deliberately shares no code with
the ``ckptool`` package: it only uses torch, numpy, safetensors and transformers, and every layout below is
written from the documented facts in ``shared/reference/megatron.md`` (sections 1-7).

Ground truth is a tiny, randomly initialised transformers model (GPT-2 or Llama style).  Its weights are
mapped to full (TP=1) Megatron tensors, padded along the vocab, then split per tensor-parallel rank,
pipeline stage and virtual-pipeline chunk, and written as ``model_optim_rng.pt`` files in one of these
dialects:

  flat2019     2019 Megatron-LM / DeepSpeedExamples: flat keys, no args, v0 QKV (stride-3 TP split)
  legacy_v0    2020 nested ``language_model`` dict, ``transformer``/``attention`` names, no checkpoint_version
  legacy_v1    same names, checkpoint_version 1.0, per-rank QKV [np_l, hn, 3]
  legacy_v2    same names, checkpoint_version 2.0, per-rank QKV [np_l, 3, hn]
  legacy_v3    2021 names (``encoder``/``self_attention``/``*_layernorm``), checkpoint_version 3.0, PP + VPP
  legacy_norm  2023-09+ legacy names (``input_norm``/``post_attention_norm``/``final_norm``); GPT-2 and Llama
  mcore        megatron-core local spec (``decoder.layers.N...``), ``_extra_state`` = None
  mcore_te     megatron-core Transformer-Engine spec (norms fused into linear_qkv / linear_fc1)

Each fixture directory ``<out>/<name>/`` holds ``checkpoint/`` (the Megatron checkpoint), ``hf/`` (the
ground-truth transformers model, safetensors), ``expected.pt`` (tokens + fp32 logits of the ground truth)
and ``case.json`` (the parameters).  ``--check`` re-merges the shards by hand (undoing every layout) and
verifies the result against the ground truth weights and logits.

Usage:
    python scripts/make_fixtures.py --out DIR [--only NAME ...] [--check] [--no-build] [--list]
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import json
import math
import random
import re
import shutil
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import torch

ITERATION = 10
TRACKER = "latest_checkpointed_iteration.txt"
CKPT_FILE = "model_optim_rng.pt"
VOCAB_DIVISOR = 128
N_TOKENS = 16

DIALECTS = ("flat2019", "legacy_v0", "legacy_v1", "legacy_v2", "legacy_v3", "legacy_norm", "mcore", "mcore_te")
LLAMA_DIALECTS = ("legacy_norm", "mcore", "mcore_te")
CHECKPOINT_VERSION = {"flat2019": None, "legacy_v0": None, "legacy_v1": 1.0, "legacy_v2": 2.0,
                      "legacy_v3": 3.0, "legacy_norm": 3.0, "mcore": 3.0, "mcore_te": 3.0}
# Per-TP-rank fused QKV row layout written by each dialect.
QKV_LAYOUT = {"flat2019": "stride3", "legacy_v0": "v0", "legacy_v1": "v1", "legacy_v2": "grouped",
              "legacy_v3": "grouped", "legacy_norm": "grouped", "mcore": "grouped", "mcore_te": "grouped"}
QKV_LAYOUT_DOC = {
    "stride3": "per rank [3, np/tp, hn] (global [3h,h] cut into 3*tp row chunks; rank r holds chunks r, r+tp, r+2tp)",
    "v0": "per rank [3, np/tp, hn]",
    "v1": "per rank [np/tp, hn, 3]",
    "grouped": "global [ng, np/ng+2, hn] (per query group: its q heads, then k, then v); "
               "rank r holds the r-th contiguous 1/tp of the rows",
}

# --------------------------------------------------------------------------------------------------
# Fixture table
# --------------------------------------------------------------------------------------------------

GPT2_BASE = dict(num_layers=4, hidden_size=64, num_heads=4, num_query_groups=4, head_dim=16, ffn_hidden_size=256,
                 max_position_embeddings=64, vocab_size=1001)
LLAMA_BASE = dict(num_layers=4, hidden_size=64, num_heads=8, num_query_groups=2, head_dim=8, ffn_hidden_size=96,
                  max_position_embeddings=64, vocab_size=1000)


def _spec(style, dialect, tp=1, pp=1, vpp=None, dtype="float32", **model):
    base = dict(GPT2_BASE if style == "gpt2" else LLAMA_BASE)
    if vpp:
        base["num_layers"] = 8
    base.update(model)
    if style == "gpt2":
        base["activation"] = "gelu_new" if dialect == "flat2019" else "gelu"
    else:
        base["activation"] = "swiglu"
    return dict(style=style, dialect=dialect, tp=tp, pp=pp, vpp=vpp, dtype=dtype, **base)


def _name(style, dialect, tp, pp, vpp=None, suffix=""):
    if dialect == "flat2019":
        n = f"{style}_flat2019_tp{tp}"
    else:
        n = f"{style}_{dialect}_tp{tp}pp{pp}"
    if vpp:
        n += f"_vpp{vpp}"
    return n + suffix


def _fixture_table():
    t = {}

    def add(style, dialect, tp=1, pp=1, vpp=None, suffix="", **kw):
        t[_name(style, dialect, tp, pp, vpp, suffix)] = _spec(style, dialect, tp, pp, vpp, **kw)

    # every dialect at TP1 PP1
    for d in DIALECTS:
        add("gpt2", d)
    for d in LLAMA_DIALECTS:
        add("llama", d)
    # flat2019 / 2020-era dialects at TP2 (the per-rank QKV layouts only differ from the global one when TP>1)
    add("gpt2", "flat2019", tp=2)
    for d in ("legacy_v0", "legacy_v1", "legacy_v2"):
        add("gpt2", d, tp=2)
    # GPT-2 mcore and legacy_v3 across TP/PP/VPP
    for d in ("mcore", "legacy_v3"):
        for tp, pp in ((2, 1), (1, 2), (2, 2), (4, 1)):
            add("gpt2", d, tp, pp)
        add("gpt2", d, 2, 2, vpp=2)
    add("gpt2", "mcore_te", 2, 2)
    # Llama (GQA 8 heads / 2 groups, SwiGLU, RMSNorm, rope, untied)
    for d in ("mcore", "legacy_norm"):
        add("llama", d, 2, 2)
        add("llama", d, 4, 1)  # TP 4 > 2 query groups
    add("llama", "legacy_norm", 2, 1)
    add("llama", "mcore", 2, 2, vpp=2)
    add("llama", "mcore_te", 2, 2)
    add("gpt2", "legacy_norm", 2, 2)  # same layout as shared/real-checkpoints/mlm_legacy_gpt2_torch_tp2pp2
    # bf16 storage
    add("gpt2", "mcore", 2, 2, suffix="_bf16", dtype="bfloat16")
    add("llama", "legacy_norm", 2, 1, suffix="_bf16", dtype="bfloat16")
    # 2019 seed-sized case: real GPT-2 vocab 50257 padded to 50432 (128 x mp 2)
    t["seed_2019_mp2"] = _spec("gpt2", "flat2019", tp=2, num_layers=2, hidden_size=32, num_heads=2,
                               num_query_groups=2, head_dim=16, ffn_hidden_size=128, max_position_embeddings=32,
                               vocab_size=50257)
    return t


FIXTURES = _fixture_table()


def padded_vocab(vocab, tp, divisor=VOCAB_DIVISOR):
    m = divisor * tp
    return int(math.ceil(vocab / m) * m)


def _torch_dtype(name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# --------------------------------------------------------------------------------------------------
# Fake ``megatron.core.enums`` module (so that ``args`` pickles a Megatron class, like real checkpoints)
# --------------------------------------------------------------------------------------------------

_FAKE_MODULES = ("megatron", "megatron.core", "megatron.core.enums")
_MISSING = object()


@contextlib.contextmanager
def fake_megatron():
    """Temporarily install ``megatron.core.enums.ModelType`` in sys.modules; yields the enum class."""
    saved = {n: sys.modules.get(n, _MISSING) for n in _FAKE_MODULES}
    mods = {n: types.ModuleType(n) for n in _FAKE_MODULES}
    model_type = enum.Enum("ModelType", [("encoder_or_decoder", 1), ("retro_encoder", 2), ("retro_decoder", 3)],
                           module="megatron.core.enums", qualname="ModelType")
    mods["megatron.core.enums"].ModelType = model_type
    mods["megatron"].core = mods["megatron.core"]
    mods["megatron.core"].enums = mods["megatron.core.enums"]
    sys.modules.update(mods)
    try:
        yield model_type
    finally:
        for n, old in saved.items():
            if old is _MISSING:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


# --------------------------------------------------------------------------------------------------
# Ground truth (transformers model) and full TP=1 Megatron tensors
# --------------------------------------------------------------------------------------------------

def _seed_for(spec):
    dims = {k: spec[k] for k in ("style", "num_layers", "hidden_size", "num_heads", "num_query_groups", "head_dim",
                                 "ffn_hidden_size", "max_position_embeddings", "vocab_size", "activation")}
    return 1234 + zlib.crc32(json.dumps(dims, sort_keys=True).encode()) % 100000


def make_hf_model(spec):
    """Build the seeded ground-truth transformers model (eval mode, fp32)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    V = spec["vocab_size"]
    if spec["style"] == "gpt2":
        assert spec["num_heads"] * spec["head_dim"] == spec["hidden_size"]
        cfg = GPT2Config(n_layer=spec["num_layers"], n_embd=spec["hidden_size"], n_head=spec["num_heads"],
                         n_positions=spec["max_position_embeddings"], vocab_size=V, n_inner=spec["ffn_hidden_size"],
                         activation_function=spec["activation"], layer_norm_epsilon=1e-5,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=V - 1, eos_token_id=V - 1,
                         tie_word_embeddings=True, attn_implementation="eager")
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(num_hidden_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
                          num_attention_heads=spec["num_heads"], num_key_value_heads=spec["num_query_groups"],
                          head_dim=spec["head_dim"], intermediate_size=spec["ffn_hidden_size"], vocab_size=V,
                          max_position_embeddings=spec["max_position_embeddings"], rms_norm_eps=1e-5,
                          rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                          hidden_act="silu", bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(_seed_for(spec))
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is visited once (as wte)
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(".bias"):
                p.copy_(0.02 * noise)
            elif p.dim() == 1:  # LayerNorm / RMSNorm weight
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)
            if spec["dtype"] != "float32":  # make the ground truth exactly representable in the storage dtype
                p.copy_(p.to(_torch_dtype(spec["dtype"])).float())
    model.eval()
    return model


def expected_outputs(model, spec):
    tokens = torch.randint(0, spec["vocab_size"], (2, N_TOKENS), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int64)
    nthreads = torch.get_num_threads()
    torch.set_num_threads(1)  # keep the bytes independent of the machine's core count
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float().contiguous()
    finally:
        torch.set_num_threads(nthreads)
    return {"tokens": tokens, "logits": logits}


def megatron_full_tensors(model, spec, tp):
    """HF weights -> full (TP=1) Megatron tensors, vocab padded for ``tp``.

    Returns ``dict(word_emb, pos_emb|None, output|None (untied only), final_w, final_b|None, layers=[...])``;
    each layer has ln1_w/ln1_b, q/k/v (+ q_b/k_b/v_b) as [rows, h], proj_w/proj_b, ln2_w/ln2_b,
    fc1_w/fc1_b (GeLU) or gate_w/up_w (SwiGLU), fc2_w/fc2_b.  Missing ones are None.
    """
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    V, h = spec["vocab_size"], spec["hidden_size"]
    Vp = padded_vocab(V, tp)
    gpad = torch.Generator().manual_seed(_seed_for(spec) + 7)
    dt = _torch_dtype(spec["dtype"])

    def pad(w):
        extra = 0.02 * torch.randn(Vp - V, h, generator=gpad)
        return torch.cat([w, extra.to(dt).float()], 0)

    G = {"layers": []}
    if spec["style"] == "gpt2":
        G["word_emb"] = pad(sd["transformer.wte.weight"])
        G["pos_emb"] = sd["transformer.wpe.weight"]
        G["output"] = None  # tied
        G["final_w"], G["final_b"] = sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]
        for i in range(spec["num_layers"]):
            p = f"transformer.h.{i}."
            qkv_w = sd[p + "attn.c_attn.weight"].t()  # Conv1D [in, out] -> [out, in]; rows [Q_all|K_all|V_all]
            qkv_b = sd[p + "attn.c_attn.bias"]
            q, k, v = qkv_w.split(h, 0)
            qb, kb, vb = qkv_b.split(h, 0)
            G["layers"].append(dict(
                ln1_w=sd[p + "ln_1.weight"], ln1_b=sd[p + "ln_1.bias"],
                q=q, k=k, v=v, q_b=qb, k_b=kb, v_b=vb,
                proj_w=sd[p + "attn.c_proj.weight"].t(), proj_b=sd[p + "attn.c_proj.bias"],
                ln2_w=sd[p + "ln_2.weight"], ln2_b=sd[p + "ln_2.bias"],
                fc1_w=sd[p + "mlp.c_fc.weight"].t(), fc1_b=sd[p + "mlp.c_fc.bias"],
                gate_w=None, up_w=None,
                fc2_w=sd[p + "mlp.c_proj.weight"].t(), fc2_b=sd[p + "mlp.c_proj.bias"]))
    else:
        G["word_emb"] = pad(sd["model.embed_tokens.weight"])
        G["pos_emb"] = None  # rope
        G["output"] = pad(sd["lm_head.weight"])
        G["final_w"], G["final_b"] = sd["model.norm.weight"], None
        for i in range(spec["num_layers"]):
            p = f"model.layers.{i}."
            G["layers"].append(dict(
                ln1_w=sd[p + "input_layernorm.weight"], ln1_b=None,
                q=sd[p + "self_attn.q_proj.weight"], k=sd[p + "self_attn.k_proj.weight"],
                v=sd[p + "self_attn.v_proj.weight"], q_b=None, k_b=None, v_b=None,
                proj_w=sd[p + "self_attn.o_proj.weight"], proj_b=None,
                ln2_w=sd[p + "post_attention_layernorm.weight"], ln2_b=None,
                fc1_w=None, fc1_b=None,
                gate_w=sd[p + "mlp.gate_proj.weight"], up_w=sd[p + "mlp.up_proj.weight"],
                fc2_w=sd[p + "mlp.down_proj.weight"], fc2_b=None))
    G["padded_vocab"] = Vp
    return G


# --------------------------------------------------------------------------------------------------
# Tensor-parallel sharding
# --------------------------------------------------------------------------------------------------

def qkv_shard(spec, q, k, v, layout, tp, r):
    """Rank ``r``'s fused QKV rows (weight [rows, h] or bias [rows]) in the given per-rank layout."""
    nq, ng, hd = spec["num_heads"], spec["num_query_groups"], spec["head_dim"]
    rest = tuple(q.shape[1:])
    if layout == "grouped":
        qpg = nq // ng
        full = torch.cat([q.reshape(ng, qpg * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)],
                         dim=1).reshape(-1, *rest)
        assert full.shape[0] % tp == 0, "grouped QKV rows must divide by TP"
        n = full.shape[0] // tp
        return full[r * n:(r + 1) * n]
    assert ng == nq, f"layout {layout} only exists for multi-head attention"
    assert nq % tp == 0
    if layout == "stride3":
        full = torch.cat([q, k, v], 0)  # [3h, ...] = [Q_all; K_all; V_all]
        n = full.shape[0] // (3 * tp)
        pieces = [full[j * n:(j + 1) * n] for j in range(3 * tp)]
        out = torch.cat([pieces[r], pieces[r + tp], pieces[r + 2 * tp]], 0)
        # cross-check against the documented per-rank [3, np/tp, hn] view
        assert torch.equal(out, qkv_shard(spec, q, k, v, "v0", tp, r))
        return out
    npl = nq // tp
    qs, ks, vs = (x.reshape(nq, hd, *rest)[r * npl:(r + 1) * npl] for x in (q, k, v))
    if layout == "v0":
        return torch.stack([qs, ks, vs], 0).reshape(-1, *rest)  # [3, np_l, hn]
    if layout == "v1":
        return torch.stack([qs, ks, vs], 2).reshape(-1, *rest)  # [np_l, hn, 3]
    raise ValueError(layout)


def rank_layer(spec, lay, layout, tp, r):
    """Per-rank tensors of one transformer layer (role -> tensor or None)."""
    def col(t):  # column-parallel: split dim 0
        return None if t is None else t.chunk(tp, 0)[r]

    R = dict(ln1_w=lay["ln1_w"], ln1_b=lay["ln1_b"], ln2_w=lay["ln2_w"], ln2_b=lay["ln2_b"])
    R["qkv_w"] = qkv_shard(spec, lay["q"], lay["k"], lay["v"], layout, tp, r)
    R["qkv_b"] = None if lay["q_b"] is None else qkv_shard(spec, lay["q_b"], lay["k_b"], lay["v_b"], layout, tp, r)
    R["proj_w"], R["proj_b"] = lay["proj_w"].chunk(tp, 1)[r], lay["proj_b"]  # row-parallel; bias replicated
    if lay["gate_w"] is not None:  # SwiGLU: per rank [gate_r ; up_r]
        R["fc1_w"] = torch.cat([col(lay["gate_w"]), col(lay["up_w"])], 0)
        R["fc1_b"] = None
    else:
        R["fc1_w"], R["fc1_b"] = col(lay["fc1_w"]), col(lay["fc1_b"])
    R["fc2_w"], R["fc2_b"] = lay["fc2_w"].chunk(tp, 1)[r], lay["fc2_b"]
    return R


# --------------------------------------------------------------------------------------------------
# Model state dicts per dialect
# --------------------------------------------------------------------------------------------------

LEGACY_NAMES = {
    "flat2019": dict(attn="attention", ln1="input_layernorm", ln2="post_attention_layernorm", final="final_layernorm",
                     enc="transformer"),
    "legacy_v0": dict(attn="attention", ln1="input_layernorm", ln2="post_attention_layernorm",
                      final="final_layernorm", enc="transformer"),
    "legacy_v3": dict(attn="self_attention", ln1="input_layernorm", ln2="post_attention_layernorm",
                      final="final_layernorm", enc="encoder"),
    "legacy_norm": dict(attn="self_attention", ln1="input_norm", ln2="post_attention_norm", final="final_norm",
                        enc="encoder"),
}
LEGACY_NAMES["legacy_v1"] = LEGACY_NAMES["legacy_v2"] = LEGACY_NAMES["legacy_v0"]


def _legacy_layer_entries(names, R, extra):
    """Legacy layer keys in module order; ``extra``: megatron.core linears add ``_extra_state`` = None."""
    a = names["attn"]
    out = [(f"{names['ln1']}.weight", R["ln1_w"]), (f"{names['ln1']}.bias", R["ln1_b"])]
    for module, w, b in ((f"{a}.query_key_value", "qkv_w", "qkv_b"), (f"{a}.dense", "proj_w", "proj_b"),
                         (None, "ln2_w", "ln2_b"),
                         ("mlp.dense_h_to_4h", "fc1_w", "fc1_b"), ("mlp.dense_4h_to_h", "fc2_w", "fc2_b")):
        if module is None:
            out += [(f"{names['ln2']}.weight", R[w]), (f"{names['ln2']}.bias", R[b])]
            continue
        out += [(f"{module}.weight", R[w]), (f"{module}.bias", R[b])]
        if extra:
            out.append((f"{module}._extra_state", _NONE))
    return out


_NONE = "<none>"          # marker: write the value None (local-spec _extra_state)
_TE_EXTRA = "<te-extra>"  # marker: write an empty uint8 tensor (TE _extra_state with FP8 off)


def _mcore_layer_entries(te, R):
    if not te:
        return [
            ("input_layernorm.weight", R["ln1_w"]), ("input_layernorm.bias", R["ln1_b"]),
            ("self_attention.linear_proj.weight", R["proj_w"]), ("self_attention.linear_proj.bias", R["proj_b"]),
            ("self_attention.linear_proj._extra_state", _NONE),
            ("self_attention.linear_qkv.weight", R["qkv_w"]), ("self_attention.linear_qkv.bias", R["qkv_b"]),
            ("self_attention.linear_qkv._extra_state", _NONE),
            ("pre_mlp_layernorm.weight", R["ln2_w"]), ("pre_mlp_layernorm.bias", R["ln2_b"]),
            ("mlp.linear_fc1.weight", R["fc1_w"]), ("mlp.linear_fc1.bias", R["fc1_b"]),
            ("mlp.linear_fc1._extra_state", _NONE),
            ("mlp.linear_fc2.weight", R["fc2_w"]), ("mlp.linear_fc2.bias", R["fc2_b"]),
            ("mlp.linear_fc2._extra_state", _NONE),
        ]
    return [
        ("self_attention.core_attention._extra_state", _TE_EXTRA),
        ("self_attention.linear_proj.weight", R["proj_w"]), ("self_attention.linear_proj.bias", R["proj_b"]),
        ("self_attention.linear_proj._extra_state", _TE_EXTRA),
        ("self_attention.linear_qkv.layer_norm_weight", R["ln1_w"]),
        ("self_attention.linear_qkv.layer_norm_bias", R["ln1_b"]),
        ("self_attention.linear_qkv.weight", R["qkv_w"]), ("self_attention.linear_qkv.bias", R["qkv_b"]),
        ("self_attention.linear_qkv._extra_state", _TE_EXTRA),
        ("mlp.linear_fc1.layer_norm_weight", R["ln2_w"]), ("mlp.linear_fc1.layer_norm_bias", R["ln2_b"]),
        ("mlp.linear_fc1.weight", R["fc1_w"]), ("mlp.linear_fc1.bias", R["fc1_b"]),
        ("mlp.linear_fc1._extra_state", _TE_EXTRA),
        ("mlp.linear_fc2.weight", R["fc2_w"]), ("mlp.linear_fc2.bias", R["fc2_b"]),
        ("mlp.linear_fc2._extra_state", _TE_EXTRA),
    ]


def _store(value, dtype):
    if value is _NONE:
        return None
    if value is _TE_EXTRA:
        return torch.empty(0, dtype=torch.uint8)
    return value.to(dtype).clone().contiguous()  # clone: never save a view of a bigger storage


def _put(d, key, value, dtype):
    if value is None:  # absent tensor (no bias, ...)
        return
    d[key] = _store(value, dtype)  # _NONE / _TE_EXTRA markers become None / empty uint8 tensor


def model_chunk_state(spec, G, t, layers, pre, post):
    """State dict of one model chunk (one TP rank, one PP stage, one VP chunk)."""
    dialect, tp, dt = spec["dialect"], spec["tp"], _torch_dtype(spec["dtype"])
    layout = QKV_LAYOUT[dialect]
    tied = G["output"] is None
    emb_r = G["word_emb"].chunk(tp, 0)[t]
    out_r = None if tied else G["output"].chunk(tp, 0)[t]
    ranks = [rank_layer(spec, G["layers"][g], layout, tp, t) for g in layers]

    if dialect == "flat2019":
        names = LEGACY_NAMES[dialect]
        sd = {}
        _put(sd, "word_embeddings.weight", emb_r, dt)
        _put(sd, "position_embeddings.weight", G["pos_emb"], dt)
        for i, R in enumerate(ranks):
            for k, v in _legacy_layer_entries(names, R, extra=False):
                _put(sd, f"transformer.layers.{i}.{k}", v, dt)
        _put(sd, f"transformer.{names['final']}.weight", G["final_w"], dt)
        _put(sd, f"transformer.{names['final']}.bias", G["final_b"], dt)
        return sd

    if dialect.startswith("legacy_"):
        names = LEGACY_NAMES[dialect]
        extra = dialect == "legacy_norm"  # 2023+ legacy models use megatron.core linears (get_extra_state)
        lm = {}
        if pre:
            emb = {"word_embeddings": {}}
            _put(emb["word_embeddings"], "weight", emb_r, dt)
            if G["pos_emb"] is not None:
                emb["position_embeddings"] = {}
                _put(emb["position_embeddings"], "weight", G["pos_emb"], dt)
            lm["embedding"] = emb
        enc = {}
        for i, R in enumerate(ranks):
            for k, v in _legacy_layer_entries(names, R, extra):
                _put(enc, f"layers.{i}.{k}", v, dt)
        if post:
            _put(enc, f"{names['final']}.weight", G["final_w"], dt)
            _put(enc, f"{names['final']}.bias", G["final_b"], dt)
        lm[names["enc"]] = enc
        if post and not tied:
            lm["output_layer"] = {}
            _put(lm["output_layer"], "weight", out_r, dt)
            if extra:
                lm["output_layer"]["_extra_state"] = None
        sd = {"language_model": lm}
        if post and tied and not pre:  # last stage of a PP>1 run keeps its own copy of the tied embedding
            sd["word_embeddings_for_head"] = {}
            _put(sd["word_embeddings_for_head"], "weight", emb_r, dt)
        return sd

    te = dialect == "mcore_te"
    sd = {}
    if pre:
        _put(sd, "embedding.word_embeddings.weight", emb_r, dt)
        _put(sd, "embedding.position_embeddings.weight", G["pos_emb"], dt)
    for i, R in enumerate(ranks):
        for k, v in _mcore_layer_entries(te, R):
            _put(sd, f"decoder.layers.{i}.{k}", v, dt)
    if post:
        _put(sd, "decoder.final_layernorm.weight", G["final_w"], dt)
        _put(sd, "decoder.final_layernorm.bias", G["final_b"], dt)
        if not tied:
            _put(sd, "output_layer.weight", out_r, dt)
        elif not pre:  # tied, PP>1: synchronized copy on the last stage
            _put(sd, "output_layer.weight", emb_r, dt)
        sd["output_layer._extra_state"] = None
    return sd


# --------------------------------------------------------------------------------------------------
# args / top-level dict per era
# --------------------------------------------------------------------------------------------------

def make_args(spec, model_type):
    d, tp, pp, vpp = spec["dialect"], spec["tp"], spec["pp"], spec["vpp"]
    llama = spec["style"] == "llama"
    dt = _torch_dtype(spec["dtype"])
    a = dict(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], num_attention_heads=spec["num_heads"],
        max_position_embeddings=spec["max_position_embeddings"], seq_length=spec["max_position_embeddings"],
    )
    if d in ("legacy_v0", "legacy_v1", "legacy_v2"):
        a["model_parallel_size"] = tp
    else:
        a.update(ffn_hidden_size=spec["ffn_hidden_size"], kv_channels=spec["head_dim"],
                 tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                 virtual_pipeline_model_parallel_size=vpp,
                 num_layers_per_virtual_pipeline_stage=(spec["num_layers"] // pp // vpp) if vpp else None)
    a.update(
        padded_vocab_size=padded_vocab(spec["vocab_size"], tp), vocab_size=spec["vocab_size"],
        make_vocab_size_divisible_by=VOCAB_DIVISOR, tokenizer_type="NullTokenizer", vocab_file=None,
        # Megatron-LM's NullTokenizer has exactly vocab_size tokens only from c9dfe34 (2026-04-22) on, and the args of
        # such runs hold the two fields that commit added (older runs' NullTokenizer had vocab_size + 1): vocab_size
        # here is the true vocabulary, so the args say the current era in every dialect
        null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1,
        merge_file=None, layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1,
        apply_residual_connection_post_layernorm=False, openai_gelu=False, onnx_safe=None, bias_gelu_fusion=False,
        init_method_std=0.02, seed=1234, fp16=dt == torch.float16, params_dtype=dt, iteration=0,
        train_iters=ITERATION, lr=1e-4, min_lr=1e-5, lr_decay_style="constant", weight_decay=0.01,
    )
    if d in ("legacy_v0", "legacy_v1", "legacy_v2"):
        a["batch_size"] = 2
    else:
        a.update(micro_batch_size=2, global_batch_size=2, data_parallel_size=1, world_size=tp * pp,
                 bf16=dt == torch.bfloat16)
    if d in ("legacy_norm", "mcore", "mcore_te"):
        a.update(
            group_query_attention=llama, num_query_groups=spec["num_query_groups"],
            position_embedding_type="rope" if llama else "learned_absolute", add_position_embedding=not llama,
            use_rotary_position_embeddings=llama, rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
            swiglu=llama, squared_relu=False, normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=1e-5,
            untie_embeddings_and_output_weights=llama, add_bias_linear=not llama, add_qkv_bias=not llama,
            transformer_impl="transformer_engine" if d == "mcore_te" else "local",
            use_legacy_models=d == "legacy_norm", ckpt_format="torch", use_dist_ckpt=False,
            expert_model_parallel_size=1, num_experts=None, decoder_first_pipeline_num_layers=None,
            decoder_last_pipeline_num_layers=None, pipeline_model_parallel_layout=None,
            consumed_train_samples=2 * ITERATION, consumed_valid_samples=0,
        )
    a["model_type"] = model_type.encoder_or_decoder
    return argparse.Namespace(**a)


def _rng_entries(seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        "random_rng_state": random.Random(seed).getstate(),
        "np_rng_state": np.random.RandomState(seed).get_state(),
        "torch_rng_state": gen.get_state(),
        "cuda_rng_state": torch.arange(16, dtype=torch.uint8) + (seed % 200),
        "rng_tracker_states": {"model-parallel-rng": torch.arange(16, dtype=torch.uint8) + (seed % 100) + 1},
    }


def _n_tensors(obj):
    if isinstance(obj, dict):
        return sum(_n_tensors(v) for v in obj.values())
    return int(isinstance(obj, torch.Tensor) and obj.is_floating_point())


def top_level(spec, models, model_type, t, p):
    d = spec["dialect"]
    n = sum(_n_tensors(m) for m in models)
    adam_groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "params": list(range(n))}]
    optimizer = {"state": {}, "param_groups": adam_groups}
    rng = _rng_entries(1000 + 10 * p + t)
    if d == "flat2019":
        sd = {"iteration": ITERATION, "model": models[0], "optimizer": optimizer,
              "lr_scheduler": {"start_lr": 1e-4, "warmup_iter": 0, "num_iters": ITERATION, "decay_style": "cosine",
                               "end_iter": 100}}
        sd.update(rng)
        return sd
    sd = {"args": make_args(spec, model_type)}
    if CHECKPOINT_VERSION[d] is not None:
        sd["checkpoint_version"] = CHECKPOINT_VERSION[d]
    sd["iteration"] = ITERATION
    if len(models) == 1:
        sd["model"] = models[0]
    else:
        for i, m in enumerate(models):
            sd[f"model{i}"] = m
    if d in ("legacy_v0", "legacy_v1", "legacy_v2", "legacy_v3"):
        sd["optimizer"] = optimizer
        sd["lr_scheduler"] = {"max_lr": 1e-4, "warmup_steps": 0, "num_steps": ITERATION * 2,
                              "decay_style": "constant", "decay_steps": 200, "min_lr": 1e-5}
        sd.update(rng)
    else:
        if spec["dtype"] == "float32":
            sd["optimizer"] = optimizer
        else:
            sd["optimizer"] = {"optimizer": optimizer, "fp32_from_fp16_params": []}
        sd["opt_param_scheduler"] = {"max_lr": 1e-4, "lr_warmup_steps": 0, "num_steps": ITERATION * 2,
                                     "lr_decay_style": "constant", "lr_decay_steps": 200, "min_lr": 1e-5,
                                     "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant",
                                     "wd_incr_steps": 200}
        sd["rng_state"] = [rng]
        sd["num_floating_point_operations_so_far"] = 123456789.0
    return sd


def stage_chunks(L, pp, vpp, p):
    """Global layer indices of each model chunk on PP stage ``p`` (documented VPP offsets)."""
    nchunks = vpp or 1
    per = L // pp // nchunks
    assert per * pp * nchunks == L
    return [list(range(v * (L // nchunks) + p * per, v * (L // nchunks) + p * per + per)) for v in range(nchunks)]


def rank_dir(t, p, pp):
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def write_checkpoint(spec, G, ckdir):
    tp, pp, vpp = spec["tp"], spec["pp"], spec["vpp"]
    if spec["dialect"] in ("flat2019", "legacy_v0", "legacy_v1", "legacy_v2"):
        assert pp == 1 and not vpp, f"{spec['dialect']} predates pipeline parallelism"
    if spec["style"] == "llama":
        assert spec["dialect"] in LLAMA_DIALECTS
    ckdir.mkdir(parents=True)
    (ckdir / TRACKER).write_text(str(ITERATION))
    itdir = ckdir / f"iter_{ITERATION:07d}"
    files = []
    with fake_megatron() as model_type:
        for p in range(pp):
            chunks = stage_chunks(spec["num_layers"], pp, vpp, p)
            for t in range(tp):
                models = [model_chunk_state(spec, G, t, layers, pre=(p == 0 and v == 0),
                                            post=(p == pp - 1 and v == len(chunks) - 1))
                          for v, layers in enumerate(chunks)]
                sd = top_level(spec, models, model_type, t, p)
                path = itdir / rank_dir(t, p, pp) / CKPT_FILE
                path.parent.mkdir(parents=True)
                torch.save(sd, path)
                files.append(path.relative_to(ckdir.parent).as_posix())
    return files


# --------------------------------------------------------------------------------------------------
# build_fixture
# --------------------------------------------------------------------------------------------------

def _notes(spec):
    d, tp = spec["dialect"], spec["tp"]
    notes = []
    if d == "flat2019":
        notes.append("2019 flat keys; no args, no checkpoint_version; GeLU is the tanh approximation "
                     "(ground truth activation gelu_new); rng keys at top level; tied embeddings only.")
    if d in ("legacy_v0", "legacy_v1", "legacy_v2"):
        notes.append("2020-era args: model_parallel_size (no tensor/pipeline_model_parallel_size), no ffn_hidden_size/"
                     "kv_channels (4h and h/np implied). vocab_size + NullTokenizer are anachronistic but included so "
                     "that the true vocab is recoverable from args.")
    if d == "legacy_v0":
        notes.append("no checkpoint_version key -> version 0.")
    if d in ("legacy_v0", "legacy_v1", "legacy_v2", "legacy_v3"):
        notes.append("top level uses lr_scheduler and the five flat rng keys (pre-2022 layout).")
    if d in ("legacy_norm", "mcore", "mcore_te"):
        notes.append("top level: opt_param_scheduler, rng_state=[dict], num_floating_point_operations_so_far.")
    if d == "legacy_norm":
        notes.append("legacy linears are megatron.core ColumnParallel/RowParallelLinear: *._extra_state=None for "
                     "query_key_value/dense/dense_h_to_4h/dense_4h_to_h and the untied output_layer (as in "
                     "shared/real-checkpoints/mlm_legacy_gpt2_torch_tp2pp2).")
    if d == "mcore":
        notes.append("local spec: *._extra_state=None for linear_qkv/linear_proj/linear_fc1/linear_fc2 and "
                     "output_layer (output_layer._extra_state present on every last-stage chunk, also when tied "
                     "at PP=1 where output_layer.weight itself is absent). No core_attention._extra_state.")
    if d == "mcore_te":
        notes.append("TE spec: norms fused as linear_qkv.layer_norm_* and linear_fc1.layer_norm_*; _extra_state = "
                     "empty torch.uint8 tensor for core_attention/linear_qkv/linear_proj/linear_fc1/linear_fc2; "
                     "output_layer._extra_state=None (plain ColumnParallelLinear).")
    if spec["style"] == "llama":
        notes.append("Llama: GQA, SwiGLU fc1 per rank [gate_r; up_r], RMSNorm (weight only), rope (rotary_base 10000, "
                     "non-interleaved), no biases, untied output layer (own padded rows).")
        if tp > spec["num_query_groups"]:
            notes.append(f"TP {tp} > num_query_groups {spec['num_query_groups']}: the global grouped QKV is sliced "
                         "into tp contiguous row blocks (a rank may hold part of a group), as mcore does since "
                         "2025-12. Legacy Megatron never supported this; the legacy_norm variant uses the same rule.")
    if spec["style"] == "gpt2" and spec["dialect"] != "flat2019":
        notes.append("GeLU exact (erf): args.openai_gelu=False, bias_gelu_fusion=False.")
    if spec["pp"] > 1 and spec["style"] == "gpt2" and d != "flat2019":
        notes.append("tied embeddings with PP>1: last stage holds a copy (legacy: word_embeddings_for_head.weight; "
                     "mcore: output_layer.weight), identical to the first stage's padded word embeddings.")
    if spec["dtype"] != "float32":
        notes.append(f"stored as {spec['dtype']}; the ground truth weights were rounded to {spec['dtype']} first, "
                     "so upcasting the stored tensors reproduces hf/ exactly (hf/ is saved in float32).")
    if d != "flat2019":
        notes.append("NullTokenizer args of Megatron-LM c9dfe34 (2026-04-22) or later (null_tokenizer_eod_id, "
                     "null_tokenizer_pad_id): vocab_size is the true vocab (older NullTokenizers had one more token).")
    notes.append("padded vocab rows are seeded random values (0.02*randn), not zeros; expected logits cover only "
                 "the true vocab.")
    return notes


def case_info(spec, files):
    tp, pp, vpp, L = spec["tp"], spec["pp"], spec["vpp"], spec["num_layers"]
    chunks = {f"pp{p}": stage_chunks(L, pp, vpp, p) for p in range(pp)}
    return {
        "style": spec["style"], "dialect": spec["dialect"], "tp": tp, "pp": pp, "vpp": vpp,
        "dtype": spec["dtype"], "vocab_size": spec["vocab_size"], "padded_vocab_size": padded_vocab(spec["vocab_size"], tp),
        "make_vocab_size_divisible_by": VOCAB_DIVISOR,
        "num_layers": L, "hidden_size": spec["hidden_size"], "ffn_hidden_size": spec["ffn_hidden_size"],
        "num_attention_heads": spec["num_heads"], "num_query_groups": spec["num_query_groups"],
        "head_dim": spec["head_dim"], "max_position_embeddings": spec["max_position_embeddings"],
        "activation": spec["activation"], "normalization": "RMSNorm" if spec["style"] == "llama" else "LayerNorm",
        "position_embedding_type": "rope" if spec["style"] == "llama" else "learned_absolute",
        "tied_embeddings": spec["style"] == "gpt2", "has_args": spec["dialect"] != "flat2019",
        "checkpoint_version": CHECKPOINT_VERSION[spec["dialect"]], "iteration": ITERATION,
        "qkv_layout": QKV_LAYOUT_DOC[QKV_LAYOUT[spec["dialect"]]],
        "global_layers_per_stage_chunk": chunks,
        "files": files, "notes": _notes(spec),
    }


def build_fixture(name, out_dir):
    """Write ``out_dir/name/{checkpoint/, hf/, expected.pt, case.json}``; returns ``out_dir/name``."""
    spec = FIXTURES[name]
    root = Path(out_dir) / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = make_hf_model(spec)
    model.save_pretrained(root / "hf", safe_serialization=True)
    torch.save(expected_outputs(model, spec), root / "expected.pt")
    G = megatron_full_tensors(model, spec, spec["tp"])
    files = write_checkpoint(spec, G, root / "checkpoint")
    (root / "case.json").write_text(json.dumps(case_info(spec, files), indent=1, sort_keys=True) + "\n")
    return root


# --------------------------------------------------------------------------------------------------
# Self-check: re-merge the written shards by hand and compare with the ground truth
# --------------------------------------------------------------------------------------------------

# reader-side key tables (written independently of the writer tables above): suffix -> role
_R_LAYER_2019 = {
    "input_layernorm.weight": "ln1_w", "input_layernorm.bias": "ln1_b",
    "attention.query_key_value.weight": "qkv_w", "attention.query_key_value.bias": "qkv_b",
    "attention.dense.weight": "proj_w", "attention.dense.bias": "proj_b",
    "post_attention_layernorm.weight": "ln2_w", "post_attention_layernorm.bias": "ln2_b",
    "mlp.dense_h_to_4h.weight": "fc1_w", "mlp.dense_h_to_4h.bias": "fc1_b",
    "mlp.dense_4h_to_h.weight": "fc2_w", "mlp.dense_4h_to_h.bias": "fc2_b",
}
_R_LAYER_2021 = {k.replace("attention.", "self_attention.", 1) if k.startswith("attention.") else k: v
                 for k, v in _R_LAYER_2019.items()}
_R_LAYER_2023 = {k.replace("input_layernorm", "input_norm").replace("post_attention_layernorm", "post_attention_norm"): v
                 for k, v in _R_LAYER_2021.items()}
_R_LAYER_2023.update({f"{m}._extra_state": "extra" for m in (
    "self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")})
_R_LAYER_MCORE = {
    "input_layernorm.weight": "ln1_w", "input_layernorm.bias": "ln1_b",
    "self_attention.linear_qkv.weight": "qkv_w", "self_attention.linear_qkv.bias": "qkv_b",
    "self_attention.linear_proj.weight": "proj_w", "self_attention.linear_proj.bias": "proj_b",
    "pre_mlp_layernorm.weight": "ln2_w", "pre_mlp_layernorm.bias": "ln2_b",
    "mlp.linear_fc1.weight": "fc1_w", "mlp.linear_fc1.bias": "fc1_b",
    "mlp.linear_fc2.weight": "fc2_w", "mlp.linear_fc2.bias": "fc2_b",
    "self_attention.linear_qkv._extra_state": "extra", "self_attention.linear_proj._extra_state": "extra",
    "mlp.linear_fc1._extra_state": "extra", "mlp.linear_fc2._extra_state": "extra",
}
_R_LAYER_TE = {
    "self_attention.linear_qkv.layer_norm_weight": "ln1_w", "self_attention.linear_qkv.layer_norm_bias": "ln1_b",
    "mlp.linear_fc1.layer_norm_weight": "ln2_w", "mlp.linear_fc1.layer_norm_bias": "ln2_b",
    "self_attention.core_attention._extra_state": "extra",
    **{k: v for k, v in _R_LAYER_MCORE.items() if "layernorm" not in k},
}


def _reader_tables(dialect):
    """(layer regex, layer suffix table, non-layer key -> role)."""
    if dialect == "flat2019":
        return (r"transformer\.layers\.(\d+)\.(.+)", _R_LAYER_2019,
                {"word_embeddings.weight": "emb", "position_embeddings.weight": "pos",
                 "transformer.final_layernorm.weight": "final_w", "transformer.final_layernorm.bias": "final_b"})
    if dialect in ("legacy_v0", "legacy_v1", "legacy_v2"):
        enc, table, fin = "transformer", _R_LAYER_2019, "final_layernorm"
    elif dialect == "legacy_v3":
        enc, table, fin = "encoder", _R_LAYER_2021, "final_layernorm"
    elif dialect == "legacy_norm":
        enc, table, fin = "encoder", _R_LAYER_2023, "final_norm"
    else:
        table = _R_LAYER_TE if dialect == "mcore_te" else _R_LAYER_MCORE
        return (r"decoder\.layers\.(\d+)\.(.+)", table,
                {"embedding.word_embeddings.weight": "emb", "embedding.position_embeddings.weight": "pos",
                 "decoder.final_layernorm.weight": "final_w", "decoder.final_layernorm.bias": "final_b",
                 "output_layer.weight": "out", "output_layer._extra_state": "extra"})
    lm = "language_model."
    return (re.escape(lm + enc) + r"\.layers\.(\d+)\.(.+)", table,
            {lm + "embedding.word_embeddings.weight": "emb", lm + "embedding.position_embeddings.weight": "pos",
             f"{lm}{enc}.{fin}.weight": "final_w", f"{lm}{enc}.{fin}.bias": "final_b",
             lm + "output_layer.weight": "out", lm + "output_layer._extra_state": "extra",
             "word_embeddings_for_head.weight": "head"})


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


_EXPECTED_TOP = {
    "flat2019": {"iteration", "model", "optimizer", "lr_scheduler", "random_rng_state", "np_rng_state",
                 "torch_rng_state", "cuda_rng_state", "rng_tracker_states"},
    "legacy_2020": {"args", "iteration", "model", "optimizer", "lr_scheduler", "random_rng_state", "np_rng_state",
                    "torch_rng_state", "cuda_rng_state", "rng_tracker_states"},
    "modern": {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler", "rng_state",
               "num_floating_point_operations_so_far"},
}


def _unshard_qkv(shards, layout, nq, ng, hd):
    """Per-rank fused QKV tensors -> (q, k, v) in HF row order."""
    tp = len(shards)
    rest = tuple(shards[0].shape[1:])
    if layout == "grouped":
        full = torch.cat(shards, 0).reshape(ng, nq // ng + 2, hd, *rest)
        q = full[:, : nq // ng].reshape(nq * hd, *rest)
        return q, full[:, nq // ng].reshape(ng * hd, *rest), full[:, nq // ng + 1].reshape(ng * hd, *rest)
    npl = nq // tp
    if layout in ("v0", "stride3"):
        per = [s.reshape(3, npl, hd, *rest) for s in shards]
    elif layout == "v1":
        per = [s.reshape(npl, hd, 3, *rest).movedim(2, 0) for s in shards]
    else:
        raise ValueError(layout)
    full = torch.cat(per, 1)  # [3, np, hd, ...]
    q, k, v = (full[i].reshape(nq * hd, *rest) for i in range(3))
    if layout == "stride3":  # independent check: merge_partitions-style stride re-interleave
        pieces = [None] * (3 * tp)
        for i, s in enumerate(shards):
            for j, piece in enumerate(s.chunk(3, 0)):
                pieces[j * tp + i] = piece
        assert torch.equal(torch.cat(pieces, 0), torch.cat([q, k, v], 0)), "stride-3 merge mismatch"
    return q, k, v


def load_checkpoint_file(path):
    with fake_megatron():
        return torch.load(path, map_location="cpu", weights_only=False)


def merge_checkpoint(ck, case, load=None, strict=True):
    """Hand-merge the Megatron checkpoint directory ``ck`` described by ``case`` into HF tensors.

    Undoes every documented layout (TP splits, fused QKV per version, SwiGLU [gate_r; up_r], PP stage /
    VPP chunk offsets, vocab padding).  ``strict`` adds checks that only hold for generated fixtures
    (args contents, no saved views, one Megatron enum in args).
    """
    load = load or load_checkpoint_file
    d, tp, pp, vpp = case["dialect"], case["tp"], case["pp"], case["vpp"]
    L, h, V, Vp = case["num_layers"], case["hidden_size"], case["vocab_size"], case["padded_vocab_size"]
    nq, ng, hd = case["num_attention_heads"], case["num_query_groups"], case["head_dim"]
    assert Vp == padded_vocab(V, tp) and Vp > V
    ck = Path(ck)
    it = int((ck / TRACKER).read_text())
    itdir = ck / f"iter_{it:07d}"
    want_dirs = {(f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}") for t in range(tp) for p in range(pp)}
    assert {x.name for x in itdir.iterdir()} == want_dirs, sorted(x.name for x in itdir.iterdir())

    layer_re, layer_table, top_table = _reader_tables(d)
    layer_re = re.compile(layer_re)
    nchunks = vpp or 1
    per_chunk = L // pp // nchunks
    # shards[role][global layer or None][tp] = tensor
    shards = {}
    stored_dtype = None
    for p in range(pp):
        for t in range(tp):
            sd = load(itdir / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}") / CKPT_FILE)
            model_keys = [f"model{v}" for v in range(nchunks)] if vpp else ["model"]
            era = "flat2019" if d == "flat2019" else ("modern" if d in ("legacy_norm", "mcore", "mcore_te")
                                                       else "legacy_2020")
            want_top = (_EXPECTED_TOP[era] - {"model"}) | set(model_keys)
            if d in ("legacy_v1", "legacy_v2", "legacy_v3"):
                want_top |= {"checkpoint_version"}
            assert set(sd) == want_top, (sorted(sd), sorted(want_top))
            assert sd["iteration"] == it
            if d != "flat2019":
                a = sd["args"]
                assert isinstance(a, argparse.Namespace)
                if strict:
                    assert type(a.model_type).__module__ == "megatron.core.enums"
                    assert a.vocab_size == V
                assert a.padded_vocab_size == Vp and a.num_layers == L
                if d in ("legacy_v0", "legacy_v1", "legacy_v2"):
                    assert a.model_parallel_size == tp and not hasattr(a, "tensor_model_parallel_size")
                else:
                    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (tp, pp)
                    assert a.virtual_pipeline_model_parallel_size == vpp
                assert sd.get("checkpoint_version") == case["checkpoint_version"]
            for v, mk in enumerate(model_keys):
                offset = v * (L // nchunks) + p * per_chunk
                pre, post = (p == 0 and v == 0), (p == pp - 1 and v == nchunks - 1)
                flat = _flatten(sd[mk]) if d.startswith("legacy_") else sd[mk]
                seen_layers = set()
                for key, val in flat.items():
                    m = layer_re.fullmatch(key)
                    if m:
                        local, role = int(m.group(1)), layer_table.get(m.group(2))
                        assert role is not None, f"unexpected layer key {key}"
                        assert 0 <= local < per_chunk, key
                        seen_layers.add(local)
                        g = offset + local
                    else:
                        role = top_table.get(key)
                        assert role is not None, f"unexpected key {key}"
                        g = None
                    if role == "extra":
                        if d == "mcore_te" and key != "output_layer._extra_state":
                            assert isinstance(val, torch.Tensor) and val.dtype == torch.uint8 and val.numel() == 0
                        else:
                            assert val is None, key
                        continue
                    assert isinstance(val, torch.Tensor), key
                    stored_dtype = stored_dtype or val.dtype
                    assert val.dtype == stored_dtype
                    if strict:
                        assert val.untyped_storage().nbytes() == val.numel() * val.element_size(), f"view: {key}"
                    if role in ("emb", "pos"):
                        assert pre, key
                    if role in ("final_w", "final_b", "out", "head"):
                        assert post, key
                    slot = shards.setdefault(role, {}).setdefault(g, {})
                    assert t not in slot, f"duplicate {role} layer {g}"
                    slot[t] = val.float()
                assert seen_layers == set(range(per_chunk)), (key, seen_layers)
                if d in ("mcore", "mcore_te"):
                    assert ("output_layer._extra_state" in flat) == post
                    n_want, pre_fmt = (5 if d == "mcore_te" else 4), "decoder.layers.{}."
                elif d == "legacy_norm":
                    assert ("language_model.output_layer._extra_state" in flat) == (post and not case["tied_embeddings"])
                    n_want, pre_fmt = 4, "language_model.encoder.layers.{}."
                else:
                    n_want, pre_fmt = 0, None
                for i in range(per_chunk if pre_fmt else 0):
                    n_extra = sum(1 for k in flat if k.startswith(pre_fmt.format(i)) and k.endswith("._extra_state"))
                    assert n_extra == n_want, (i, n_extra)
                if n_want == 0:
                    assert not any("_extra_state" in k for k in flat)
    assert stored_dtype == _torch_dtype(case["dtype"])

    def full_list(role, g=None):
        slot = shards[role][g]
        assert sorted(slot) == list(range(tp)), (role, g, sorted(slot))
        return [slot[t] for t in range(tp)]

    def replicated(role, g=None):
        if role not in shards or g not in shards[role]:
            return None
        xs = full_list(role, g)
        for x in xs[1:]:
            assert torch.equal(x, xs[0]), f"{role} not replicated across TP"
        return xs[0]

    emb = torch.cat(full_list("emb"), 0)
    assert emb.shape == (Vp, h)
    if case["tied_embeddings"]:
        assert "out" not in shards or "head" not in shards
        copy = "head" if "head" in shards else ("out" if "out" in shards else None)
        if pp > 1:
            assert copy is not None, "tied PP>1 checkpoint lacks the last-stage embedding copy"
            assert torch.equal(torch.cat(full_list(copy), 0), emb), "tied copy differs from the embedding"
        else:
            assert copy is None
        out = None
    else:
        out = torch.cat(full_list("out"), 0)
        assert out.shape == (Vp, h)
    layout = QKV_LAYOUT[d]

    hf = {}
    gpt2 = case["style"] == "gpt2"
    if gpt2:
        hf["transformer.wte.weight"] = emb[:V]
        hf["transformer.wpe.weight"] = replicated("pos")
        hf["transformer.ln_f.weight"], hf["transformer.ln_f.bias"] = replicated("final_w"), replicated("final_b")
    else:
        assert "pos" not in shards and "final_b" not in shards
        hf["model.embed_tokens.weight"] = emb[:V]
        hf["lm_head.weight"] = out[:V]
        hf["model.norm.weight"] = replicated("final_w")
    for g in range(L):
        q, k, v = _unshard_qkv(full_list("qkv_w", g), layout, nq, ng, hd)
        proj = torch.cat(full_list("proj_w", g), 1)
        fc2 = torch.cat(full_list("fc2_w", g), 1)
        if gpt2:
            p = f"transformer.h.{g}."
            qb, kb, vb = _unshard_qkv(full_list("qkv_b", g), layout, nq, ng, hd)
            hf[p + "ln_1.weight"], hf[p + "ln_1.bias"] = replicated("ln1_w", g), replicated("ln1_b", g)
            hf[p + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t()
            hf[p + "attn.c_attn.bias"] = torch.cat([qb, kb, vb], 0)
            hf[p + "attn.c_proj.weight"], hf[p + "attn.c_proj.bias"] = proj.t(), replicated("proj_b", g)
            hf[p + "ln_2.weight"], hf[p + "ln_2.bias"] = replicated("ln2_w", g), replicated("ln2_b", g)
            hf[p + "mlp.c_fc.weight"] = torch.cat(full_list("fc1_w", g), 0).t()
            hf[p + "mlp.c_fc.bias"] = torch.cat(full_list("fc1_b", g), 0)
            hf[p + "mlp.c_proj.weight"], hf[p + "mlp.c_proj.bias"] = fc2.t(), replicated("fc2_b", g)
        else:
            for role in ("qkv_b", "proj_b", "fc1_b", "fc2_b", "ln1_b", "ln2_b"):
                assert g not in shards.get(role, {}), f"unexpected {role} in llama layer {g}"
            p = f"model.layers.{g}."
            hf[p + "input_layernorm.weight"] = replicated("ln1_w", g)
            hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"] = q, k
            hf[p + "self_attn.v_proj.weight"], hf[p + "self_attn.o_proj.weight"] = v, proj
            hf[p + "post_attention_layernorm.weight"] = replicated("ln2_w", g)
            gates, ups = zip(*(x.chunk(2, 0) for x in full_list("fc1_w", g)))
            hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = torch.cat(gates, 0), torch.cat(ups, 0)
            hf[p + "mlp.down_proj.weight"] = fc2
    if gpt2:
        hf["lm_head.weight"] = hf["transformer.wte.weight"]
    return hf


def self_check(name, out_dir):
    """Re-merge ``out_dir/name/checkpoint`` by hand and compare with hf/ weights and expected.pt logits."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(out_dir) / name
    case = json.loads((root / "case.json").read_text())
    V = case["vocab_size"]
    hf = merge_checkpoint(root / "checkpoint", case)
    truth = load_file(str(root / "hf" / "model.safetensors"))
    assert set(truth) <= set(hf), sorted(set(truth) - set(hf))
    for k, x in truth.items():
        assert hf[k].shape == x.shape and torch.equal(hf[k], x.float()), f"weight mismatch: {k}"

    config = AutoConfig.from_pretrained(root / "hf")
    config._attn_implementation = "eager"
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    missing, unexpected = model.load_state_dict({k: x.contiguous() for k, x in hf.items()}, strict=False)
    assert not unexpected and not [m for m in missing if not m.endswith("lm_head.weight")], (missing, unexpected)
    model.eval()
    exp = torch.load(root / "expected.pt", map_location="cpu", weights_only=True)
    assert exp["tokens"].shape == (2, N_TOKENS) and exp["tokens"].dtype == torch.int64
    assert exp["logits"].shape == (2, N_TOKENS, V) and exp["logits"].dtype == torch.float32
    with torch.no_grad():
        logits = model(input_ids=exp["tokens"]).logits.float()
    err = (logits - exp["logits"]).abs().max().item()
    assert err < 1e-5, f"logits differ by {err}"
    return {"name": name, "max_abs_logit_err": err, "files": len(case["files"])}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def _describe(name):
    s = FIXTURES[name]
    return (f"{name:34s} {s['style']:5s} {s['dialect']:11s} tp={s['tp']} pp={s['pp']} vpp={s['vpp'] or '-'} "
            f"L={s['num_layers']} h={s['hidden_size']} heads={s['num_heads']}/{s['num_query_groups']} "
            f"V={s['vocab_size']}->{padded_vocab(s['vocab_size'], s['tp'])} {s['dtype']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="output directory (one sub-directory per fixture)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="build only these fixtures")
    ap.add_argument("--list", action="store_true", help="list fixture names and parameters")
    ap.add_argument("--check", action="store_true", help="run the self-check after building")
    ap.add_argument("--no-build", action="store_true", help="with --check: check existing fixtures only")
    args = ap.parse_args(argv)
    names = args.only or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        ap.error(f"unknown fixture(s): {', '.join(unknown)}")
    if args.list:
        for n in names:
            print(_describe(n))
        return 0
    if args.out is None:
        ap.error("--out is required")
    for n in names:
        if not args.no_build:
            build_fixture(n, args.out)
        if args.check:
            r = self_check(n, args.out)
            print(f"ok  {n}  ({r['files']} files, max |dlogit| {r['max_abs_logit_err']:.2e})")
        else:
            print(f"built {args.out / n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
