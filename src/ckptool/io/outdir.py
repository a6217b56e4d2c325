"""Output directories that appear complete or not at all.

atomic_output_dir() writes into a hidden temporary sibling of DST and renames it into place only
after every file and the manifest (written last) are complete. An interrupted run leaves at most
a `.DST.ckptool-partial-*` directory, which the next run removes; DST itself is never half
written. An existing DST is refused unless force=True, and DST may not lie inside the source.
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
from typing import Iterable

from ..errors import CkptError
from .chunked import HASH_NAME, file_digest

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


def _clean_stale(dst: Path) -> None:
    for stale in dst.parent.glob(f".{dst.name}{PARTIAL_TAG}*"):
        shutil.rmtree(stale, ignore_errors=True)


def make_partial_dir(dst, sources: Iterable[Path] = (), force: bool = False) -> Path:
    """Check dst may be written and create the hidden temporary sibling that becomes it."""
    dst = Path(dst)
    check_destination(dst, sources, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(dst)
    tmp = dst.parent / f".{dst.name}{PARTIAL_TAG}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def seal_partial_dir(tmp: Path, dst, manifest: bool = True) -> None:
    """Manifest last, fsync, then rename tmp into place (replacing an old dst)."""
    dst = Path(dst)
    from . import profile
    if manifest:
        with profile.stage("manifest"):
            write_manifest(tmp)
    with profile.stage("fsync"):
        _fsync_tree(tmp)
    if dst.exists():
        old = dst.parent / f".{dst.name}{PARTIAL_TAG}old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


@contextlib.contextmanager
def atomic_output_dir(dst, sources: Iterable[Path] = (), force: bool = False,
                      manifest: bool = True):
    """Yield a temporary directory; on success it becomes dst (with a manifest written last)."""
    tmp = make_partial_dir(dst, sources, force)
    try:
        yield tmp
        seal_partial_dir(tmp, dst, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    import errno
    if e.errno == errno.ENOSPC:
        return CkptError(f"no space left on the device while writing {where}",
                         "free disk space or write to another disk; nothing was left at the output")
    return CkptError(f"cannot write {where}: {e.strerror or e}")
