"""The Hugging Face family records (src/ckptool/families/): the registry's contract. Every family
ckptool writes is the one chosen for a config of its kind and reads its own config.json back to the
same GPTConfig; each table names every canonical tensor at most once; the package imports without torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ckptool import families
from ckptool.config import MLA, GPTConfig, MoE, Yarn
from ckptool.errors import CkptError
from ckptool.families.family import canonical_names


def _rope(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, head_dim=8,
                ffn_hidden_size=64, padded_vocab_size=64, vocab_size=64, vocab_size_source="config.json vocab_size",
                max_position_embeddings=32, position_embedding="rope", rotary_base=10000.0, normalization="rmsnorm",
                norm_eps=1e-6, activation="swiglu", add_bias_linear=False, add_qkv_bias=False)
    base.update(kw)
    return GPTConfig(**base)


def _routed(**kw) -> MoE:
    return MoE(**dict(dict(num_experts=4, top_k=2, ffn_hidden_size=16, layers=(1,)), **kw))


MLA_SIZES = MLA(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8, latent_norm_eps=1e-6)
CONFIGS = {  # model_type -> a GPTConfig only that family's class computes
    "gpt2": GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, padded_vocab_size=64,
                      vocab_size=64, vocab_size_source="config.json vocab_size", max_position_embeddings=32,
                      position_embedding="learned", normalization="layernorm", activation="gelu_tanh",
                      add_bias_linear=True, add_qkv_bias=True),
    "llama": _rope(),
    "qwen2": _rope(add_qkv_bias=True),
    "qwen3": _rope(qk_layernorm=True),
    # every Mixtral layer is MoE: config.json's intermediate_size is the experts' (no dense MLP to size)
    "mixtral": _rope(ffn_hidden_size=16, moe=_routed(layers=(0, 1), topk_norm=True)),
    "qwen2_moe": _rope(add_qkv_bias=True, moe=_routed(shared_ffn_hidden_size=24, shared_gate=True)),
    "qwen3_moe": _rope(qk_layernorm=True, moe=_routed(topk_norm=True)),
    # Gemma (issue 32): zero-centred RMSNorm, GeGLU, post norms, sqrt(hidden) embeddings, a sliding window
    "gemma2": _rope(activation="geglu", apply_layernorm_1p=True, embedding_scale=True, post_norms=True,
                    query_pre_attn_scalar=8.0, attn_softcap=50.0, final_softcap=30.0, sliding_window=4, local_layers=(0,)),
    "gemma3_text": _rope(activation="geglu", apply_layernorm_1p=True, embedding_scale=True, post_norms=True,
                         qk_layernorm=True, query_pre_attn_scalar=8.0, sliding_window=4, local_layers=(1,),
                         rotary_base_local=10000.0, rope_linear_factor=8.0),
    "deepseek_v3": _rope(num_query_groups=4, head_dim=10, mla=MLA_SIZES, rotary_interleaved=True,
                         moe=_routed(num_experts=8, score_function="sigmoid", expert_bias=True, topk_norm=True,
                                     shared_ffn_hidden_size=32, num_groups=4, group_topk=2, scaling_factor=2.5)),
    # GLM-4.5: DeepSeek-V3's routing on grouped-query attention with partial RoPE, q/k/v biases and q/k norms
    "glm4_moe": _rope(head_dim=16, rotary_percent=0.5, add_qkv_bias=True, qk_layernorm=True,
                      moe=_routed(num_experts=8, top_k=4, score_function="sigmoid", expert_bias=True, topk_norm=True,
                                  shared_ffn_hidden_size=32, num_groups=4, group_topk=2, scaling_factor=2.5)),
    # GPT-OSS: sinks, a sliding window on layer 0, clamped quick GeGLU with offset 1, biases, YaRN, every layer MoE
    "gpt_oss": _rope(ffn_hidden_size=16, activation="quick_geglu", add_bias_linear=True, add_qkv_bias=True,
                     tied_embeddings=False, attn_sinks=True, sliding_window=4, local_layers=(0,), glu_clamp=7.0,
                     glu_linear_offset=1.0, rope_yarn=Yarn(factor=32.0, original_max_position_embeddings=16,
                                                           truncate=False),
                     moe=_routed(layers=(0, 1), topk_norm=True, router_bias=True)),
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_written_family_is_chosen_for_its_config_and_reads_its_config_json_back(model_type):
    cfg = CONFIGS[model_type]
    family = families.for_config(cfg)
    assert family.model_type == model_type
    conf = family.write_config(cfg, cfg.padded_vocab_size)
    assert conf["model_type"] == model_type and conf["architectures"] == [family.architecture]
    assert families.of_hf_config(conf) is family
    assert family.read_config(conf, cfg.padded_vocab_size) == cfg


def test_every_family_that_writes_has_a_config_of_its_own_here():
    assert sorted(f.model_type for f in families.FAMILIES if f.config_json is not None) == sorted(CONFIGS)
    assert families.of_hf_config({"architectures": ["MistralForCausalLM"]}) is families.for_model_type("mistral")
    assert families.of_hf_config({"model_type": "bert"}) is None


def test_no_class_computes_it():
    with pytest.raises(CkptError, match="a combination Mixtral, Qwen2-MoE and Qwen3-MoE do not compute"):
        families.for_config(_rope(moe=_routed(topk_norm=False)))


@pytest.mark.parametrize("change, says", [
    (dict(rotary_percent=0.5, moe=None), "--rotary-percent 0.5, and Qwen3ForCausalLM rotates the whole head"),
    (dict(add_bias_linear=True), "--add-bias-linear (biases beyond q, k and v), which Glm4MoeForCausalLM"),
    (dict(moe=_routed(score_function="sigmoid", expert_bias=True)), "no shared expert, which Glm4MoeForCausalLM"),
])
def test_partial_rope_and_glm_routing_are_refused_where_no_class_computes_them(change, says):
    with pytest.raises(CkptError, match="cannot export to Hugging Face") as e:
        families.for_config(CONFIGS["glm4_moe"].replace(**change))
    assert says in str(e.value)


def test_glm_config_json_defaults_are_transformers():
    """A GLM-4.5 config.json that leaves out what Glm4MoeConfig defaults (partial_rotary_factor 0.5 at the top, as
    the released config.json has it, or not at all; first_k_dense_replace 1; norm_topk_prob on) reads as the class."""
    family = families.for_model_type("glm4_moe")
    conf = family.write_config(CONFIGS["glm4_moe"], 64)
    for key in ("first_k_dense_replace", "norm_topk_prob", "partial_rotary_factor"):
        conf.pop(key)
    conf["rope_parameters"].pop("partial_rotary_factor")
    cfg = family.read_config(conf, 64)
    assert (cfg.rotary_percent, cfg.moe.layers, cfg.moe.topk_norm) == (0.5, (1,), True)
    released = dict(conf, partial_rotary_factor=0.25, use_qk_norm=False, attention_bias=False)
    cfg = family.read_config(released, 64)
    assert (cfg.rotary_percent, cfg.qk_layernorm, cfg.add_qkv_bias) == (0.25, False, False)


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.model_type)
def test_each_table_names_a_canonical_tensor_once(family):
    rows = family.names.expand(num_layers=2, num_experts=2)
    made = [n for _, entry, _ in rows for n in canonical_names(entry)]
    assert len(made) == len(set(made))
    assert len({hf for hf, _, _ in rows}) == len(rows)
    assert family.names.word_embedding in family.names.globals


def test_families_import_without_torch():
    code = "import sys, ckptool.families, ckptool.formats.hf.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
