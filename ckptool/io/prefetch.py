"""Read-ahead while converting: the kernel is asked for the next layer's source bytes while this one
is converted (posix_fadvise WILLNEED on their byte ranges, from a background thread).

Why: with a cold source a conversion reads one tensor at a time (a pread waits for the disk), and
its CPU work (merges, transposes, checksums) leaves the disk idle in between. Start-up read-ahead
(startup.py) covers the first part of each file; this covers the rest, one group (a layer) ahead
of the loader. The hints fill the page cache only (reclaimable, not the process's memory), and only
GROUPS_AHEAD groups ahead, so a source larger than memory is not pushed out before it is used.
CKPTOOL_PREFETCH=0 turns it off (as does CKPTOOL_READAHEAD=0); CKPTOOL_PREFETCH=N asks N groups ahead.

A lazy tensor's source ranges are found by walking its parents down to stored tensors that know
their bytes in a file (a `file_ranges()` method: torch archives, torch_dist chunk files, safetensors
entries); tensors computed from nothing, or read from formats without that method, add nothing.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Iterable, List, Optional, Tuple

Range = Tuple[str, int, int]  # (path, offset, length)


def groups_ahead() -> int:
    if os.environ.get("CKPTOOL_READAHEAD", "") == "0":
        return 0
    try:
        return max(0, int(os.environ.get("CKPTOOL_PREFETCH", "1") or 1))
    except ValueError:
        return 1


def source_ranges(lazies: Iterable) -> List[Range]:
    """The file byte ranges the given lazy tensors read, adjacent ones joined, in file order."""
    found: list = []
    seen: set = set()
    stack = list(lazies)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        ranges = getattr(node, "file_ranges", None)
        if ranges is not None:
            found.extend(ranges())
            continue
        stack.extend(getattr(node, "parents", ()) or ())
    found.sort()
    joined: List[Range] = []
    for path, off, n in found:
        if joined and joined[-1][0] == path and off <= joined[-1][1] + joined[-1][2]:
            p, o, m = joined[-1]
            joined[-1] = (p, o, max(m, off + n - o))
        elif n > 0:
            joined.append((path, off, n))
    return joined


class Prefetcher:
    """A daemon thread issuing WILLNEED hints for the ranges handed to ask(); close() ends it.
    Hints are only hints: any failure is ignored (the conversion reads what it needs anyway)."""

    def __init__(self):
        self._q: "queue.Queue[Optional[List[Range]]]" = queue.Queue()
        self._fds: dict = {}
        self._thread = threading.Thread(target=self._run, name="ckptool-prefetch", daemon=True)
        self._thread.start()

    def ask(self, lazies: Iterable) -> None:
        ranges = source_ranges(lazies)
        if ranges:
            self._q.put(ranges)

    def _run(self) -> None:
        while True:
            ranges = self._q.get()
            if ranges is None:
                break
            for path, off, n in ranges:
                try:
                    fd = self._fds.get(path)
                    if fd is None:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


def prefetcher() -> Optional[Prefetcher]:
    """A Prefetcher when read-ahead is on and the platform has posix_fadvise, else None."""
    if groups_ahead() == 0 or not hasattr(os, "posix_fadvise"):
        return None
    return Prefetcher()
