"""Keeping the process's memory at what the current layer needs, and measuring it.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after which
layer-sized tensors come from the heap; freed heap blocks are rarely returned to the system, so a
streaming conversion's resident memory creeps up with the model's size (measured: 0.96 GB peak for a
0.6 GB checkpoint, 0.56 GB with a fixed threshold). Fixing the threshold keeps every large tensor
mmapped, so freeing it returns the pages at once.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
_THRESHOLD = 1 << 20  # tensors above 1 MiB get their own mapping
_libc = None
_done = False


def _glibc():
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.mallopt, _libc.malloc_trim  # glibc only (musl lacks them)
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def bound_heap() -> None:
    """Fix glibc's mmap threshold (once per process); a no-op elsewhere."""
    global _done
    libc = _glibc()
    if libc and not _done:
        libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
        _done = True


def trim() -> None:
    """Hand freed heap pages back to the system (between layers)."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
