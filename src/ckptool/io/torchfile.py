"""Torch checkpoint files (torch.save zip archives) read lazily and written by streaming.

Reading: the archive's data.pkl is unpickled with the restricted unpickler, but every tensor comes
back as a StoredTensor: a (file, record, offset, size, stride) handle. Bytes are read with pread
only when a writer asks, and only the span that tensor (or a narrowed slice of it) covers, so a
ZeRO flat partition or one layer of a big file costs what it holds, not the file.
Files written before torch 1.6 (not zip archives) are read eagerly through torch.load with the
same restricted unpickler.

Writing: save_streaming() pickles a structure whose leaves may be LazyTensors, then writes each
storage record with torch's own archive writer, loading one tensor at a time.
"""
from __future__ import annotations

import collections
import io
import os
import threading
import zlib
from pathlib import Path
from typing import Any, Optional
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import CkptError
from ..lazy import Const, Derived, LazyTensor, itemsize
from ..lazy import load_scopes as lazy_scopes
from . import buffers, chunked, dtensor, prefetch, profile, torchzip, writeback
from .buffers import empty
from .outdir import remember_digest
from .zip_records import zip_records
from .safe_pickle import (UNSUPPORTED_TORCH_REBUILDS, SafeUnpickler, StandInPickler, check_rebuild_from_type,
                          rebuild_unsupported, torch_pickle_module)
from ..lazy import load_scope
from .memory import bound_heap, trim

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128, "UntypedStorage": torch.uint8,
    "Float8_e4m3fnStorage": getattr(torch, "float8_e4m3fn", torch.uint8),
    "Float8_e5m2Storage": getattr(torch, "float8_e5m2", torch.uint8),
}


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


class StorageRef:
    """One storage record inside a torch zip archive."""

    def __init__(self, archive: "TorchArchive", key: str, dtype: torch.dtype, numel: int):
        self.archive, self.key, self.dtype, self.numel = archive, key, dtype, numel

    def read(self, first: int, count: int) -> torch.Tensor:
        """Elements [first, first+count) of this storage as a 1-D tensor that owns its memory."""
        out = empty((count,), self.dtype)  # uninitialised (pread fills it), recycled when large
        self.read_into(first, out)
        return out

    def read_into(self, first: int, out: torch.Tensor) -> None:
        """Fill the contiguous tensor out with elements first, first+1, ... of this storage."""
        if out.numel():
            item = out.element_size()
            self.archive.read_record_into(self.key, first * item, out.reshape(-1).view(torch.uint8).numpy())


class StoredTensor(LazyTensor):
    """A tensor inside a torch archive, read on demand."""

    def __init__(self, storage: StorageRef, offset: int, size, stride):
        self.storage, self.offset = storage, int(offset)
        self.shape, self.stride = torch.Size(size), tuple(stride)
        self.dtype = storage.dtype
        self._shared: Optional["_SharedRead"] = None

    def _contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def load(self) -> torch.Tensor:
        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        if self._contiguous():
            return self.storage.read(self.offset, self.numel).view(self.shape)
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        flat = self.storage.read(self.offset, extent)
        return flat.as_strided(self.shape, self.stride).clone()

    def file_ranges(self) -> list:
        """[(path, offset, length)]: the bytes of the archive this tensor spans (io/prefetch.py)."""
        rec = self.storage.archive.records.get(f"data/{self.storage.key}")
        if rec is None or self.numel == 0:
            return []
        item = itemsize(self.dtype)
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        return [(str(self.storage.archive.path), rec[0] + self.offset * item, extent * item)]

    def load_into(self, out: torch.Tensor) -> None:
        if self._contiguous() and out.is_contiguous() and out.dtype == self.dtype and self.numel:
            self.storage.read_into(self.offset, out)  # straight from the file into out's memory
        else:
            super().load_into(out)

    def narrow(self, dim, start, length):
        if dim == 0 and self._contiguous() and len(self.shape) >= 1:
            row = self.numel // self.shape[0] if self.shape[0] else 0
            size = (length,) + tuple(self.shape[1:])
            return StoredTensor(self.storage, self.offset + start * row, size, self.stride)
        # A column block (a row-parallel weight cut for more tensor-parallel ranks) is strided in
        # the file: every slice of this tensor comes from one shared read of it (_SharedRead)
        if self._shared is None:
            self._shared = _SharedRead(self)
        self._shared.users += 1
        return Derived(lambda t: t.narrow(dim, start, length), [self._shared])


class _SharedRead(Derived):
    """A stored tensor read once for all the slices cut from it within one load_scope (one layer of
    a reshard): the value is kept until as many loads as there are slices have taken it, then
    dropped, so TP2 -> TP4 reads each row-parallel shard once, not once per target rank, and holds it
    only until its last slice is loaded (write_grouped loads sibling slices one after another).
    Outside a scope every load reads (nothing would ever release the value)."""

    def __init__(self, stored: "StoredTensor"):
        super().__init__(None, [stored], memo=True, shape=stored.shape, dtype=stored.dtype)
        self.users = 0

    def _compute(self) -> torch.Tensor:
        return self.parents[0].load()

    def load(self) -> torch.Tensor:
        scopes = lazy_scopes()
        if not scopes:
            return self._compute()
        cache = scopes[-1]
        entry = cache.get(id(self))
        if entry is None:
            entry = cache[id(self)] = [self, self._compute(), self.users]  # self: keeps id() unique
        entry[2] -= 1
        if entry[2] <= 0:  # the last slice: nothing else in this scope needs it
            del cache[id(self)]
        return entry[1]


# Reads of at least READ_SPLIT bytes go in READ_PIECE pieces over READ_THREADS threads
# (CKPTOOL_READ_THREADS; 1 reads every tensor in one pread on the calling thread).
READ_THREADS = max(1, int(os.environ.get("CKPTOOL_READ_THREADS", "4") or 4))
READ_PIECE = 16 << 20
READ_SPLIT = 2 * READ_PIECE
# Every storage record read whole is checked against its zip CRC-32 (CKPTOOL_CRC=0: not checked).
# CRC-32 runs at ~1.5 GB/s on a core, slower than a page-cache copy, so a checked read goes in
# CRC_READ_PIECE pieces over one thread per core, each piece read and summed by one thread while its
# bytes are in that core's cache: the sums then cost the loading thread little wall time.
CHECK_CRC = os.environ.get("CKPTOOL_CRC", "1") != "0"
CRC_READ_PIECE = 4 << 20
_executors: dict = {}
_READ_POOL_LOCK = threading.Lock()


def _read_pieces(length: int, crc: bool = False) -> list:
    """[(start, end)] of one read: itself when small or read serially, else pieces."""
    piece, split = (CRC_READ_PIECE, 2 * CRC_READ_PIECE) if crc else (READ_PIECE, READ_SPLIT)
    if READ_THREADS == 1 or length < split:
        return [(0, length)]
    return [(a, min(a + piece, length)) for a in range(0, length, piece)]


def _read_pool(crc: bool = False):
    """The threads of plain reads (READ_THREADS), or of checked reads (one per core)."""
    executor = _executors.get(crc)
    if executor is None:
        with _READ_POOL_LOCK:
            executor = _executors.get(crc)
            if executor is None:
                threads = max(READ_THREADS, chunked.workers()) if crc else READ_THREADS
                executor = _executors[crc] = ThreadPoolExecutor(threads, thread_name_prefix="ckptool-read")
    return executor


def _rebuild_lazy(storage, storage_offset, size, stride, *rest):
    if not isinstance(storage, StorageRef):
        raise CkptError("unexpected tensor storage in a torch file")
    return StoredTensor(storage, storage_offset, size, stride)


def _rebuild_param(data, *rest):
    return data


def _rebuild_from_type(func, new_type, args, state):
    if dtensor.is_dtensor_rebuild(func):  # a DTensor: its (lazy) local tensor and placements (io/dtensor.py)
        return dtensor.from_pickle(new_type, args, state)
    # the stored call is func(*args): only our own lazy tensor rebuilds may be named here
    check_rebuild_from_type(func, new_type, (_rebuild_lazy, _rebuild_param))
    return func(*args)


def _inner(name: str) -> str:
    """A record's name inside the archive's top folder ("archive/data/3" -> "data/3")."""
    return name.split("/", 1)[1] if "/" in name else name


class TorchArchive:
    """Random access to the records of one torch.save zip archive."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: Optional[int] = None
        try:
            with open(self.path, "rb") as f:
                found = zip_records(f)
        except CkptError as e:
            raise CkptError(f"{self.path}: {e.message}", "the file is truncated or corrupt (torch.save never "
                            "compresses or truncates records): re-save or re-copy it") from None
        self.prefix = found[0].name.split("/", 1)[0]
        # record (name inside the archive's folder) -> (file offset, size); and the central directory's CRC-32
        self.records = {_inner(r.name): (r.start, r.size) for r in found}
        self.crcs = {_inner(r.name): r.crc for r in found}
        if "data.pkl" not in self.records:
            raise CkptError(f"{self.path}: no data.pkl in the archive", "not a torch checkpoint")
        byteorder = self.records.get("byteorder")
        if byteorder and self._read(byteorder[0], byteorder[1]) == b"big":
            raise CkptError(f"{self.path}: big-endian checkpoints are not supported")

    def _read(self, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        self._read_into(offset, memoryview(buf))
        return buf

    def _read_into(self, offset: int, view: memoryview, crc: bool = False) -> Optional[int]:
        """Fill view from the file at offset; with crc, return zlib.crc32 of what was read, each
        piece summed by the thread that read it while its bytes are still in that core's cache."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        length = len(view)
        with profile.stage("read", length):
            pieces = _read_pieces(length, crc)
            if len(pieces) == 1:
                return self._pread_all(offset, view, crc)
            # a large tensor in pieces on several threads: more reads in flight for the disk, and
            # page-cache copies on several cores (pread releases the GIL, and so does zlib.crc32)
            futures = [_read_pool(crc).submit(self._pread_all, offset + a, view[a:b], crc) for a, b in pieces]
            sums = [f.result() for f in futures]
        if not crc:
            return None
        total = 0
        for (a, b), part in zip(pieces, sums):
            total = chunked.crc32_combine(total, part, b - a)
        return total

    def _pread_all(self, offset: int, view: memoryview, crc: bool = False) -> Optional[int]:
        length, done = len(view), 0
        while done < length:
            chunk = os.preadv(self._fd, [view[done:]], offset + done)
            if chunk <= 0:
                raise CkptError(f"{self.path}: unexpected end of file", "the file is truncated")
            done += chunk
        if not crc:
            return None
        with profile.stage("crc32", length):
            return zlib.crc32(view)

    def _check_crc(self, record: str, got: int) -> None:
        want = self.crcs.get(record)
        if want is not None and got != want:
            from ..integrity import corrupt_record_message, tensor_names  # only once a record is bad
            raise CkptError(corrupt_record_message(self.path, f"{self.prefix}/{record}", got, want,
                                                   tensor_names(self.path)),
                            "the file was damaged after torch wrote it; copy it again from where it came from "
                            "(CKPTOOL_CRC=0 skips this check)")

    def read_record(self, key: str, start: int = 0, length: Optional[int] = None) -> bytearray:
        rec = self.records.get(f"data/{key}")
        if rec is None:
            raise CkptError(f"{self.path}: storage record data/{key} is missing", "the file is corrupt")
        offset, size = rec
        length = size - start if length is None else length
        if start + length > size:
            raise CkptError(f"{self.path}: tensor data past the end of record data/{key}",
                            "the file is corrupt")
        return self._read(offset + start, length)

    def read_record_into(self, key: str, start: int, out) -> None:
        """Fill out (a writable byte buffer) from record data/{key} at byte start. A record read
        whole is checked against its CRC-32 from the zip directory (CHECK_CRC) as it is read; a part
        of a record (a ZeRO flat partition's parameter, a TP slice cut by narrow()) is not: its CRC
        says nothing without the rest of the record, and reading the rest would cost what the
        partial read saves."""
        view = memoryview(out).cast("B")
        rec = self.records.get(f"data/{key}")
        if rec is None:
            raise CkptError(f"{self.path}: storage record data/{key} is missing", "the file is corrupt")
        offset, size = rec
        if start + len(view) > size:
            raise CkptError(f"{self.path}: tensor data past the end of record data/{key}",
                            "the file is corrupt")
        whole = CHECK_CRC and start == 0 and len(view) == size
        got = self._read_into(offset + start, view, crc=whole)
        if whole:
            self._check_crc(f"data/{key}", got)

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def load_tree(self) -> Any:
        offset, size = self.records["data.pkl"]
        buf = bytearray(size)
        got = self._read_into(offset, memoryview(buf), crc=CHECK_CRC)
        if CHECK_CRC:
            self._check_crc("data.pkl", got)
        data = bytes(buf)
        archive = self

        class _Lazy(SafeUnpickler):
            source = str(self.path)
            torch_hooks = {
                ("torch._utils", "_rebuild_tensor"): _rebuild_lazy,
                ("torch._utils", "_rebuild_tensor_v2"): _rebuild_lazy,
                ("torch._utils", "_rebuild_tensor_v3"): _rebuild_lazy,
                ("torch._utils", "_rebuild_parameter"): _rebuild_param,
                ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_param,
                ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
                **{(m, n): rebuild_unsupported for m in ("torch._utils", "torch._tensor")
                   for n in UNSUPPORTED_TORCH_REBUILDS + (
                       "_rebuild_device_tensor_from_numpy", "_rebuild_meta_tensor_no_storage")},
                **{("torch", n): _StorageType(d) for n, d in _STORAGE_DTYPES.items()},
                ("torch.storage", "UntypedStorage"): _StorageType(torch.uint8),
            }

            def persistent_load(self, pid):
                if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
                    raise CkptError(f"{archive.path}: unknown persistent id in data.pkl")
                _, stype, key, _location, numel = pid[:5]
                dtype = stype.dtype if isinstance(stype, _StorageType) else getattr(stype, "dtype", None)
                if dtype is None:
                    raise CkptError(f"{archive.path}: unknown storage type {stype!r}")
                return StorageRef(archive, str(key), dtype, int(numel))

        try:
            return _Lazy(io.BytesIO(data)).load()
        except CkptError:
            raise
        except Exception as e:
            raise CkptError(f"{self.path}: cannot unpickle data.pkl ({type(e).__name__}: {e})",
                            "the file is corrupt or was not written by torch.save") from e


def _eager_to_lazy(obj):
    if isinstance(obj, torch.Tensor):
        return Const(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _eager_to_lazy(v)) for k, v in obj.items()) if not isinstance(
            obj, collections.defaultdict) else {k: _eager_to_lazy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_eager_to_lazy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_eager_to_lazy(v) for v in obj)
    return obj


def load_torch_file(path) -> Any:
    """Load a torch file with every tensor as a LazyTensor; nothing in the file can run code."""
    path = Path(path)
    if not path.is_file():
        raise CkptError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"PK":
        return TorchArchive(path).load_tree()
    if not magic:
        raise CkptError(f"{path}: empty file", "the file is truncated")
    # Pre-1.6 (legacy, non-zip) format: torch's own reader, our restricted globals, no mmap.
    try:
        obj = torch.load(path, map_location="cpu", pickle_module=torch_pickle_module,
                         weights_only=False)
    except CkptError:
        raise
    except Exception as e:
        raise CkptError(f"{path}: cannot read this torch file ({type(e).__name__}: {e})",
                        "the file is truncated, corrupt or not a torch checkpoint") from e
    return _eager_to_lazy(obj)


def load_torch_bytes(data: bytes, source: str) -> Any:
    """torch.load of an in-memory blob (DCP byte entries), eagerly, with restricted globals."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", pickle_module=torch_pickle_module,
                         weights_only=False)
    except CkptError:
        raise
    except Exception as e:
        raise CkptError(f"{source}: cannot read this torch blob ({type(e).__name__}: {e})") from e
    return obj


# ------------------------------------------------------------------------------------------
# Streaming writer
_STORAGE_CLASS = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}


class _PendingStorage:
    def __init__(self, key: str, lazy: LazyTensor):
        self.key, self.lazy = key, lazy


class StreamingTorchWriter:
    """One torch.save-compatible file whose tensors are written as they are produced.

    The pickle (data.pkl) is built up front from shapes and dtypes alone; tensor records are then
    written one at a time by write(), in any order, and finish() seals the archive. The layout is
    torch's own archive writer's, so torch.load reads the result like any torch.save file; the
    bytes go out through torchzip.ArchiveOut (checksums over the cores) where this torch allows.
    """

    def __init__(self, path, obj: Any):
        self.path = Path(path)
        self.pending: list = []

        def reducer(o):
            if isinstance(o, (LazyTensor, torch.Tensor)):
                lazy = o if isinstance(o, LazyTensor) else Const(o.detach())
                if lazy.dtype not in _STORAGE_CLASS:
                    raise CkptError(f"cannot save a tensor of dtype {lazy.dtype}")
                ps = _PendingStorage(str(len(self.pending)), lazy)
                self.pending.append(ps)
                stride, acc = [], 1
                for s in reversed(lazy.shape):
                    stride.append(acc)
                    acc *= s
                return (torch._utils._rebuild_tensor_v2,
                        (ps, 0, tuple(lazy.shape), tuple(reversed(stride)), False,
                         collections.OrderedDict()))
            return NotImplemented

        def persistent_id(o):
            if isinstance(o, _PendingStorage):
                return ("storage", getattr(torch, _STORAGE_CLASS[o.lazy.dtype]), o.key, "cpu",
                        o.lazy.numel)
            return None

        buf = io.BytesIO()
        with profile.stage("plan"):
            StandInPickler(buf, protocol=2, persistent_id=persistent_id,
                           reducer_override=reducer).dump(obj)
        self._pickle = buf.getvalue()
        if torchzip.supported():
            self._archive = torchzip.ArchiveOut(self.path)
        else:  # torch's writer does it all, on the calling thread
            self._archive = None
            self._file = _HashingFile(self.path)
            self._writer = torchzip.torch_archive_writer(self._file)
        self._done: set = set()

    @property
    def nbytes(self) -> int:
        return sum(ps.lazy.nbytes for ps in self.pending)

    def prepare(self, ps: "_PendingStorage", tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ps's tensor loaded, checked against the plan and laid out exactly as it will be stored."""
        t = ps.lazy.load() if tensor is None else tensor
        if t.dtype != ps.lazy.dtype or tuple(t.shape) != tuple(ps.lazy.shape):
            raise CkptError(f"internal: tensor {ps.key} of {self.path.name} has shape "
                            f"{tuple(t.shape)} {t.dtype}, planned {tuple(ps.lazy.shape)} {ps.lazy.dtype}")
        with profile.stage("prepare"):
            return self._laid_out(t)

    def _laid_out(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if self._archive is None and t.storage_offset() != 0:
            t = t.clone()  # a view into the middle of a buffer: torch's writer takes whole storages
        elif nbytes >= _PARALLEL_HASH_BYTES and t.untyped_storage().nbytes() > 2 * nbytes:
            # a small slice must not keep a large buffer alive while it waits to be written (a
            # tensor-parallel rank's share of a full tensor; peak RSS); a larger share is written
            # in place (the buffer may be a recycled one of up to twice the size, io/buffers.py)
            t = t.clone()
        return t

    def write_prepared(self, ps: "_PendingStorage", t: torch.Tensor) -> int:
        nbytes = t.numel() * t.element_size()
        if self._archive is not None:
            if nbytes < _PARALLEL_HASH_BYTES:  # small: torch's writer copes, CRC and all
                self._archive.write_small(f"data/{ps.key}", t.reshape(-1).view(torch.uint8).numpy().tobytes())
            else:  # straight from the tensor's memory (a view into a larger buffer is fine)
                self._archive.write_record(f"data/{ps.key}", memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            self._done.add(ps.key)
            return nbytes
        # the first nbytes of the storage: a recycled buffer (io/buffers.py) may be larger
        with profile.stage("zip"):
            self._writer.write_record(f"data/{ps.key}", t.untyped_storage(), nbytes)
        self._done.add(ps.key)
        return nbytes

    def write_chunks(self, ps: "_PendingStorage", chunks, on_bytes=None) -> int:
        """ps's record from its tensor's elements in order, given as chunks (tensors of ps's dtype),
        so a tensor larger than memory streams through: each chunk is written before the next is
        asked for (its producer may reuse its memory). A small record, or any record where torch's
        own writer is used (no write_record_metadata), is joined and written whole."""
        def flat():
            for c in chunks:
                if c.dtype != ps.lazy.dtype:
                    raise CkptError(f"internal: a {c.dtype} chunk for the {ps.lazy.dtype} tensor {ps.key} "
                                    f"of {self.path.name}")
                c = c.detach().cpu().contiguous().reshape(-1)
                if on_bytes:
                    on_bytes(c.numel() * c.element_size())
                yield c

        nbytes = ps.lazy.nbytes
        if self._archive is None or nbytes < _PARALLEL_HASH_BYTES:
            parts = [c.clone() for c in flat()]  # clone: the producer may refill a chunk's buffer
            whole = torch.cat(parts) if parts else torch.empty(0, dtype=ps.lazy.dtype)
            return self.write(ps, whole.reshape(ps.lazy.shape))
        self._archive.write_record_chunks(f"data/{ps.key}", nbytes,
                                          (c.view(torch.uint8).numpy() for c in flat()))
        self._done.add(ps.key)
        return nbytes

    def write(self, ps: "_PendingStorage", tensor: Optional[torch.Tensor] = None) -> int:
        return self.write_prepared(ps, self.prepare(ps, tensor))

    def finish(self) -> None:
        missing = [ps.key for ps in self.pending if ps.key not in self._done]
        if missing:
            raise CkptError(f"internal: {len(missing)} tensors of {self.path.name} were never written")
        if self._archive is not None:
            for name, data in (("data.pkl", self._pickle), (".format_version", b"1"), ("byteorder", b"little")):
                self._archive.write_small(name, data)
            remember_digest(self.path, self._archive.finish())
            self._archive = None
            return
        w = self._writer
        w.write_record("data.pkl", self._pickle, len(self._pickle))
        w.write_record(".format_version", "1", 1)
        w.write_record("byteorder", "little", len("little"))
        w.write_end_of_file()
        del self._writer
        self._file.close()
        remember_digest(self.path, self._file.digest.hexdigest())


_PARALLEL_HASH_BYTES = 1 << 20  # records below this go through torch's writer whole


class _HashingFile:
    """The archive's file, hashed as torch's writer streams into it (sequentially), so sealing the
    output directory needs no second read of every byte for the manifest."""

    def __init__(self, path: Path):
        self._f = open(path, "wb")
        self.digest = chunked.PieceDigest()
        self._writeback = writeback.for_file(self._f)  # dirty pages go to disk as we go (writeback.py)

    def write(self, data) -> int:
        # hashed on the checksum pool while the bytes go to the file; data is only valid during
        # this call, so wait for the hashing before returning
        self.digest.feed(data)
        try:
            with profile.stage("write", len(data)):
                n = self._f.write(data)
        finally:
            self.digest.settle()
        if self._writeback:
            self._writeback.written(n)
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def save_streaming(obj: Any, path, on_tensor=None) -> int:
    """torch.save(obj, path) where obj's tensor leaves may be LazyTensors, loaded one at a time."""
    writer = StreamingTorchWriter(path, obj)
    total = 0
    for ps in writer.pending:
        n = writer.write(ps)
        total += n
        if on_tensor:
            on_tensor(n)
    writer.finish()
    return total


def write_grouped(writers: list, group_of, on_tensor=None) -> int:
    """Write several StreamingTorchWriters together, one group (e.g. one layer) at a time.

    group_of(lazy) -> sortable key. Within a group all files' tensors are loaded inside one
    load_scope, so a merged source tensor feeding several target ranks is read once. Loading
    (reads, merges, splits) and writing overlap: one writer thread stores group g while this
    thread loads group g+1, and g+2 waits until g is on disk, so at most two groups are in memory.
    torch and os release the GIL in file I/O and tensor ops, so the two really run together.
    """
    bound_heap()
    groups: dict = {}
    for w in writers:
        for ps in w.pending:
            groups.setdefault(group_of(ps.lazy), []).append((w, ps))
    total = 0

    # Files are independent: each group's files are written in parallel (torch's archive writer,
    # CRC32, sha256 and write() all release the GIL), one task per file so each file's records
    # stay in order; group g+1 is loaded meanwhile.
    workers = max(1, min(len(writers), 4))
    order = sorted(groups, key=lambda k: (k is None, k))
    sizes = [sum(ps.lazy.nbytes for _, ps in groups[k]) for k in order]
    in_flight_peak = max([a + b for a, b in zip(sizes, sizes[1:])] + sizes[:1], default=0)  # a group and the next
    ahead, n = prefetch.prefetcher(), prefetch.groups_ahead()  # the next groups' source bytes, asked early
    try:  # two groups in flight: their memory recycled from group to group (io/buffers.py)
        with buffers.sized_for(in_flight_peak), \
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptool-writer") as pool:
            in_flight: list = []
            for i, key in enumerate(order):
                if ahead is not None:  # groups i+1 .. i+n asked for (all of them at the start)
                    for k in (order[:n] if i == 0 else []) + order[i + n:i + n + 1]:
                        ahead.ask(ps.lazy for _, ps in groups[k])
                with load_scope():
                    by_file: dict = {}
                    for w, ps in _siblings_together(groups[key]):
                        by_file.setdefault(id(w), []).append((w, ps, w.prepare(ps)))
                with profile.stage("wait"):
                    total += sum(f.result() for f in in_flight)
                if in_flight:
                    trim()
                in_flight = [pool.submit(_store, items, on_tensor) for items in by_file.values()]
                del by_file
            total += sum(f.result() for f in in_flight)
    finally:
        if ahead is not None:
            ahead.close()
    for w in writers:
        w.finish()
    return total


def _store(items, on_tensor) -> int:
    """One file's share of a group, written in order (on a writer thread); its bytes."""
    n = 0
    for w, ps, t in items:
        k = w.write_prepared(ps, t)
        n += k
        if on_tensor:
            on_tensor(k)
    return n


def _siblings_together(items: list) -> list:
    """A group's (writer, tensor) pairs in loading order: round-robin over the files (each file's
    own tensors stay in order), so the slices target ranks cut from one source tensor load one
    after another and a shared read (_SharedRead) is held for a moment, not for a whole file."""
    per_file: dict = {}
    for w, ps in items:
        per_file.setdefault(id(w), []).append((w, ps))
    queues = list(per_file.values())
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out
