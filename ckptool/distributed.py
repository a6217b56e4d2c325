"""Several processes (or nodes) converting one checkpoint together, under torchrun.

torchrun sets WORLD_SIZE/RANK; each rank then writes only its share of the target files (every
file is independent, so no tensor crosses processes) and the ranks meet only to agree on the
temporary output directory, to report success or failure, and to let rank 0 seal the output
(manifest, rename). Without WORLD_SIZE (or with 1) nothing here starts a process group.
Gloo on CPU: conversion needs no accelerator, and the messages are a few small Python objects.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional


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
        from .io import profile
        with profile.stage("team"):
            dist.init_process_group("gloo")
        import atexit
        atexit.register(_leave)
    return Team(rank=dist.get_rank(), world=dist.get_world_size())


_ABANDONED = False  # set when this rank leaves with an error: the others may never reach a barrier


def _leave() -> None:
    """Close the process group before the interpreter tears down: left to static destructors, gloo
    sometimes aborts (SIGABRT) a rank that exits while another still finishes the last broadcast."""
    if _ABANDONED:
        return
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


# --- a failed command under torchrun -------------------------------------------------------------
# torchrun's agent stops every other rank (SIGTERM) as soon as one rank exits non-zero, and then
# prints its own ChildFailedError report (and exits 1, whatever the ranks' statuses). So the rank
# that reports the error must be the first to exit, and the others must wait for it silently; if it
# never exits (it did not meet this error, e.g. it waits in a collective for this rank), they report
# it themselves after REPORTER_GRACE_S.
REPORTER_GRACE_S = 10.0


def torchrun_rank() -> Optional[int]:
    """This process's rank when torchrun started several (WORLD_SIZE > 1), else None. Read from the
    environment: a command can fail before any process group exists."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return int(os.environ.get("RANK", "0") or 0)


def fail_as_team(line: str, status: int, reporter: int, say: Callable[[str], None]) -> NoReturn:
    """End this rank of a failed torchrun command: the reporter rank says `line` and exits first with
    `status`; the others exit with the same status without a word once torchrun stops them (or, after
    REPORTER_GRACE_S, say it themselves). `line` also goes to torchrun's error file
    (TORCHELASTIC_ERROR_FILE), so torchrun's report names ckptool's error instead of a traceback hint."""
    global _ABANDONED
    _ABANDONED = True
    rank = torchrun_rank() or 0
    if rank != reporter:
        import signal
        import time
        signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
        time.sleep(REPORTER_GRACE_S)
    _write_error_file(line)
    say(line)
    sys.stderr.flush()
    sys.stdout.flush()
    sys.exit(status)


def _write_error_file(line: str) -> None:
    """torchrun's agent shows the `py_callstack` of the first failed rank's error file in its report."""
    import json
    import time
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": f"ckptool {line}",
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the report then carries torchrun's own hint; the error line is printed anyway
