"""Several processes (or nodes) converting one checkpoint together, under torchrun.

torchrun sets WORLD_SIZE/RANK; each rank then writes only its share of the target files (every
file is independent, so no tensor crosses processes) and the ranks meet only to agree on the
temporary output directory, to report success or failure, and to let rank 0 seal the output
(manifest, rename). Without WORLD_SIZE (or with 1) nothing here starts a process group.
Gloo on CPU: conversion needs no accelerator, and the messages are a few small Python objects.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Team:
    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Round-robin share of the work items 0, 1, 2, ..."""
        return index % self.world == self.rank

    def broadcast(self, obj):
        """Rank 0's obj, on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def current_team() -> Team:
    """The team this process belongs to: torchrun's world, or a team of one."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Team()
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        import atexit
        atexit.register(_leave)
    return Team(rank=dist.get_rank(), world=dist.get_world_size())


def _leave() -> None:
    """Close the process group before the interpreter tears down: left to static destructors, gloo
    sometimes aborts (SIGABRT) a rank that exits while another still finishes the last broadcast."""
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
