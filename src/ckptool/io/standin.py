"""The inert stand-in for a class a checkpoint's pickle names but ckptool will not run, torch-free.

Both unpicklers use it: io/safe_pickle.py (the full path) for classes of training frameworks
(Megatron's enums, DeepSpeed's loss scalers, ...), and quick/torch_pickle.py (inspect without torch)
for those and for torch's own classes it does not import (DCP's metadata dataclasses, torch.device).
A StandIn keeps the constructor arguments and the state it was built with, runs nothing, and
pickles back as the original class reference (safe_pickle.StandInPickler), so a Megatron loading
ckptool's output sees its own enums again.
"""
from __future__ import annotations

import copyreg
import enum
import signal
from typing import Any, Tuple

# Top-level packages whose classes become inert stand-ins (new enums appear with every release,
# so no fixed list of names).
FRAMEWORK_PACKAGES = (
    "megatron", "deepspeed", "apex", "transformer_engine", "nemo", "mpu", "fp16", "model",
    "modelopt", "megatron_bridge", "lightning", "pytorch_lightning", "fairscale", "torchtitan",
    "__main__", "utils", "arguments",
)


class StandIn:
    """Inert replacement for a class from a training framework: keeps its data, runs nothing."""

    _ckptool_module = ""
    _ckptool_name = ""
    _BUILT_BY = ("_ckptool_args", "_ckptool_state", "_ckptool_member")  # what equality compares

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_ckptool_args"] = args
        obj.__dict__["_ckptool_state"] = None
        return obj

    def __init__(self, *args, **kwargs):
        # reached only when the pickle called the class (REDUCE: enums, factories); objects pickled
        # by protocol 2+ come back through cls.__new__ alone (NEWOBJ) and must be written that way,
        # or unpickling calls e.g. DeepSpeed's DynamicLossScaler() without its required arguments
        self.__dict__["_ckptool_called"] = True

    def __setstate__(self, state):
        self.__dict__["_ckptool_state"] = state
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            self.__dict__.update(state[0] if isinstance(state[0], dict) else {}, **state[1])

    def __reduce_ex__(self, protocol):
        cls = type(self)
        member = self.__dict__.get("_ckptool_member")
        if member is not None:  # an enum member the pickle named (enum_member): written back alike
            return (getattr, (cls, member))
        state = self.__dict__.get("_ckptool_state")
        args = tuple(self.__dict__.get("_ckptool_args", ()))
        if not self.__dict__.get("_ckptool_called") and protocol >= 2:
            return (copyreg.__newobj__, (cls,) + args, state)
        return (cls, args, state)

    @property
    def value(self):
        """The first constructor argument: an enum member's value."""
        args = self.__dict__.get("_ckptool_args", ())
        return args[0] if args else None

    def __repr__(self) -> str:
        args = ", ".join(repr(a) for a in self.__dict__.get("_ckptool_args", ()))
        member = self.__dict__.get("_ckptool_member")
        return f"<{self._ckptool_module}.{self._ckptool_name}" + (f".{member}>" if member else f"({args})>")

    # Equal when built alike: the same arguments and state (a frozen dataclass of DCP's metadata, a
    # MetadataIndex, is a dict key in its index and must stay as many keys as it was written with).
    def __eq__(self, other):
        return other is self or (isinstance(other, StandIn) and type(other) is type(self)
                and all(other.__dict__.get(k) == self.__dict__.get(k) for k in self._BUILT_BY))

    def __hash__(self):  # the state is set before a pickle uses the object as a key (BUILD precedes SETITEMS)
        return hash((self._ckptool_module, self._ckptool_name, *(repr(self.__dict__.get(k)) for k in self._BUILT_BY)))


_standin_classes: dict = {}


def standin_class(module: str, name: str) -> type:
    """The one StandIn subclass for module.name (the same class object every time)."""
    key = (module, name)
    cls = _standin_classes.get(key)
    if cls is None:
        cls = type(name, (StandIn,), {"_ckptool_module": module, "_ckptool_name": name,
                                      "__module__": module, "__qualname__": name})
        _standin_classes[key] = cls
    return cls


def is_framework_module(module: str) -> bool:
    return module.split(".", 1)[0] in FRAMEWORK_PACKAGES


def stands_for(obj) -> Tuple[str, str]:
    """(module, name) of the class a StandIn replaces; ("", "") for anything else."""
    return (obj._ckptool_module, obj._ckptool_name) if isinstance(obj, StandIn) else ("", "")


def state_of(obj) -> Any:
    """The state a StandIn was given by the pickle (its __setstate__ argument), or None."""
    return obj.__dict__.get("_ckptool_state") if isinstance(obj, StandIn) else None


def signal_member(module: str, name: str):
    """A signal as a pickle may name it: Python 3.10 and early 3.11 (Debian 12's 3.11.2) pickle
    signal.SIGTERM by its global name, not as signal.Signals(15), so Megatron args saved there
    (exit_signal) hold `signal SIGTERM`. The member, or None for any other name (signal.signal, ...)."""
    if module == "signal" and name in signal.Signals.__members__:
        return signal.Signals[name]
    return None


def enum_member(cls, name):
    """An enum member as Python 3.11's early releases (Debian 12's 3.11.2) pickle it, getattr(its
    class, its name) (Megatron's args.model_type, attention_backend, ...): for a framework class's
    StandIn an inert member that pickles back the same way, for an enum class the unpickler allows
    (signal.Signals, DCP's) the member; None for anything else (getattr could reach any attribute)."""
    if not isinstance(name, str) or not isinstance(cls, type):
        return None
    if issubclass(cls, StandIn) and cls is not StandIn:
        member = cls.__new__(cls)
        member.__dict__["_ckptool_member"] = name
        return member
    if issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    return None
