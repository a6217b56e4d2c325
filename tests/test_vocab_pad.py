"""Re-padded vocabulary rows (ckptool/vocab.py PaddedRows): every row slice a target rank takes
equals the slice of the whole padded tensor, and loads only the source rows it covers."""
from __future__ import annotations

import pytest
import torch

from ckptool.config import GPTConfig
from ckptool.lazy import Const, LazyTensor
from ckptool.vocab import resize_rows, resize_slot_vocab


class CountedRows(LazyTensor):
    """A stored tensor that records how many rows each load reads."""

    def __init__(self, tensor: torch.Tensor, log: list, first: int = 0):
        self.tensor, self.log, self.first = tensor, log, first
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def load(self) -> torch.Tensor:
        self.log.append(self.shape[0])
        return self.tensor.clone()

    def narrow(self, dim, start, length):
        assert dim == 0
        return CountedRows(self.tensor.narrow(0, start, length), self.log, self.first + start)


def _cfg(vocab: int) -> GPTConfig:
    return GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
                     padded_vocab_size=104, vocab_size=vocab, vocab_size_source="test", max_position_embeddings=8)


@pytest.mark.parametrize("fill", ["zero", "mean", "last"])
def test_slices_of_padded_rows_equal_the_whole_and_read_only_their_rows(fill):
    src = torch.randn(104, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    real = 101
    log: list = []
    padded = resize_rows(CountedRows(src, log), 128, _cfg(real), fill)
    whole = padded.load()
    pad = {"zero": torch.zeros(24, 8, dtype=src.dtype),
           "mean": src[:real].float().mean(0, keepdim=True).to(src.dtype).expand(24, 8),
           "last": src[real - 1:real].expand(24, 8)}[fill]
    assert torch.equal(whole, torch.cat([src, pad]))
    for tp in (2, 4, 8, 3, 5):  # shares inside the source, across its end, inside the pad
        step = -(-128 // tp)
        for start in range(0, 128, step):
            n = min(step, 128 - start)
            log.clear()
            got = padded.narrow(0, start, n).load()
            assert torch.equal(got, whole[start:start + n]), (fill, tp, start)
            if fill != "mean":  # the mean pad needs every real row; the others read only their own
                assert sum(log) <= max(0, min(n, 104 - start)) + (1 if fill == "last" else 0), (fill, tp, start, log)


def test_new_master_rows_come_from_the_padded_weight_slice_by_slice():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(104, 8, generator=g).to(torch.bfloat16)
    m = torch.randn(104, 8, generator=g)
    cfg = _cfg(101)
    weights = {"embed.word": resize_rows(Const(w), 128, cfg, "last")}
    slot = resize_slot_vocab({"embed.word": Const(m)}, weights, cfg, 128, "from-weight")["embed.word"]
    whole = slot.load()
    assert torch.equal(whole[:104], m) and torch.equal(whole[104:], weights["embed.word"].load()[104:].float())
    for start in range(0, 128, 32):
        assert torch.equal(slot.narrow(0, start, 32).load(), whole[start:start + 32])


def test_shares_across_the_source_shards_read_only_their_rows_and_hold_nothing_whole():
    """The source embedding is itself a merge of TP shards (sharding.py: a memoised Concat). A TP4
    share that spans two TP2 shards reads its rows from each, not both shards whole: built whole,
    the merged tensor of every optimizer slot stayed memoised for the group's load (peak RSS over
    the bound on the device, docs/benchmarks.md)."""
    from ckptool.lazy import Concat, load_scope, load_scopes
    src = torch.randn(104, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    log: list = []
    merged = Concat([CountedRows(src[:52], log), CountedRows(src[52:], log)], 0, memo=True)
    padded = resize_rows(merged, 128, _cfg(101), "zero")
    whole = torch.cat([src, torch.zeros(24, 8, dtype=src.dtype)])
    with load_scope():
        for start in range(0, 128, 32):  # rank 1 spans both shards, rank 3 the second and the pad
            log.clear()
            got = padded.narrow(0, start, 32).load()
            assert torch.equal(got, whole[start:start + 32]), start
            assert sum(log) == max(0, min(32, 104 - start)), (start, log)
            assert all(v.numel() <= 32 * 8 for _, v in load_scopes()[-1].values()), start
    # a share across two parts of any Concat is the same: both parts' slices, joined
    log.clear()
    assert torch.equal(merged.narrow(0, 40, 30).load(), src[40:70]) and sorted(log) == [12, 18]
