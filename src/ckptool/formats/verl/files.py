"""verl's FSDP checkpoint folders on disk, without torch: whether a path is one, its rank files, its config.

verl/utils/checkpoint/fsdp_checkpoint_manager.py save_checkpoint (volcengine/verl b178a3c, 2026-01): every rank
torch.save()s its model.state_dict() to model_world_size_{N}_rank_{R}.pt (FSDP2: DTensors; FSDP1 under
SHARDED_STATE_DICT: ShardedTensors), optimizer.state_dict() to optim_world_size_{N}_rank_{R}.pt and
{lr_scheduler, rng} to extra_state_world_size_{N}_rank_{R}.pt; rank 0 writes the model's Hugging Face config
(save_pretrained) to huggingface/ and {FSDP_version, world_size} to fsdp_config.json. The trainer keeps that
folder as <save>/global_step_{S}/actor/ (critic/ beside it for PPO's critic).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional, Tuple

from ...errors import CkptError, require

MODEL_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
OPTIM_FILE = "optim_world_size_{world}_rank_{rank}.pt"
HF_DIR = "huggingface"
# the role folder a verl save step holds (global_step_S/actor/): a user may name the step's folder instead
ROLE_DIRS = ("actor",)


def _model_files(d: Path) -> Dict[Tuple[int, int], Path]:
    out = {}
    for p in d.iterdir() if d.is_dir() else ():
        m = MODEL_FILE.match(p.name)
        if m and p.is_file():
            out[(int(m.group(1)), int(m.group(2)))] = p
    return out


def locate(path: Path) -> Optional[Path]:
    """The folder holding the rank files: path itself, or its actor/ folder (a global_step_S folder)."""
    path = Path(path)
    for d in (path,) + tuple(path / r for r in ROLE_DIRS):
        if _model_files(d):
            return d
    return None


def looks_like(path: Path) -> bool:
    return Path(path).is_dir() and locate(path) is not None


def rank_files(d: Path) -> Dict[int, Path]:
    """{rank: model file} of one world size, every rank present (CkptError otherwise)."""
    files = _model_files(d)
    worlds = sorted({w for w, _ in files})
    require(len(worlds) == 1, f"{d}: model files of several world sizes ({', '.join(map(str, worlds))})",
            "keep the files of one save in a folder")
    world = worlds[0]
    missing = [r for r in range(world) if (world, r) not in files]
    require(not missing, f"{d}: model_world_size_{world}_rank_R.pt is missing for ranks {missing}",
            "the checkpoint is incomplete: every rank's file is needed")
    extra = sorted(r for w, r in files if r >= world)
    require(not extra, f"{d}: rank files {extra} beyond world size {world}", "the checkpoint is damaged")
    return {r: files[(world, r)] for r in range(world)}


def hf_config_path(d: Path, given: Optional[str]) -> Path:
    """The config.json: huggingface/ beside the rank files, else --hf-config; CkptError naming both."""
    own = d / HF_DIR / "config.json"
    if own.is_file():
        return own
    if given:
        g = Path(given)
        f = g / "config.json" if g.is_dir() else g
        require(f.is_file(), f"--hf-config {given}: no config.json there", "pass a config.json or a directory holding one")
        return f
    raise CkptError(f"{d}: verl FSDP rank files but no {HF_DIR}/config.json beside them (the model's config)",
                    "give --hf-config DIR (the Hugging Face config of the trained model)")
