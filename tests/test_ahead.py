"""Tensors loaded on a background thread ahead of a streamed record's writes (ckptool/io/ahead.py)."""
from __future__ import annotations

import threading

import pytest
import torch

from ckptool.errors import CkptError
from ckptool.io.ahead import loaded_ahead
from ckptool.lazy import LazyTensor


class Slot(LazyTensor):
    """n fp32 elements of value i; records its loads, can fail or block on its load."""

    def __init__(self, i: int, n: int, log: list, fail: bool = False, gate: threading.Event = None):
        self.i, self.log, self.fail, self.gate = i, log, fail, gate
        self.shape, self.dtype = torch.Size([n]), torch.float32

    def load(self) -> torch.Tensor:
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise CkptError(f"slot {self.i} is unreadable")
        self.log.append(self.i)
        return torch.full(self.shape, float(self.i))


def test_in_order_and_never_more_than_the_limit_ahead():
    log: list = []
    slots = [Slot(i, 1000, log) for i in range(12)]  # 4000 bytes each
    for j, t in enumerate(loaded_ahead(slots, limit=8000)):
        assert float(t[0]) == j
        # loaded and not yet taken: within the limit (the one taken is counted in it too)
        assert len(log) - j <= 2, (j, log)
    assert log == list(range(12))


def test_a_slot_larger_than_the_limit_is_still_loaded_one_at_a_time():
    log: list = []
    slots = [Slot(i, 10_000, log) for i in range(4)]  # 40 KB each, over a 1 KB limit
    got = []
    for j, t in enumerate(loaded_ahead(slots, limit=1000)):
        assert len(log) - j <= 2  # the one taken and at most the next
        got.append(float(t[0]))
    assert got == [0.0, 1.0, 2.0, 3.0]


def test_a_load_error_comes_out_where_its_tensor_would_have():
    log: list = []
    slots = [Slot(0, 10, log), Slot(1, 10, log, fail=True), Slot(2, 10, log)]
    it = loaded_ahead(slots, limit=1 << 20)
    assert float(next(it)[0]) == 0
    with pytest.raises(CkptError, match="slot 1 is unreadable"):
        next(it)
    assert 2 not in log  # nothing loaded after the failure


def test_closing_early_stops_the_loader():
    log: list = []
    gate = threading.Event()
    slots = [Slot(0, 10, log)] + [Slot(i, 10, log, gate=gate) for i in range(1, 50)]
    before = threading.active_count()
    it = loaded_ahead(slots, limit=40)  # one slot: the loader waits for room after the next one
    next(it)
    gate.set()
    it.close()  # the caller gave up (a write failed): the thread ends, the rest is not loaded
    assert threading.active_count() <= before
    assert len(log) <= 3
