"""The model-family spec (ckptool/spec/) and the name tables built from it (state.expected_names, roles.py,
megatron_names dialects, dist.py and deepspeed/pipeline.py key maps): names in streaming order, each canonical
tensor in one role, every key read back as the role it was written for, the fixtures' names. (While the
tables moved onto the spec they were checked equal, order included, to the literal tables they replaced.)"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckptool import roles, state
from ckptool.config import MLA, GPTConfig, MoE
from ckptool.formats.dcp import torch_dist as dist
from ckptool.formats.deepspeed import pipeline as mds_pipeline
from ckptool.formats.megatron import names as megatron_names
from ckptool.spec import GPT
from ckptool.spec.schema import Role, Spec, Tensor


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


def _cfg(**kw):
    return GPTConfig(**{**dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
                               padded_vocab_size=10, max_position_embeddings=8), **kw})


@pytest.mark.parametrize("cfg, names", [
    (_cfg(), ["embed.word", "embed.pos", "layers.0.attn_norm.weight", "layers.0.attn_norm.bias",
              "layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.attn.v.weight", "layers.0.attn.q.bias",
              "layers.0.attn.k.bias", "layers.0.attn.v.bias", "layers.0.attn.out.weight", "layers.0.attn.out.bias",
              "layers.0.mlp_norm.weight", "layers.0.mlp_norm.bias", "layers.0.mlp.up.weight",
              "layers.0.mlp.down.weight", "layers.0.mlp.up.bias", "layers.0.mlp.down.bias", "final_norm.weight",
              "final_norm.bias"]),  # GPT-2
    (_cfg(activation="swiglu", normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
          add_qkv_bias=True, qk_layernorm=True, tied_embeddings=False),  # Qwen-like: q/k/v biases, q/k norms
     ["embed.word", "layers.0.attn_norm.weight", "layers.0.attn.q.weight", "layers.0.attn.k.weight",
      "layers.0.attn.v.weight", "layers.0.attn.q.bias", "layers.0.attn.k.bias", "layers.0.attn.v.bias",
      "layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight", "layers.0.attn.out.weight",
      "layers.0.mlp_norm.weight", "layers.0.mlp.gate.weight", "layers.0.mlp.up.weight", "layers.0.mlp.down.weight",
      "final_norm.weight", "output.weight"]),
    (_cfg(num_layers=2, activation="swiglu", normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
          add_qkv_bias=False, mla=MLA(q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                                      v_head_dim=2),
          moe=MoE(num_experts=2, top_k=1, ffn_hidden_size=6, layers=(1,), shared_ffn_hidden_size=4,
                  expert_bias=True)),  # DeepSeek-V3-like: MLA, a dense first layer, then an MoE layer
     ["embed.word"]
     + [f"layers.{i}.{n}" for i in (0, 1) for n in ["attn_norm.weight", "attn.q_down.weight",
                                                    "attn.q_down_norm.weight", "attn.q_up.weight", "attn.kv_down.weight",
                                                    "attn.kv_down_norm.weight", "attn.kv_up.weight", "attn.out.weight",
                                                    "mlp_norm.weight"]
        + (["mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"] if i == 0 else
           ["mlp.router.weight", "mlp.router.expert_bias"]
           + [f"mlp.experts.{e}.{m}.weight" for e in (0, 1) for m in ("gate", "up", "down")]
           + ["mlp.shared.gate.weight", "mlp.shared.up.weight", "mlp.shared.down.weight"])]
     + ["final_norm.weight"]),
])
def test_expected_names_are_the_tensors_in_streaming_order(cfg, names):
    assert state.expected_names(cfg) == names


# --- what the spec guarantees ---------------------------------------------------------------------

def test_the_spec_and_its_views_need_no_torch():
    """The quick inspect path reads the spec and the Megatron dialect tables in a process without torch."""
    import subprocess
    import sys
    code = ("import sys, ckptool.spec, ckptool.state, ckptool.formats.megatron.names\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fused_roles_list_their_parts_in_fused_order():
    for role in GPT.roles.values():
        parts = [t.part for t in GPT.tensors_of(role.name)]
        if role.fused == "qkv":
            assert parts == ["q", "k", "v"], role.name
        elif role.fused == "halves":
            assert parts == ["gate", "up"], role.name
        else:
            assert parts in ([None], []), role.name  # [] only for a role no tensor names (none today)
        assert role.rule is not None or role.base != role.name, f"{role.name}: an unscoped role needs a rule"


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.mla is None][::4] + [c for c in CONFIGS if c.mla is not None])
def test_each_canonical_tensor_sits_in_exactly_one_role(cfg):
    """Expanding the spec and asking each role which canonical tensors it holds give the same names, once (MLA's
    direct q too, which has GQA's q name: a role of its own, and no QKV in an MLA model)."""
    held = {}
    expanded = []
    for name, t, layer, expert in GPT.expand(cfg):
        assert t.role is not None, f"{name}: every tensor has a Megatron role"
        role = t.role.format(expert=expert) if expert is not None else t.role
        held[(role, layer)] = roles.canonical_names(role, layer, cfg)
        expanded.append(name)
    flat = [n for names in held.values() for n in names]
    assert sorted(flat) == sorted(expanded) == sorted(set(expanded))


def test_every_role_key_round_trips_through_every_megatron_dialect():
    """A key a writer makes from a dialect's table is read back as the same role (layer-relative keys under
    the dialect's layer prefix, experts with their local index), and no two roles of one kind of model share a key
    (megatron-core's q_layernorm is GQA's q norm or MLA's q latent norm: the matcher is told which model it reads)."""
    for d in megatron_names.DIALECTS.values():
        m = megatron_names.KeyMatcher(d)
        for role, key in d.globals.items():
            assert m.match(key) == (role, None), (d.name, key)
        layer = d.layer_prefix.format(i=5)
        for table in (d.layer, d.moe_layer):
            for role, key in table.items():
                mm = megatron_names.KeyMatcher(d, mla=role.startswith("mla."))
                assert mm.match(layer + key) == (role, 5), (d.name, key)
        for role, key in d.mla_layer.items():  # an MLA layer's own names (TE: the input norm unfused)
            assert megatron_names.KeyMatcher(d, mla=True).match(layer + key) == (role, 5), (d.name, key)
        for table in d.experts:
            for base, key in table.items():
                assert m.match(layer + key.format(j=2)) == (f"experts.2.{base}", 5), (d.name, key)
        for base, key in d.stacked_experts.items():
            assert m.match(layer + key) == (f"experts.*.{base}", 5)
        by_key = {}
        for role, key in list(d.layer.items()) + list(d.moe_layer.items()):
            kind = (key, role.startswith("mla."))
            assert by_key.setdefault(kind, role) == role, f"{d.name}: {key} names {role} and {by_key[kind]}"


def test_every_role_key_round_trips_through_torch_dist_and_megatron_deepspeed_names():
    for role, key in {**dist.WRITE_NAMES, **dist.MOE_WRITE_NAMES}.items():
        assert dist.LAYER_KEYS[key] == role
    for role, key in dist.MOE_NORM_NAMES["transformer_engine"].items():
        assert dist.LAYER_KEYS[key] == role
    for base, key in dist.EXPERT_WRITE_NAMES.items():
        assert dist.EXPERT_KEYS[key] == base
    for impl, names in dist.MLA_WRITE_NAMES.items():  # an MLA model's keys, local or TE spec
        for role, key in names.items():
            assert dist.MLA_LAYER_KEYS[key] == role or role.startswith("q_norm."), (impl, key)  # GQA's, not MLA's
    assert dist.MLA_LAYER_KEYS["self_attention.q_layernorm.weight"] == "mla.q_down_norm.weight"
    assert dist.LAYER_KEYS["self_attention.q_layernorm.weight"] == "q_norm.weight"
    assert set(dist.GLOBAL_KEYS.values()) == set(roles.GLOBAL_ROLES)
    assert set(dist.WRITE_NAMES) == set(roles.LAYER_ROLES)
    for kind, table in (("embed", mds_pipeline.EMBED_KEYS), ("head", mds_pipeline.HEAD_KEYS),
                        ("final_norm", mds_pipeline.FINAL_NORM_KEYS), ("layer", mds_pipeline.LAYER_KEYS)):
        for key, role in table.items():
            assert mds_pipeline.role_of(kind, key) == role
            assert mds_pipeline.classify({7: [key]})[7] == kind
    assert set(mds_pipeline.EMBED_KEYS.values()) | set(mds_pipeline.HEAD_KEYS.values()) | \
        set(mds_pipeline.FINAL_NORM_KEYS.values()) == set(roles.GLOBAL_ROLES)


FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("path", ["gpt2_mcore_tp2pp2/checkpoint", "gpt2_mcore_tp2pp2/hf",
                                  "llama_legacy_norm_tp2pp1/checkpoint", "llama_legacy_norm_tp2pp1/hf",
                                  "real/mlm_legacy_gpt2_torch_tp2pp2/checkpoint",
                                  "real/mds_gpt2_pipe_tp2pp2_bf16_zero1/checkpoint"])
def test_each_fixture_holds_exactly_the_names_its_config_expands_to(path):
    import ckptool
    ckpt = ckptool.open(FIXTURES / path)
    assert sorted(ckpt.tensors) == sorted(state.expected_names(ckpt.config))


def test_a_role_shards_by_its_format_s_rule_where_the_spec_gives_one():
    """Transformer Engine's MLA down projections are whole on every TP rank (TELinear 'duplicated'); the local
    spec's are column-parallel; torch_dist, stored whole, follows TE's names and so its rules too."""
    from ckptool.spec.schema import DIST, MCORE, TE, TE_MLA
    down = GPT.roles["mla.kv_down.weight"]
    assert [down.rule_in(c) for c in (None, MCORE, TE, TE_MLA, DIST)] == ["column", "column", "replicated",
                                                                          "replicated", "replicated"]
    assert GPT.roles["mla.kv_up.weight"].rule_in(TE_MLA) == "column"
    assert megatron_names.DIALECTS["mcore-te"].rule_column == TE_MLA and megatron_names.DIALECTS["mcore"].rule_column is None


@pytest.mark.parametrize("tensors, roles_, says", [
    ((Tensor("a", role="r"), Tensor("a", role="r")), (Role("r", "replicated"),), "listed twice"),
    ((Tensor("a", ("mla",), role="r"), Tensor("a", ("moe",), role="r")), (Role("r", "replicated"),), "listed twice"),
    ((), (Role("r", "replicated", rules={"megatron-9": "column"}),), "rule for an unknown name column"),
    ((Tensor("a", role="nope"),), (), "roles the spec lacks"),
    ((Tensor("a", ("no_such_predicate",)),), (), "unknown predicate"),
    ((), (Role("r", "replicated", {"megatron-9": "x"}),), "unknown name column"),
])
def test_a_spec_with_a_mistake_fails_when_it_is_built(tensors, roles_, says):
    with pytest.raises(ValueError, match=says):
        Spec(tensors, roles_)
