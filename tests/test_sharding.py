"""The sharding table and the fused layouts: split and merge are exact inverses for every rule,
TP size and GQA shape, and the grouped QKV layout matches the documented Megatron order."""
import itertools

import pytest
import torch

from ckptool.config import GPTConfig, check_tensor_parallel, padded_vocab_size
from ckptool.errors import CkptError
from ckptool.lazy import Const
from ckptool.roles import fuse_qkv, unfuse_qkv
from ckptool.sharding import ReplicaPolicy, Rule, merge, merge_lazy, split, split_lazy


@pytest.mark.parametrize("rule", list(Rule))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_split_merge_roundtrip(rule, tp):
    t = torch.randn(16 * 8, 24)
    parts = split(t, rule, tp)
    assert len(parts) == tp
    assert torch.equal(merge(parts, rule), t)
    lazy = split_lazy(Const(t), rule, tp)
    assert all(torch.equal(a, b.load()) for a, b in zip(parts, lazy))
    assert torch.equal(merge_lazy(lazy, rule, "x").load(), t)


def test_gated_rank_holds_gate_and_up_halves():
    gate, up = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    parts = split(torch.cat([gate, up]), Rule.GATED, 2)
    assert torch.equal(parts[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(parts[1], torch.cat([gate[4:], up[4:]]))


def test_row_and_column_dims():
    t = torch.randn(8, 6)
    assert split(t, Rule.ROW, 2)[0].shape == (8, 3)
    assert split(t, Rule.COLUMN, 2)[0].shape == (4, 6)
    with pytest.raises(CkptError):
        split(torch.randn(5, 6), Rule.COLUMN, 2)


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (8, 1), (6, 3)])
def test_grouped_qkv_layout(heads, groups):
    hd = 3
    cfg = GPTConfig(num_layers=1, hidden_size=heads * hd, num_attention_heads=heads, num_query_groups=groups,
                    ffn_hidden_size=8, padded_vocab_size=8, max_position_embeddings=4)
    # label every row with (kind, head, dim) so the layout is checked element by element
    q = torch.tensor([[1000 + h * 10 + d] for h in range(heads) for d in range(hd)], dtype=torch.float)
    k = torch.tensor([[2000 + g * 10 + d] for g in range(groups) for d in range(hd)], dtype=torch.float)
    v = torch.tensor([[3000 + g * 10 + d] for g in range(groups) for d in range(hd)], dtype=torch.float)
    fused = fuse_qkv(q, k, v, cfg)
    per = heads // groups
    expected = []
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            expected += [1000 + h * 10 + d for d in range(hd)]
        expected += [2000 + g * 10 + d for d in range(hd)]
        expected += [3000 + g * 10 + d for d in range(hd)]
    assert fused.flatten().tolist() == expected
    q2, k2, v2 = unfuse_qkv(fused, cfg)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("heads,groups,tp,ok", [
    (8, 2, 1, True), (8, 2, 2, True), (8, 2, 4, True), (8, 2, 8, True), (8, 4, 8, True),
    (8, 2, 3, False), (6, 3, 2, False), (12, 6, 4, False), (4, 4, 8, False)])
def test_tensor_parallel_sizes_megatron_accepts(heads, groups, tp, ok):
    cfg = GPTConfig(num_layers=1, hidden_size=heads * 4, num_attention_heads=heads, num_query_groups=groups,
                    ffn_hidden_size=64, padded_vocab_size=8, max_position_embeddings=4)
    if ok:
        check_tensor_parallel(cfg, tp)
    else:
        with pytest.raises(CkptError):
            check_tensor_parallel(cfg, tp)


@pytest.mark.parametrize("vocab,div,tp,expected", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 4, 50688), (50257, 128, 8, 51200),
    (32000, 128, 4, 32256), (32000, 128, 8, 32768), (151936, 128, 2, 152064), (1001, 128, 2, 1024)])
def test_megatron_vocab_padding(vocab, div, tp, expected):
    assert padded_vocab_size(vocab, div, tp) == expected


def test_replica_policy_modes():
    a, b = torch.ones(3), torch.ones(3) + torch.tensor([0.0, 0.5, 0.0])
    seen = []
    first = ReplicaPolicy("first", seen.append)
    assert torch.equal(merge_lazy([Const(a), Const(b)], Rule.REPLICATED, "n", first).load(), a)
    assert first.divergences == {"n": 0.5} and "max abs diff 0.5" in seen[0]
    mean = ReplicaPolicy("mean")
    assert torch.allclose(merge_lazy([Const(a), Const(b)], Rule.REPLICATED, "n", mean).load(), (a + b) / 2)
    with pytest.raises(CkptError, match="replicas differ"):
        merge_lazy([Const(a), Const(b)], Rule.REPLICATED, "n", ReplicaPolicy("strict")).load()
    same = ReplicaPolicy("strict")
    assert torch.equal(merge_lazy([Const(a), Const(a.clone())], Rule.REPLICATED, "n", same).load(), a)
