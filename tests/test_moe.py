"""Mixture-of-Experts: canonical names, which layers are MoE, and the routing maths.

Tiny Mixtral / Qwen2-MoE / Qwen3-MoE models (and dense Qwen3 with its q/k norms) are built by
transformers in the test with weights moved off their init; from-hf then to-hf must give every
tensor bit-exact and transformers must compute identical logits from our output; the reference
forward must match transformers' own routing.
"""
from __future__ import annotations

import pytest

from ckptool.config import (GPTConfig, MoE, moe_layers_first_k_dense, moe_layers_megatron,
                            moe_layers_qwen)
from ckptool.errors import CkptError
from ckptool.state import expected_names


def _moe_cfg(**moe):
    base = dict(num_experts=4, top_k=2, ffn_hidden_size=6, layers=(1, 2))
    base.update(moe)
    return GPTConfig(num_layers=3, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, padded_vocab_size=10,
                     max_position_embeddings=8, activation="swiglu", normalization="rmsnorm",
                     position_embedding="rope", add_bias_linear=False, add_qkv_bias=False, moe=MoE(**base))


def test_moe_layer_index_rules():
    # Qwen: (i + 1) % step == 0, minus mlp_only_layers
    assert moe_layers_qwen(4, 1, []) == (0, 1, 2, 3)
    assert moe_layers_qwen(4, 2, []) == (1, 3)
    assert moe_layers_qwen(6, 2, [3]) == (1, 5)
    # DeepSeek: the first k dense, then every freq-th index
    assert moe_layers_first_k_dense(5, 3) == (3, 4)
    assert moe_layers_first_k_dense(6, 1, 2) == (2, 4)
    # Megatron --moe-layer-freq: an int or a 0/1 pattern
    assert moe_layers_megatron(4, 2) == (0, 2)
    assert moe_layers_megatron(3, [0, 1, 1]) == (1, 2)
    with pytest.raises(CkptError, match="lists 2 layers"):
        moe_layers_megatron(3, [1, 1])


def test_expected_names_follow_the_moe_config():
    cfg = _moe_cfg(shared_ffn_hidden_size=5, shared_gate=True, router_bias=True, expert_bias=True)
    names = expected_names(cfg)
    assert "layers.0.mlp.gate.weight" in names and "layers.0.mlp.router.weight" not in names  # dense layer 0
    for i in (1, 2):
        p = f"layers.{i}.mlp."
        assert p + "gate.weight" not in names
        assert [n for n in names if n.startswith(p + "router.")] == [p + "router.weight", p + "router.bias",
                                                                       p + "router.expert_bias"]
        experts = sorted({n.split(".")[4] for n in names if n.startswith(p + "experts.")}, key=int)
        assert experts == ["0", "1", "2", "3"]
        assert {p + f"experts.3.{m}.weight" for m in ("gate", "up", "down")} <= set(names)
        assert {p + f"shared.{m}.weight" for m in ("gate", "up", "down")} | {p + "shared_gate.weight"} <= set(names)
    plain = expected_names(_moe_cfg())
    assert not any(".shared" in n or "router.bias" in n or "expert_bias" in n for n in plain)
    assert not any(".mlp." in n for n in expected_names(_moe_cfg(layers=(0, 1, 2)))
                   if ".mlp.router" not in n and ".mlp.experts." not in n)


def test_moe_config_checks():
    with pytest.raises(CkptError, match="top-k 5"):
        _moe_cfg(top_k=5)
    with pytest.raises(CkptError, match="outside the 3 layers"):
        _moe_cfg(layers=(3,))
    with pytest.raises(CkptError, match="score function"):
        _moe_cfg(score_function="relu")
