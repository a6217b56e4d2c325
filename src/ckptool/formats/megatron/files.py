"""Megatron-LM torch-format checkpoints on disk, without torch: which directories and files make one,
and what its model keys say (flattened key paths, the key dialect). The reader and writer
(checkpoint.py) and the quick inspect (formats/megatron/quick.py) both start here; `import torch` is not
needed to answer where a checkpoint is or which format the table should call it.

Directory facts (shared/reference/megatron.md section 1): see checkpoint.py.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...errors import CkptError, require
from .names import DIALECTS, Dialect, KeyMatcher, is_ignorable, is_mla

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILES = ("model_optim_rng.pt", "model_rng.pt")
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
ITER_DIR = re.compile(r"^iter_(\d{7})$")


# --- locating the files ---------------------------------------------------------------------

# 2022-03..2023-05 runs with --use-distributed-optimizer wrote mp_rank_XX[_YYY]/model_rng.pt plus one
# mp_rank_XX[_YYY]_DDD/optim.pt per data-parallel rank: those names look like PP or EP ranks, but a
# directory holding only optim.pt carries no model weights.
OPTIMIZER_ONLY_FILE = "optim.pt"


def is_optimizer_only(d: Path) -> bool:
    return (d / OPTIMIZER_ONLY_FILE).is_file() and not any((d / n).is_file() for n in MODEL_FILES)


def list_rank_dirs(d: Path) -> List[Path]:
    return sorted(p for p in d.iterdir() if p.is_dir() and RANK_DIR.match(p.name) and not is_optimizer_only(p))


def resolve_iteration_dir(path: Path, iteration: Optional[int] = None) -> Tuple[Path, Optional[int], bool]:
    """(directory holding mp_rank_*, iteration, release?) for a save dir or an iteration dir."""
    path = Path(path)
    if not path.exists():
        raise CkptError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CkptError(f"{path} is a file, but a Megatron checkpoint is a directory",
                        "pass the save directory (holding latest_checkpointed_iteration.txt) or an iter_* directory")
    if list_rank_dirs(path):
        m = ITER_DIR.match(path.name)
        return path, (int(m.group(1)) if m else None), path.name == "release"
    if iteration is not None:
        d = path / f"iter_{iteration:07d}"
        if not d.is_dir():
            have = sorted(p.name for p in path.iterdir() if ITER_DIR.match(p.name))
            raise CkptError(f"{path}: no iteration {iteration}", f"available: {', '.join(have) or 'none'}")
        return d, iteration, False
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if text == "release":
            d = path / "release"
            if not d.is_dir():
                raise CkptError(f"{tracker} says 'release' but {d} does not exist",
                                "the checkpoint is incomplete; pass the directory of an existing iteration")
            return d, None, True
        if not text.isdigit():
            raise CkptError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'",
                            "fix the tracker file or pass --iteration N")
        d = path / f"iter_{int(text):07d}"
        if not d.is_dir():
            raise CkptError(f"{tracker} points to iteration {int(text)} but {d.name}/ does not exist",
                            "pass --iteration N for an iteration that exists")
        return d, int(text), False
    iters = sorted(p for p in path.iterdir() if p.is_dir() and ITER_DIR.match(p.name))
    if iters:
        return iters[-1], int(ITER_DIR.match(iters[-1].name).group(1)), False
    if (path / "release").is_dir():
        return path / "release", None, True
    raise CkptError(f"{path}: no Megatron checkpoint here (no {TRACKER}, iter_* or mp_rank_* directories)",
                    "pass the directory you gave Megatron's --save")


def looks_like_megatron(path: Path) -> bool:
    path = Path(path)
    if not path.is_dir():
        return False
    if list_rank_dirs(path):
        return True
    if not ((path / TRACKER).is_file() or (path / "release").is_dir()
            or any(ITER_DIR.match(p.name) for p in path.iterdir())):
        return False
    try:  # a torch_dist save has the same tracker and iter_* dirs, but no mp_rank_* inside
        it_dir, _, _ = resolve_iteration_dir(path)
    except CkptError:
        return True  # let the reader report what is wrong
    return not ((it_dir / "metadata.json").is_file() or (it_dir / ".metadata").is_file())


def model_file(rank_dir: Path) -> Path:
    for name in MODEL_FILES:
        if (rank_dir / name).is_file():
            return rank_dir / name
    raise CkptError(f"{rank_dir}: no {' or '.join(MODEL_FILES)}", "the rank directory is incomplete")


def flatten(tree, prefix: str = "") -> Dict[str, object]:
    """Nested model dicts -> {'language_model/encoder/layers.0.x.weight': leaf}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def detect_dialect(keys) -> Dialect:
    keys = [k for k in keys if not is_ignorable(k)]
    best, best_hits = None, -1
    mla = is_mla(keys)
    for d in DIALECTS.values():
        m = KeyMatcher(d, mla=mla)
        hits = sum(1 for k in keys if m.match(k))
        if hits > best_hits:
            best, best_hits = d, hits
    if best_hits <= 0:
        sample = ", ".join(sorted(keys)[:4])
        raise CkptError(f"unrecognised Megatron model keys (e.g. {sample})",
                        "ckptool reads GPT models in the 2019, legacy and megatron-core dialects")
    return best


# --- the rank grid (shared with formats/megatron/quick.py) -------------------------------------------

def rank_coordinates(rank_dirs: List[Path], first_tree) -> Dict[Tuple[int, int, int], Path]:
    """{(tp, pp, ep): dir}. mp_rank_TT_NNN is a pipeline rank unless the run's args say it was expert-
    parallel without pipeline parallelism (the names alone cannot tell)."""
    args = first_tree.get("args") if isinstance(first_tree, dict) else None
    ep_only = (getattr(args, "expert_model_parallel_size", None) or 1) > 1 and \
        (getattr(args, "pipeline_model_parallel_size", None) or 1) == 1
    out = {}
    for d in rank_dirs:
        nums = [int(g) for g in RANK_DIR.match(d.name).groups() if g is not None]
        if len(nums) == 3:
            rk = tuple(nums)
        elif len(nums) == 2:
            rk = (nums[0], 0, nums[1]) if ep_only else (nums[0], nums[1], 0)
        else:
            rk = (nums[0], 0, 0)
        out[rk] = d
    return out


def expert_grid(tp: int, ep: int, etp: int) -> Dict[Tuple[int, int], int]:
    """{(TP rank, EP rank): expert-TP rank} of the rank directories of one pipeline stage.

    In a stage, rank x (megatron-core's default order tp-cp-ep-dp-pp, parallel_state.RankGenerator) has
    dense TP rank x % TP and, on the expert grid (tp-ep-dp with the expert TP size), expert-TP rank
    x % ETP and EP rank (x // ETP) % EP. Megatron-LM names a rank's file by (TP rank, EP rank) only
    (checkpointing.py get_checkpoint_name), saves from data-parallel rank 0 and expert-data-parallel rank 0
    (save_checkpoint; before 2026-05 only the latter), and every rank loads the file of its (TP rank,
    EP rank). So the pairs repeat with period lcm(TP, ETP x EP): with ETP = TP every (t, e) exists; with
    ETP below TP only some do (TP2 ETP1 EP2: mp_rank_00_000 and mp_rank_01_001) and file (t, e) holds
    EP rank e's experts cut at expert-TP rank t % ETP (ETP divides TP, so x % ETP = t % ETP)."""
    require(tp % etp == 0, *etp_refusal(tp, etp))
    period = tp * ep * etp // math.gcd(tp, ep * etp)
    return {(x % tp, (x // etp) % ep): x % etp for x in range(period)}


def etp_refusal(tp: int, etp: int) -> Tuple[str, str]:
    if etp > tp and etp % tp == 0:
        return (f"expert tensor parallelism {etp} above TP {tp} has no torch-format layout: ranks of different "
                "expert-TP rank save to (and load from) the same mp_rank directory, which holds one of their shards",
                f"choose --etp dividing --tp {tp}, or use the run's torch_dist checkpoint")
    return (f"expert tensor parallelism {etp} does not divide TP {tp}", "choose an expert TP size that divides TP")
