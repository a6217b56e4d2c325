"""Which shape each TP rank's flat optimizer buffer holds of a tensor follows the run's modules, not one
rule per role: Transformer Engine's MLA keeps the q / kv down projections whole on every TP rank
(megatron-core's TE spec builds them as duplicated, unsplit linears), so a dp_reshardable save of a TE run
holds them whole per rank, where the local spec cuts them by columns. The full reader and quick inspect lay
a buffer out from one list (formats/megatron_buffers.rank_param_shapes), whose shapes must be the pieces the
writer's own split (roles.shard_role) cuts."""
from __future__ import annotations

import pytest
import torch

from ckptool.config import MLA, GPTConfig, MoE
from ckptool.formats.megatron.buffers import HEAD_COPY, ONE, FlatRun, is_expert, rank_param_shapes, rule_column
from ckptool.lazy import Const
from ckptool.quick.meta import canonical_shapes
from ckptool.roles import global_role_tensor, layer_role_tensor, shard_role

CFG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, vocab_size=64, padded_vocab_size=64,
                max_position_embeddings=32, activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                add_bias_linear=False, add_qkv_bias=False,
                mla=MLA(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4),
                moe=MoE(num_experts=2, top_k=1, ffn_hidden_size=6, layers=(1,)))
DOWN = ("mla.q_down.weight", "mla.kv_down.weight")


def _run(impl):
    return FlatRun(tp=2, pp=1, vpp=1, dp=1, ep=1, etp=2, impl=impl, grouped=False, chunks=((0, 0, 0, 2),))


@pytest.mark.parametrize("impl, whole", [("transformer_engine", True), ("local", False)])
def test_mla_down_projections_per_rank_follow_the_runs_modules(impl, whole):
    shapes = canonical_shapes(CFG)
    run = _run(impl)
    weights = {n: Const(torch.zeros(s)) for n, s in shapes.items()}
    for r in run.buffer_ranks(ONE[0]):
        got = {(role, layer): shape for role, layer, shape in rank_param_shapes(shapes, CFG, run, r, ONE[0])}
        for layer in (0, 1):
            for role in DOWN:
                full = tuple(shapes[f"layers.{layer}.attn.{role.split('.')[1]}.weight"])
                want = full if whole else (full[0] // 2,) + full[1:]
                assert got[(role, layer)] == want, (impl, role, layer, got[(role, layer)])
        # the shapes the full reader lays a buffer out with are the pieces the writer's own split cuts
        for (role, layer), shape in got.items():
            full = (global_role_tensor(weights, "word" if role == HEAD_COPY else role) if layer is None
                    else layer_role_tensor(weights, CFG, layer, role))
            size = run.etp if is_expert(role) else run.tp
            piece = shard_role(full, "word" if role == HEAD_COPY else role, CFG, size, layer,
                               column=rule_column(impl))[r.t % size]
            assert tuple(piece.shape) == shape, (impl, role, layer)
