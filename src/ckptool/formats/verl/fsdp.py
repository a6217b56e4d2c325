"""verl's FSDP checkpoints (files.py says the layout): each rank's model_world_size_N_rank_R.pt holds the FSDP2
model's state_dict(), Hugging Face names, every parameter a DTensor over the one-dimensional FSDP mesh of the N
ranks, placed Shard(0) (torch.distributed.fsdp fully_shard, torch 2.13: _fsdp_param.py shards dim 0 by torch.chunk,
and state_dict() hands out each rank's unpadded piece). The rank files are read lazily through the safe unpickler
(io/dtensor.py keeps each DTensor's local tensor and placement), each parameter put together from its ranks'
pieces in mesh order, then mapped as a Hugging Face model of its config.json's family (formats/hf/reader.py).
FSDP1's ShardedTensor files (fsdp_config.json FSDP_version 1) are not read; the per-rank optimizer files are (optim.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from ... import families
from ...config import Layout
from ...errors import CkptError, require
from ...io.dtensor import DTensorShard
from ...io.torchfile import load_torch_file
from ...lazy import LazyTensor, cat
from ...options import ReadOptions
from ...state import Checkpoint, SourceInfo
from ..hf import reader as hf_format
from . import optim as verl_optim
from .files import OPTIM_FILE, hf_config_path, locate, rank_files

FORMAT = "verl-fsdp"
TIED_HEAD = "lm_head.weight"  # a tied model's state dict names its one embedding parameter twice
# Module wrappers whose names FSDP1 / activation checkpointing / torch.compile put into parameter names.
WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _refuse_fsdp1(d: Path) -> None:
    f = d / "fsdp_config.json"
    try:
        version = json.loads(f.read_text()).get("FSDP_version") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        version = None
    require(version != 1, f"{d}: a verl FSDP1 checkpoint (fsdp_config.json FSDP_version 1: ShardedTensor shards)",
            "ckptool reads verl's FSDP2 checkpoints (DTensor shards); save with actor.strategy=fsdp2, or use verl's "
            "model merger")


def _piece(name: str, rank: int, p: DTensorShard, world: int, where: str) -> Optional[LazyTensor]:
    """Rank's piece of a Shard(dim) DTensor of `world` ranks (torch.chunk's split: ceil(n / world) each, the last
    ones shorter or empty), checked against its global shape; None where it holds no rows."""
    dim = p.placements[0][1]
    n = p.global_shape[dim]
    step = -(-n // world)
    want = list(p.global_shape)
    want[dim] = max(0, min(step, n - rank * step))
    got = tuple(p.local.shape)
    require(got == tuple(want), f"{where}: {name} on rank {rank} has shape {got}, expected {tuple(want)} (Shard({dim}) "
            f"of {tuple(p.global_shape)} over {world} ranks)", "the rank files do not belong together")
    return p.local if want[dim] else None


def _whole(name: str, parts: List, where: str) -> LazyTensor:
    """One parameter from every rank's entry: the pieces of a DTensor in mesh order, or a replicated tensor."""
    first, world = parts[0], len(parts)
    if not isinstance(first, DTensorShard):
        require(all(not isinstance(p, DTensorShard) and hasattr(p, "shape") for p in parts),
                f"{where}: {name} is not a tensor on every rank", "the rank files do not belong together")
        return first
    require(all(isinstance(p, DTensorShard) and p.global_shape == first.global_shape and
                p.placements == first.placements for p in parts),
            f"{where}: {name} is placed differently on different ranks", "the rank files do not belong together")
    require(len(first.placements) == 1, f"{where}: {name} is a DTensor over a {len(first.placements)}-dimensional "
            "mesh", "ckptool reads FSDP2's one-dimensional sharding (no HSDP or tensor parallelism)")
    for rank, p in enumerate(parts):
        require(p.coordinate in (None, (rank,)), f"{where}: {name} in rank {rank}'s file sits at mesh coordinate "
                f"{p.coordinate}", "the rank files are misnamed")
    if first.placements[0] == ("replicate",):
        return first.local
    pieces = [x for r, p in enumerate(parts) for x in [_piece(name, r, p, world, where)] if x is not None]
    return cat(pieces, first.placements[0][1])


def _hf_name(name: str) -> str:
    for infix in WRAPPER_INFIXES:
        name = name.replace(infix, "")
    return name


def rank_states(d: Path) -> List[dict]:
    """Every rank file's state dict, lazily, in rank order."""
    files = rank_files(d)
    states = [load_torch_file(files[r]) for r in sorted(files)]
    for r, s in enumerate(states):
        require(isinstance(s, dict), f"{files[r]}: not a state dict", "the file is not a verl model shard")
        require(set(s) == set(states[0]), f"{files[r]} holds other parameters than {files[0].name}",
                "the rank files do not belong together")
    return states


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    opts = opts or ReadOptions()
    d = locate(Path(path))
    require(d is not None, f"{path}: no model_world_size_N_rank_R.pt files", "pass verl's global_step_S/actor folder")
    _refuse_fsdp1(d)
    config_file = hf_config_path(d, opts.hf_config)
    try:
        conf = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"{config_file}: not valid JSON ({e})", "pass a Hugging Face config.json")
    family = families.of_hf_config(conf) if isinstance(conf, dict) else None
    require(family is not None, f"{config_file}: model_type {conf.get('model_type') if isinstance(conf, dict) else None!r} "
            "is not one ckptool converts", f"supported: {', '.join(families.BY_MODEL_TYPE)}")
    states = rank_states(d)
    named = {_hf_name(k): _whole(k, [s[k] for s in states], str(d)) for k in states[0]}
    cfg, tensors = hf_format.to_canonical(named, conf, family.model_type, opts, d)
    warnings: List[str] = []
    world = len(states)

    def canonical(by_name: Dict[str, LazyTensor]) -> Dict[str, LazyTensor]:
        return hf_format.to_canonical(by_name, conf, family.model_type, opts, d)[1]

    optimizer = None
    if opts.optimizer and (d / OPTIM_FILE.format(world=world, rank=0)).is_file():
        optimizer = verl_optim.read(d, world, _parameter_names(states[0], conf), named, canonical, tensors, _whole,
                                    warnings.append)
    info = SourceInfo(path=str(path), format=FORMAT, dialect=family.model_type, layout=Layout(1, 1),
                      extra={"hf_config": conf, "fsdp_world_size": world})
    return Checkpoint(cfg, tensors, info, warnings, optimizer)


def _parameter_names(state: dict, conf: dict) -> List[str]:
    """The model's parameters in named_parameters() order, the order verl gives them to its optimizer
    (build_optimizer(actor_module_fsdp.parameters())): the state dict's keys without a tied head's second name."""
    tied = conf.get("tie_word_embeddings", True)  # transformers' PretrainedConfig default
    return [_hf_name(k) for k in state if not (tied and _hf_name(k) == TIED_HEAD)]
