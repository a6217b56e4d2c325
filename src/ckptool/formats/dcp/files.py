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
DCP_METADATA = ".metadata"  # DCP's index (io/dcp_io.METADATA; that module imports torch)


def is_dist_dir(d: Path) -> bool:
    return d.is_dir() and ((d / DCP_METADATA).is_file() or (d / CONFIG_FILE).is_file())


def locate(path: Path, iteration: Optional[int] = None) -> Tuple[Path, Optional[int], bool]:
    """(directory holding .metadata, iteration, release?) for a save dir or an iteration dir."""
    path = Path(path)
    if is_dist_dir(path):
        m = re.match(r"^iter_(\d{7})$", path.name)
        return path, (int(m.group(1)) if m else None), path.name == "release"
    return resolve_iteration_dir(path, iteration)


def looks_like(path: Path) -> bool:
    path = Path(path)
    if not path.is_dir():
        return False
    if is_dist_dir(path):
        return True
    if not ((path / TRACKER).is_file() or any(p.name.startswith("iter_") for p in path.iterdir())):
        return False
    try:
        d, _, _ = resolve_iteration_dir(path)
    except CkptError:
        return False
    return is_dist_dir(d)
