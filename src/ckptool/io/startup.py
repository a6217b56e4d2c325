"""What a conversion does before it imports torch (torch-free; called by the CLI before it parses).

Importing torch takes 1.5-3.5 s on a many-core host, before the first byte of the checkpoint is
read. Two things shorten or use that time:

- The bytecode cache. Container images often set PYTHONDONTWRITEBYTECODE=1 and install packages
  without compiling them, so every start compiles torch's ~2000 modules again (measured on the
  16-core device machine: `import torch` 3.2-3.5 s, 1.7 s from a cache). When the interpreter is
  told not to write bytecode beside the sources, no cache prefix is set and torch was installed
  without its bytecode, ckptool keeps the
  bytecode under its own cache folder (sys.pycache_prefix: nothing is written beside any source;
  Python checks each entry against its source's mtime). CKPTOOL_PYCACHE=0 turns this off;
  CKPTOOL_PYCACHE=DIR picks the folder (default $XDG_CACHE_HOME/ckptool/pycache).
- Read-ahead. A background thread reads the source's files into the page cache while torch is
  imported, so the disk works during the import (prefetch.pull: the bytes are read, not hinted,
  and thrown away). Only the first part of each file, the files in turn, at most a quarter of the
  available memory (and 8 GiB) in all, so a source larger than memory does not push out what the
  conversion needs; pages already cached cost nothing. It ends when the conversion starts its own
  read-ahead of the groups it converts next (prefetch.HANDOVER), so it never competes with reads
  in the order the conversion needs them. Only on hosts of MIN_CORES cores or more (see
  start_readahead()). CKPTOOL_READAHEAD=0 turns it off, CKPTOOL_READAHEAD=1 on everywhere.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence
import importlib.util

from . import prefetch

# commands whose first path argument is a checkpoint that is read whole
READING_COMMANDS = {"merge", "reshard", "fix-vocab", "to-hf", "from-hf"}
READAHEAD_CAP = 8 << 30
# bytes a start-up read-ahead call reads, with the kernel's own read-ahead off for its files: at
# most this much of the source is queued at the disk at any moment (see readahead())
STARTUP_PIECE = 4 << 20
MIN_CORES = 4  # fewer: no start-up read-ahead unless CKPTOOL_READAHEAD=1 (start_readahead())
_WALK_LIMIT = 20000  # entries looked at: a wrong argument (a home directory) must not cost seconds


def prepare(argv: Sequence[str]) -> Optional[threading.Thread]:
    """Called with the command line (without the program name) before anything imports torch."""
    use_own_bytecode_cache()
    return start_readahead(argv)


def use_own_bytecode_cache(probe: str = "torch") -> Optional[str]:
    """Keep compiled bytecode under ckptool's cache folder when the interpreter would otherwise
    recompile every module on every start (see the module docstring). Returns the folder used.

    probe: the package whose bytecode decides it: when it was compiled at install time (its
    __pycache__ beside the sources), the interpreter reads that and nothing needs changing."""
    choice = os.environ.get("CKPTOOL_PYCACHE", "")
    if choice == "0" or probe in sys.modules:  # too late to matter (an embedding program, tests)
        return None
    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return None  # bytecode is cached beside the sources or where the user said
    if _has_bytecode(probe):
        return None
    folder = Path(choice) if choice else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "ckptool" / "pycache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            return None
    except OSError:
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    return str(folder)


def _has_bytecode(package: str) -> bool:
    """Whether package's __init__ has its compiled bytecode beside it (found without importing it)."""
    try:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return True  # not there, or not Python source: nothing to gain
        return os.path.exists(importlib.util.cache_from_source(spec.origin))
    except (ImportError, ValueError, NotImplementedError):
        return True


def source_argument(argv: Sequence[str]) -> Optional[Path]:
    """The checkpoint a reading command will read: the first argument after the command name that
    names an existing file or folder (options and their values do not)."""
    args = list(argv)
    at = next((i for i, a in enumerate(args) if a in READING_COMMANDS), None)
    if at is None:
        return None
    for a in args[at + 1:]:
        if a.startswith("-"):
            continue
        p = Path(a)
        if p.exists():
            return p
    return None


def files_to_read(src: Path) -> List[Path]:
    """The source's files, largest share first in the order a reader meets them: the tracked
    iteration's folder when a Megatron or DeepSpeed tracker names one, else everything under src."""
    if src.is_file():
        return [src]
    root = src
    for tracker in ("latest_checkpointed_iteration.txt", "latest"):
        t = src / tracker
        if t.is_file() and t.stat().st_size < 256:
            try:
                tag = t.read_text().strip()
            except (OSError, UnicodeDecodeError):
                continue
            for name in (f"iter_{int(tag):07d}" if tag.isdigit() else tag, tag):
                if name and (src / name).is_dir():
                    root = src / name
                    break
            break
    files, seen = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            seen += 1
            if seen > _WALK_LIMIT:
                return files
            files.append(Path(dirpath) / name)
    return files


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def readahead(files: Sequence[Path], cap: int, stop: Optional[threading.Event] = None) -> int:
    """Read the first cap/len(files) bytes of each file into the page cache (small files whole),
    the files in turn, a few pieces of each at a time, so every file's head arrives early; ends
    once stop is set. Returns the bytes read.

    Read, not hinted (posix_fadvise WILLNEED): the kernel caps a hint at one read-ahead window,
    8 MiB of a 2 GiB share on the device machine (prefetch.py says more).

    One STARTUP_PIECE at a time, the kernel's read-ahead off for these reads (POSIX_FADV_RANDOM on
    this open file only): the import running beside it reads torch's libraries page fault by page
    fault, each a small synchronous read that queues behind whatever the disk was given first.
    With sendfile's usual read-ahead (8 MiB pieces and windows) in flight, the import took 6.8 s
    instead of 2.1 s on the device machine (session 10): it waited behind 8 GiB of source reads.
    With one 4 MiB read queued at a time, an import fault waits for a few milliseconds at most."""
    if not files or cap <= 0:
        return 0
    sizes = []
    for p in files:
        try:
            sizes.append((p, p.stat().st_size))
        except OSError:
            pass
    # small files (configs, trackers, optimizer-less ranks) whole first, then equal shares of the rest
    sizes.sort(key=lambda x: x[1])
    todo, left = [], cap
    for i, (p, size) in enumerate(sizes):
        share = min(size, left // (len(sizes) - i))
        if share > 0:
            todo.append([p, 0, share])
            left -= share
    step = 4 * prefetch.PIECE
    done = 0
    while todo and not (stop is not None and stop.is_set()):
        for item in list(todo):
            p, at, share = item
            n = min(step, share - at)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                todo.remove(item)
                continue
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                got = prefetch.pull(fd, at, n, stop, STARTUP_PIECE)
            except OSError:
                got = 0
            finally:
                os.close(fd)
            done += got
            item[1] += got
            if got < n or item[1] >= share:
                todo.remove(item)
            if stop is not None and stop.is_set():
                break
    return done


def readahead_cap() -> int:
    """READAHEAD_CAP, or CKPTOOL_READAHEAD_CAP GiB (a knob for measuring how much helps)."""
    try:
        return int(float(os.environ["CKPTOOL_READAHEAD_CAP"]) * (1 << 30))
    except (KeyError, ValueError):
        return READAHEAD_CAP


def readahead_wanted() -> bool:
    """Read-ahead beside the work: CKPTOOL_READAHEAD=1 or 0 decides, else only with MIN_CORES cores (below)."""
    choice = os.environ.get("CKPTOOL_READAHEAD", "")
    return choice == "1" or (choice != "0" and (os.cpu_count() or 1) >= MIN_CORES)


def start_readahead(argv: Sequence[str]) -> Optional[threading.Thread]:
    """Read-ahead of the command's source on a daemon thread (returns it, or None). Only on hosts
    with cores to spare (MIN_CORES): torch's import keeps a core busy, and on the 2-core box the
    read-ahead's system time (page allocation, I/O completion) slowed the import by about as much
    as the bytes it read saved later (session 10). CKPTOOL_READAHEAD=1 turns it on anywhere."""
    if not readahead_wanted():
        return None
    src = source_argument(argv)
    if src is None:
        return None
    cap = min(readahead_cap(), available_memory() // 4)

    def run() -> None:
        try:
            readahead(files_to_read(src), cap, prefetch.HANDOVER)
        except OSError:
            pass  # only a hint: the conversion reads what it needs anyway

    thread = threading.Thread(target=run, name="ckptool-readahead", daemon=True)
    thread.start()
    return thread
