"""ckptool: one canonical GPT state between Megatron, DeepSpeed and Hugging Face checkpoints.

The Python API (ckptool/api.py) is loaded on first use, so `import ckptool` stays cheap (no torch):
ckptool.open, merge, reshard, fix_vocab, to_hf, from_hf, verify; errors in ckptool.errors (CkptError).
"""
__version__ = "0.1.0"

_API = ("open", "merge", "reshard", "fix_vocab", "to_hf", "from_hf", "verify", "ConversionResult",
        "VerifyResult")
_ERRORS = ("CkptError", "TeamError", "EXIT", "EXIT_STATUSES")
__all__ = list(_API + _ERRORS)


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    if name in _ERRORS:
        from . import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'ckptool' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
