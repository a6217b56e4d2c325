"""Restricted unpickling: loading a checkpoint never runs code from it.

Every pickle ckptool opens (torch files, DeepSpeed states, DCP metadata and byte entries) goes
through SafeUnpickler. What may load:
  * tensors, storages, dtypes, torch.Size and the torch rebuild helpers (see _TORCH_NAMES);
  * plain containers and a short list of harmless stdlib types (argparse.Namespace, OrderedDict,
    enums Megatron keeps in args such as signal.Signals, pathlib paths, ...), and enum members as
    older Pythons name them (signal.SIGTERM; getattr(EnumClass, "member") of Python 3.11's early
    releases, for an enum class only: standin.enum_member);
  * torch.distributed.checkpoint metadata dataclasses (data only);
  * DTensors (an FSDP2 state_dict() saved with torch.save): their local tensor and placements as a
    dtensor.DTensorShard record; DTensor, its spec, device mesh and placements load as inert StandIns;
  * any class from a training framework's namespace (megatron.*, deepspeed.*, apex.*, ...), which
    becomes an inert StandIn (io/standin.py) that keeps its constructor arguments and state and runs nothing.
Everything else (builtins.eval, os.system, subprocess.*, torch.load, ...) raises UnsafePickleError.
The constructors pickle needs (copyreg._reconstructor/__newobj__, defaultdict, torch's
_rebuild_from_type_v2, numpy arrays) are wrapped so that they accept only plain types: the stdlib
versions would call whatever class or factory the file names.

StandIns remember how they were built, so StandInPickler writes them back as the original class
reference: a Megatron loading our output sees its own enums again.
"""
from __future__ import annotations

import collections
import copyreg
import dataclasses
import enum
import io
import pickle
import pickletools
from typing import Any, Callable, Optional

import torch

from ..errors import CkptError
from . import dtensor
from .standin import FRAMEWORK_PACKAGES, StandIn, is_framework_module, standin_class  # noqa: F401 (torch-free home)
from .standin import enum_member, signal_member


class UnsafePickleError(CkptError):
    pass


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "deque"): collections.deque,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "range"): range,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "bytes"): bytes,
    ("builtins", "object"): object,
    ("builtins", "tuple"): tuple,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "int"): int,
    ("builtins", "float"): float,
    ("builtins", "str"): str,
    ("builtins", "bool"): bool,
    ("__builtin__", "set"): set,
    ("argparse", "Namespace"): __import__("argparse").Namespace,
    ("types", "SimpleNamespace"): __import__("types").SimpleNamespace,
    ("signal", "Signals"): __import__("signal").Signals,
    ("pathlib", "PosixPath"): __import__("pathlib").PosixPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    ("pathlib", "WindowsPath"): __import__("pathlib").PurePosixPath,
    ("datetime", "datetime"): __import__("datetime").datetime,
    ("datetime", "timedelta"): __import__("datetime").timedelta,
    ("datetime", "date"): __import__("datetime").date,
    ("_codecs", "encode"): __import__("codecs").encode,
    ("io", "BytesIO"): io.BytesIO,
    ("enum", "Enum"): __import__("enum").Enum,
}


def _numpy_globals() -> dict:
    out = {}
    try:
        import numpy as np  # numpy only for pickles that hold numpy values
    except ImportError:  # pragma: no cover
        return out
    out[("numpy", "dtype")] = _np_dtype
    out[("numpy", "ndarray")] = np.ndarray
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[(mod, "_reconstruct")] = _np_reconstruct
        out[(mod, "scalar")] = _np_scalar
    for name in ("Float64DType", "Float32DType", "Int64DType", "Int32DType", "UInt32DType",
                 "UInt8DType", "BoolDType", "Float16DType"):
        if hasattr(np, "dtypes") and hasattr(np.dtypes, name):
            out[("numpy.dtypes", name)] = getattr(np.dtypes, name)
    return out


def _plain_numpy_dtype(dtype):
    """Numeric dtypes only: an object array's elements are Python objects, and nothing in a
    checkpoint needs them (numpy RNG states are uint32)."""
    import numpy as np  # numpy only for pickles that hold numpy values
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise UnsafePickleError("refusing a numpy object array in a pickle (it can hold arbitrary objects)",
                                "the file is not a plain checkpoint")
    return dtype


def _np_dtype(obj, *args, **kwargs):
    return _plain_numpy_dtype(__import__("numpy").dtype(obj, *args, **kwargs))


def _np_reconstruct(subtype, shape, dtype):
    import numpy as np  # numpy only for pickles that hold numpy values
    if subtype is not np.ndarray:
        raise UnsafePickleError("refusing a numpy array subclass in a pickle")
    return np.ndarray.__new__(np.ndarray, shape, _plain_numpy_dtype(dtype))


def _np_scalar(dtype, data=None):
    import numpy as np  # numpy only for pickles that hold numpy values
    dtype = _plain_numpy_dtype(dtype)
    if data is None:
        return np.zeros((), dtype=dtype)[()]
    return np.frombuffer(data, dtype=dtype)[0]


_SAFE_GLOBALS.update(_numpy_globals())

# Constructors pickle calls with arguments taken from the file. The stdlib versions accept any
# class or factory, so a crafted pickle could reach code through them; these accept only the
# harmless types a checkpoint uses.
_PLAIN_BASES = (object, dict, list, tuple, set, frozenset, int, float, str, bytes, bytearray)
_DEFAULT_FACTORIES = (None, list, dict, set, int, float, str, tuple, bool, collections.OrderedDict)


def _safe_reconstructor(cls, base, state):
    if not isinstance(cls, type) or base not in _PLAIN_BASES or not issubclass(cls, base):
        raise UnsafePickleError(f"refusing copyreg._reconstructor({getattr(cls, '__name__', cls)!r}, "
                                f"{getattr(base, '__name__', base)!r}) in a pickle (it could run code)",
                                "the file is not a plain checkpoint")
    return copyreg._reconstructor(cls, base, state)


def _safe_newobj(cls, *args):
    if not isinstance(cls, type):
        raise UnsafePickleError(f"refusing copyreg.__newobj__ of {cls!r} in a pickle (not a class)",
                                "the file is not a plain checkpoint")
    return cls.__new__(cls, *args)


def _safe_defaultdict(factory=None, *args):
    if factory not in _DEFAULT_FACTORIES:
        raise UnsafePickleError(f"refusing a defaultdict whose factory is {factory!r} (it would run "
                                "when a key is missing)", "the file is not a plain checkpoint")
    return collections.defaultdict(factory, *args)


_SAFE_GLOBALS.update({
    ("collections", "defaultdict"): _safe_defaultdict,
    ("copyreg", "_reconstructor"): _safe_reconstructor,
    ("copyreg", "__newobj__"): _safe_newobj,
})

# torch names a checkpoint may reference.  Everything else in torch (torch.load, torch.storage.
# _load_from_bytes, torch._ops...) is refused: some of them would run arbitrary pickles.
# _rebuild_from_type_v2 calls its first argument, so it gets a checked wrapper; helpers that rebuild
# exotic tensors (quantized, sparse, nested, wrapper subclasses) are refused as unsupported.
_TORCH_REBUILDS = {
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_device_tensor_from_numpy",
    "_rebuild_meta_tensor_no_storage",
}
UNSUPPORTED_TORCH_REBUILDS = ("_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_nested_tensor",
                              "_rebuild_sparse_csr",
                              "_rebuild_xla_tensor", "_rebuild_mlc_tensor", "_rebuild_cuda_tensor")


def rebuild_unsupported(*args, **kwargs):
    raise CkptError("this torch file holds a tensor kind ckptool does not read "
                    "(quantized, sparse, nested or a tensor subclass)",
                    "re-save the checkpoint with plain dense tensors")


def check_rebuild_from_type(func, new_type, rebuilds) -> None:
    """_rebuild_from_type_v2(func, new_type, args, state) calls func(*args): allow only tensor
    rebuild helpers, and only plain tensors/parameters as the resulting type."""
    if func not in rebuilds or new_type not in (torch.Tensor, torch.nn.Parameter):
        raise UnsafePickleError(f"refusing _rebuild_from_type_v2({getattr(func, '__name__', func)!r}, "
                                f"{getattr(new_type, '__name__', new_type)!r}) in a pickle (it could run code)",
                                "the file is not a plain checkpoint")


def _safe_rebuild_from_type_v2(func, new_type, args, state):
    if dtensor.is_dtensor_rebuild(func):  # a DTensor (FSDP2 state_dict): its local tensor and placement, as data
        return dtensor.from_pickle(new_type, args, state)
    check_rebuild_from_type(func, new_type, {getattr(torch._utils, n) for n in _TORCH_REBUILDS})
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
    "torch.distributed.checkpoint._hf_utils",
)


_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}

# The C unpickler grows its memo table to whatever index a PUT opcode names (a zeroed slot of 8
# bytes per index), so a 5-byte LONG_BINPUT 2**31 in a crafted or damaged file makes it allocate and
# clear 32 GiB before any check runs. Picklers number memo entries 0, 1, 2, ... as they store them,
# so an index far beyond the entries stored so far is refused before unpickling starts.
_PUT_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_SLACK = 1024


def check_memo_indices(stream, source: str = "pickle") -> None:
    """Scan the next pickle in stream (then rewind) and refuse memo indices out of sequence.
    Anything else malformed is left for the unpickler itself to report."""
    try:
        start = stream.tell()
    except (AttributeError, OSError, ValueError):
        return  # not seekable: nothing to rewind to (ckptool always passes files or BytesIO)
    stored = 0
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "MEMOIZE":
                stored += 1
            elif op.name in _PUT_OPCODES:
                if not isinstance(arg, int) or arg > stored + _MEMO_SLACK:
                    raise UnsafePickleError(
                        f"{source}: pickle stores memo entry {arg} after only {stored} entries (a crafted "
                        "or damaged file; unpickling it would allocate gigabytes)",
                        "the file is corrupt or not a checkpoint")
                stored = max(stored, arg + 1)
    except UnsafePickleError:
        raise
    except Exception:  # malformed in another way: the unpickler says how
        pass
    finally:
        stream.seek(start)


class SafeUnpickler(pickle.Unpickler):
    """pickle.Unpickler that only resolves the globals listed above.

    torch_hooks, when given, is a dict of overrides for torch names (the lazy torch-file reader
    swaps _rebuild_tensor_v2 and the storage classes for its own lazy versions).
    """

    torch_hooks: Optional[dict] = None
    source = "pickle"

    def __init__(self, file, *args, **kwargs):
        super().__init__(file, *args, **kwargs)
        self._stream = file

    def load(self) -> Any:
        check_memo_indices(self._stream, self.source)
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)  # protocol-2 pickles name Python 2 modules
        hooks = self.torch_hooks or {}
        if (module, name) in hooks:
            return hooks[(module, name)]
        found = _SAFE_GLOBALS.get((module, name), signal_member(module, name))
        if found is not None:
            return found
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        if module == "torch._utils" and name in _TORCH_REBUILDS:
            return getattr(torch._utils, name)
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _safe_rebuild_from_type_v2
        if module in ("torch._utils", "torch._tensor") and name in UNSUPPORTED_TORCH_REBUILDS:
            return rebuild_unsupported
        if (module, name) == ("torch._utils", "_rebuild_wrapper_subclass"):
            return dtensor.wrapper_subclass_args  # only a DTensor's rebuild accepts it (dtensor.from_pickle)
        if module in dtensor.DTENSOR_MODULES:
            return standin_class(module, name)  # DTensor, its spec, mesh and placements: inert records
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or obj in (
                    torch.Size, torch.device, torch.Tensor):
                return obj
            if name.endswith("Storage") and isinstance(obj, type):
                return obj
        if module in ("torch.storage",) and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        if module == "torch.nn.parameter" and name == "Parameter":
            return torch.nn.Parameter
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module in _DCP_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            # data-only classes: dataclasses and enums (not readers/writers that touch files)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        if is_framework_module(module):
            return standin_class(module, name)
        raise UnsafePickleError(
            f"{self.source}: refusing to load {module}.{name} from a pickle (it could run code)",
            "the file is not a plain checkpoint; if you trust it, re-save it with plain tensors")

    def _enum_member(self, cls, name):
        """getattr as a pickle calls it: only for an enum member by name (standin.enum_member)."""
        member = enum_member(cls, name)
        if member is None:
            raise UnsafePickleError(f"{self.source}: refusing to load getattr({getattr(cls, '__name__', cls)!r}, "
                                    f"{name!r}) from a pickle (only an enum's members load by name)",
                                    "the file is not a plain checkpoint; if you trust it, re-save it with plain tensors")
        return member


def safe_loads(data: bytes, source: str = "pickle") -> Any:
    return safe_load(io.BytesIO(data), source=source)


def safe_load(fileobj, source: str = "pickle") -> Any:
    up = SafeUnpickler(fileobj)
    up.source = source
    try:
        return up.load()
    except CkptError:
        raise
    except Exception as e:  # malformed pickles raise anything from UnpicklingError to ValueError
        raise CkptError(f"{source}: cannot read this pickle ({type(e).__name__}: {e})",
                        "the file is corrupt or not a checkpoint") from e


class _TorchPickleModule:
    """A `pickle_module` for torch.load: torch's own reader, our restricted globals."""

    Unpickler = SafeUnpickler
    UnpicklingError = pickle.UnpicklingError
    __name__ = "ckptool_safe_pickle"

    @staticmethod
    def load(f, **kwargs):
        kwargs.pop("encoding", None)
        return SafeUnpickler(f, encoding="utf-8").load()


torch_pickle_module = _TorchPickleModule()


class StandInPickler(pickle._Pickler):
    """Pure-python pickler that writes StandIn classes back under their original names, and hands
    tensors to a persistent_id callback (the streaming torch writer)."""

    def __init__(self, file, protocol=2, persistent_id: Optional[Callable] = None,
                 reducer_override: Optional[Callable] = None):
        super().__init__(file, protocol=protocol)
        self._pid = persistent_id
        self._reducer = reducer_override

    def persistent_id(self, obj):
        return self._pid(obj) if self._pid else None

    def reducer_override(self, obj):
        if self._reducer is not None:
            return self._reducer(obj)
        return NotImplemented

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, StandIn) and obj is not StandIn:
            module, qual = obj._ckptool_module, obj._ckptool_name
            if self.proto >= 4:
                self.save(module)
                self.save(qual)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qual.encode("utf-8") + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[type] = save_global
