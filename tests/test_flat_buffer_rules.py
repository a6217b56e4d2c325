"""Which shape each TP rank's flat optimizer buffer holds of a tensor follows the run's modules, not one
rule per role: Transformer Engine's MLA keeps the q / kv down projections whole on every TP rank
(megatron-core's TE spec builds them as duplicated, unsplit linears), so a dp_reshardable save of a TE run
holds them whole per rank, where the local spec cuts them by columns. Both the full reader
(formats/dist_optim_buckets.rank_params) and quick inspect (quick/dist_buckets.rank_params) must agree."""
from __future__ import annotations

import math

import pytest
import torch

from ckptool.config import MLA, GPTConfig, MoE
from ckptool.formats import dist_optim_buckets
from ckptool.formats.megatron_buffers import ONE
from ckptool.lazy import Const
from ckptool.quick import dist_buckets
from ckptool.quick.meta import TensorMeta, canonical_shapes

CFG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, vocab_size=64, padded_vocab_size=64,
                max_position_embeddings=32, activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                add_bias_linear=False, add_qkv_bias=False,
                mla=MLA(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4),
                moe=MoE(num_experts=2, top_k=1, ffn_hidden_size=6, layers=(1,)))
DOWN = ("mla.q_down.weight", "mla.kv_down.weight")


def _full_params(impl, t):
    weights = {n: Const(torch.zeros(s)) for n, s in canonical_shapes(CFG).items()}
    return {(role, layer): tuple(shape) for role, layer, shape in
            dist_optim_buckets.rank_params(weights, CFG, 2, t, impl, part=ONE[0])}


@pytest.mark.parametrize("impl, whole", [("transformer_engine", True), ("local", False)])
def test_mla_down_projections_per_rank_follow_the_runs_modules(impl, whole):
    shapes = canonical_shapes(CFG)
    for t in (0, 1):
        got = _full_params(impl, t)
        for layer in (0, 1):
            for role in DOWN:
                full = tuple(shapes[f"layers.{layer}.attn.{role.split('.')[1]}.weight"])
                want = full if whole else (full[0] // 2,) + full[1:]
                assert got[(role, layer)] == want, (impl, role, layer, got[(role, layer)])
        metas = {n: TensorMeta(tuple(s), "float32") for n, s in shapes.items()}
        quick = dist_buckets.rank_params(metas, CFG, 2, t, impl, range(2), True, True, 1, ONE[0], 2, 1, 0, False)
        assert quick == [(role, math.prod(shape)) for (role, _), shape in got.items()]
