"""Run several `ckptool verify` checks in one torchrun launch (used by tests/test_verify.py).

    torchrun --nproc-per-node N tests/verify_batch.py CASES.json OUT_DIR

CASES.json maps a case name to the verify arguments. Each case is the real command
(ckptool.cli, as `torchrun -m ckptool verify ARGS` runs it); the only difference is that this
script joins the process group once, so the cases share one start-up of N interpreters instead of
paying it per case. Rank 0 writes OUT_DIR/NAME.txt: the command's stdout and stderr, then the
exit status on the last line as `rc=N`.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch.distributed as dist


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


def main_batch(cases_file: str, out_dir: str) -> None:
    from ckptool import distributed
    # no torchrun stops the other ranks here after a failed case: they go on to the next case at once
    distributed.REPORTER_GRACE_S = distributed.AGREED_GRACE_S = 0.0
    cases = json.loads(Path(cases_file).read_text())
    dist.init_process_group("gloo")
    try:
        for name, args in cases.items():
            text, rc = run_case(args)
            if dist.get_rank() == 0:
                (Path(out_dir) / f"{name}.txt").write_text(f"{text}\nrc={rc}\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main_batch(*sys.argv[1:3])
