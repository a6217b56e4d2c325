#!/usr/bin/env python3
"""Drop Python's own files and its packages' (torch, transformers, the CUDA libraries in site-packages, ...)
from the page cache, leaving every other cached file where it is: the next program starts as on a machine
that has just booted, while the checkpoints it reads stay cached. scripts/gpu_verify_8b.sh (COLD=libs) runs
it before each timed verify. posix_fadvise(DONTNEED) drops clean pages only; pages mapped by a running
program stay. Without torch, so that it leaves no trace itself.

    python3 scripts/evict_libs.py [DIR...]      # default: sys.prefix, sys.base_prefix and every sys.path folder
"""
from __future__ import annotations

import os
import sys


def folders(given) -> list:
    if given:
        return given
    found = {sys.prefix, sys.base_prefix} | {p for p in sys.path if p and os.path.isdir(p)}
    return sorted(found)


def drop(path: str) -> int:
    """Pages of one file dropped (its size in bytes), 0 where it could not be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.fstat(fd).st_size
    except OSError:
        return 0
    finally:
        os.close(fd)


def main(argv) -> int:
    files = total = 0
    seen = set()
    for top in folders(argv):
        for root, _, names in os.walk(top):
            for name in names:
                path = os.path.join(root, name)
                if path not in seen:
                    seen.add(path)
                    size = drop(path)
                    files, total = files + (size > 0), total + size
    print(f"evict_libs: {files} files, {total / 2**30:.2f} GiB dropped from the page cache", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
