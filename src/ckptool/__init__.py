"""ckptool: one canonical GPT state between Megatron, DeepSpeed and Hugging Face checkpoints.

The Python API (ckptool/api.py) is loaded on first use, so `import ckptool` stays cheap (no torch):
ckptool.open, inspect, merge, reshard, fix_vocab, to_hf, from_hf, verify; errors in ckptool.errors (CkptError).
"""
import sys
import types

__version__ = "0.1.0"

_API = ("open", "inspect", "merge", "reshard", "fix_vocab", "to_hf", "from_hf", "ConversionResult", "VerifyResult")
_ERRORS = ("CkptError", "TeamError", "EXIT", "EXIT_STATUSES")
__all__ = list(_API + _ERRORS) + ["verify"]


class _VerifyPackage(types.ModuleType):
    """ckptool.verify is both the subpackage ckptool/verify/ (the forwards and comparisons) and the
    API function: the import system sets the package attribute `verify` to the subpackage whenever a
    module under it is imported, so the subpackage itself is made callable. Calling it calls
    ckptool.api.verify (see its docstring)."""

    def __call__(self, *args, **kwargs):
        from .api import verify  # on first use: `import ckptool` stays light
        return verify(*args, **kwargs)


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "verify" and isinstance(value, types.ModuleType) and type(value) is types.ModuleType:
            value.__class__ = _VerifyPackage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name):
    if name in _API:
        from . import api  # on first use: `import ckptool` stays light (no torch, no click)
        return getattr(api, name)
    if name in _ERRORS:
        from . import errors  # on first use, as api above
        return getattr(errors, name)
    if name == "verify":
        import importlib  # the subpackage, made callable as the import sets it (see _Package)
        return importlib.import_module(".verify", __name__)
    raise AttributeError(f"module 'ckptool' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
