"""Recycled memory for layer-sized tensors.

A streaming conversion allocates and frees the same few layer-sized buffers once per layer. Fresh
memory costs a page fault (and the kernel zeroing a page) for every 4 KiB the first time it is
written: measured on the 2-core CI box, filling a fresh 256 MiB tensor runs at ~0.9 GB/s, refilling
a used one at ~6 GB/s, so for a conversion that only moves bytes the faults cost more than the
copies. This pool hands a buffer back out once no tensor uses it any more (CPython reference
counts say so: a tensor made by torch.frombuffer holds a reference to its buffer until it dies).

The pool holds at most POOL_LIMIT bytes, so resident memory stays at about what two layers in
flight need. Small tensors (< MIN_BYTES) come from torch's allocator as usual.
"""
from __future__ import annotations

import mmap
import sys
import threading

import torch

MIN_BYTES = 1 << 20
POOL_LIMIT = 512 << 20  # never more than this held for reuse (the RSS budget is 1 GiB + 2 layers)

_lock = threading.Lock()
_pool: list = []  # mmap objects; free when only the pool refers to them


def _refcounts(bufs: list) -> list:
    return [sys.getrefcount(buf) for buf in bufs]


# A pooled buffer that no tensor uses has exactly as many references as this probe counted the
# same way (list slot, loop variable, getrefcount's argument): measured rather than assumed, as the
# count differs between Python versions.
_FREE_REFS = _refcounts([bytearray(1)])[0]


def _free(bufs: list) -> list:
    """The buffers of bufs that no tensor uses."""
    return [buf for buf, n in zip(bufs, _refcounts(bufs)) if n <= _FREE_REFS]


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor, on recycled memory when it is large."""
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    buf = _take(nbytes)
    if buf is None:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(tuple(shape))


def _take(nbytes: int):
    with _lock:
        # the smallest free buffer that fits, wasting at most half of it
        fits = [buf for buf in _free(_pool) if nbytes <= len(buf) <= 2 * nbytes]
        if fits:
            return min(fits, key=len)
        held = sum(len(b) for b in _pool)
        if held + nbytes > POOL_LIMIT:  # make room: drop free buffers, largest first
            for buf in sorted(_free(_pool), key=len, reverse=True):
                if held + nbytes <= POOL_LIMIT:
                    break
                _pool.remove(buf)
                held -= len(buf)
                buf.close()
            if held + nbytes > POOL_LIMIT:
                return None
        buf = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer, larger faults the first time round
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        _pool.append(buf)
        return buf


def held_bytes() -> int:
    with _lock:
        return sum(len(b) for b in _pool)
