"""Checksums over the cores: the manifest digest and zip CRC32, computed piece by piece in parallel.

Why: sha256 and CRC32 are sequential within one stream (~1.3-2 GB/s per core). A merge writes
one multi-GB file, so one core hashing it set the pace on a 16-core host (docs/benchmarks.md).

The manifest digest (HASH_NAME) is therefore defined over fixed pieces of the file: the sha256 of
the concatenated sha256 digests of each consecutive PIECE bytes of the file (the last piece may be
shorter; an empty file has no pieces, so its digest is sha256 of nothing). Changing any byte
changes its piece's digest and so the file's: the guarantee is sha256's, and the pieces hash on
as many cores as there are. Manifests written before it name no algorithm and hold one plain
sha256 per file; outdir.check_manifest verifies both.

CRC32 (zip records) is computed per piece too and the pieces combined (crc32_combine below:
CRC arithmetic over GF(2), so the result equals zlib.crc32 of the whole record).

With CKPTOOL_FUSED_SUMS=1 both sums of a zip record are taken in one pass instead
(PieceDigest.feed(view, crc=True)): one task per manifest piece the record overlaps walks it in
BLOCK-sized steps, sha256 then CRC32 of each block, so the CRC reads what the hash has just
brought into the core's cache. It is not the default because it measured no faster
(docs/benchmarks.md, session 8): on 16 cores, cold 12 GB sources, the walls were the same within
the noise and the writers waited longer (a piece's two sums run one after the other on one core
instead of side by side on two), and on the 2-core box a merge took the same CPU time. The bytes
written are the same either way.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from . import profile

HASH_NAME = "sha256-64MiB-pieces"
PIECE = 64 << 20  # manifest digest piece: large enough that per-piece overhead is nil
CRC_PIECE = 16 << 20  # CRC work unit: a 400 MiB record splits over 25 tasks
_SMALL = 1 << 20  # below this, hashing inline beats a round trip through the pool
BLOCK = 2 << 20  # fused pass: sha256 and CRC32 take turns over blocks this size (a core's L2)
FUSED = os.environ.get("CKPTOOL_FUSED_SUMS", "0") == "1"  # see the top: measured, not faster

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads for checksum work: the cores this process may run on (hashlib and zlib drop the GIL),
    at most CKPTOOL_THREADS when that is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, int(os.environ.get("CKPTOOL_THREADS", "0") or 0) or n))


def pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(2, workers()), thread_name_prefix="ckptool-sum")
        return _pool


# --- CRC32 -----------------------------------------------------------------------------------
# zlib's CRC32 is reflected with polynomial 0xEDB88320. crc(A || B) = crc(A) * x^(8|B|) + crc(B)
# (mod P, with the pre/post inversion cancelling out), so pieces combine with one multiplication
# by x^(8n) mod P, itself a product of precomputed x^(2^k) mod P.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo P, both as reflected 32-bit polynomials (bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not (a & (m - 1)):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2K = [1 << 30]  # x^(2^k) mod P for k = 0, 1, ...: x^1 is bit 30 when x^0 is bit 31
for _ in range(63):
    _X2K.append(_multmodp(_X2K[-1], _X2K[-1]))


def _x8n(n: int) -> int:
    """x^(8n) mod P."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2K[k], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(A + B) from crc1 = crc32(A), crc2 = crc32(B) and len(B)."""
    return _multmodp(_x8n(len2), crc1) ^ crc2


def _crc(view) -> int:
    with profile.stage("crc32", len(view)):
        return zlib.crc32(view)


def crc32_parallel(view: memoryview) -> int:
    """zlib.crc32(view), its pieces computed on the pool."""
    n = len(view)
    if n <= CRC_PIECE:
        return _crc(view)
    spans = [(i, min(n, i + CRC_PIECE)) for i in range(0, n, CRC_PIECE)]
    futures = [pool().submit(_crc, view[a:b]) for a, b in spans]
    crc = 0
    for (a, b), f in zip(spans, futures):
        crc = crc32_combine(crc, f.result(), b - a)
    return crc


def crc32_start(view: memoryview) -> list:
    """Start CRC32 of view's pieces on the pool; crc32_finish(...) gives the record's CRC."""
    n = len(view)
    spans = [(i, min(n, i + CRC_PIECE)) for i in range(0, n, CRC_PIECE)] or [(0, 0)]
    return [(b - a, pool().submit(_crc, view[a:b])) for a, b in spans]


def crc32_finish(started: list) -> int:
    """The CRC of consecutive parts [(length, crc)], each crc an int, or a future of an int or of
    a (digest, crc) pair (a whole piece summed in one pass)."""
    crc = 0
    for length, part in started:
        value = part.result() if hasattr(part, "result") else part
        crc = crc32_combine(crc, value[1] if isinstance(value, tuple) else value, length)
    return crc


# --- the manifest digest ---------------------------------------------------------------------

def _sha(view) -> tuple:
    with profile.stage("hash", len(view)):
        return hashlib.sha256(view).digest(), None


def _sums(h, view) -> int:
    """h.update(view) and zlib.crc32(view) in one pass over memory, block by block (see the top)."""
    crc, n = 0, len(view)
    clock, spent_hash, spent_crc = time.perf_counter, 0.0, 0.0
    for at in range(0, n, BLOCK):
        block = view[at:at + BLOCK]
        t0 = clock()
        h.update(block)
        t1 = clock()
        crc = zlib.crc32(block, crc)
        spent_hash += t1 - t0
        spent_crc += clock() - t1
    profile.add("hash", spent_hash, n)  # leaf work on a pool thread: no enclosing stage to subtract
    profile.add("crc32", spent_crc, n)
    return crc


def _piece_sums(view) -> tuple:
    h = hashlib.sha256()
    crc = _sums(h, view)
    return h.digest(), crc


class PieceDigest:
    """The manifest digest of a file fed in order, in writes of any size.

    feed(view) starts hashing view's complete pieces on the pool and returns at once; the caller
    keeps view's memory unchanged until settle() (or hexdigest()) returns. A piece split across
    feeds is continued in one hashlib object (header-sized writes between tensor records)."""

    def __init__(self):
        self._pieces: List = []  # per piece, in file order: a future of its digest, or an open hasher
        self._partial = None      # the open piece's hasher, or None
        self._partial_len = 0
        self._partial_job = None  # the last hashing job on the open piece
        self._pending: list = []  # jobs that may still read caller memory

    def feed(self, view, crc: bool = False) -> Optional[list]:
        """Start hashing view. crc=True also takes view's CRC32 in the same pass and returns its
        parts for crc32_finish (ready once settle() has returned)."""
        view = memoryview(view).cast("B")
        n, pos = len(view), 0
        parts: list = []
        if self._partial is not None:  # finish the open piece first
            take = min(n, PIECE - self._partial_len)
            parts.append((take, self._extend_partial(view[:take], crc)))
            pos = take
        while n - pos >= PIECE:
            job = pool().submit(_piece_sums if crc else _sha, view[pos:pos + PIECE])
            self._pieces.append(job)
            self._pending.append(job)
            parts.append((PIECE, job))
            pos += PIECE
        if pos < n:
            parts.append((n - pos, self._extend_partial(view[pos:], crc)))
        return parts if crc else None

    def _extend_partial(self, view, crc: bool = False):
        """Feed view to the open piece's hasher (opening one if none); with crc, returns view's
        CRC32 (an int, or a future of one)."""
        if self._partial is None:
            self._partial, self._partial_len = hashlib.sha256(), 0
            self._pieces.append(self._partial)
        if self._partial_job is not None:
            self._partial_job.result()  # updates of one hasher go in order
            self._partial_job = None
        out = None
        if len(view) >= _SMALL:
            self._partial_job = pool().submit(_sums if crc else _update, self._partial, view)
            self._pending.append(self._partial_job)
            out = self._partial_job
        elif crc:
            out = _sums(self._partial, view)
        else:
            self._partial.update(view)
        self._partial_len += len(view)
        if self._partial_len == PIECE:
            # complete; its digest is read in hexdigest(). Its last job is in _pending (settle waits
            # for it); the next piece's hasher need not wait for it: a record that ends one piece
            # and begins the next used to wait here, on the calling thread, for the first hash
            self._partial = self._partial_job = None
        return out

    def settle(self) -> None:
        """Wait until no hashing job reads memory passed to feed()."""
        pending, self._pending = self._pending, []
        for job in pending:
            job.result()
        self._partial_job = None

    def hexdigest(self) -> str:
        self.settle()
        parts = [p.digest() if hasattr(p, "digest") else p.result()[0] for p in self._pieces]
        return hashlib.sha256(b"".join(parts)).hexdigest()


def _update(h, view) -> None:
    with profile.stage("hash", len(view)):
        h.update(view)


def digest_bytes(data) -> str:
    d = PieceDigest()
    d.feed(data)
    return d.hexdigest()


def file_digest(path) -> str:
    """The manifest digest of a file on disk, its pieces read and hashed in parallel."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    block = 8 << 20

    def piece(offset: int) -> bytes:
        h, buf = hashlib.sha256(), bytearray(block)  # memory: threads x 8 MiB
        end = min(size, offset + PIECE)
        while offset < end:
            view = memoryview(buf)[:min(block, end - offset)]
            got = os.preadv(fd, [view], offset)
            if got <= 0:
                raise OSError(f"{path}: file shrank while being hashed")
            h.update(view[:got])
            offset += got
        return h.digest()

    try:
        with ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="ckptool-verify") as ex:
            parts = list(ex.map(piece, range(0, size, PIECE)))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(parts)).hexdigest()
