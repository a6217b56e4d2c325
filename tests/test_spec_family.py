"""The family registry (spec.FAMILIES, spec_for) and the role traits of the spec: a toy second family,
defined here and registered for the test, gets its own expected names, role tables and Megatron dialects
from its spec alone, while the GPT views stay as they were; the traits, registration orders and layer
prefixes the optimizer and dialect code read are consistent with the roles they name."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from ckptool import roles, spec, state
from ckptool.config import GPTConfig
from ckptool.formats.megatron import names as megatron_names
from ckptool.lazy import Const
from ckptool.sharding import Rule
from ckptool.spec import GPT
from ckptool.spec.schema import HEAD_COPY, LEGACY, MCORE, TE, TE_MLA, TRAITS, Role, Spec, Tensor

# --- a toy family: an embedding, per layer a norm, a fused QKV and one column-parallel linear, no output layer
L = "layers.{layer}."
TOY = Spec(
    tensors=(
        Tensor("embed.word", role="word"),
        Tensor(L + "norm.weight", role="norm"),
        Tensor(L + "attn.q.weight", role="qkv", part="q"),
        Tensor(L + "attn.k.weight", role="qkv", part="k"),
        Tensor(L + "attn.v.weight", role="qkv", part="v"),
        Tensor(L + "mix.weight", ("linear_bias",), role="mix"),  # present only with linear biases on
    ),
    roles=(
        Role("word", "vocab", {MCORE: "tok.weight", LEGACY: "toy/tok"}, traits=("embedding_or_output",
                                                                             "tied_embedding", "first_stage")),
        Role(HEAD_COPY, "vocab", {MCORE: "head.weight"}, traits=("tied_embedding",)),
        Role("norm", "replicated", {MCORE: "n.w", LEGACY: "n_w"}),
        Role("qkv", "qkv", {MCORE: "a.qkv", LEGACY: "a_qkv"}, fused="qkv", traits=("linear",)),
        Role("mix", "column", {MCORE: "m.w", LEGACY: "m_w"}, traits=("linear",)),
    ),
    registration={MCORE: ("mix", "qkv", "norm"), LEGACY: ("norm", "qkv", "mix")},
    layer_prefix={MCORE: "blocks.{i}.", LEGACY: "toy/blocks.{i}."},
)


@dataclasses.dataclass
class ToyConfig(GPTConfig):
    family: ClassVar[str] = "toy"


def _toy(**kw) -> ToyConfig:
    return ToyConfig(**{**dict(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8,
                               padded_vocab_size=12, max_position_embeddings=8, position_embedding="rope"), **kw})


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(spec.FAMILIES, "toy", TOY)


def _gpt_views():
    return (list(megatron_names.DIALECTS.items()), roles.LAYER_ROLES, dict(roles.GLOBAL_ROLES),
            dict(roles.ROLE_RULES), state.expected_names(_gpt()))


def _gpt():
    return GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8, padded_vocab_size=12,
                     max_position_embeddings=8)


def test_a_config_picks_its_familys_spec(toy_family):
    assert spec.spec_for(_gpt()) is GPT
    assert spec.spec_for(_toy()) is TOY


def test_a_config_of_an_unregistered_family_is_refused():
    with pytest.raises(KeyError, match="no spec for model family 'toy'"):
        state.expected_names(_toy())


def test_a_second_family_gets_its_own_views_and_leaves_gpts_alone(toy_family):
    before = _gpt_views()
    cfg = _toy(add_bias_linear=False)
    assert state.expected_names(cfg) == ["embed.word"] + [f"layers.{i}.{n}" for i in (0, 1) for n in (
        "norm.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight")]
    assert "layers.1.mix.weight" in state.expected_names(_toy(add_bias_linear=True))

    t = roles.tables_for(cfg)
    assert t.layer_roles == ("norm", "qkv", "mix")
    assert t.global_roles == {"word": "embed.word"}
    assert t.layer_simple == {"norm": "norm.weight", "mix": "mix.weight"}
    assert roles.rule_for("mix", cfg) is Rule.COLUMN and roles.rule_for("qkv", cfg) is Rule.QKV
    assert roles.canonical_names("qkv", 1, cfg) == ["layers.1.attn.q.weight", "layers.1.attn.k.weight",
                                                   "layers.1.attn.v.weight"]
    assert roles.canonical_names(HEAD_COPY, None, cfg) == ["embed.word"]  # the tied embedding again

    d = megatron_names.dialects_for(cfg)
    assert d is megatron_names.dialects(TOY) and d is not megatron_names.DIALECTS
    mcore, legacy = d["mcore"], d["legacy"]
    assert (mcore.globals, mcore.layer, mcore.layer_prefix) == ({"word": "tok.weight"},
                                                              {"norm": "n.w", "qkv": "a.qkv", "mix": "m.w"},
                                                              "blocks.{i}.")
    assert (mcore.param_order, legacy.param_order) == (("mix", "qkv", "norm"), ("norm", "qkv", "mix"))
    assert (mcore.head_copy, legacy.head_copy) == ("head.weight", None)
    assert mcore.extra_state == ("m._extra_state", "a._extra_state")  # the linears, in registration order
    assert d["legacy-2020"].layer_prefix == "toy/blocks.{i}."
    m = megatron_names.KeyMatcher(mcore)
    assert m.match("blocks.3.a.qkv") == ("qkv", 3) and m.match("head.weight") == ("head_copy", None)
    assert m.match("decoder.layers.0.self_attention.linear_qkv.weight") is None  # GPT's keys are not the toy's

    assert _gpt_views() == before


def test_a_second_family_splits_and_assembles_by_its_own_rules(toy_family):
    """The code the writers and readers run (shard_role / assemble) takes the toy's roles from its spec."""
    cfg = _toy(add_bias_linear=True)
    g = torch.Generator().manual_seed(0)
    tensors = {n: Const(torch.randn(8 if ".attn." in n else 16, 8, generator=g))
               for n in state.expected_names(cfg)}
    shards = {}
    for role in roles.tables_for(cfg).layer_roles:
        whole = roles.layer_role_tensor(tensors, cfg, 1, role)
        shards[(role, 1)] = roles.shard_role(whole, role, cfg, 2, 1)
    assert [p.shape[0] for p in shards[("mix", 1)]] == [8, 8]  # column-parallel: rows split
    assert [p.shape[0] for p in shards[("norm", 1)]] == [16, 16]  # replicated
    back = roles.assemble(cfg, shards)
    assert sorted(back) == sorted(n for n in tensors if n.startswith("layers.1."))
    for name, t in back.items():
        assert torch.equal(t.load(), tensors[name].load()), name


# --- the traits and orders of the GPT spec ------------------------------------------------------

def test_every_trait_names_known_roles_and_the_tied_roles_shard_alike():
    for trait in TRAITS:
        assert set(GPT.with_trait(trait)) <= set(GPT.roles)
    tied = GPT.with_trait("tied_embedding")
    assert {GPT.roles[r].rule for r in tied} == {"vocab"}, "roles holding one tensor must share its TP rule"
    assert HEAD_COPY in tied and not GPT.tensors_of(HEAD_COPY)  # the copy has no canonical tensor of its own
    assert set(GPT.with_trait("first_stage")) | set(roles.LAST_STAGE_ROLES) == set(roles.GLOBAL_ROLES)
    assert roles.EMBEDDING_OR_OUTPUT_ROLES <= set(roles.GLOBAL_ROLES) | {HEAD_COPY}
    with pytest.raises(KeyError, match="unknown role trait"):
        GPT.with_trait("embeding")


@pytest.mark.parametrize("column", [LEGACY, MCORE, TE, TE_MLA])
def test_a_registration_order_lists_each_role_the_column_names_once(column):
    order = GPT.registration_order(column)
    named = set(GPT.keys("layer", column))
    assert len(order) == len(set(order)) and set(order) <= named
    if column == TE:  # Transformer Engine orders an MLA layer apart (TE_MLA): the two cover every role
        order = order + GPT.registration_order(TE_MLA)
    if column != TE_MLA:
        assert set(order) == named, sorted(named ^ set(order))


def test_the_moe_registration_order_lists_the_moe_layers_own_roles_once():
    own = [r.name for r in GPT.role_list("moe") + GPT.role_list("expert")]
    assert sorted(GPT.moe_registration) == sorted(own)
    assert roles.MOE_SHARED_ROLES[0] == "shared_gate.weight"  # SharedExpertMLP registers gate_weight first


@pytest.mark.parametrize("bad, says", [
    (dict(registration={MCORE: ("nope",)}), "registration order names role 'nope'"),
    (dict(moe_registration=("nope",)), "registration order names role 'nope'"),
    (dict(layer_prefix={"megatron-9": "x."}), "unknown name column"),
])
def test_a_spec_with_a_bad_order_or_prefix_fails_when_it_is_built(bad, says):
    with pytest.raises(ValueError, match=says):
        Spec((Tensor("a", role="r"),), (Role("r", "replicated"),), **bad)


def test_a_role_with_an_unknown_trait_fails_when_it_is_built():
    with pytest.raises(ValueError, match="unknown trait"):
        Spec((Tensor("a", role="r"),), (Role("r", "replicated", traits=("shiny",)),))


def test_match_inverts_expand():
    """Spec.match (the quick DeepSpeed reader's name -> role) finds the Tensor, layer and expert expand made
    the name from, for dense, MoE and MLA models (MLA's direct q and GQA's q share a name: by the config)."""
    from ckptool.config import MLA, MoE
    cfgs = [_gpt(), GPTConfig(**{**dataclasses.asdict(_gpt()), "activation": "swiglu", "num_layers": 3,
                                 "moe": MoE(num_experts=12, top_k=2, ffn_hidden_size=4, layers=(1, 2),
                                            shared_ffn_hidden_size=4, shared_gate=True)}),
            GPTConfig(**{**dataclasses.asdict(_gpt()), "mla": MLA(q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2,
                                                                  qk_rope_head_dim=2, v_head_dim=2)})]
    for cfg in cfgs:
        for name, t, layer, expert in GPT.expand(cfg):
            assert GPT.match(name, cfg) == (t, layer, expert), name
    q = GPT.match("layers.0.attn.q.weight", cfgs[0])[0]  # one name, two kinds of q: the config picks
    assert q.role == "qkv.weight" and GPT.match("layers.0.attn.q.weight", dataclasses.replace(
        cfgs[2], mla=dataclasses.replace(cfgs[2].mla, q_lora_rank=None)))[0].role == "mla.q.weight"
    for name in ("layers.x.attn.q.weight", "layers.1.attn.q.weight.extra", "embed", "layers.1.mlp.experts.up.weight"):
        assert GPT.match(name) is None, name


def test_a_per_column_tp_rule_follows_the_fallback_columns():
    """Role.rule_in: Transformer Engine's rule (MLA's down projections whole) holds in the TE MLA column, which
    falls back to TE; the local spec's column keeps the role's own rule."""
    role = GPT.roles["mla.kv_down.weight"]
    assert (role.rule_in(TE), role.rule_in(TE_MLA), role.rule_in(MCORE), role.rule_in(None)) == (
        "replicated", "replicated", "column", "column")
    assert GPT.roles["word"].rule_in(TE_MLA) == "vocab"
