"""torch_dist / DCP directories on disk, without torch: whether a path is one and where its iteration
directory is. The reader (torch_dist.py), the format table and the quick inspect (formats/dcp/quick.py) ask here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Tuple

from ...errors import CkptError
from ..megatron.files import TRACKER, resolve_iteration_dir

CONFIG_FILE = "metadata.json"  # megatron-core's {"sharded_backend": ...}
COMMON_FILE = "common.pt"  # the non-sharded state (args, iteration), older saves
COMMON_KEY = "common_state/shard_0_1"  # the same as a DCP byte entry, newer saves
# Megatron-LM's --ckpt-format torch_dcp / fsdp_dtensor (training/checkpointing.py save_checkpoint, Megatron-LM
# d98e8a64) save generate_state_dict()'s plain entries with torch.distributed.checkpoint itself: each a byte entry
# of its own beside the model's tensors (under "model.", Megatron-FSDP's "model.module." for fsdp_dtensor).
DCP_COMMON_KEYS = ("args", "checkpoint_version", "iteration")
DCP_METADATA = ".metadata"  # DCP's index (io/dcp_io.METADATA; that module imports torch)
# Folders holding a trainer's torch_dist files below the checkpoint directory a user names, its config
# sidecar beside them (formats/dcp/sidecars.py): NeMo 2's <ckpt>/weights/, verl's <actor>/dist_ckpt/.
CONTAINED_DIST_DIRS = ("weights", "dist_ckpt")


def is_dist_dir(d: Path) -> bool:
    return d.is_dir() and ((d / DCP_METADATA).is_file() or (d / CONFIG_FILE).is_file())


def contained_dist_dir(path: Path) -> Optional[Path]:
    """The torch_dist folder a trainer keeps below path (CONTAINED_DIST_DIRS), or None."""
    for name in CONTAINED_DIST_DIRS:
        if is_dist_dir(Path(path) / name):
            return Path(path) / name
    return None


def locate(path: Path, iteration: Optional[int] = None) -> Tuple[Path, Optional[int], bool]:
    """(directory holding .metadata, iteration, release?) for a save dir, an iteration dir, or a folder
    holding a trainer's torch_dist folder (CONTAINED_DIST_DIRS)."""
    path = Path(path)
    inner = contained_dist_dir(path) if path.is_dir() else None
    if inner is not None and not is_dist_dir(path):
        return inner, None, False
    if is_dist_dir(path):
        m = re.match(r"^iter_(\d{7})$", path.name)
        return path, (int(m.group(1)) if m else None), path.name == "release"
    return resolve_iteration_dir(path, iteration)


def looks_like(path: Path) -> bool:
    path = Path(path)
    if not path.is_dir():
        return False
    if is_dist_dir(path) or contained_dist_dir(path) is not None:
        return True
    if not ((path / TRACKER).is_file() or any(p.name.startswith("iter_") for p in path.iterdir())):
        return False
    try:
        d, _, _ = resolve_iteration_dir(path)
    except CkptError:
        return False
    return is_dist_dir(d)
