"""Whether source bytes, once read, are dropped from the page cache (Linux): only for sources too
large to stay cached anyway.

Why: a conversion reads each source byte once, in layer order. When the checkpoint is larger than
memory, keeping what was read in the page cache is worthless to ckptool and expensive for
everyone. Each new page has to reclaim an old one (system time charged to the reader), and the
stream pushes every other process's cached files out. Telling the kernel that a range has been
used (posix_fadvise DONTNEED) keeps ckptool's share of the cache small, in the same way
writeback.py treats the output. Measured on a 30.67 GB TP2 PP2 bf16 merge on the 24 GiB CI VM
(docs/benchmarks.md): 77-82 s wall with 85-89 s system time without the hint, and 51-61 s with
39-52 s using it.

A source that fits easily (at most half of physical memory) keeps its pages, so a second command on
the same checkpoint, such as verify after reshard, reads from memory. CKPTOOL_DROP_SOURCE=1 or 0
forces the hint on or off. It only changes what the kernel caches, never what is read.
"""
from __future__ import annotations

import os
from pathlib import Path

MIN_DROP_BYTES = 1 << 20  # smaller reads (pickles, headers) are not worth a system call

_drop = False


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def source_bytes(path: Path) -> int:
    """Bytes of the regular files under path (path itself if it is a file)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


def decide(nbytes: int, memory: int) -> bool:
    """The policy: drop a source's pages after reading when it exceeds half of memory."""
    forced = os.environ.get("CKPTOOL_DROP_SOURCE")
    if forced in ("0", "1"):
        return forced == "1"
    return hasattr(os, "posix_fadvise") and memory > 0 and nbytes > memory // 2


def configure_for(path) -> bool:
    """Set the policy for the source at path (called when a checkpoint is opened)."""
    global _drop
    _drop = decide(source_bytes(path), _physical_memory())
    return _drop


def done_with(fd: int, offset: int, length: int) -> None:
    """Bytes [offset, offset+length) of fd have been read and will not be needed again."""
    if _drop and length >= MIN_DROP_BYTES:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system that refuses the hint: nothing to do
            pass
