"""Where a conversion's time goes, stage by stage (CKPTOOL_PROFILE=1; off by default, free when off).

Each stage is timed where it runs, in whichever thread, and reported as thread-seconds: with
stages running in parallel on several cores, their sum exceeds the wall time, and a stage whose
thread-seconds approach the wall time is the one that sets the pace. Timing is exclusive: a stage
entered inside another (a file read inside a merge) is subtracted from the outer one, so the rows
add up to the work done. At exit the process prints one line to stderr,

    ckptool-profile {"wall": s, "cpu_user": s, "cpu_sys": s, "startup": s, "stages": {name: [s, bytes]}}

which scripts/bench.py --profile collects (one line per process under torchrun).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

ENABLED = os.environ.get("CKPTOOL_PROFILE") == "1"

# the stages, in pipeline order, with what each one covers (bench.py prints them in this order)
STAGES = {
    "startup": "interpreter start to the command's first line (imports: torch, ckptool)",
    "plan": "opening the source, pickling the target's data.pkl, planning files",
    "read": "pread of source bytes into memory",
    "merge": "allocating merged tensors, interleaving tensor-parallel parts",
    "transform": "transposes, QKV reorders, dtype casts, concatenations",
    "check": "fp32 optimizer masters checked against their model weights (cast and compare)",
    "prepare": "contiguous copies and compacting clones of tensors before they are written",
    "zip": "zip headers and records through torch's writer (its own CRC32 included when used)",
    "crc32": "CRC32 of zip records (ckptool's own, chunked over the cores)",
    "hash": "manifest hash of the output (chunked over the cores)",
    "write": "write() of output bytes into the page cache",
    "writeback": "waiting for early write-back of the output (sync_file_range)",
    "wait": "a thread waiting for another (loader for writer, writer for its checksum pieces)",
    "fsync": "fsync of the output directory's files",
    "manifest": "manifest: hashing files not hashed while written, writing the json",
    "team": "torchrun: joining the gloo process group",
    "reference-import": "verify: importing transformers' model code (on the reference's own thread)",
    "reference-load": "verify: loading the transformers reference (on its own thread, beside the target)",
    "reference-readahead": "verify: the reference's weight files read into the page cache (own thread)",
    "main-other": "main thread outside every stage above (Python work, progress, process group, exit)",
}

_lock = threading.Lock()
_totals: dict = {}
_local = threading.local()
_T0 = time.perf_counter()
_main = [0.0]


@contextlib.contextmanager
def stage(name: str, nbytes: int = 0):
    """Time the block as stage name (exclusive of stages nested inside it)."""
    if not ENABLED:
        yield
        return
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    frame = [0.0]  # time spent in nested stages
    stack.append(frame)
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        stack.pop()
        if stack:
            stack[-1][0] += took
        elif threading.current_thread() is threading.main_thread():
            _main[0] += took  # the main thread's time inside any stage
        add(name, took - frame[0], nbytes)


def add(name: str, seconds: float, nbytes: int = 0) -> None:
    if not ENABLED:
        return
    with _lock:
        s = _totals.setdefault(name, [0.0, 0])
        s[0] += seconds
        s[1] += nbytes


def _process_age() -> float:
    """Seconds since this process started (Linux /proc), or 0 where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


_STARTUP = None


def command_started() -> None:
    """Called once the command line is parsed: everything before it counts as start-up."""
    global _STARTUP
    if ENABLED and _STARTUP is None:
        _STARTUP = _process_age()


def report() -> dict:
    t = os.times()
    with _lock:
        stages = {k: [round(v[0], 3), v[1]] for k, v in _totals.items()}
    startup = _STARTUP or 0.0
    wall = _process_age() or time.perf_counter() - _T0
    if startup:
        stages["startup"] = [round(startup, 3), 0]
        stages["main-other"] = [round(max(0.0, wall - startup - _main[0]), 3), 0]
    return {"wall": round(wall, 3), "cpu_user": round(t.user, 2),
            "cpu_sys": round(t.system, 2), "cores": os.cpu_count(), "stages": stages}


def _print_at_exit() -> None:
    # one write() of one line: the ranks of a torchrun share stderr, and lines must not interleave
    try:
        sys.stderr.flush()
        os.write(2, ("ckptool-profile " + json.dumps(report()) + "\n").encode())
    except OSError:
        pass


if ENABLED:
    atexit.register(_print_at_exit)
