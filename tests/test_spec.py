"""The model-family spec (ckptool/spec/) and the name tables built from it.

While the format modules' tables move onto the spec, they are checked against the tables as the code
had them before (tests/spec_tables_before.json, written once from that code) and expected_names against
the code it replaced (_names_before)."""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from ckptool import roles, state
from ckptool.config import MLA, GPTConfig, MoE
from ckptool.formats import dist, mds_pipeline, megatron_names
from ckptool.spec import GPT


def _items(d):
    return [[k, v] for k, v in d.items()]


def _tables_now():
    dialects = {}
    for name, d in megatron_names.DIALECTS.items():
        row = {}
        for f in dataclasses.fields(d):
            v = getattr(d, f.name)
            if isinstance(v, dict):
                v = _items(v)
            elif isinstance(v, tuple):
                v = [_items(x) if isinstance(x, dict) else x for x in v]
            row[f.name] = v
        dialects[name] = row
    return {
        "dialects": dialects,
        "dist": {**{k: _items(getattr(dist, k)) for k in ("GLOBAL_KEYS", "WRITE_NAMES", "LAYER_KEYS",
                                                           "MOE_WRITE_NAMES", "EXPERT_WRITE_NAMES", "EXPERT_KEYS")},
                 "MOE_NORM_NAMES": {k: _items(v) for k, v in dist.MOE_NORM_NAMES.items()}},
        "mds": {k: _items(getattr(mds_pipeline, k)) for k in ("EMBED_KEYS", "HEAD_KEYS", "FINAL_NORM_KEYS",
                                                               "LAYER_KEYS")},
        "roles": {"ROLE_RULES": [[k, v.value] for k, v in roles.ROLE_RULES.items()],
                  "GLOBAL_ROLES": _items(roles.GLOBAL_ROLES), "LAYER_SIMPLE": _items(roles.LAYER_SIMPLE),
                  "LAYER_ROLES": list(roles.LAYER_ROLES), "MOE_ROUTER_ROLES": list(roles.MOE_ROUTER_ROLES),
                  "MOE_EXPERT_ROLES": list(roles.MOE_EXPERT_ROLES),
                  "MOE_SHARED_ROLES": list(roles.MOE_SHARED_ROLES)},
    }


@pytest.mark.parametrize("part", ["dialects", "dist", "mds", "roles"])
def test_name_tables_equal_the_tables_before_the_spec(part):
    before = json.loads((Path(__file__).parent / "spec_tables_before.json").read_text())[part]
    now = _tables_now()[part]
    if part == "roles":  # ROLE_RULES is looked up, never iterated: its order is free
        before["ROLE_RULES"], now["ROLE_RULES"] = sorted(before["ROLE_RULES"]), sorted(now["ROLE_RULES"])
    assert now == before


def _configs():
    for act, norm, pos, bias, qkvb, qkn, tied in itertools.product(
            ("gelu", "swiglu"), ("layernorm", "rmsnorm"), ("learned", "rope"), *[(True, False)] * 4):
        yield dict(activation=act, normalization=norm, position_embedding=pos, add_bias_linear=bias,
                   add_qkv_bias=qkvb, qk_layernorm=qkn, tied_embeddings=tied)
    moe = dict(activation="swiglu", normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
               add_qkv_bias=False)
    for shared, gate, rb, eb, layers in itertools.product((0, 5), *[(False, True)] * 3, ((1,), (0, 1))):
        if gate and not shared:
            continue
        yield dict(moe, moe=MoE(num_experts=3, top_k=2, ffn_hidden_size=6, layers=layers, shared_ffn_hidden_size=shared,
                                shared_gate=gate, router_bias=rb, expert_bias=eb))
    for q in (None, 0, 4):
        yield dict(moe, qk_layernorm=True, mla=MLA(q_lora_rank=q, kv_lora_rank=4, qk_nope_head_dim=2,
                                                   qk_rope_head_dim=2, v_head_dim=2),
                   moe=MoE(num_experts=2, top_k=1, ffn_hidden_size=6, layers=(1,)))


CONFIGS = [GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, padded_vocab_size=10,
                     max_position_embeddings=8, **c) for c in _configs()]


def _names_before(cfg):
    """state.expected_names as code, before the spec."""
    def mlp(prefix, bias):
        parts = ["gate", "up", "down"] if cfg.gated else ["up", "down"]
        return [f"{prefix}{m}.weight" for m in parts] + ([f"{prefix}{m}.bias" for m in parts] if bias else [])

    norm = ["weight", "bias"] if cfg.norm_has_bias else ["weight"]
    names = ["embed.word"] + (["embed.pos"] if cfg.position_embedding == "learned" else [])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [f"{p}attn_norm.{x}" for x in norm]
        a = p + "attn."
        if cfg.mla is not None:
            q = ["q_down", "q_down_norm", "q_up"] if cfg.mla.q_lora_rank else ["q"]
            names += [f"{a}{x}.weight" for x in q + ["kv_down", "kv_down_norm", "kv_up", "out"]]
        else:
            names += [f"{a}{x}.weight" for x in "qkv"]
            names += [f"{a}{x}.bias" for x in "qkv"] if cfg.add_qkv_bias or cfg.add_bias_linear else []
            names += [f"{a}q_norm.{x}" for x in norm] + [f"{a}k_norm.{x}" for x in norm] if cfg.qk_layernorm else []
            names += [f"{a}out.weight"] + ([f"{a}out.bias"] if cfg.add_bias_linear else [])
        names += [f"{p}mlp_norm.{x}" for x in norm]
        if cfg.is_moe_layer(i):
            moe, m = cfg.moe, p + "mlp."
            names += [m + "router.weight"] + ([m + "router.bias"] if moe.router_bias else [])
            names += [m + "router.expert_bias"] if moe.expert_bias else []
            for e in range(moe.num_experts):
                names += mlp(f"{m}experts.{e}.", False)
            names += mlp(f"{m}shared.", False) if moe.shared_ffn_hidden_size else []
            names += [m + "shared_gate.weight"] if moe.shared_gate else []
        else:
            names += mlp(p + "mlp.", cfg.add_bias_linear)
    names += [f"final_norm.{x}" for x in norm]
    return names + ([] if cfg.tied_embeddings else ["output.weight"])


def test_expected_names_equal_the_code_before_the_spec():
    assert len(CONFIGS) == 155
    for cfg in CONFIGS:
        assert state.expected_names(cfg) == _names_before(cfg)
