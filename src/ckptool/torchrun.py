"""`python -m ckptool.torchrun [torchrun options] COMMAND ...`: torchrun for ckptool commands, ending
with ckptool's words and status.

Plain `torchrun -m ckptool ...` works, but when a rank fails torchrun logs the failure, prints a Python
traceback and its ChildFailedError report, and exits 1 whatever the ranks' statuses were; nothing a rank
does changes that (docs/errors.md: "Errors under torchrun"). This launcher runs the same elastic launch through
torch.distributed.run and, when a rank fails, ends instead with the status of the rank that failed
first (2 for bad input, 1 for a verify mismatch, ...): that rank has already printed ckptool's error
line, so nothing follows it. A rank that died without a word (a signal, a crash) gets one line here.

    python -m ckptool.torchrun --nproc-per-node 4 verify out --reference src

On one node with only the plain options (--nproc-per-node N, --master-addr/--master-port,
--standalone, --nnodes 1, --node-rank 0) the ranks are started directly, without importing torch in
the launcher (about 2.5 s on a many-core host, spent before any rank could start): each rank gets
the environment torchrun's agent gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_ERROR_FILE, ...), the first rank to fail stops the others (SIGTERM, then SIGKILL) and
its status and error file decide the launcher's, as above. Any other option (several nodes,
rendezvous settings, restarts) goes through torch.distributed.run; CKPTOOL_LAUNCHER=torchrun forces that.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from .io import startup
from .distributed import LAUNCHER_ENV
from .io import prefetch


def split_argv(argv: List[str]) -> tuple:
    """(torchrun options, ckptool command line): the command starts at the first ckptool command name."""
    from .cli import COMMANDS  # click only when a command line is split
    names = set(COMMANDS)  # the command names, without importing the commands
    for i, arg in enumerate(argv):
        if arg in names:
            return argv[:i], argv[i:]
    return argv, []


def _quiet_torchrun_failure_logs() -> None:
    """torchrun's agent logs each failed rank and the SIGTERMs it sends (loggers with their own levels)."""
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401  (create its loggers)
    import torch.distributed.launcher.api  # noqa: F401
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    torchrun_opts, command = split_argv(argv)
    if not command:
        print("usage: python -m ckptool.torchrun [torchrun options] COMMAND [ARGS]...  "
              "(COMMAND: a ckptool command, e.g. verify)", file=sys.stderr)
        return 2
    direct = direct_options(torchrun_opts)
    if direct is not None and os.environ.get("CKPTOOL_LAUNCHER", "") != "torchrun":
        return launch_direct(command, *direct)
    # the launcher imports torch too, before any worker starts: bytecode cache, and the disk reads the
    # source meanwhile, for the workers (io/startup.py)
    startup.prepare(command)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # torch only for torchrun's own agent (the direct launch starts ranks without it)
    from torch.distributed.run import parse_args, run  # as above
    args = parse_args([*torchrun_opts, "-m", "ckptool", *command])
    os.environ[LAUNCHER_ENV] = "1"  # the ranks say their line at once: this launcher ends with it
    prefetch.HANDOVER.set()  # the workers read ahead from here, each what it converts next
    _quiet_torchrun_failure_logs()
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        said = isinstance(failure.message, dict)  # the rank wrote ckptool's error file: it printed the line
        if failure.exitcode < 0:
            if not said:
                print(f"ckptool: rank {rank} was killed by {failure.signal_name()}", file=sys.stderr)
            return 128 - failure.exitcode  # as a shell reports a signal
        if not said:
            print(f"ckptool: rank {rank} exited with status {failure.exitcode} without a message "
                  "(rerun with `ckptool --debug`)", file=sys.stderr)
        return failure.exitcode
    return 0


# --- one node, plain options: the ranks started without torch --------------------------------------
_VALUED = {"--nproc-per-node": "nproc", "--nproc_per_node": "nproc", "--master-port": "port",
           "--master_port": "port", "--master-addr": "addr", "--master_addr": "addr", "--nnodes": "nnodes",
           "--node-rank": "node_rank", "--node_rank": "node_rank"}
_FLAGS = {"--standalone"}
TERM_GRACE_S = 30.0  # as torchrun's agent: SIGTERM, then SIGKILL for a rank still there after this


def direct_options(opts: List[str]) -> Optional[tuple]:
    """(nproc, master addr, master port or None) when opts are only options the direct launch
    honours exactly as torchrun would on one node; None sends the launch through torchrun."""
    found: dict = {}
    i = 0
    while i < len(opts):
        opt, value = opts[i], None
        if "=" in opt and opt.startswith("--"):
            opt, value = opt.split("=", 1)
        if opt in _FLAGS and value is None:
            i += 1
            continue
        if opt not in _VALUED:
            return None
        if value is None:
            if i + 1 >= len(opts):
                return None
            value = opts[i + 1]
            i += 1
        found[_VALUED[opt]] = value
        i += 1
    try:
        nproc = int(found.get("nproc", "1"))
        port = int(found["port"]) if "port" in found else None
    except ValueError:
        return None  # "auto", "gpu": torchrun's own rules decide
    if found.get("nnodes", "1") not in ("1", "1:1") or found.get("node_rank", "0") != "0" or nproc < 1:
        return None
    return nproc, found.get("addr", "127.0.0.1"), port


def reserve_port():
    """A free port, held for the launch: the returned socket stays bound until the ranks have ended.

    A port that is picked and let go can be handed to another process (its own port-0 bind, an
    outgoing connection) in the seconds before rank 0 has imported torch and bound its store to it.
    While this socket holds the port the kernel hands it to no one else, yet rank 0's store can
    still bind it: both sockets ask for SO_REUSEADDR (torch's store does, with or without libuv),
    and Linux lets such sockets share a port as long as at most the store listens."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _rank_env(rank: int, nproc: int, addr: str, port: int, error_file: str) -> dict:
    """What torchrun's local agent puts in a rank's environment (one node, no restarts)."""
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
                "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": addr,
                "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_ERROR_FILE": error_file, "TORCH_NCCL_ASYNC_ERROR_HANDLING":
                os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")})
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks on one node
    env[LAUNCHER_ENV] = "1"  # the ranks say their line at once: this launcher ends with it
    return env


def _said(error_file: str) -> bool:
    """Whether a rank wrote ckptool's error file (it then printed its error line itself)."""
    try:
        with open(error_file) as f:
            return isinstance(json.load(f).get("message"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def launch_direct(command: List[str], nproc: int, addr: str, port: Optional[int]) -> int:
    """Start nproc ranks of `python -m ckptool COMMAND` and wait for them (see the module docstring)."""
    held = None if port else reserve_port()  # closed when the launch ends (finally below)
    port = port or held.getsockname()[1]
    python = os.environ.get("PYTHON_EXEC", sys.executable)  # as torchrun picks the interpreter
    errors = tempfile.mkdtemp(prefix="ckptool-torchrun-")
    procs: list = []
    stopping = []

    def stop(sig=signal.SIGTERM) -> None:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)  # each rank leads its own session, as under torchrun
                except (ProcessLookupError, PermissionError):
                    pass

    def on_signal(signum, _frame):  # Ctrl-C, a scheduler's SIGTERM, a closed terminal's SIGHUP: pass it
        stopping.append(signum)    # on (each rank removes what it wrote), then end as it says
        stop(signal.Signals(signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN}  # nohup: SIGHUP stays ignored
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([python, "-u", "-m", "ckptool", *command],
                                          env=_rank_env(rank, nproc, addr, port, os.path.join(errors, f"{rank}.json")),
                                          start_new_session=True))
        first = None  # (rank, status) of the first rank seen failing
        while any(p.poll() is None for p in procs) and first is None and not stopping:
            time.sleep(0.02)
            first = next(((r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
        if first is not None or stopping:
            stop()
            end = time.monotonic() + TERM_GRACE_S
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                time.sleep(0.02)
            stop(signal.SIGKILL)
        for p in procs:
            p.wait()
        if stopping:  # stopped from outside: end as the signal says, whatever the ranks made of it
            return 128 + stopping[0]
        if first is None:
            first = next(((r, p.returncode) for r, p in enumerate(procs) if p.returncode), None)
        return 0 if first is None else _team_status(*first, errors)
    finally:
        stop(signal.SIGKILL)
        if held is not None:
            held.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(errors, ignore_errors=True)


def _team_status(rank: int, status: int, errors: str) -> int:
    """The launch's status when `rank` failed first with `status`: the rank's own (128 + N for a rank killed
    by signal N, as a shell reports it), with one line for a rank that died without saying why."""
    said = _said(os.path.join(errors, f"{rank}.json"))
    if status < 0:
        if not said:
            print(f"ckptool: rank {rank} was killed by {signal.Signals(-status).name}", file=sys.stderr)
        return 128 - status
    if not said:
        print(f"ckptool: rank {rank} exited with status {status} without a message "
              "(rerun with `ckptool --debug`)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
