"""Early write-back for large output files (Linux), so the page cache never fills with dirty output.

Why: a conversion writes gigabytes through write() into the page cache. Left alone, the kernel
lets dirty pages pile up to its dirty limit and then throttles the writer (balance_dirty_pages),
and the final fsync has most of the file still to write. On the 2-core CI VM a plain 2 GiB
sequential write + fsync took 1.3-7.2 s depending on what was already dirty; starting write-back
after every window (sync_file_range WRITE), waiting for the window before it and dropping those
clean pages (posix_fadvise DONTNEED) took 0.9-1.1 s every time, with a third of the system time.
The dropped pages were already hashed for the manifest, so nothing reads them back.
In ckptool itself (2.24 GB TP2 PP2 bf16, scripts/bench.py, two alternating runs each, see
docs/benchmarks.md): merge 11.7 / 10.0 s -> 7.8 / 5.8 s, reshard --tp 4 9.8 / 8.3 s -> 7.6 / 6.2 s,
system time about halved. CKPTOOL_WRITEBACK=0 turns it off (to measure without it).

sync_file_range is not in Python's os module; it is called through libc with ctypes. Anywhere it is
missing (not Linux, no libc symbol) or refused (a filesystem or file that does not support it),
the writer goes on without it: this only changes when bytes reach the disk, never what is written.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

from . import profile

WINDOW = 64 << 20  # bytes per write-back window: large enough for big disk requests
LAG = int(os.environ.get("CKPTOOL_WRITEBACK_LAG", "4") or 4)  # windows in flight before waiting

# <fcntl.h>: SYNC_FILE_RANGE_WAIT_BEFORE = 1, SYNC_FILE_RANGE_WRITE = 2, SYNC_FILE_RANGE_WAIT_AFTER = 4
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _load_sync_file_range():
    if not sys.platform.startswith("linux") or os.environ.get("CKPTOOL_WRITEBACK") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class Writeback:
    """Tracks how far one sequentially written file is and pushes it to disk window by window.

    Call written(n) after each write() of n bytes to f.
    """

    def __init__(self, f):
        self.f, self.fd = f, f.fileno()
        self.pos = 0       # bytes written so far
        self.started = 0   # [0, started) has had write-back started
        self.settled = 0   # [0, settled) is on disk and dropped from the page cache
        self.windows: list = []  # ends of the windows started and not yet settled, oldest first
        self.enabled = _sync_file_range is not None

    def written(self, nbytes: int) -> None:
        self.pos += nbytes
        if not self.enabled or self.pos - self.started < WINDOW:
            return
        self.f.flush()  # bytes still in Python's buffer are not the kernel's to write
        # start this window's write-back; once more than LAG windows are on their way, wait for
        # the oldest (by now mostly done) and drop it: write() never meets a full dirty limit,
        # and the disk always has LAG windows queued (one was too few to keep a fast disk busy)
        with profile.stage("writeback"):  # starting it can block too, on a full device queue
            started = self._call(self.started, self.pos - self.started, _WRITE)
        if not started:
            return
        self.windows.append(self.pos)
        self.started = self.pos
        while len(self.windows) > LAG:
            end = self.windows.pop(0)
            with profile.stage("writeback"):
                settled = self._call(self.settled, end - self.settled, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            if settled:
                _drop(self.fd, self.settled, end - self.settled)
            self.settled = end

    def _call(self, offset: int, nbytes: int, flags: int) -> bool:
        if _sync_file_range(self.fd, offset, nbytes, flags) != 0:
            self.enabled = False  # EINVAL/ESPIPE/ENOSYS...: this file cannot; the final fsync still holds
            return False
        return True


def _drop(fd: int, offset: int, nbytes: int) -> None:
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def for_file(f) -> Optional[Writeback]:
    try:
        return Writeback(f)
    except (OSError, AttributeError, ValueError):
        return None
