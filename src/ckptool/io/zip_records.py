"""The records of a zip archive as torch.save writes it, located through their local headers. Torch-free.

torch.save stores every record uncompressed, so a record is a byte range of the file: its data starts
after the local header (30 bytes), the member's name and the header's extra field, whose lengths only
the local header holds (the central directory's may differ). The full reader (io/torchfile.py), the
quick inspect (quick/torch_pickle.py) and `verify --files` (integrity.py) all locate records here, and
all refuse what torch would not have written: compressed members, headers outside the file, records
running past its end, a local CRC-32 that contradicts the central directory's.
"""
from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from typing import List, Optional

from ..errors import CkptError

ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field
DATA_DESCRIPTOR = 0x08  # general-purpose flag: the CRC follows the data, the local header has none
# a damaged central directory fails in many ways inside zipfile
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, UnicodeDecodeError, ValueError,
              EOFError, struct.error, OverflowError, OSError)


@dataclass
class ZipRecord:
    name: str  # the member's name, "archive/data/3"
    start: int  # file offset of its first data byte
    size: int
    crc: int  # the central directory's CRC-32


class _Window:
    """Bytes [base, base + length) of an open file as a read-only seekable file, so that zipfile can
    read the directory of a torch.save blob inside a DCP .distcp file."""

    def __init__(self, fh, base: int, length: int):
        self.fh, self.base, self.length, self.pos = fh, base, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.length}[whence] + offset
        if self.pos < 0:
            raise OSError("seek before the start")
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, max(0, self.length - self.pos))
        self.fh.seek(self.base + self.pos)
        data = self.fh.read(n)
        self.pos += len(data)
        return data


def zip_records(fh, base: int = 0, length: Optional[int] = None) -> List[ZipRecord]:
    """The stored records of the zip archive at [base, base + length) of fh, their data located through
    their local headers; CkptError for anything torch would not have written."""
    if length is None:
        length = os.fstat(fh.fileno()).st_size - base
    window = _Window(fh, base, length)
    try:
        infos = zipfile.ZipFile(window).infolist()
    except ZIP_ERRORS as e:
        raise CkptError(f"not a readable zip archive ({e})") from None
    if not infos:
        raise CkptError("empty archive")
    out = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CkptError(f"record {info.filename} is compressed (torch never compresses)")
        if not 0 <= info.header_offset <= length - LOCAL_HEADER:
            raise CkptError(f"record {info.filename}: its local header would lie outside the file")
        window.seek(info.header_offset)
        header = window.read(LOCAL_HEADER)
        if len(header) < LOCAL_HEADER or header[:4] != ZIP_MAGIC:
            raise CkptError(f"record {info.filename}: no local header at byte {info.header_offset}")
        flags, local_crc = struct.unpack("<H", header[6:8])[0], struct.unpack("<I", header[14:18])[0]
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + LOCAL_HEADER + name_len + extra_len
        if start + info.file_size > length:
            raise CkptError(f"record {info.filename} runs past the end of the file (truncated)")
        if not flags & DATA_DESCRIPTOR and local_crc != info.CRC:
            raise CkptError(f"record {info.filename}: its local header's CRC-32 {local_crc:08x} differs from "
                            f"the central directory's {info.CRC:08x}")
        out.append(ZipRecord(info.filename, base + start, info.file_size, info.CRC))
    return out
