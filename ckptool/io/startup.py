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
- Read-ahead. A background thread asks the kernel (posix_fadvise WILLNEED) to start reading the
  source's files while torch is imported, so the disk works during the import. Only the first
  part of each file is asked for, at most a quarter of the available memory (and 8 GiB) in all, so
  a source larger than memory does not push out what the conversion needs; pages already cached
  cost nothing. CKPTOOL_READAHEAD=0 turns it off.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence

# commands whose first path argument is a checkpoint that is read whole
READING_COMMANDS = {"merge", "reshard", "fix-vocab", "to-hf", "from-hf"}
READAHEAD_CAP = 8 << 30
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
    import importlib.util
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


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def readahead(files: Sequence[Path], cap: int) -> int:
    """Ask the kernel to read the first cap/len(files) bytes of each file (small files whole).
    Returns the bytes asked for."""
    if not hasattr(os, "posix_fadvise") or not files or cap <= 0:
        return 0
    sizes = []
    for p in files:
        try:
            sizes.append((p, p.stat().st_size))
        except OSError:
            pass
    asked, left = 0, cap
    # small files (configs, trackers, optimizer-less ranks) whole first, then equal shares of the rest
    sizes.sort(key=lambda x: x[1])
    for i, (p, size) in enumerate(sizes):
        share = min(size, left // (len(sizes) - i))
        if share <= 0:
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, share, os.POSIX_FADV_WILLNEED)
            asked += share
            left -= share
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def start_readahead(argv: Sequence[str]) -> Optional[threading.Thread]:
    """Read-ahead of the command's source on a daemon thread (returns it, or None)."""
    if os.environ.get("CKPTOOL_READAHEAD", "") == "0":
        return None
    src = source_argument(argv)
    if src is None:
        return None
    cap = min(READAHEAD_CAP, _available_memory() // 4)

    def run() -> None:
        try:
            readahead(files_to_read(src), cap)
        except OSError:
            pass  # only a hint: the conversion reads what it needs anyway

    thread = threading.Thread(target=run, name="ckptool-readahead", daemon=True)
    thread.start()
    return thread
