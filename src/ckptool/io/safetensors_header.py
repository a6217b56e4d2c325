"""The header of a .safetensors file, parsed and validated before any tensor is read.

Layout: an 8-byte little-endian length N, N bytes of UTF-8 JSON ({name: {dtype, shape,
data_offsets: [begin, end]}, optional "__metadata__": {str: str}}), then the data buffer; offsets
are relative to the buffer's start. Every problem (a length past the end, an offset outside the
buffer, an unknown dtype, a size that does not match the shape, holes or overlaps) is a CkptError
naming the file, so a truncated or hand-edited file never reaches torch or the safetensors library.
Dtypes are kept by torch's name and resolved on use, so reading a header imports no torch
(quick_inspect.py relies on that).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import CkptError

# safetensors dtype name -> (torch dtype's name, bytes per element)
DTYPES: Dict[str, Tuple[str, int]] = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1),
    "I16": ("int16", 2), "U16": ("uint16", 2), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I32": ("int32", 4), "U32": ("uint32", 4),
    "F32": ("float32", 4), "I64": ("int64", 8), "U64": ("uint64", 8),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),  # UE8M0 block-FP8 scales (formats/hf/quant.py)
}
# The reference implementation refuses headers above 100 MB; so do we (a bigger length is a
# corrupt or hostile file, and reading it would allocate that much).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype_name: str  # torch's name for the dtype: "bfloat16"
    shape: Tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def dtype(self):
        """The torch.dtype (imports torch)."""
        import torch  # torch on use: the header parser serves the torch-free inspect
        return getattr(torch, self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class SafetensorsHeader:
    tensors: Dict[str, TensorEntry]
    metadata: Dict[str, str]
    data_start: int


def _fail(source: str, problem: str) -> CkptError:
    return CkptError(f"{source}: {problem}", "the safetensors file is truncated or corrupt; re-save or re-download it")


def parse_safetensors_header(prefix: bytes, file_size: int, source: str = "safetensors") -> SafetensorsHeader:
    """Validate the header found at the start of a file of file_size bytes.

    prefix must hold at least the first 8 + N bytes (fewer means the file is truncated).
    """
    if len(prefix) < 8:
        raise _fail(source, f"{file_size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > MAX_HEADER_BYTES:
        raise _fail(source, f"header length {n} is out of range")
    if 8 + n > file_size or len(prefix) < 8 + n:
        raise _fail(source, f"header length {n} runs past the end of the file ({file_size} bytes)")
    try:
        doc = json.loads(bytes(prefix[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(source, f"header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _fail(source, "header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise _fail(source, "__metadata__ must map strings to strings")
    data_start = 8 + n
    buffer_len = file_size - data_start
    tensors: Dict[str, TensorEntry] = {}
    spans = []
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise _fail(source, f"entry {name!r} is not an object")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype_name not in DTYPES:
            raise _fail(source, f"tensor {name!r} has unknown dtype {dtype_name!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _fail(source, f"tensor {name!r} has an invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            raise _fail(source, f"tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end > buffer_len:
            raise _fail(source, f"tensor {name!r} ends at byte {end} of a {buffer_len}-byte data buffer")
        torch_name, item = DTYPES[dtype_name]
        numel = 1
        for d in shape:
            numel *= d
        if numel * item != end - begin:
            raise _fail(source, f"tensor {name!r}: shape {shape} {dtype_name} needs {numel * item} bytes, "
                                f"data_offsets give {end - begin}")
        tensors[name] = TensorEntry(name, torch_name, tuple(shape), data_start + begin, data_start + end)
        spans.append((begin, end, name))
    # The tensors must tile the buffer exactly: a gap or overlap means a damaged file.
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else f"leaves a gap at byte {position}"
            raise _fail(source, f"tensor {name!r} {what}")
        position = end
    if position != buffer_len:
        raise _fail(source, f"the tensors cover {position} of the {buffer_len} data bytes")
    return SafetensorsHeader(tensors, dict(metadata), data_start)


def read_safetensors_header(path) -> SafetensorsHeader:
    """Read and validate the header of one .safetensors file (reads only the header bytes)."""
    path = Path(path)
    if not path.is_file():
        raise CkptError(f"{path}: no such file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n: Optional[int] = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        body = f.read(n) if n is not None and 2 <= n <= min(MAX_HEADER_BYTES, size) else b""
    return parse_safetensors_header(head + body, size, str(path))
