"""torch.save's zip archive, written with its checksums computed over the cores.

torch's archive writer (PyTorchFileWriter) computes each record's CRC32 on the calling thread
before the bytes move on, and hands every byte to one sequential stream: for a merge's single
multi-GB file that is one core doing CRC32, then sha256, then write() in turn (docs/benchmarks.md:
~20 s of a 27 s merge on 16 cores went to the loader waiting for that thread).

Here torch's writer still decides every byte of the layout, so the output stays byte-identical
to what it writes itself: it runs as a dry run into LayoutSink, where tensor records are declared
with write_record_metadata (it emits the headers and seeks over the data), and ArchiveOut writes
the real file: the headers torch produced, then the tensor bytes straight from the tensor's
memory, with their CRC32 in 16 MiB pieces and the manifest digest in 64 MiB pieces on the
checksum pool (chunked.py; or both in one pass, CKPTOOL_FUSED_SUMS=1) while write() runs. What the dry run could not know is patched in:
each tensor record's CRC32 in its data descriptor and central-directory entry, and the
.data/serialization_id record, whose second half torch derives from the descriptors' CRCs (the
first half, a hash of the record names, the dry run got right).

supported() is False on a torch without write_record_metadata; torchfile.py then keeps torch's
own writer.
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch

from ..errors import CkptError
from . import chunked, profile, writeback

_DESCRIPTOR = b"PK\x07\x08"   # data descriptor (CRC and sizes after a record's data)
_CENTRAL = b"PK\x01\x02"      # central directory entry
_ZIP64_END = b"PK\x06\x06"    # zip64 end of central directory record
_SERIAL_ID = ".data/serialization_id"
_MASK64 = (1 << 64) - 1


def supported() -> bool:
    """This torch can lay out an archive without its data (and CKPTOOL_TORCH_WRITER=1, for A/B
    measurements, does not ask for torch's own writer)."""
    if os.environ.get("CKPTOOL_TORCH_WRITER") == "1":
        return False
    return hasattr(torch._C.PyTorchFileWriter, "write_record_metadata")


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t: how torch folds descriptor CRCs into the serialization id."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)) & _MASK64


class LayoutSink:
    """The file object of the dry run: keeps what torch writes, with offsets; data is skipped."""

    def __init__(self):
        self.pos = 0
        self.pieces: List[Tuple[int, bytearray]] = []
        self.crcs: List[int] = []  # CRC of every data descriptor, in order (as torch folds them)
        self.gap: Optional[Tuple[int, int]] = None  # (offset, length) last skipped by a seek

    def write(self, data) -> int:
        data = bytearray(data)
        if len(data) >= 8 and data[:4] == _DESCRIPTOR:
            self.crcs.append(struct.unpack_from("<I", data, 4)[0])
        self.pieces.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        new = offset if whence == 0 else self.pos + offset if whence == 1 else None
        if new is None or new < self.pos:
            raise CkptError("internal: torch's archive writer moved backwards in a dry run")
        self.gap = (self.pos, new - self.pos)
        self.pos = new
        return new

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def take(self) -> List[Tuple[int, bytearray]]:
        pieces, self.pieces = self.pieces, []
        return pieces


class _Output:
    """The real file, written in order: small pieces buffered, tensor bytes written straight
    from memory, every byte fed to the manifest digest, write-back started as it goes."""

    def __init__(self, path: Path):
        self.f = open(path, "wb", buffering=0)
        self.pos = 0
        self.digest = chunked.PieceDigest()
        self._buf = bytearray()
        self._writeback = writeback.for_file(self.f)

    def small(self, offset: int, data) -> None:
        if offset != self.pos + len(self._buf):
            raise CkptError(f"internal: archive piece at {offset}, expected {self.pos + len(self._buf)}")
        self._buf += data

    def flush(self) -> None:
        if self._buf:
            buf, self._buf = self._buf, bytearray()
            self.digest.feed(buf)
            self._write(memoryview(buf))

    def big(self, offset: int, view: memoryview) -> int:
        """Write view at offset; returns its CRC32 (taken beside the hash, or in its pass: chunked.py)."""
        self.flush()
        if offset != self.pos:
            raise CkptError(f"internal: archive record at {offset}, expected {self.pos}")
        if chunked.FUSED:
            crc_parts = self.digest.feed(view, crc=True)  # runs on the pool while the bytes go to the file
        else:  # two passes: CRC32 in CRC_PIECE pieces, then the hash
            crc_parts = chunked.crc32_start(view)
            self.digest.feed(view)
        try:
            for start in range(0, len(view), writeback.WINDOW):
                self._write(view[start:start + writeback.WINDOW])
        finally:
            with profile.stage("wait"):
                self.digest.settle()  # view's memory may be reused once this returns
                crc = chunked.crc32_finish(crc_parts)
        return crc

    def _write(self, view: memoryview) -> None:
        with profile.stage("write", len(view)):
            done = 0
            while done < len(view):
                done += self.f.write(view[done:])
        self.pos += len(view)
        if self._writeback:
            self._writeback.written(len(view))

    def close(self) -> str:
        self.flush()
        self.f.close()
        return self.digest.hexdigest()


def torch_archive_writer(f):
    """torch's own archive writer over file-like f, with the options torch.save uses (CRC32 on,
    64-byte record alignment)."""
    ser = torch.serialization
    try:
        return torch._C.PyTorchFileWriter(f, ser.get_crc32_options(), ser._get_storage_alignment())
    except (AttributeError, TypeError):  # older torch: one-argument constructor
        return torch._C.PyTorchFileWriter(f)


class ArchiveOut:
    """One torch.save zip archive: records go out in the order given, checksums over the cores."""

    def __init__(self, path):
        self.path = Path(path)
        self._sink = LayoutSink()
        self._layout = torch_archive_writer(self._sink)
        self._out = _Output(self.path)
        self._tensor_crcs: dict = {}  # record name -> CRC32 for the records written from memory

    def write_record(self, name: str, data: memoryview) -> None:
        """One record from memory (its bytes must stay unchanged until this returns)."""
        view = memoryview(data).cast("B")
        self.write_record_chunks(name, len(view), [view])

    def write_record_chunks(self, name: str, nbytes: int, chunks: Iterable) -> None:
        """One record of nbytes whose bytes arrive in order as chunks (buffers), so a record larger
        than memory streams through a small one: each chunk is on disk and checksummed before the
        next is asked for (its memory may then be reused). The archive is byte for byte the one
        write_record of the joined bytes gives; the CRC is combined over the chunks."""
        with profile.stage("zip"):
            self._sink.gap = None
            self._layout.write_record_metadata(name, nbytes)
            pieces = self._sink.take()
        gap_at, gap_len = self._sink.gap if self._sink.gap else (None, 0)
        if nbytes and (gap_len != nbytes or gap_at is None):
            raise CkptError(f"internal: torch's writer planned {gap_len} bytes for {name}, not {nbytes}")
        descriptor = None
        for offset, piece in pieces:
            if gap_at is not None and offset >= gap_at + gap_len and piece[:4] == _DESCRIPTOR:
                descriptor = (offset, piece)
            elif gap_at is None or offset < gap_at:
                self._out.small(offset, piece)
            else:
                raise CkptError(f"internal: unexpected archive piece after the data of {name}")
        crc, done = 0, 0
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if not len(view):
                continue
            if done + len(view) > nbytes:
                raise CkptError(f"internal: more than the {nbytes} bytes planned for {name}")
            crc = chunked.crc32_combine(crc, self._out.big(gap_at + done, view), len(view))
            done += len(view)
        if done != nbytes:
            raise CkptError(f"internal: {done} bytes came for {name}, {nbytes} planned")
        if descriptor is None:
            raise CkptError(f"internal: no data descriptor for {name}")
        offset, piece = descriptor
        struct.pack_into("<I", piece, 4, crc)
        self._sink.crcs[-1] = crc
        self._tensor_crcs[name] = crc
        self._out.small(offset, piece)

    def write_small(self, name: str, data: bytes) -> None:
        """A small record (the pickle, version tags): torch writes it whole, CRC included."""
        with profile.stage("zip"):
            self._layout.write_record(name, data, len(data))
            for offset, piece in self._sink.take():
                self._out.small(offset, piece)

    def finish(self) -> str:
        """Seal the archive; returns the file's manifest digest."""
        with profile.stage("zip"):
            crcs_before_end = len(self._sink.crcs)
            self._layout.write_end_of_file()
            tail = self._sink.take()
            base = tail[0][0] if tail else self._out.pos
            blob = bytearray()
            for offset, piece in tail:
                if offset != base + len(blob):
                    raise CkptError("internal: gap in the archive's tail")
                blob += piece
            self._patch_tail(blob, base, crcs_before_end)
            self._out.small(base, blob)
        digest = self._out.close()
        del self._layout
        return digest

    def _patch_tail(self, blob: bytearray, base: int, crcs_before_end: int) -> None:
        """Put the real CRCs into the central directory and recompute the serialization id."""
        entries = _central_entries(blob, base)
        # the serialization id: torch folds every descriptor CRC written before its own record
        serial = entries.get("/" + _SERIAL_ID)
        if serial is not None and self._tensor_crcs:
            folded = 0
            for crc in self._sink.crcs[:-1]:  # the last descriptor is the id record's own
                folded = _hash_combine(folded, crc)
            local = serial["local"] - base
            name_len, extra_len = struct.unpack_from("<HH", blob, local + 26)
            start = local + 30 + name_len + extra_len
            size = serial["size"]
            old = bytes(blob[start:start + size])
            new = old[:20] + b"%020d" % folded
            if len(new) != size or blob[start + size:start + size + 4] != _DESCRIPTOR:
                raise CkptError("internal: unexpected serialization id layout in torch's archive")
            blob[start:start + size] = new
            crc = zlib.crc32(new)
            struct.pack_into("<I", blob, start + size + 4, crc)
            struct.pack_into("<I", blob, serial["at"] + 16, crc)
        for name, crc in self._tensor_crcs.items():
            entry = entries.get("/" + name)
            if entry is None:
                raise CkptError(f"internal: record {name} missing from the archive's directory")
            struct.pack_into("<I", blob, entry["at"] + 16, crc)


def _central_entries(blob: bytearray, base: int) -> dict:
    """Central directory entries found in the tail: "/record" -> {at, size, local} (offsets in
    blob for "at", in the file for "local"); keys drop the archive's top folder name."""
    at = blob.rfind(_ZIP64_END)
    if at < 0:
        raise CkptError("internal: torch's archive has no zip64 end record")
    cd_size, cd_offset = struct.unpack_from("<QQ", blob, at + 40)
    pos = cd_offset - base
    if pos < 0:
        raise CkptError("internal: the archive's central directory lies before its tail")
    out = {}
    end = pos + cd_size
    while pos < end:
        if blob[pos:pos + 4] != _CENTRAL:
            raise CkptError("internal: bad central directory entry in torch's archive")
        size32, name_len, extra_len, comment_len = struct.unpack_from("<IHHH", blob, pos + 24)
        local32 = struct.unpack_from("<I", blob, pos + 42)[0]
        name = bytes(blob[pos + 46:pos + 46 + name_len]).decode()
        extra = blob[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        size, local = size32, local32
        if 0xFFFFFFFF in (size32, local32):  # real values in the zip64 extra field
            size, local = _zip64_values(extra, size32, local32)
        key = "/" + name.split("/", 1)[1] if "/" in name else "/" + name
        out[key] = {"at": pos, "size": size, "local": local}
        pos += 46 + name_len + extra_len + comment_len
    return out


def _zip64_values(extra, size32: int, local32: int) -> Tuple[int, int]:
    """Uncompressed size and local header offset from a central entry's zip64 extra field
    (it lists, in order, uncompressed size, compressed size and offset, each only if its 32-bit
    field is 0xFFFFFFFF; compressed size equals uncompressed for stored records)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            size = values.pop(0) if size32 == 0xFFFFFFFF else size32
            if size32 == 0xFFFFFFFF:
                values.pop(0)  # compressed size
            local = values.pop(0) if local32 == 0xFFFFFFFF else local32
            return size, local
        pos += 4 + length
    raise CkptError("internal: zip64 fields missing in torch's archive")
