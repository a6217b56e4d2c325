"""Run several `ckptool verify` checks in one torchrun launch (tests/test_verify.py verify_batch / verify_jobs).

    torchrun --nproc-per-node N tests/verify_batch.py "OUT_FILE ARG ..." ...

Each argument is one job (tests/torchrun_jobs.py): the verify arguments, split on spaces. Each is the real command
(ckptool.cli, as `torchrun -m ckptool verify ARGS` runs it); the only difference is that the process group is
joined once, so the checks share one start-up of N interpreters instead of paying it per check (and the checks of
several test files share one launch through conftest's shared_followups). Rank 0 writes OUT_FILE: the command's
stdout and stderr, then the exit status on the last line as `rc=N`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchrun_jobs import run_jobs  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="one `ckptool verify` check")
    ap.add_argument("out", help="the file rank 0 writes: the command's output, then rc=N")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the verify command's arguments")
    return ap


def run_case(args) -> tuple:
    from ckptool.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["verify", *args], standalone_mode=False)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return out.getvalue() + err.getvalue(), rc


def run_job(a) -> None:
    from ckptool import distributed
    # no torchrun stops the other ranks here after a failed case: they go on to the next job at once
    distributed.REPORTER_GRACE_S = distributed.AGREED_GRACE_S = 0.0
    text, rc = run_case(a.args)
    if dist.get_rank() == 0:
        Path(a.out).write_text(f"{text}\nrc={rc}\n")


if __name__ == "__main__":
    run_jobs(parser(), run_job)
