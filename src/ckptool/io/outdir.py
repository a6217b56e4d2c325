"""Output directories that appear complete or not at all.

A run writes into a hidden sibling of DST (`.DST.ckptool-partial-*`, PartialDir) and renames it into
place only after every file and the manifest (written last) are complete; DST itself is never half
written. The run owns its partial output through a lock (io/writer_lock.py): a second run writing
the same DST refuses at once, and the next run removes only the leftovers of runs that are gone
(killed, crashed). An interrupted run removes its own (a signal raises in the main thread,
stopping.py). An existing DST is refused unless force=True; then it is set aside, and removed only
once the new DST is in its place (put back if the run fails first). DST may not lie inside a source.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterable, Optional
import errno

from .. import stopping
from ..errors import CkptError
from . import writer_lock
from .chunked import HASH_NAME, file_digest
from . import profile

MANIFEST = "ckptool-manifest.json"
PARTIAL_TAG = ".ckptool-partial-"


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def check_destination(dst: Path, sources: Iterable[Path] = (), force: bool = False) -> None:
    dst = Path(dst)
    for src in sources:
        src = Path(src)
        src_dir = src if src.is_dir() else src.parent
        if _inside(dst, src_dir):
            raise CkptError(f"the output {dst} lies inside the source {src_dir}",
                            "write the output somewhere outside the source checkpoint")
        if _inside(src_dir, dst):
            raise CkptError(f"the source {src_dir} lies inside the output {dst}",
                            "choose an output directory that does not contain the source")
    if dst.exists() and not force:
        raise CkptError(f"{dst} already exists", "pass --force to replace it, or choose another path")
    if dst.exists() and not dst.is_dir():
        raise CkptError(f"{dst} exists and is not a directory")


# Manifest digests (chunked.HASH_NAME) of files this process wrote, computed while writing:
# path -> (size, mtime_ns, digest). Under torchrun every rank sends its own to rank 0
# (known_digests / adopt_digests), so sealing never reads an output file back.
_KNOWN_DIGESTS: dict = {}


def remember_digest(path: Path, digest: str) -> None:
    st = os.stat(path)
    _KNOWN_DIGESTS[os.path.abspath(path)] = (st.st_size, st.st_mtime_ns, digest)


def known_digests(root: Path) -> dict:
    """The digests this process took while writing files under root (to send to rank 0)."""
    prefix = os.path.abspath(root) + os.sep
    return {p: v for p, v in _KNOWN_DIGESTS.items() if p.startswith(prefix)}


def adopt_digests(digests: dict) -> None:
    """Digests another process of the team took while writing (still checked against size and mtime)."""
    _KNOWN_DIGESTS.update(digests)


def _digest(path: Path) -> str:
    """The file's manifest digest: the one taken while writing it, else read and hashed in parallel."""
    known = _KNOWN_DIGESTS.get(os.path.abspath(path))
    if known is not None:
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) == known[:2]:
            return known[2]
    return file_digest(path)


def _plain_sha256(path: Path) -> str:
    """Manifests written before HASH_NAME hold one plain sha256 per file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(root: Path, tool: str = "ckptool") -> dict:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = [_digest(p) for p in files]  # each file's pieces hash in parallel when not known
    manifest = {
        "tool": tool,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hash": HASH_NAME,  # digest: sha256 over the sha256s of the file's 64 MiB pieces (chunked.py)
        "files": [{"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "digest": d}
                  for p, d in zip(files, digests)],
    }
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, root / MANIFEST)
    return manifest


def check_manifest(root: Path) -> list:
    """Problems found comparing a directory with its manifest ([] means it verifies)."""
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.is_file():
        return [f"{root}: no {MANIFEST} (not written by ckptool, or the write did not finish)"]
    try:
        manifest = json.loads(mpath.read_text())
        entries = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable manifest ({e})"]
    algorithm = manifest.get("hash", "sha256")  # manifests before HASH_NAME: plain sha256 per file
    if algorithm not in ("sha256", HASH_NAME):
        return [f"{mpath}: unknown hash {algorithm!r} (written by a newer ckptool?)"]
    problems = []
    listed = set()
    for entry in entries:
        p = root / entry["path"]
        listed.add(entry["path"])
        if not p.is_file():
            problems.append(f"missing file {entry['path']}")
        elif p.stat().st_size != entry["size"]:
            problems.append(f"{entry['path']}: size {p.stat().st_size}, manifest says {entry['size']}")
        elif "sha256" in entry and _plain_sha256(p) != entry["sha256"]:
            problems.append(f"{entry['path']}: sha256 differs from the manifest")
        elif "sha256" not in entry and file_digest(p) != entry.get("digest"):
            problems.append(f"{entry['path']}: {algorithm} digest differs from the manifest")
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and p.name != MANIFEST and rel not in listed:
            problems.append(f"unexpected file {rel}")
    return problems


# --- the partial output of one run -------------------------------------------------------------------
# Beside DST, while run X writes it: `.DST.ckptool-partial-X` (the files), `.DST.ckptool-partial-X.lock`
# (the run's lock, io/writer_lock.py) and, during --force's swap, `.DST.ckptool-partial-X.old` (the old
# DST set aside). The lock is a sibling, not a file inside the partial directory: one inside would be
# renamed into DST with the rest, and removing it just before that rename would leave a moment in which
# the finished partial output looks abandoned to another run.
LOCK_SUFFIX, OLD_SUFFIX = ".lock", ".old"
CLAIM_TRIES = 8  # names tried when other runs clearing leftovers keep taking the new lock away


def _run_base(dst: Path, run_id: str) -> Path:
    return dst.parent / f".{dst.name}{PARTIAL_TAG}{run_id}"


def _runs_beside(dst: Path) -> set:
    """The run ids of every partial output, lock and set-aside DST beside dst."""
    prefix = f".{dst.name}{PARTIAL_TAG}"
    return {name[len(prefix):].split(".", 1)[0] for name in os.listdir(dst.parent) if name.startswith(prefix)}


def tree_size(root: Path) -> tuple:
    """(files, bytes) under root."""
    sizes = [p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return len(sizes), sum(sizes)


class PartialDir:
    """The hidden directory one run writes DST into, owned by the run through its lock.

    claim() checks DST may be written, takes the lock, makes the directory and then clears what
    earlier runs left beside DST, refusing at once when a live run is writing the same DST. seal()
    writes the manifest, fsyncs and puts the directory in DST's place; release() (always, also after a
    failure or a signal) removes whatever is not DST: the unsealed partial output, the old DST that
    --force replaced (put back when the new one never took its place), the lock."""

    def __init__(self, dst: Path, force: bool, run_id: str, lock_fd: int):
        self.dst, self.force = dst, force
        base = _run_base(dst, run_id)
        self.path, self.lock = base, Path(f"{base}{LOCK_SUFFIX}")
        self.old = Path(f"{base}{OLD_SUFFIX}")
        self.lock_fd: Optional[int] = lock_fd
        self.sealed = False
        self.replaced: Optional[tuple] = None  # (files, bytes) of the DST --force replaces, for the report

    @classmethod
    def claim(cls, dst, sources: Iterable[Path] = (), force: bool = False) -> "PartialDir":
        dst = Path(dst)
        check_destination(dst, sources, force=True)  # where DST lies; whether it exists: once it is ours
        dst.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(CLAIM_TRIES):
            run_id = uuid.uuid4().hex[:8]
            fd = writer_lock.claim(Path(f"{_run_base(dst, run_id)}{LOCK_SUFFIX}"))
            if fd is not None:
                break
        else:
            raise CkptError(f"could not claim {dst}: other runs keep clearing its partial outputs",
                            "run one ckptool at a time for this output")
        part = cls(dst, force, run_id, fd)
        try:
            # with the lock held (so that of two runs starting together at least one sees the other):
            # clear what gone runs left, which may put back a DST a killed --force run had set aside
            _clear_leftovers(dst, own=run_id)
            check_destination(dst, sources, force)
            part.replaced = tree_size(dst) if dst.is_dir() else None
            part.path.mkdir()
        except BaseException:
            part.release()
            raise
        _WRITING[dst] = part
        return part

    def seal(self, manifest: bool = True) -> None:
        """Manifest last, fsync, then rename the directory into place (swapping out an old DST)."""
        if manifest:
            with profile.stage("manifest"):
                write_manifest(self.path)
        with profile.stage("fsync"):
            _fsync_tree(self.path)
        if self.dst.exists() and not self.force:  # another run finished it meanwhile
            raise CkptError(f"{self.dst} was written by another run while this one wrote it",
                            "pass --force to replace it, or choose another path")
        with stopping.deferred():  # both renames or neither: a signal waits until they are done
            if self.dst.exists():
                os.replace(self.dst, self.old)
            os.replace(self.path, self.dst)
            self.sealed = True

    def release(self) -> None:
        """Remove all this run made beside DST except DST itself; let the lock go. Whole, whatever signal
        comes meanwhile (stopping.surely)."""
        stopping.surely(self._release)

    def _release(self) -> None:
        if self.lock_fd is None:
            return
        if not self.sealed:
            shutil.rmtree(self.path, ignore_errors=True)
        _settle_old(self.dst, self.old)
        writer_lock.release(self.lock_fd, self.lock)
        self.lock_fd = None


# DST -> its PartialDir while this process writes it (sealed or not): what a stopped command reports
_WRITING: dict = {}


def stop_outcome() -> str:
    """What a command stopped by a signal leaves behind, in words for its one line."""
    if not _WRITING:
        return "nothing was written"
    part = list(_WRITING.values())[-1]
    if part.sealed:
        return f"{part.dst} had been written completely"
    if part.replaced is not None:
        return f"{part.dst} is left as it was"
    return f"nothing was written to {part.dst}"


def _settle_old(dst: Path, old: Path) -> None:
    """The old DST set aside by a swap: put back when the new DST never took its place, else removed."""
    if not old.exists():
        return
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, dst)


def _clear_leftovers(dst: Path, own: str) -> None:
    """Remove what runs that are gone left beside dst; refuse at once when a live run writes dst."""
    for run_id in sorted(_runs_beside(dst) - {own}):
        base = _run_base(dst, run_id)
        with writer_lock.if_abandoned(Path(f"{base}{LOCK_SUFFIX}")) as holder:
            if holder is not None:
                raise CkptError(f"{dst} is being written by {holder}",
                                "wait for it or choose another output")
            shutil.rmtree(base, ignore_errors=True)
            _settle_old(dst, Path(f"{base}{OLD_SUFFIX}"))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{base}{LOCK_SUFFIX}")


@contextlib.contextmanager
def partial_output(dst, sources: Iterable[Path] = (), force: bool = False, manifest: bool = True):
    """Yield the PartialDir of dst; on success it is sealed into dst (manifest written last), and
    whatever happens nothing but dst is left."""
    part = PartialDir.claim(dst, sources, force)
    try:
        yield part
        part.seal(manifest)
    finally:
        part.release()


@contextlib.contextmanager
def atomic_output_dir(dst, sources: Iterable[Path] = (), force: bool = False,
                      manifest: bool = True):
    """Yield a temporary directory; on success it becomes dst (with a manifest written last)."""
    with partial_output(dst, sources, force, manifest) as part:
        yield part.path


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError:
                pass


def translate_os_error(e: OSError, where: str) -> CkptError:
    if e.errno == errno.ENOSPC:
        return CkptError(f"no space left on the device while writing {where}",
                         "free disk space or write to another disk; nothing was left at the output")
    return CkptError(f"cannot write {where}: {e.strerror or e}")
