"""Which reader opens a path. Each format module exposes FORMAT, looks_like(path), read(path, opts).

Order matters: a torch_dist iteration directory also has Megatron's tracker file, and a DeepSpeed
save directory may have one too, so the more specific formats are asked first.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

from ..errors import CkptError
from ..options import ReadOptions
from ..state import Checkpoint

READER_MODULES = [
    "ckptool.formats.dist",  # before megatron_reader: same tracker file and iter_* dirs
    "ckptool.formats.deepspeed",  # before megatron: an MDS save dir also has Megatron's tracker file
    "ckptool.formats.hf",
    "ckptool.formats.megatron_reader",
]


def _modules():
    for name in READER_MODULES:
        yield importlib.import_module(name)


def detect_format(path) -> str:
    path = Path(path)
    if not path.exists():
        raise CkptError(f"{path}: no such file or directory")
    if path.is_dir() and not any(path.iterdir()):
        raise CkptError(f"{path} is an empty directory", "pass the directory the training run saved to")
    for mod in _modules():
        if mod.looks_like(path):
            return mod.FORMAT
    raise CkptError(f"{path}: not a checkpoint ckptool recognises",
                    "expected a Megatron save dir (mp_rank_*), a torch_dist/DCP dir, a DeepSpeed "
                    "global_step dir or a Hugging Face model dir")


def open_checkpoint(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    """Read any supported checkpoint into the canonical state (lazily)."""
    opts = opts or ReadOptions()
    fmt = detect_format(path)
    from ..io import profile
    for mod in _modules():
        if mod.FORMAT == fmt:
            with profile.stage("plan"):
                return mod.read(Path(path), opts)
    raise CkptError(f"internal: no reader for {fmt}")  # pragma: no cover
