"""Which run owns a partial output: an fcntl.flock held on a lock file for as long as the run lives.

The kernel releases a flock when its process ends, however it ends (kill -9 included), so "nobody
holds the lock" means "the run that made this partial output is gone" and its leftovers may be
removed; a held lock means a live run is writing, and its partial output must be left alone. The
file also says who holds it (process id, start time), for the message another run prints.

A lock is claimed with O_EXCL (a fresh file), then flocked, then checked to be still the file at its
path: a run clearing leftovers may have taken and removed it in between (it looked abandoned while
it was being claimed), and the claimant then simply tries again under a new name.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional


# flock's errors on a file system that has no locks (some network and FUSE mounts): there every partial
# output is taken for a leftover, as before runs had locks, rather than refusing to write at all
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _lock(fd: int) -> bool:
    """flock(fd) without waiting: False when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in NO_LOCKS:
            raise
    return True


def claim(path: Path) -> Optional[int]:
    """A new lock file at path, flocked by this process: its descriptor (keep it open while the run
    lives), or None when another run took it away while it was being claimed (try another name)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return None
    try:
        if _lock(fd):
            os.write(fd, owner_text().encode())
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
    except FileNotFoundError:
        pass  # a run clearing leftovers has removed it already
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def owner_text() -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"process {os.getpid()} on {socket.gethostname()} (started {started})"


@contextlib.contextmanager
def if_abandoned(path: Path) -> Iterator[Optional[str]]:
    """Yield None while holding path's lock when no live run holds it (or there is no lock file: a
    leftover of a run killed before it made one, or of an older ckptool); else yield who holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        yield None if _lock(fd) else _read_owner(fd)
    finally:
        os.close(fd)


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"  # it has the lock but has not written its name yet


def release(fd: int, path: Path) -> None:
    """Remove the lock file, then let the lock go (in this order, so no other run finds it free)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)
