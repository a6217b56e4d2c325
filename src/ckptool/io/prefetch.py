"""Read-ahead while converting: the next layer's source bytes are brought into the page cache while
this one is converted (pull(): read by a background thread, the bytes themselves thrown away).

Why: with a cold source a conversion reads one tensor at a time (a pread waits for the disk), and
its CPU work (merges, transposes, checksums) leaves the disk idle in between. Start-up read-ahead
(startup.py) covers the first part of each file; this covers the rest, one group (a layer) ahead
of the loader. The reads fill the page cache only (reclaimable, not the process's memory), and only
GROUPS_AHEAD groups ahead, so a source larger than memory is not pushed out before it is used.
CKPTOOL_PREFETCH=0 turns it off (as does CKPTOOL_READAHEAD=0); CKPTOOL_PREFETCH=N asks N groups ahead.

Why read instead of hinting: posix_fadvise(WILLNEED) reads at most one read-ahead window per call
(Linux's force_page_cache_ra caps the request at max(read_ahead_kb, the device's largest I/O)),
so a hint for a 300 MiB layer brought in its first 8 MiB and nothing more (seen on the 16-core
device machine, read_ahead_kb 8192: the disk trace of a reshard was the same with and without the
hints; on the 2-core box a WILLNEED of a whole 256 MiB file cached 8 MiB of it). pull() instead
reads every byte, without copying it out of the kernel where it can: sendfile() to /dev/null
(the page cache is filled, the null device drops the pages unread), else pread() into one reused
piece-sized buffer. Either costs a thread blocked on the disk, not memory: the pages are the page
cache's, reclaimable, and the buffer is PIECE bytes.

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

PIECE = 8 << 20  # bytes pulled per call: small enough to stop soon when told to
# set once a conversion starts its own read-ahead (prefetcher()): start-up read-ahead ends there
HANDOVER = threading.Event()
_devnull: Optional[int] = None


def pull(fd: int, offset: int, length: int, stop: Optional[threading.Event] = None, piece: int = PIECE) -> int:
    """Bring bytes [offset, offset + length) of the open file fd into the page cache by reading them
    (see the module docstring); stops early at the end of the file or once stop is set. Returns the
    bytes read (at most piece bytes a call)."""
    global _devnull
    done, scratch = 0, None
    while done < length and not (stop is not None and stop.is_set()):
        n = min(piece, length - done)
        got = 0
        if scratch is None:
            try:
                if _devnull is None:
                    _devnull = os.open(os.devnull, os.O_WRONLY)
                got = os.sendfile(_devnull, fd, offset + done, n)
            except (OSError, AttributeError):  # no sendfile from this file system or platform
                scratch = bytearray(piece)
        if scratch is not None:
            got = os.preadv(fd, [memoryview(scratch)[:n]], offset + done)
        if got <= 0:
            break
        done += got
    return done


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
    """A daemon thread reading ahead the ranges handed to ask(); close() ends it (what it had not
    read yet is dropped). Read-ahead is only a help: any failure is ignored (the conversion reads
    what it needs anyway)."""

    def __init__(self):
        self._q: "queue.Queue[Optional[List[Range]]]" = queue.Queue()
        self._fds: dict = {}
        self._stop = threading.Event()
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
                if self._stop.is_set():
                    break
                try:
                    fd = self._fds.get(path)
                    if fd is None:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY)
                    pull(fd, off, n, self._stop)
                except OSError:
                    pass
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join()


def prefetcher() -> Optional[Prefetcher]:
    """A Prefetcher when read-ahead is on, else None. The start-up read-ahead (startup.py) ends
    here: from now on the conversion reads ahead what it will use next."""
    HANDOVER.set()
    if groups_ahead() == 0 or not hasattr(os, "preadv"):
        return None
    return Prefetcher()
