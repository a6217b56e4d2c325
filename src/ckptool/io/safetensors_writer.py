"""Sharded safetensors output, one tensor in memory at a time.

The shard plan comes from shapes and dtypes alone (plan_shards), so every file's header, with the
byte offsets of all its tensors, is known before any tensor is loaded. Each file is then created
at its final size and each tensor written at its offset as soon as it is loaded: peak memory is one
tensor (plus whatever a load_scope shares within a layer), never a shard.

File format (safetensors spec): 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}} padded with spaces to a
multiple of 8, then the data, contiguous and without holes.
"""
from __future__ import annotations

import json
import os
import re
import struct
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import CkptError
from ..lazy import Concat, Derived, LazyTensor, load_scope
from . import prefetch, profile, writeback
from .chunked import PieceDigest
from .prefetch import Prefetcher
from .memory import bound_heap
from .outdir import remember_digest

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",  # block-FP8 weights (to-hf --fp8)
}

# safetensors files written at once (CKPTOOL_SHARD_THREADS to change; 1 writes them one by one)
SHARD_THREADS = max(1, int(os.environ.get("CKPTOOL_SHARD_THREADS", "2") or 2))

# huggingface_hub's convention: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1234' -> 1234."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise CkptError(f"--max-shard-size {text!r} is not a size",
                        "write it like 5GB, 500MB or 200MiB (KB/MB/GB are decimal as in huggingface_hub)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise CkptError(f"--max-shard-size {text!r} must be positive")
    return size


Item = Tuple[str, LazyTensor, str]  # (name, tensor, group: tensors of one group load in one scope)


def plan_shards(items: Sequence[Item], max_bytes: int) -> List[List[Item]]:
    """Greedy split in order: a shard takes tensors until the next would overflow it.

    A tensor larger than max_bytes gets a shard of its own (as huggingface_hub does).
    """
    shards: List[List[Item]] = [[]]
    size = 0
    for it in items:
        n = it[1].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    return [s for s in shards if s]


def shard_names(count: int) -> List[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(items: Sequence[Item], metadata: Dict[str, str]) -> Tuple[bytes, List[int]]:
    head: Dict[str, object] = {"__metadata__": dict(metadata)}
    offsets, pos = [], 0
    for name, t, _ in items:
        if t.dtype not in DTYPE_NAMES:
            raise CkptError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        head[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [pos, pos + t.nbytes]}
        offsets.append(pos)
        pos += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class ByteBudget:
    """Bytes of loaded tensors that writer threads may hold together, so shards written in parallel
    keep the peak memory of one shard written alone (two tensors: one loading, one writing)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        n = min(n, self.limit)
        with self._cond:
            while self.held and self.held + n > self.limit:
                self._cond.wait()
            self.held += n

    def give(self, n: int) -> None:
        with self._cond:
            self.held -= min(n, self.limit)
            self._cond.notify_all()


def _charge(lazy: LazyTensor) -> int:
    """Memory a tensor takes while it is loaded and written: a computed one (a transpose, a
    reorder) also holds its inputs and the layer's shared (memoised) source while it is built, so
    it counts three times."""
    computed = isinstance(lazy, Derived) and not isinstance(lazy, Concat)
    return lazy.nbytes * (3 if computed else 1)


def write_safetensors_file(path: Path, items: Sequence[Item], metadata: Optional[Dict[str, str]] = None,
                           progress: Optional[Callable[[int], None]] = None,
                           budget: Optional[ByteBudget] = None, ahead: Optional[Prefetcher] = None) -> int:
    """Write one safetensors file, loading its tensors one at a time. Returns the data bytes.

    Loading tensor i+1 (reads, merges) overlaps writing tensor i on one writer thread (file
    writes and hashing release the GIL); at most two tensors are in memory. Data goes out in file
    order, so the file is hashed as written (its 64 MiB pieces on the checksum pool, beside the
    write) and sealing the output need not read it back. ahead: the next groups' source bytes are
    asked for there as each group starts (prefetch.py)."""
    bound_heap()
    header, _ = _header(items, metadata or {"format": "pt"})
    digest = PieceDigest()
    digest.feed(header)
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="ckptool-st-writer") as pool:
        out = _TensorSink(f, digest, progress, budget)
        out.write_header(header)
        in_flight = None
        with _GroupScopes(items, ahead) as scopes:
            for name, lazy, g in items:
                scopes.enter(g)  # tensors of one layer share fused reads inside one scope
                charge = _charge(lazy)
                if budget:
                    with profile.stage("wait"):
                        budget.take(charge)
                t = _loaded(name, lazy)
                if in_flight is not None:
                    with profile.stage("wait"):
                        in_flight.result()
                in_flight = pool.submit(out.store, t, lazy.nbytes, charge)
                del t
            if in_flight is not None:
                in_flight.result()
    remember_digest(Path(path), digest.hexdigest())
    return sum(t.nbytes for _, t, _ in items)


def _loaded(name: str, lazy: LazyTensor) -> torch.Tensor:
    """lazy's tensor, contiguous, checked against the shape and dtype its header entry planned."""
    t = lazy.load()
    if tuple(t.shape) != tuple(lazy.shape) or t.dtype != lazy.dtype:
        raise CkptError(f"internal: {name} loaded as {tuple(t.shape)} {t.dtype}, "
                        f"planned as {tuple(lazy.shape)} {lazy.dtype}")
    with profile.stage("prepare"):
        return t.detach().contiguous()


class _TensorSink:
    """One file's data written in order (on the writer thread): hashed on the pool while the bytes go
    to the file, dirty pages written back as it goes (writeback.py), the byte budget given back once a
    tensor's memory may be reused."""

    def __init__(self, f, digest: PieceDigest, progress, budget: Optional[ByteBudget]):
        self.f, self.digest, self.progress, self.budget = f, digest, progress, budget
        self.wb = writeback.for_file(f)

    def write_header(self, header: bytes) -> None:
        self.f.write(header)
        if self.wb:
            self.wb.written(len(header))

    def store(self, t: torch.Tensor, nbytes: int, charge: int) -> None:
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        self.digest.feed(data)  # hashed on the pool while the bytes go to the file
        try:
            for start in range(0, len(data), writeback.WINDOW):
                piece = data[start:start + writeback.WINDOW]
                with profile.stage("write", len(piece)):
                    self.f.write(piece)
                if self.wb:
                    self.wb.written(len(piece))
        finally:
            with profile.stage("wait"):
                self.digest.settle()  # t's memory may be reused once this returns
            del data, t
            if self.budget:
                self.budget.give(charge)
        if self.progress:
            self.progress(nbytes)


class _GroupScopes:
    """One load scope per group of items (a layer's tensors share fused reads inside it), entered as the
    writer reaches the group's first tensor; with a Prefetcher, the next groups' source bytes are asked
    for as each group starts (all of the first prefetch.groups_ahead() at the start)."""

    def __init__(self, items: Sequence[Item], ahead: Optional[Prefetcher]):
        self.items, self.ahead = items, ahead
        self.order = list(dict.fromkeys(g for _, _, g in items))  # this file's groups, in order
        self.n = prefetch.groups_ahead()
        self.group, self.scope = None, None

    def enter(self, g) -> None:
        if g == self.group:
            return
        self._leave()
        self.scope, self.group = load_scope(), g
        self.scope.__enter__()
        if self.ahead is not None:  # groups j+1 .. j+n asked for (all of them at the start)
            j, n = self.order.index(g), self.n
            for k in (self.order[:n] if j == 0 else []) + self.order[j + n:j + n + 1]:
                self.ahead.ask(t for _, t, gg in self.items if gg == k)

    def _leave(self) -> None:
        if self.scope is not None:
            self.scope.__exit__(None, None, None)
            self.scope = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._leave()
        return False


def write_sharded(out_dir: Path, items: Sequence[Item], max_bytes: int,
                  progress: Optional[Callable[[int], None]] = None,
                  owns: Optional[Callable[[int], bool]] = None) -> dict:
    """Write items as model[-0000i-of-0000N].safetensors (+ index when sharded).

    owns(i) (torchrun): write only the shards i it owns; the index goes with shard 0's owner.
    "bytes" counts the tensor bytes this process wrote."""
    shards = plan_shards(items, max_bytes)
    names = shard_names(len(shards))
    weight_map = {}
    mine = []
    for i, (fname, shard) in enumerate(zip(names, shards)):
        if owns is None or owns(i):
            mine.append((fname, shard))
        weight_map.update({name: fname for name, _, _ in shard})
    # Shards are independent files: up to SHARD_THREADS are written at once (loading, transposes,
    # hashing and write() of one shard overlap another's), sharing a budget of two of the largest
    # tensor, the memory one shard alone needs (computed tensors count three times, see _charge).
    largest = max((t.nbytes for _, shard in mine for _, t, _ in shard), default=0)
    budget = ByteBudget(2 * largest)
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress:
            with lock:
                progress(n)

    ahead = prefetch.prefetcher()

    def one(job) -> int:
        fname, shard = job
        return write_safetensors_file(Path(out_dir) / fname, shard, {"format": "pt"}, report, budget, ahead)

    try:
        with ThreadPoolExecutor(max(1, min(SHARD_THREADS, len(mine))), thread_name_prefix="ckptool-shard") as ex:
            total = sum(ex.map(one, mine))
    finally:
        if ahead is not None:
            ahead.close()
    if len(shards) > 1 and (owns is None or owns(0)):
        total_size = sum(t.nbytes for shard in shards for _, t, _ in shard)
        index = {"metadata": {"total_size": total_size},
                 "weight_map": dict(sorted(weight_map.items()))}
        (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"files": names, "bytes": total}
