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
from typing import Callable, List, NoReturn, Optional
import atexit
import json
import signal
import time


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
        import torch.distributed as dist  # torch on use: this module is imported by torch-free commands
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist  # torch on use: this module is imported by torch-free commands
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def current_team() -> Team:
    """The team this process belongs to: torchrun's world, or a team of one."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Team()
    import torch.distributed as dist  # torch on use: this module is imported by torch-free commands
    if not dist.is_initialized():
        # io.profile prints a report at exit once imported: only a rank that joins a team imports it here
        # (the torchrun agent imports this module and must not print a profile line of its own)
        from .io import profile
        with profile.stage("team"):
            dist.init_process_group("gloo")
        atexit.register(_leave)
    return Team(rank=dist.get_rank(), world=dist.get_world_size())


_ABANDONED = False  # set when this rank leaves with an error: the others may never reach a barrier


def _leave() -> None:
    """Close the process group before the interpreter tears down: left to static destructors, gloo
    sometimes aborts (SIGABRT) a rank that exits while another still finishes the last broadcast."""
    if _ABANDONED:
        return
    import torch.distributed as dist  # torch on use: this module is imported by torch-free commands
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
# it themselves after REPORTER_GRACE_S. When the team agreed on the reporter (a verify result, a
# TeamError), it surely reports, and may take a while to exit on a loaded machine (its interpreter's
# teardown): the others then wait up to AGREED_GRACE_S, so the line is not said by every rank.
REPORTER_GRACE_S = 10.0
AGREED_GRACE_S = 120.0
# Set by `python -m ckptool.torchrun` for its ranks: that launcher ends with ckptool's line itself.
LAUNCHER_ENV = "CKPTOOL_TORCHRUN_LAUNCHER"
# How long the line deferred past torchrun's report waits for torchrun to end (it ends within
# seconds of a failure; this only bounds a process left behind by a launcher that never ends).
TAIL_WAIT_S = 600.0


def torchrun_rank() -> Optional[int]:
    """This process's rank when torchrun started several (WORLD_SIZE > 1), else None. Read from the
    environment: a command can fail before any process group exists."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return int(os.environ.get("RANK", "0") or 0)


def fail_as_team(line: str, status: int, reporter: int, say: Callable[[str], None],
                 tail: Optional[str] = None, agreed: bool = False) -> NoReturn:
    """End this rank of a failed torchrun command: the reporter rank says `line` and exits first with
    `status` (after giving its local peers PEER_WAIT_S to fail too); the others exit with the same status
    without a word once torchrun stops them (or, after REPORTER_GRACE_S, or AGREED_GRACE_S when the team
    agreed on the reporter, say it themselves). Every failing rank writes `line` to torchrun's error file
    (TORCHELASTIC_ERROR_FILE), so torchrun's report names ckptool's error for each rank instead of a
    traceback hint. Under plain torchrun, whose report would otherwise be the last thing printed, the
    reporter leaves `tail` (default: `line`) to be printed once torchrun has ended (say_after_torchrun)."""
    global _ABANDONED
    _ABANDONED = True
    rank = torchrun_rank() or 0
    if rank != reporter:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
        _write_error_file(line, status)
        time.sleep(AGREED_GRACE_S if agreed else REPORTER_GRACE_S)
    else:
        _write_error_file(line, status)
        _wait_for_local_peers()
    tail = line if tail is None else tail
    if not (tail and say_after_torchrun(tail)):
        say(line)
    sys.stderr.flush()
    sys.stdout.flush()
    sys.exit(status)


def stop_as_team(line: str, status: int, say: Callable[[str], None]) -> NoReturn:
    """End this rank of a command stopped by a signal: torchrun's agent (or ckptool's launcher) sends it
    to every rank, so each ends at once, without the barrier of a normal exit (a peer may still wait in
    a collective); rank 0, which held the partial output, says the line."""
    global _ABANDONED
    _ABANDONED = True
    if not torchrun_rank():
        say(line)
    sys.exit(status)


def _write_error_file(line: str, status: Optional[int] = None) -> None:
    """torchrun's agent shows the `py_callstack` of each failed rank's error file in its report. The
    file also carries ckptool's exit status, for the ranks torchrun stops before they met the error
    (stop_with_the_team)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": f"ckptool {line}", "timestamp": str(int(time.time()))}
    if status is not None:
        extra[_STATUS_KEY] = status
    # written whole or not at all: the agent fails on a partial file, and a rank may be stopped mid-write
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": extra}}, f)
        os.replace(part, path)
    except OSError:
        pass  # the report then carries torchrun's own hint; the error line is printed anyway


# --- the ranks on this node, seen through torchrun's per-rank error files ---------------------------
# torch.distributed.elastic gives each local rank <attempt dir>/<local_rank>/error.json (documented in
# torch/distributed/elastic/multiprocessing/__init__.py). A rank that failed in ckptool has written its
# file (with the status) before it waits for torchrun; so the files tell which peers have failed too.
_STATUS_KEY = "ckptool_status"
# How long the reporter waits for the other local ranks to fail too before it exits (and torchrun stops
# them): a rank still starting up (imports, on a loaded machine) would otherwise be killed by SIGTERM
# before it meets the same error, and end with -15 instead of ckptool's status.
PEER_WAIT_S = 20.0


def _peer_error_files() -> List[str]:
    """The error-file paths of the other local ranks of this torchrun attempt ([] if unknown)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    local_rank = os.environ.get("LOCAL_RANK")
    if not path or local_world <= 1 or local_rank is None:
        return []
    rank_dir = os.path.dirname(path)
    if os.path.basename(rank_dir) != local_rank:
        return []  # not torchrun's layout: nothing to learn from the neighbours
    attempt = os.path.dirname(rank_dir)
    name = os.path.basename(path)
    return [os.path.join(attempt, str(r), name) for r in range(local_world) if str(r) != local_rank]


def _peer_status(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            status = json.load(f)["message"]["extraInfo"][_STATUS_KEY]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return status if isinstance(status, int) else None


def _wait_for_local_peers() -> None:
    """The reporter exits first, but not before the other local ranks that meet the error too have
    said so in their error files (or PEER_WAIT_S passed): then torchrun's SIGTERM finds each of them
    with ckptool's handler in place."""
    peers = _peer_error_files()
    end = time.monotonic() + PEER_WAIT_S
    while peers and time.monotonic() < end:
        peers = [p for p in peers if _peer_status(p) is None]
        if peers:
            time.sleep(0.05)


def stop_with_the_team() -> None:
    """Under torchrun, make a SIGTERM from the agent end this rank with the status a failed peer left in
    its error file: torchrun stops every rank once one fails, also those that never met the error
    (waiting in a collective, or still starting). Any other SIGTERM (a user's or a scheduler's, no
    ckptool failure recorded) does what it did before: stopping.py's clean-up, or the default.
    Installed first thing by the command line."""
    if torchrun_rank() is None or "TORCHELASTIC_RUN_ID" not in os.environ or not _peer_error_files():
        return
    before = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        for path in _peer_error_files():
            status = _peer_status(path)
            if status is not None:
                os._exit(status)
        if callable(before):
            return before(signum, frame)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:
        pass  # not the main thread (an embedding program): leave its signals alone


# Run by a detached interpreter: wait until torchrun's agent (this rank's parent) has ended, then say the
# line on the stderr the rank had. Its own session, so the agent's SIGTERM to the rank's group misses it.
_TAIL_SCRIPT = r"""
import os, sys, time
agent, line, wait = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])

def running(pid):
    # an agent that ended but is not reaped yet (a zombie: its own parent waits to read our pipe) has ended
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

end = time.monotonic() + wait
while running(agent):
    if time.monotonic() > end:
        sys.exit(0)
    time.sleep(0.02)
sys.stderr.write(line + "\n")
"""


def say_after_torchrun(line: str) -> bool:
    """Print `line` after torchrun's own failure report, so that a user's last line is ckptool's: True
    when that is arranged. Only under plain torchrun (its agent is this rank's parent), only where
    stderr is a file or a pipe (in a terminal the shell's prompt would come first: there the line is
    said at once and torchrun's report repeats it), and not when torchrun will restart the ranks."""
    if os.environ.get(LAUNCHER_ENV) or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) < restarts:
        return False  # the agent starts the ranks again instead of ending
    try:
        if os.isatty(sys.stderr.fileno()):
            return False
    except (AttributeError, ValueError, OSError):
        return False  # no real stderr (captured): nothing a later process could write to
    try:
        import subprocess  # on use: slow to import, and every command imports this module
        subprocess.Popen([sys.executable, "-c", _TAIL_SCRIPT, str(os.getppid()), line, str(TAIL_WAIT_S)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sys.stderr.fileno(),
                         start_new_session=True, close_fds=True)
    except OSError:
        return False
    return True
