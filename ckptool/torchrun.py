"""`python -m ckptool.torchrun [torchrun options] COMMAND ...`: torchrun for ckptool commands, ending
with ckptool's words and status.

Plain `torchrun -m ckptool ...` works, but when a rank fails torchrun logs the failure, prints a Python
traceback and its ChildFailedError report, and exits 1 whatever the ranks' statuses were; nothing a rank
does changes that (README: "Errors under torchrun"). This launcher runs the same elastic launch through
torch.distributed.run and, when a rank fails, ends instead with the status of the rank that failed
first (2 for bad input, 1 for a verify mismatch, ...): that rank has already printed ckptool's error
line, so nothing follows it. A rank that died without a word (a signal, a crash) gets one line here.

    python -m ckptool.torchrun --nproc-per-node 4 verify out --reference src
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional


def split_argv(argv: List[str]) -> tuple:
    """(torchrun options, ckptool command line): the command starts at the first ckptool command name."""
    from .cli import COMMANDS
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
    from .io import startup
    # the launcher imports torch too, before any worker starts: bytecode cache, and the disk reads the
    # source meanwhile, for the workers (io/startup.py)
    startup.prepare(command)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    args = parse_args([*torchrun_opts, "-m", "ckptool", *command])
    from .distributed import LAUNCHER_ENV
    os.environ[LAUNCHER_ENV] = "1"  # the ranks say their line at once: this launcher ends with it
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


if __name__ == "__main__":
    sys.exit(main())
