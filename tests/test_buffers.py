"""Recycled layer buffers (ckptool/io/buffers.py) and in-place merges (lazy.Concat)."""
from __future__ import annotations

import torch

from ckptool.io import buffers
from ckptool.io.torchfile import StoredTensor, load_torch_file
from ckptool.lazy import Concat, Const


def _held():
    return buffers.held_bytes()


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    a = buffers.empty((1024, 1024), torch.bfloat16)  # 2 MiB: pooled
    a.fill_(1)
    held = _held()
    view = a[3:]
    del a
    b = buffers.empty((1024, 1024), torch.bfloat16)  # the view keeps a's memory busy
    assert _held() == held + (2 << 20)
    b.fill_(2)
    assert bool((view == 1).all())  # b did not land on a's memory
    del view
    c = buffers.empty((1024, 1024), torch.bfloat16)
    assert _held() == held + (2 << 20)  # a's buffer came back instead of a new one
    c.fill_(3)
    assert bool((b == 2).all())
    small = buffers.empty((10,), torch.float32)
    assert small.numel() == 10 and _held() == held + (2 << 20)  # small tensors use torch's allocator


def test_the_pool_stays_under_its_limit(monkeypatch):
    monkeypatch.setattr(buffers, "POOL_LIMIT", _held() + (8 << 20))
    live = [buffers.empty((1 << 20,), torch.float32) for _ in range(4)]  # 4 x 4 MiB
    assert _held() <= buffers.POOL_LIMIT
    assert all(t.shape == (1 << 20,) for t in live)  # over the limit: plain torch memory


def test_a_writer_lets_the_pool_hold_its_groups_then_it_shrinks_back(monkeypatch):
    """sized_for: while a writer runs, the pool keeps (and hands out again) what its groups in flight
    need beyond POOL_LIMIT, so each group's tensors land on the memory of the group before; afterwards
    the free buffers beyond the limit are closed."""
    monkeypatch.setattr(buffers, "_pool", [])  # an empty pool: what earlier tests left is not counted
    monkeypatch.setattr(buffers, "POOL_LIMIT", 8 << 20)
    with buffers.sized_for(24 << 20):
        first = [buffers.empty((1 << 20,), torch.float32) for _ in range(4)]  # 4 x 4 MiB, all pooled
        assert _held() == 16 << 20
        ptrs = {t.data_ptr() for t in first}
        del first
        again = [buffers.empty((1 << 20,), torch.float32) for _ in range(4)]
        assert {t.data_ptr() for t in again} == ptrs  # the same memory, no fresh pages
        del again
    assert _held() <= buffers.POOL_LIMIT


def test_concat_reads_shards_into_place_and_slices_within_a_shard(tmp_path):
    parts = [torch.randn(300, 700), torch.randn(300, 700)]
    torch.save({"a": parts[0], "b": parts[1]}, tmp_path / "f.pt")
    tree = load_torch_file(tmp_path / "f.pt")
    whole = Concat([tree["a"], tree["b"]], 0)
    assert torch.equal(whole.load(), torch.cat(parts, 0))
    piece = whole.narrow(0, 350, 200)  # inside shard b: a ranged read of b
    assert isinstance(piece, StoredTensor)
    assert torch.equal(piece.load(), torch.cat(parts, 0)[350:550])
    across = whole.narrow(0, 250, 100)  # spans both shards
    assert torch.equal(across.load(), torch.cat(parts, 0)[250:350])
    cols = Concat([tree["a"], Const(parts[1])], 1)  # dim 1: strided slices, copied in
    assert torch.equal(cols.load(), torch.cat(parts, 1))
