"""The fp32 master check as lazy nodes (ckptool/masters.py, lazy.Checked and lazy.Memo): a master loaded
into its place in a merged tensor is checked there, a slice of it against the same slice of the weight,
and a memoised weight loaded into a merge keeps its slice of the merged tensor (no copy, no second read)."""
from __future__ import annotations

import pytest
import torch

from ckptool.errors import CkptError
from ckptool.lazy import Concat, Const, Derived, LazyTensor, Memo, load_scope
from ckptool.masters import checked_master, rounds_to


class Counted(LazyTensor):
    """A tensor that counts its loads (the stand-in for a stored tensor's reads)."""

    def __init__(self, t: torch.Tensor, log: list, name: str):
        self.t, self.log, self.name = t, log, name
        self.shape, self.dtype = t.shape, t.dtype

    def load(self) -> torch.Tensor:
        self.log.append(self.name)
        return self.t.clone()

    def narrow(self, dim, start, length):
        return Counted(self.t.narrow(dim, start, length), self.log, f"{self.name}[{start}:{start + length}]")


def _master_and_weight(rows=64, cols=48, seed=0):
    m = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return m, m.to(torch.bfloat16)


def test_rounds_to_is_the_bitwise_cast_compare():
    m, w = _master_and_weight()
    assert rounds_to(m, w) and rounds_to(m[:, 8:24], w[:, 8:24])  # a strided column block too
    off = w.clone()
    off[17, 5] += 1  # one element differs
    assert not rounds_to(m, off)
    assert not rounds_to(m, w[:-1])


def test_a_master_merges_in_place_and_is_checked_there():
    log: list = []
    parts = [_master_and_weight(seed=s) for s in (1, 2)]
    weights = [Memo(Counted(w, log, f"w{i}")) for i, (_, w) in enumerate(parts)]
    masters = [checked_master(Counted(m, log, f"m{i}"), weights[i], f"master {i} is off", "hint")
               for i, (m, _) in enumerate(parts)]
    with load_scope():
        merged_w = Concat(weights, 0).load()
        merged_m = Concat(masters, 0).load()
    assert torch.equal(merged_m, torch.cat([m for m, _ in parts]))
    assert torch.equal(merged_w, torch.cat([w for _, w in parts]))
    assert sorted(log) == ["m0", "m1", "w0", "w1"]  # each weight read once for the merge and the check


def test_a_wrong_master_fails_its_load_with_the_message():
    m, w = _master_and_weight()
    bad = checked_master(Const(m + 1), Const(w), "rank 3: the fp32 master of x does not round", "use --no-optimizer")
    with pytest.raises(CkptError, match="does not round"):
        bad.load()
    with pytest.raises(CkptError, match="does not round"):
        bad.narrow(0, 8, 8).load()


def test_a_slice_of_a_checked_master_reads_and_checks_only_that_slice():
    log: list = []
    m, w = _master_and_weight()
    checked = checked_master(Counted(m, log, "m"), Counted(w, log, "w"), "off", "hint")
    for dim, (a, n) in ((0, (16, 32)), (1, (8, 16))):
        log.clear()
        got = checked.narrow(dim, a, n).load()
        assert torch.equal(got, m.narrow(dim, a, n))
        assert log == [f"m[{a}:{a + n}]", f"w[{a}:{a + n}]"]
    w_bad = w.clone()
    w_bad[40, 0] += 1
    other = checked_master(Const(m), Const(w_bad), "off", "hint")
    other.narrow(0, 0, 32).load()  # the wrong row is not in this half: this half is fine
    with pytest.raises(CkptError):
        other.narrow(0, 32, 32).load()


def test_a_memoised_weight_merged_in_place_keeps_its_slice():
    log: list = []
    w = torch.randn(8, 4).to(torch.bfloat16)
    memo = Memo(Counted(w, log, "w"))
    whole = Concat([memo, Const(w)], 0)
    with load_scope():
        merged = whole.load()
        again = memo.load()  # the slice of merged, not another read
        assert again.data_ptr() == merged.data_ptr() and torch.equal(again, w)
        twice = Derived(lambda x: x * 2, [memo]).load()
    assert log == ["w"] and torch.equal(twice, w * 2)
    memo.load()  # outside a scope every load reads
    assert log == ["w", "w"]
