"""torch.distributed.checkpoint (DCP) directories, read and written without a process group.

On disk (shared/reference/hf-and-peers.md section 4.2): `.metadata` is a pickle of DCP's Metadata
(global shape, dtype and chunk list per tensor; where each chunk's bytes live); `__{rank}_{n}.distcp`
files hold every chunk as a torch.save blob at [offset, offset + length). torch's own reader
unpickles `.metadata` and byte entries with plain pickle, so ckptool reads both with its restricted
unpickler and slices the chunk blobs itself: a DcpTensor reads only the chunks that overlap the
region it stands for (one layer of a stacked [L, ...] tensor), so memory stays near one layer.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple
import dataclasses

import torch

from ..errors import CkptError
from ..integrity import blob_problem
from ..lazy import LazyTensor
from .safe_pickle import safe_loads
from .torchfile import CHECK_CRC, load_torch_bytes


class _LazyDcp:
    """torch.distributed.checkpoint's metadata classes, imported on first use: importing that
    package costs 2-3 s (it pulls in DTensor), and every conversion imports this module through
    the format registry while only DCP sources and targets need it."""

    def __getattr__(self, name):
        from torch.distributed.checkpoint import filesystem, metadata  # torch's DCP classes on first use (slow to import)
        for mod in (metadata, filesystem):
            if hasattr(mod, name):
                value = getattr(mod, name)
                setattr(self, name, value)
                return value
        raise AttributeError(name)


_dcp = _LazyDcp()

METADATA = ".metadata"


def _is_index(v, rank: Optional[int] = None) -> bool:
    """A tuple of non-negative ints (of `rank` entries when given)."""
    return isinstance(v, (tuple, list, torch.Size)) and all(type(x) is int and x >= 0 for x in v) and \
        (rank is None or len(v) == rank)


def _metadata_problem(md: _dcp.Metadata) -> Optional[str]:
    """What is wrong in an unpickled Metadata, or None. Everything later code relies on is checked
    here, so a damaged index fails at open with one message instead of deep inside a read."""
    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, (dict, type(None))):
        return "its state_dict_metadata or storage_data is not a mapping"
    for fqn, e in entries.items():
        if not isinstance(fqn, str) or not isinstance(e, (_dcp.TensorStorageMetadata, _dcp.BytesStorageMetadata)):
            return f"entry {fqn!r} is a {type(e).__name__}, not tensor or bytes metadata"
        if isinstance(e, _dcp.BytesStorageMetadata):
            continue
        if not isinstance(e.properties, _dcp.TensorProperties) or not isinstance(e.properties.dtype, torch.dtype):
            return f"tensor {fqn} has no dtype"
        if not _is_index(e.size) or not isinstance(e.chunks, list):
            return f"tensor {fqn} has size {e.size!r}"
        for c in e.chunks:
            if not isinstance(c, _dcp.ChunkStorageMetadata) or not _is_index(c.offsets, len(e.size)) or \
                    not _is_index(c.sizes, len(e.size)) or \
                    any(o + n > full for o, n, full in zip(c.offsets, c.sizes, e.size)):
                return f"tensor {fqn} of size {tuple(e.size)} has a chunk outside it"
    for idx, info in (storage or {}).items():
        if not isinstance(idx, _dcp.MetadataIndex) or not isinstance(idx.fqn, str) or \
                not (idx.offset is None or _is_index(idx.offset)):
            return f"storage key {idx!r} is not an index"
        path = info.relative_path if isinstance(info, _dcp._StorageInfo) else None
        if not isinstance(path, str) or not path or Path(path).name != path or path in (".", ".."):
            return f"storage of {idx.fqn} names the file {path!r}, not a file of this directory"
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            return f"storage of {idx.fqn} has offset {info.offset!r} and length {info.length!r}"
        if not isinstance(info.transform_descriptors, (list, tuple, type(None))):
            return f"storage of {idx.fqn} has transforms {info.transform_descriptors!r}"
    return None


def check_metadata(md: _dcp.Metadata, where: Path) -> None:
    try:
        problem = _metadata_problem(md)
    except AttributeError as e:  # a pickle can build these classes without some of their fields
        problem = f"a field is missing ({e})"
    if problem:
        raise CkptError(f"{where}: the torch.distributed.checkpoint index is damaged: {problem}",
                        "the checkpoint is corrupt; copy it again from the source")


def _plain_metadata(md) -> Tuple[object, dict]:
    """(DCP Metadata, megatron-core's per-key mcore_data). megatron-core before 0.16 pickled its own
    subclass, MCoreMetadata (the DCP fields plus mcore_data: the original global shape of each N-D
    flattened optimizer tensor), which the restricted unpickler leaves as an inert stand-in: rebuilt
    here as the plain Metadata it extends."""
    if getattr(type(md), "_ckptool_name", None) != "MCoreMetadata":
        return md, {}
    fields = {f.name: md.__dict__[f.name] for f in dataclasses.fields(_dcp.Metadata) if f.name in md.__dict__}
    mcore = md.__dict__.get("mcore_data")
    try:
        return _dcp.Metadata(**fields), mcore if isinstance(mcore, dict) else {}
    except TypeError:
        return md, {}


class DcpDir:
    """An opened DCP directory: its metadata, and ranged reads of its entries."""

    def __init__(self, path: Path):
        self.path = Path(path)
        md_path = self.path / METADATA
        if not md_path.is_file():
            raise CkptError(f"{self.path}: no {METADATA} file (the torch.distributed.checkpoint index)",
                            "the checkpoint is incomplete: the save was interrupted or a file was not copied")
        md = safe_loads(md_path.read_bytes(), source=str(md_path))
        md, self.mcore_data = _plain_metadata(md)
        if not isinstance(md, _dcp.Metadata):
            raise CkptError(f"{md_path} does not hold torch.distributed.checkpoint Metadata "
                            f"(found {type(md).__name__})")
        check_metadata(md, md_path)
        self.metadata = md
        # storage_data keys compare on (fqn, offset); index by fqn -> {offsets: info}
        self.storage: Dict[str, Dict[Optional[Tuple[int, ...]], _dcp._StorageInfo]] = {}
        for idx, info in (md.storage_data or {}).items():
            off = tuple(idx.offset) if idx.offset is not None else None
            self.storage.setdefault(idx.fqn, {})[off] = info
        # Check every data file up front: a missing one should fail at open, not halfway through a write.
        for rel in sorted({info.relative_path for d in self.storage.values() for info in d.values()}):
            if not (self.path / rel).is_file():
                raise CkptError(f"{self.path}: chunk file {rel} is missing",
                                "copy the complete checkpoint directory; every __*_*.distcp file is needed")

    @property
    def entries(self) -> dict:
        return self.metadata.state_dict_metadata

    def tensor_keys(self) -> List[str]:
        return [k for k, v in self.entries.items() if isinstance(v, _dcp.TensorStorageMetadata)]

    def _read(self, fqn: str, offsets: Optional[Tuple[int, ...]]) -> bytes:
        info = self.storage.get(fqn, {}).get(offsets)
        if info is None:
            raise CkptError(f"{self.path / METADATA}: no storage entry for {fqn} at offset {offsets}",
                            "the metadata file is corrupt")
        if info.transform_descriptors:
            raise CkptError(f"{fqn}: stored with stream transforms {list(info.transform_descriptors)} "
                            "(e.g. compression), which ckptool does not read",
                            "re-save the checkpoint without DCP storage extensions")
        f = self.path / info.relative_path
        if not f.is_file():
            raise CkptError(f"{self.path}: chunk file {info.relative_path} is missing (needed for {fqn})",
                            "copy the complete checkpoint directory; every __*_*.distcp file is needed")
        with open(f, "rb") as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
        if len(data) != info.length:
            raise CkptError(f"{f} is truncated: {fqn} needs bytes {info.offset}..{info.offset + info.length}",
                            "the checkpoint was not copied completely")
        return data

    def read_bytes(self, fqn: str) -> bytes:
        return self._read(fqn, None)

    def read_chunk(self, fqn: str, chunk: _dcp.ChunkStorageMetadata) -> torch.Tensor:
        data = self._read(fqn, tuple(chunk.offsets))
        if CHECK_CRC:  # the blob is read whole: its records' CRCs cost one pass over memory
            problem = blob_problem(data)
            if problem:
                info = self.storage[fqn][tuple(chunk.offsets)]
                raise CkptError(f"{self.path / info.relative_path}: {fqn} chunk at {tuple(chunk.offsets)} is "
                                f"corrupt: {problem}", "the file was damaged after it was written; copy the "
                                "checkpoint again (CKPTOOL_CRC=0 skips this check)")
        t = load_torch_bytes(data, source=f"{self.path.name}:{fqn}")
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(chunk.sizes):
            raise CkptError(f"{fqn}: chunk at {tuple(chunk.offsets)} holds "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}, "
                            f"metadata says {tuple(chunk.sizes)}", "the checkpoint is corrupt")
        return t

    def lazy(self, fqn: str, offsets: Sequence[int] = (), sizes: Optional[Sequence[int]] = None,
             squeeze: int = 0) -> "DcpTensor":
        return DcpTensor(self, fqn, offsets, sizes, squeeze)


class Region(LazyTensor):
    """A region [offsets, offsets + sizes) of a tensor of global shape `full`, `squeeze` leading axes
    dropped; narrow() gives a smaller region of the same source (subclasses say how: _at)."""

    def _region(self, full: Sequence[int], offsets: Sequence[int], sizes, squeeze: int, dtype) -> None:
        self.offsets = tuple(offsets) + (0,) * (len(full) - len(offsets))
        self.sizes = tuple(sizes) if sizes is not None else tuple(f - o for f, o in zip(full, self.offsets))
        self.squeeze, self.dtype = squeeze, dtype
        self.shape = torch.Size(self.sizes[squeeze:])

    def narrow(self, dim: int, start: int, length: int) -> "Region":
        """A smaller region: reads only its own chunks (the gate half of [gate; up] fc1)."""
        dim = dim % len(self.shape) + self.squeeze
        offsets, sizes = list(self.offsets), list(self.sizes)
        offsets[dim] += start
        sizes[dim] = length
        return self._at(offsets, sizes)

    def _at(self, offsets: Sequence[int], sizes: Sequence[int]) -> "Region":
        raise NotImplementedError


class DcpTensor(Region):
    """A region [offsets, offsets + sizes) of a DCP tensor; `squeeze` leading axes dropped (the
    layer axis of a stacked tensor). load() reads only the overlapping chunks."""

    def __init__(self, d: DcpDir, fqn: str, offsets: Sequence[int] = (), sizes=None, squeeze: int = 0):
        md = d.entries[fqn]
        self.dir, self.fqn = d, fqn
        self._region(tuple(md.size), offsets, sizes, squeeze, md.properties.dtype)

    def _at(self, offsets, sizes) -> "DcpTensor":
        return DcpTensor(self.dir, self.fqn, offsets, sizes, self.squeeze)

    def _chunks(self):
        """The stored chunks that overlap this region, each with the overlap's [lo, hi) per dim."""
        for chunk in self.dir.entries[self.fqn].chunks:
            lo = [max(a, c) for a, c in zip(self.offsets, chunk.offsets)]
            hi = [min(a + s, c + cs) for a, s, c, cs in zip(self.offsets, self.sizes, chunk.offsets, chunk.sizes)]
            if all(h > l for l, h in zip(lo, hi)):
                yield chunk, lo, hi

    def file_ranges(self) -> list:
        """[(path, offset, length)] of the chunk records load() reads (io/prefetch.py)."""
        out = []
        for chunk, _, _ in self._chunks():
            info = self.dir.storage.get(self.fqn, {}).get(tuple(chunk.offsets))
            if info is not None:
                out.append((str(self.dir.path / info.relative_path), info.offset, info.length))
        return out

    def load(self) -> torch.Tensor:
        out = torch.empty(self.sizes, dtype=self.dtype)
        covered = 0
        for chunk, lo, hi in self._chunks():
            data = self.dir.read_chunk(self.fqn, chunk)
            src, dst = data, out
            for dim, (l, h) in enumerate(zip(lo, hi)):
                src = src.narrow(dim, l - chunk.offsets[dim], h - l)
                dst = dst.narrow(dim, l - self.offsets[dim], h - l)
            dst.copy_(src)
            covered += src.numel()
        if covered != out.numel():
            raise CkptError(f"{self.fqn}: the stored chunks cover {covered} of the {out.numel()} elements "
                            f"of region {self.offsets}+{self.sizes}", "the checkpoint is incomplete")
        for _ in range(self.squeeze):
            out = out.squeeze(0)
        return out


# --- writing --------------------------------------------------------------------------------

class DcpWriter:
    """Writes one __0_0.distcp data file and the .metadata index, one chunk in memory at a time.

    The .metadata pickle references only torch.distributed.checkpoint classes, so torch's own
    FileSystemReader (and megatron-core's loader on top of it) opens it.
    """

    def __init__(self, path: Path, data_file: str = "__0_0.distcp"):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.data_file = data_file
        self.fh = open(self.path / data_file, "wb")
        self.entries: Dict[str, object] = {}
        self.storage: Dict[_dcp.MetadataIndex, _dcp._StorageInfo] = {}
        self.bytes_written = 0
        self.aliases: List[Tuple[str, str]] = []

    def _append(self, payload: bytes) -> Tuple[int, int]:
        offset = self.fh.tell()
        self.fh.write(payload)
        self.bytes_written += len(payload)
        return offset, len(payload)

    def declare(self, fqn: str, global_shape: Sequence[int], dtype: torch.dtype) -> None:
        if fqn not in self.entries:
            self.entries[fqn] = _dcp.TensorStorageMetadata(
                properties=_dcp.TensorProperties(dtype=dtype), size=torch.Size(global_shape), chunks=[])

    def add_chunk(self, fqn: str, tensor: torch.Tensor, offsets: Sequence[int]) -> int:
        md = self.entries[fqn]
        if tensor.dtype != md.properties.dtype:
            raise CkptError(f"internal: {fqn} chunk is {tensor.dtype}, declared {md.properties.dtype}")
        buf = io.BytesIO()
        torch.save(tensor.detach().contiguous().clone(), buf)  # clone: never save a view's whole storage
        off, length = self._append(buf.getvalue())
        offsets = torch.Size(offsets)
        md.chunks.append(_dcp.ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape))
        self.storage[_dcp.MetadataIndex(fqn, offsets)] = _dcp._StorageInfo(self.data_file, off, length)
        return length

    def add_bytes(self, fqn: str, payload: bytes) -> None:
        self.entries[fqn] = _dcp.BytesStorageMetadata()
        off, length = self._append(payload)
        self.storage[_dcp.MetadataIndex(fqn)] = _dcp._StorageInfo(self.data_file, off, length)

    def alias(self, fqn: str, of: str) -> None:
        """fqn names the same bytes as `of` (one copy on disk); resolved at finish(), once every chunk
        of `of` is written."""
        self.aliases.append((fqn, of))

    def finish(self) -> None:
        for fqn, of in dict(self.aliases).items():
            src = self.entries[of]
            self.entries[fqn] = _dcp.TensorStorageMetadata(properties=src.properties, size=src.size, chunks=list(src.chunks))
            for c in src.chunks:
                self.storage[_dcp.MetadataIndex(fqn, c.offsets)] = self.storage[_dcp.MetadataIndex(of, c.offsets)]
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        md = _dcp.Metadata(state_dict_metadata=self.entries, planner_data={}, storage_data=self.storage)
        with open(self.path / METADATA, "wb") as f:
            pickle.dump(md, f)
