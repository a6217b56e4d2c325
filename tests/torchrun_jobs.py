"""The main loop of the tests' torchrun helpers, torch-only (no framework import): each command-line argument
is one job, parsed by the helper's parser and run under torchrun (one start for several jobs: importing torch and
a framework is the slow part). tests/mcore_jobs.py runs the jobs of several megatron-core helpers in one start
through the same loop.

Each job runs in a process of its own, forked from the rank once the imports are done: it starts from the state
the imports left, whatever the jobs before it set (module globals, megatron-core's parallel state, patches a
helper applies on use, process groups with their gloo threads), and it ends with everything it made. Its
process group meets in torchrun's own store under a prefix of its own."""
import argparse
import ctypes
import datetime
import os
import signal
import sys
import traceback

import torch.distributed as dist


# A rank whose job ended early (an error it alone met) leaves the others waiting in a collective: they fail after
# this long instead of holding the launch until its own timeout (torch's default is 30 minutes).
JOB_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


def run_jobs(ap: argparse.ArgumentParser, run_job) -> None:
    """Run every command-line argument as a job of one helper (its parser ap, its run_job)."""
    run_parsed([(run_job, ap.parse_args(job.split())) for job in sys.argv[1:]])


def run_parsed(jobs: list) -> None:
    """Run [(run_job, parsed arguments)] one after another, each in a forked process (every job parsed before the
    first starts: a typo fails the launch at once). A failed job ends the rank with its exit status: torchrun
    then stops the launch (the other ranks' job processes end with their ranks)."""
    for index, (run_job, args) in enumerate(jobs):
        pid = os.fork()
        if pid == 0:
            _run_forked(index, run_job, args)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            sys.exit(f"rank {os.environ.get('RANK')}: job {index + 1} of {len(jobs)} failed ({args})")


def _run_forked(index: int, run_job, args) -> None:
    """The job's process: die with the rank (PR_SET_PDEATHSIG), meet the other ranks' job processes, run, exit."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a killed rank takes its job with it
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"job{index}/", store), timeout=JOB_COLLECTIVE_TIMEOUT,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        run_job(args)
        dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
