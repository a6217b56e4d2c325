"""torch.save files and DCP metadata read for their structure only, without importing torch.

A torch.save zip holds `<name>/data.pkl`, a pickle whose tensors are calls of torch's rebuild helpers
(torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)) on storages named by
persistent ids ('storage', <dtype's storage class>, key, location, numel); the bytes live in other
zip entries this module never opens. The unpickler here resolves every torch global to an inert
stand-in: a rebuild helper returns a TensorMeta (shape and dtype name), a dtype or storage class its
name, torch.Size a tuple, and any other class (DCP's metadata dataclasses, a framework's enums, numpy
arrays of RNG state) an inert StandIn (io/standin.py, the full path's own) that keeps the data it was
built with and runs nothing. Only the plain
Python types in SAFE are real; a global from any other module (os.system, builtins.eval, ...) raises
NotQuick, and the caller leaves the file to the full reader, which refuses it as it always has.
"""
from __future__ import annotations

import argparse
import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import CkptError
from ..io.standin import FRAMEWORK_PACKAGES, StandIn, enum_member, signal_member, standin_class
from ..io.zip_records import zip_records
from .meta import ITEMSIZE, STORAGE_DTYPES, TensorMeta


class NotQuick(Exception):
    """This file is not one the quick path can read with certainty: use the full reader."""


class DtypeName(str):
    """A torch dtype in a pickle (torch.bfloat16): its name."""


@dataclass(frozen=True)
class Scalar(TensorMeta):
    """A 0-d tensor (Adam's per-parameter `step`) and its value: the one kind of tensor whose bytes the
    quick path reads (a few bytes of one small zip record), because inspect shows the step."""
    value: Optional[float] = field(default=None, compare=False)


# struct formats of the dtypes a scalar may be stored in
SCALAR_FORMATS = {"float32": "<f", "float64": "<d", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                  "int8": "<b", "uint8": "<B", "bool": "<?"}
SCALAR_RECORD_LIMIT = 64  # bytes: a 0-d view into a larger storage is not read (its value stays None)


def _rebuild_tensor(storage, storage_offset, size, *rest, **kwargs) -> TensorMeta:
    shape = tuple(int(d) for d in size)
    if shape or storage.read is None or storage.dtype not in SCALAR_FORMATS:
        return TensorMeta(shape, storage.dtype)
    fmt, start = SCALAR_FORMATS[storage.dtype], int(storage_offset) * ITEMSIZE[storage.dtype]
    data = storage.read(storage.key)
    if data is None or start + struct.calcsize(fmt) > len(data):
        return Scalar(shape, storage.dtype)
    return Scalar(shape, storage.dtype, struct.unpack_from(fmt, data, start)[0])


def _rebuild_parameter(data, *rest, **kwargs):
    return data


def _rebuild_from_type(func, new_type, args, state):
    if func not in (_rebuild_tensor, _rebuild_parameter):
        raise NotQuick(f"tensor subclass rebuilt by {func!r}")
    return func(*args)


def _reconstructor(cls, base, state):  # copyreg._reconstructor: only ever builds a StandIn here
    if not (isinstance(cls, type) and issubclass(cls, (StandIn, collections.OrderedDict, argparse.Namespace))):
        raise NotQuick(f"copyreg._reconstructor of {cls!r}")
    return cls.__new__(cls)


def _encode(text, encoding="latin1"):  # _codecs.encode: how protocol 2 pickles bytes
    return str(text).encode(encoding)


# plain Python types a checkpoint's pickle may build for real: they run no code of the file's choosing
SAFE = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    ("builtins", "tuple"): tuple, ("builtins", "list"): list, ("builtins", "dict"): dict,
    ("builtins", "int"): int, ("builtins", "float"): float, ("builtins", "str"): str,
    ("builtins", "bool"): bool, ("builtins", "bytes"): bytes, ("builtins", "complex"): complex,
    ("__builtin__", "set"): set,
    ("argparse", "Namespace"): argparse.Namespace,
    ("copyreg", "_reconstructor"): _reconstructor, ("copy_reg", "_reconstructor"): _reconstructor,
    ("_codecs", "encode"): _encode,
}
# stdlib classes a Megatron args Namespace or DCP metadata holds; kept as StandIns (data only)
RECORDED_STDLIB = {("types", "SimpleNamespace"), ("signal", "Signals"), ("pathlib", "PosixPath"),
                   ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("datetime", "datetime"),
                   ("datetime", "timedelta"), ("datetime", "date"), ("enum", "Enum"), ("io", "BytesIO")}
TORCH_REBUILDS = {"_rebuild_tensor": _rebuild_tensor, "_rebuild_tensor_v2": _rebuild_tensor,
                  "_rebuild_tensor_v3": _rebuild_tensor, "_rebuild_parameter": _rebuild_parameter,
                  "_rebuild_parameter_with_state": _rebuild_parameter}
# Top-level packages whose classes a checkpoint may name: the frameworks' (enums in args, loss
# scalers), which io/safe_pickle.py turns into the same stand-ins on the full path, and torch's and
# numpy's own classes (DCP metadata, numpy RNG state), which it imports but this module must not.
RECORDED_PACKAGES = ("torch", "numpy") + FRAMEWORK_PACKAGES


def _enum_member(cls, name):
    """getattr as a pickle calls it: an enum member by name (standin.enum_member), else the full reader's."""
    member = enum_member(cls, name)
    if member is None:
        raise NotQuick(f"getattr({cls!r:.40}, {name!r:.40}) in a pickle")
    return member


class MetaUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = SAFE.get((module, name), signal_member(module, name))
        if found is not None:
            return found
        if name == "getattr" and module in ("builtins", "__builtin__"):
            return _enum_member
        if module == "torch._utils" and name in TORCH_REBUILDS:
            return TORCH_REBUILDS[name]
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and name.endswith("Storage"):
            if name not in STORAGE_DTYPES:
                raise NotQuick(f"storage class torch.{name}")
            return DtypeName(STORAGE_DTYPES[name])
        if module == "torch" and name == "device":
            return standin_class(module, name)
        if module == "torch" and name[0].islower():
            return DtypeName(name)  # torch.bfloat16 and the like (a layout or memory format reads the same)
        if module.startswith("torch._utils") or module.startswith("torch._tensor"):
            raise NotQuick(f"{module}.{name}")  # sparse, quantized, ... tensors: the full reader's to judge
        if (module, name) in RECORDED_STDLIB or module.split(".", 1)[0] in RECORDED_PACKAGES:
            return standin_class(module, name)
        raise NotQuick(f"{module}.{name} in a pickle")

    storage_keys: set
    read_record: Optional[Callable[[str], Optional[bytes]]] = None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[1], DtypeName)):
            raise NotQuick(f"persistent id {pid!r:.60}")
        self.storage_keys.add(str(pid[2]))
        return _Storage(str(pid[1]), str(pid[2]), self.read_record)


class _Storage:
    def __init__(self, dtype: str, key: str = "", read=None):
        self.dtype, self.key, self.read = dtype, key, read


def loads(data: bytes, storage_keys: Optional[set] = None, read_record=None) -> Any:
    """The object a plain pickle holds (DCP's .metadata); storage_keys collects the tensor records a
    torch.save pickle refers to; read_record(key) gives a small record's bytes (for Scalar values)."""
    up = MetaUnpickler(io.BytesIO(data), encoding="utf-8")
    up.storage_keys = storage_keys if storage_keys is not None else set()
    up.read_record = read_record
    try:
        return up.load()
    except NotQuick:
        raise
    except Exception as e:  # malformed: the full reader reports it
        raise NotQuick(f"{type(e).__name__}: {e}") from e


def load_torch_zip(source) -> Any:
    """The object a torch.save zip (a path or bytes) holds, tensors as TensorMeta. NotQuick for legacy
    (non-zip) torch files, anything the unpickler does not resolve, and any archive the full reader
    could find fault with on opening it (compressed or truncated records, big-endian data, a tensor
    whose storage record is absent): that reader then says what is wrong."""
    try:
        with (io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")) as f, zipfile.ZipFile(f) as z:
            records = _sound_records(f)
            pkl = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise NotQuick("no single data.pkl")
            prefix = pkl[0].rsplit("/", 1)[0]
            if f"{prefix}/byteorder" in records and z.read(f"{prefix}/byteorder") != b"little":
                raise NotQuick("big-endian data")
            data = z.read(pkl[0])
            keys: set = set()

            def small_record(key: str) -> Optional[bytes]:
                name = f"{prefix}/data/{key}"
                if name not in records or z.getinfo(name).file_size > SCALAR_RECORD_LIMIT:
                    return None
                return z.read(name)

            obj = loads(data, keys, small_record)
    except (zipfile.BadZipFile, OSError, KeyError, ValueError) as e:
        raise NotQuick(str(e)) from e
    if any(f"{prefix}/data/{k}" not in records for k in keys):
        raise NotQuick("a tensor's storage record is missing")
    return obj


def _sound_records(f) -> set:
    """The archive's member names, if every member is stored uncompressed inside the file (the rules the
    full reader opens it by: io/zip_records.py)."""
    try:
        return {r.name for r in zip_records(f, 0, f.seek(0, io.SEEK_END))}
    except CkptError as e:
        raise NotQuick(e.message) from None
