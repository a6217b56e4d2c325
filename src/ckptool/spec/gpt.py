"""The GPT family (GPT-2, Llama, Mistral, Qwen, Mixtral, Qwen-MoE, DeepSeek-V3) as data: every canonical
tensor once (TENSORS) and every Megatron role once with its key in each format (ROLES). schema.py says
what the fields mean; docs/design.md "Adding a tensor, a bias or a family" how to extend it. Hugging Face names stay per
architecture in families/ (one module per HF family): one HF architecture's names do not line up with Megatron's roles.
"""
from __future__ import annotations

from .schema import (DIST, FLAT, HEAD_COPY, LEGACY, LEGACY_GROUPED, MCORE, MDS, SEQUENTIAL, TE, TE_GROUPED, TE_MLA,
                     TE_MOE, MtpKeys, Role, Spec, Tensor)

L = "layers.{layer}."
E = L + "mlp.experts.{expert}."
# predicate runs (order matters where a later one reads config that an earlier one guarantees: moe first)
NORM_BIAS, QK_NORM, MOE, EXPERT = ("norm_bias",), ("gqa", "qk_norm"), ("moe",), ("moe",)

TENSORS = (
    Tensor("embed.word", role="word"),
    Tensor("embed.pos", ("learned_pos",), role="pos"),
    # --- multi-token prediction (MTP): an MTP layer's own tensors (layers num_layers ..; see MTP below) ---
    Tensor(L + "mtp.enorm.weight", ("mtp",), role="mtp.enorm.weight"),
    Tensor(L + "mtp.enorm.bias", ("mtp",) + NORM_BIAS, role="mtp.enorm.bias"),
    Tensor(L + "mtp.hnorm.weight", ("mtp",), role="mtp.hnorm.weight"),
    Tensor(L + "mtp.hnorm.bias", ("mtp",) + NORM_BIAS, role="mtp.hnorm.bias"),
    Tensor(L + "mtp.eh_proj.weight", ("mtp",), role="mtp.eh_proj.weight"),
    # --- (end MTP) ---
    Tensor(L + "attn_norm.weight", role="attn_norm.weight"),
    Tensor(L + "attn_norm.bias", NORM_BIAS, role="attn_norm.bias"),
    # attention: grouped-query (gqa) or Multi-Latent (mla); attn.q is both GQA's q (a part of the fused QKV) and
    # MLA's direct q without a q latent (megatron-core's linear_q_proj): listed once per kind (schema.EXCLUSIVE)
    Tensor(L + "attn.q_down.weight", ("mla_q_lora",), role="mla.q_down.weight"),
    Tensor(L + "attn.q_down_norm.weight", ("mla_q_lora",), role="mla.q_down_norm.weight"),
    Tensor(L + "attn.q_up.weight", ("mla_q_lora",), role="mla.q_up.weight"),
    Tensor(L + "attn.q.weight", ("mla_q_direct",), role="mla.q.weight"),
    Tensor(L + "attn.q.weight", ("gqa",), role="qkv.weight", part="q"),
    Tensor(L + "attn.k.weight", ("gqa",), role="qkv.weight", part="k"),
    Tensor(L + "attn.v.weight", ("gqa",), role="qkv.weight", part="v"),
    Tensor(L + "attn.q.bias", ("gqa", "qkv_bias"), role="qkv.bias", part="q"),
    Tensor(L + "attn.k.bias", ("gqa", "qkv_bias"), role="qkv.bias", part="k"),
    Tensor(L + "attn.v.bias", ("gqa", "qkv_bias"), role="qkv.bias", part="v"),
    Tensor(L + "attn.q_norm.weight", QK_NORM, role="q_norm.weight"),
    Tensor(L + "attn.q_norm.bias", QK_NORM + NORM_BIAS, role="q_norm.bias"),
    Tensor(L + "attn.k_norm.weight", QK_NORM, role="k_norm.weight"),
    Tensor(L + "attn.k_norm.bias", QK_NORM + NORM_BIAS, role="k_norm.bias"),
    Tensor(L + "attn.kv_down.weight", ("mla",), role="mla.kv_down.weight"),
    Tensor(L + "attn.kv_down_norm.weight", ("mla",), role="mla.kv_down_norm.weight"),
    Tensor(L + "attn.kv_up.weight", ("mla",), role="mla.kv_up.weight"),
    # GPT-OSS: a learned softmax sink per attention head (issue 32)
    Tensor(L + "attn.sinks", ("gqa", "attn_sinks"), role="attn.sinks"),
    Tensor(L + "attn.out.weight", role="proj.weight"),
    Tensor(L + "attn.out.bias", ("gqa", "linear_bias"), role="proj.bias"),
    Tensor(L + "attn_post_norm.weight", ("post_norms",), role="attn_post_norm.weight"),  # Gemma
    Tensor(L + "mlp_norm.weight", role="mlp_norm.weight"),
    Tensor(L + "mlp_norm.bias", NORM_BIAS, role="mlp_norm.bias"),
    # dense MLP
    Tensor(L + "mlp.gate.weight", ("dense_mlp", "gated"), role="fc1.weight", part="gate"),
    Tensor(L + "mlp.up.weight", ("dense_mlp",), role="fc1.weight", part="up"),
    Tensor(L + "mlp.down.weight", ("dense_mlp",), role="fc2.weight"),
    Tensor(L + "mlp.gate.bias", ("dense_mlp", "linear_bias", "gated"), role="fc1.bias", part="gate"),
    Tensor(L + "mlp.up.bias", ("dense_mlp", "linear_bias"), role="fc1.bias", part="up"),
    Tensor(L + "mlp.down.bias", ("dense_mlp", "linear_bias"), role="fc2.bias"),
    Tensor(L + "mlp_post_norm.weight", ("post_norms",), role="mlp_post_norm.weight"),  # Gemma
    # MoE layer: router, experts (biased with --add-bias-linear: GPT-OSS), shared expert and its gate
    Tensor(L + "mlp.router.weight", MOE, role="router.weight"),
    Tensor(L + "mlp.router.bias", MOE + ("router_bias",), role="router.bias"),
    Tensor(L + "mlp.router.expert_bias", MOE + ("expert_bias",), role="router.expert_bias"),
    Tensor(E + "gate.weight", EXPERT + ("gated",), role="experts.{expert}.fc1.weight", part="gate"),
    Tensor(E + "up.weight", EXPERT, role="experts.{expert}.fc1.weight", part="up"),
    Tensor(E + "down.weight", EXPERT, role="experts.{expert}.fc2.weight"),
    # GPT-OSS: the experts' biases (megatron-core gives every expert linear a bias with --add-bias-linear)
    Tensor(E + "gate.bias", EXPERT + ("linear_bias", "gated"), role="experts.{expert}.fc1.bias", part="gate"),
    Tensor(E + "up.bias", EXPERT + ("linear_bias",), role="experts.{expert}.fc1.bias", part="up"),
    Tensor(E + "down.bias", EXPERT + ("linear_bias",), role="experts.{expert}.fc2.bias"),
    Tensor(L + "mlp.shared.gate.weight", MOE + ("shared_expert", "gated"), role="shared.fc1.weight", part="gate"),
    Tensor(L + "mlp.shared.up.weight", MOE + ("shared_expert",), role="shared.fc1.weight", part="up"),
    Tensor(L + "mlp.shared.down.weight", MOE + ("shared_expert",), role="shared.fc2.weight"),
    Tensor(L + "mlp.shared_gate.weight", MOE + ("shared_gate",), role="shared_gate.weight"),
    Tensor(L + "mtp.final_norm.weight", ("mtp",), role="mtp.final_norm.weight"),  # MTP: before its shared head
    Tensor(L + "mtp.final_norm.bias", ("mtp",) + NORM_BIAS, role="mtp.final_norm.bias"),
    Tensor("final_norm.weight", role="final_norm.weight"),
    Tensor("final_norm.bias", NORM_BIAS, role="final_norm.bias"),
    Tensor("output.weight", ("untied",), role="output"),
)

_NESTED = "language_model/"
# role traits (schema.TRAITS)
EMBEDDING_OR_OUTPUT, TIED, FIRST, LINEAR = "embedding_or_output", "tied_embedding", "first_stage", "linear"
ROLES = (
    # globals: whole keys
    Role("word", "vocab", {LEGACY: _NESTED + "embedding/word_embeddings/weight", FLAT: "word_embeddings.weight",
                           MCORE: "embedding.word_embeddings.weight", MDS: "embed/word_embeddings.weight"},
         traits=(EMBEDDING_OR_OUTPUT, TIED, FIRST)),
    Role("pos", "replicated", {LEGACY: _NESTED + "embedding/position_embeddings/weight",
                               FLAT: "position_embeddings.weight", MCORE: "embedding.position_embeddings.weight",
                               MDS: "embed/position_embeddings.weight"}, traits=(FIRST,)),
    Role("final_norm.weight", "replicated", {LEGACY: _NESTED + "encoder/final_layernorm.weight",
                                             FLAT: "transformer.final_layernorm.weight",
                                             MCORE: "decoder.final_layernorm.weight", MDS: "final_norm/weight"}),
    Role("final_norm.bias", "replicated", {LEGACY: _NESTED + "encoder/final_layernorm.bias",
                                           FLAT: "transformer.final_layernorm.bias",
                                           MCORE: "decoder.final_layernorm.bias", MDS: "final_norm/bias"}),
    Role("output", "vocab", {LEGACY: _NESTED + "output_layer/weight", MCORE: "output_layer.weight",
                             MDS: "head/lm_head.weight"}, traits=(EMBEDDING_OR_OUTPUT, TIED, LINEAR)),
    # the last stage's copy of a tied embedding when PP > 1 (megatron-core names it as the output layer; the
    # 2019 flat files keep none); no canonical tensor: it is the embedding again
    Role(HEAD_COPY, "vocab", {LEGACY: "word_embeddings_for_head/weight", MCORE: "output_layer.weight"},
         traits=(EMBEDDING_OR_OUTPUT, TIED)),
    # layer roles: keys relative to the layer, in the order writers write them
    Role("attn_norm.weight", "replicated", {LEGACY: "input_layernorm.weight", MCORE: "input_layernorm.weight",
                                            TE: "self_attention.linear_qkv.layer_norm_weight",
                                            TE_MLA: "input_layernorm.weight"}),
    Role("attn_norm.bias", "replicated", {LEGACY: "input_layernorm.bias", MCORE: "input_layernorm.bias",
                                          TE: "self_attention.linear_qkv.layer_norm_bias", TE_MLA: "input_layernorm.bias"}),
    Role("qkv.weight", "qkv", {LEGACY: "self_attention.query_key_value.weight",
                               MCORE: "self_attention.linear_qkv.weight"}, fused="qkv", traits=(LINEAR,)),
    Role("qkv.bias", "qkv", {LEGACY: "self_attention.query_key_value.bias",
                             MCORE: "self_attention.linear_qkv.bias"}, fused="qkv"),
    Role("q_norm.weight", "replicated", {MCORE: "self_attention.q_layernorm.weight"}),
    Role("q_norm.bias", "replicated", {MCORE: "self_attention.q_layernorm.bias"}),
    Role("k_norm.weight", "replicated", {MCORE: "self_attention.k_layernorm.weight"}),
    Role("k_norm.bias", "replicated", {MCORE: "self_attention.k_layernorm.bias"}),
    # Multi-Latent Attention (megatron-core MLASelfAttention). Rows as Hugging Face's DeepSeek has them: kv_down
    # [kv_lora_rank | rope], q_up and q per head [nope | rope], kv_up per head [k nope | v]. The local spec
    # (gpt_layer_specs.get_gpt_layer_local_spec) builds every MLA linear column-parallel, the down projections too
    # (their outputs gathered in the forward), so their rows are TP-split. The TE spec
    # (get_gpt_layer_with_transformer_engine_spec, with --qk-layernorm) builds the down projections as TELinear,
    # which MLASelfAttention.__init__ makes parallel_mode 'duplicated' (whole on every TP rank: the TE rule), the up
    # projections as TELayerNormColumnParallelLinear holding the latent norms (layer_norm_weight), and a separate
    # input_layernorm (TENorm): there is no linear_qkv to fuse it into (the TE_MLA column).
    Role("mla.q.weight", "column", {MCORE: "self_attention.linear_q_proj.weight"}, traits=(LINEAR,)),
    Role("mla.q_down.weight", "column", {MCORE: "self_attention.linear_q_down_proj.weight"},
         rules={TE: "replicated"}, traits=(LINEAR,)),
    Role("mla.q_down_norm.weight", "replicated", {MCORE: "self_attention.q_layernorm.weight",
                                                  TE: "self_attention.linear_q_up_proj.layer_norm_weight"}),
    Role("mla.q_up.weight", "column", {MCORE: "self_attention.linear_q_up_proj.weight"}, traits=(LINEAR,)),
    Role("mla.kv_down.weight", "column", {MCORE: "self_attention.linear_kv_down_proj.weight"},
         rules={TE: "replicated"}, traits=(LINEAR,)),
    Role("mla.kv_down_norm.weight", "replicated", {MCORE: "self_attention.kv_layernorm.weight",
                                                   TE: "self_attention.linear_kv_up_proj.layer_norm_weight"}),
    Role("mla.kv_up.weight", "column", {MCORE: "self_attention.linear_kv_up_proj.weight"}, traits=(LINEAR,)),
    # GPT-OSS: DotProductAttention's learned softmax offset (megatron-core 0.16 transformer/dot_product_attention.py,
    # --softmax-type learnable), one per head, so split over TP with the heads (its sharded_state_dict: axis 0)
    Role("attn.sinks", "column", {MCORE: "self_attention.core_attention.softmax_offset"}),
    Role("proj.weight", "row", {LEGACY: "self_attention.dense.weight", MCORE: "self_attention.linear_proj.weight"},
         traits=(LINEAR,)),
    Role("proj.bias", "replicated", {LEGACY: "self_attention.dense.bias", MCORE: "self_attention.linear_proj.bias"}),
    # Gemma 2 / 3's norms of the attention and MLP outputs (issue 32). megatron-core 0.16 has no such module;
    # Megatron-Bridge (src/megatron/bridge/models/gemma/gemma2_provider.py, gemma3_provider.py: linear_proj and
    # linear_fc2 are TERowParallelLinearLayerNorm, a row-parallel linear whose output goes through its
    # post_layernorm) keys them under the output projections. No legacy Megatron model has them.
    Role("attn_post_norm.weight", "replicated", {MCORE: "self_attention.linear_proj.post_layernorm.weight"}),
    Role("mlp_norm.weight", "replicated", {LEGACY: "post_attention_layernorm.weight",
                                           MCORE: "pre_mlp_layernorm.weight",
                                           TE: "mlp.linear_fc1.layer_norm_weight",
                                           TE_MOE: "pre_mlp_layernorm.weight"}),
    Role("mlp_norm.bias", "replicated", {LEGACY: "post_attention_layernorm.bias", MCORE: "pre_mlp_layernorm.bias",
                                         TE: "mlp.linear_fc1.layer_norm_bias", TE_MOE: "pre_mlp_layernorm.bias"}),
    Role("fc1.weight", "column", {LEGACY: "mlp.dense_h_to_4h.weight", MCORE: "mlp.linear_fc1.weight"},
         fused="halves", traits=(LINEAR,)),
    Role("fc1.bias", "column", {LEGACY: "mlp.dense_h_to_4h.bias", MCORE: "mlp.linear_fc1.bias"}, fused="halves"),
    Role("fc2.weight", "row", {LEGACY: "mlp.dense_4h_to_h.weight", MCORE: "mlp.linear_fc2.weight"}, traits=(LINEAR,)),
    Role("fc2.bias", "replicated", {LEGACY: "mlp.dense_4h_to_h.bias", MCORE: "mlp.linear_fc2.bias"}),
    Role("mlp_post_norm.weight", "replicated", {MCORE: "mlp.linear_fc2.post_layernorm.weight"}),  # Gemma, as above
    # MoE layer roles (megatron-core only): TopKRouter, SharedExpertMLP
    Role("router.weight", "replicated", {MCORE: "mlp.router.weight"}),
    Role("router.bias", "replicated", {MCORE: "mlp.router.bias"}),
    Role("router.expert_bias", "replicated", {MCORE: "mlp.router.expert_bias"}, traits=("buffer",)),
    Role("shared.fc1.weight", names={MCORE: "mlp.shared_experts.linear_fc1.weight"}, fused="halves",
         traits=(LINEAR,)),
    Role("shared.fc2.weight", names={MCORE: "mlp.shared_experts.linear_fc2.weight"}, traits=(LINEAR,)),
    Role("shared_gate.weight", "replicated", {MCORE: "mlp.shared_experts.gate_weight"}),
    # experts, by module form; {j}: the expert's index local to its expert-parallel rank. torch_dist keeps a
    # layer's experts in one tensor with the global expert index as its leading axis.
    Role("experts.{expert}.fc1.weight", fused="halves", traits=(LINEAR,), names={
        SEQUENTIAL: "mlp.experts.local_experts.{j}.linear_fc1.weight", TE_GROUPED: "mlp.experts.linear_fc1.weight{j}",
        LEGACY_GROUPED: "mlp.experts.weight1", DIST: "mlp.experts.experts.linear_fc1.weight"}),
    Role("experts.{expert}.fc2.weight", traits=(LINEAR,), names={
        SEQUENTIAL: "mlp.experts.local_experts.{j}.linear_fc2.weight", TE_GROUPED: "mlp.experts.linear_fc2.weight{j}",
        LEGACY_GROUPED: "mlp.experts.weight2", DIST: "mlp.experts.experts.linear_fc2.weight"}),
    # GPT-OSS: expert biases (megatron-core 0.16 moe/experts.py: SequentialMLP's MLPs, TEGroupedMLP's bias{j}; the
    # legacy GroupedMLP has none)
    Role("experts.{expert}.fc1.bias", fused="halves", names={
        SEQUENTIAL: "mlp.experts.local_experts.{j}.linear_fc1.bias", TE_GROUPED: "mlp.experts.linear_fc1.bias{j}",
        DIST: "mlp.experts.experts.linear_fc1.bias"}),
    Role("experts.{expert}.fc2.bias", names={
        SEQUENTIAL: "mlp.experts.local_experts.{j}.linear_fc2.bias", TE_GROUPED: "mlp.experts.linear_fc2.bias{j}",
        DIST: "mlp.experts.experts.linear_fc2.bias"}),
)

# --- multi-token prediction (MTP) ---
# megatron-core 0.16.1 transformer/multi_token_prediction.py MultiTokenPredictionLayer: enorm, hnorm (the model's
# norm), eh_proj (a column-parallel linear from [enorm(embedding) | hnorm(hidden)], 2h -> h, no bias; its output
# gathered over TP), transformer_layer (the decoder's last layer spec), final_layernorm; keys relative to
# `mtp.layers.{k}.` (GPTModel.mtp, MultiTokenPredictionBlock.layers), in torch_dist too (no layer axis: each MTP
# layer its own keys). The embedding and the output layer are the main model's (megatron-core shares them; with
# PP > 1 the last stage keeps a copy of the word embedding, tied to the first stage's by its sharded key).
MTP_ROLES = (
    Role("mtp.enorm.weight", "replicated", {MCORE: "enorm.weight"}),
    Role("mtp.enorm.bias", "replicated", {MCORE: "enorm.bias"}),
    Role("mtp.hnorm.weight", "replicated", {MCORE: "hnorm.weight"}),
    Role("mtp.hnorm.bias", "replicated", {MCORE: "hnorm.bias"}),
    Role("mtp.eh_proj.weight", "column", {MCORE: "eh_proj.weight"}, traits=("linear",)),
    Role("mtp.final_norm.weight", "replicated", {MCORE: "final_layernorm.weight"}),
    Role("mtp.final_norm.bias", "replicated", {MCORE: "final_layernorm.bias"}),
)
MTP = MtpKeys(prefix={MCORE: "mtp.layers.{i}."}, inner="transformer_layer.",
              before=("mtp.enorm.weight", "mtp.enorm.bias", "mtp.hnorm.weight", "mtp.hnorm.bias", "mtp.eh_proj.weight"),
              after=("mtp.final_norm.weight", "mtp.final_norm.bias"))
# --- (end MTP) ---

# A layer's keys: the layer prefix per name column ({i} the layer's index in its file), then the role's key. The
# legacy eras rename it with their keys (megatron_names.ERAS); the 2019 flat files have their own.
LAYER_PREFIX = {LEGACY: _NESTED + "encoder/layers.{i}.", FLAT: "transformer.layers.{i}.", MCORE: "decoder.layers.{i}."}

# A layer's roles in the order each framework registers the parameters (named_parameters() and state-dict order,
# which its optimizer's param groups follow: megatron/optim.py). Legacy: norm, query_key_value, dense, norm, MLP.
# megatron-core registers linear_proj before linear_qkv (Attention.__init__ runs before SelfAttention adds
# linear_qkv), and core_attention (GPT-OSS's softmax_offset) before linear_proj.
# MLASelfAttention (megatron-core 0.16 multi_latent_attention.py) registers linear_proj, then its q
# linear(s) (linear_q_proj, or linear_q_down_proj and linear_q_up_proj), the kv linears, and the latent norms last
# (local spec; the TE spec's norms sit inside the up projections, registered before their weights); an MLA model
# has no qkv roles, a GQA model none of these. Transformer Engine's LayerNormLinear registers layer_norm_weight/
# _bias before weight/bias (read in TE's module/layernorm_linear.py; not run here: TE does not install on a
# CPU-only machine). The TE spec's MLA layer keeps input_layernorm as a module registered before self_attention
# (TransformerLayer.__init__), so there the input norm comes first.
_QK_NORMS = ("q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias")
# Gemma's post norms sit inside the output projections (Megatron-Bridge's TERowParallelLinearLayerNorm builds its
# post_layernorm after the linear's own parameters), so each comes right after its projection's weight and bias
_MLP = ("mlp_norm.weight", "mlp_norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
_MLP_POST = _MLP + ("mlp_post_norm.weight",)
_PROJ = ("proj.weight", "proj.bias", "attn_post_norm.weight")
_MLA = ("mla.q.weight", "mla.q_down.weight", "mla.q_up.weight", "mla.kv_down.weight", "mla.kv_up.weight",
        "mla.q_down_norm.weight", "mla.kv_down_norm.weight")
REGISTRATION = {
    LEGACY: ("attn_norm.weight", "attn_norm.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias") + _MLP,
    MCORE: ("attn_norm.weight", "attn_norm.bias", "attn.sinks") + _PROJ + ("qkv.weight", "qkv.bias") + _MLA + _QK_NORMS
    + _MLP_POST,
    TE: ("attn.sinks",) + _PROJ + ("attn_norm.weight", "attn_norm.bias", "qkv.weight", "qkv.bias") + _QK_NORMS
    + _MLP_POST,
    TE_MLA: ("attn_norm.weight", "attn_norm.bias", "proj.weight", "proj.bias", "mla.q.weight", "mla.q_down.weight",
             "mla.q_down_norm.weight", "mla.q_up.weight", "mla.kv_down.weight", "mla.kv_down_norm.weight",
             "mla.kv_up.weight") + _MLP,
}
# An MoE layer's own roles in megatron-core's order: TopKRouter, the experts, then SharedExpertMLP, which
# registers its gate_weight before its linears.
MOE_REGISTRATION = ("router.weight", "router.bias", "router.expert_bias", "experts.{expert}.fc1.weight",
                    "experts.{expert}.fc1.bias", "experts.{expert}.fc2.weight", "experts.{expert}.fc2.bias",
                    "shared_gate.weight", "shared.fc1.weight", "shared.fc2.weight")

GPT = Spec(TENSORS, ROLES + MTP_ROLES, REGISTRATION, MOE_REGISTRATION, LAYER_PREFIX, MTP)
