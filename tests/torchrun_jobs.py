"""The main loop of the tests' torchrun helpers, torch-only (no framework import): each command-line argument
is one job, parsed by the helper's parser and run under torchrun (one start for several jobs: importing torch and
a framework is the slow part). tests/mcore_jobs.py runs the jobs of several megatron-core helpers in one start
through the same loop.

The jobs of each helper run in a process of their own, forked from the rank once the imports are done: they start
from the state the imports left, whatever the other helpers' jobs set (module globals, patches a helper applies on
use), and the process ends with everything they made. One process per helper rather than per job: what a job
imports on use (transformers' model code, ckptool's commands: 1-2 s) is then imported once per helper, as when
each helper had a launch of its own. Their process group meets in torchrun's own store under a prefix of its own;
between two jobs every process group but the default one is destroyed."""
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
    """Run [(run_job, parsed arguments)], every job parsed before the first starts (a typo fails the launch at
    once): the jobs of each helper in order, in a process of their own (see the module docstring). A failed job
    ends the rank with its exit status: torchrun then stops the launch (the other ranks' processes end with their
    ranks)."""
    by_helper: dict = {}
    for run_job, args in jobs:
        by_helper.setdefault(run_job.__module__, []).append((run_job, args))
    for index, (helper, batch) in enumerate(by_helper.items()):
        pid = os.fork()
        if pid == 0:
            _run_forked(index, batch)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            sys.exit(f"rank {os.environ.get('RANK')}: a job of {helper} failed (its traceback above)")


def _run_forked(index: int, batch: list) -> None:
    """One helper's process: die with the rank (PR_SET_PDEATHSIG), meet the other ranks' processes, run the jobs,
    exit."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a killed rank takes its jobs with it
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"helper{index}/", store),
                                timeout=JOB_COLLECTIVE_TIMEOUT,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        for run_job, args in batch:
            run_job(args)
            destroy_job_groups()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def destroy_job_groups() -> None:
    """Destroy every process group but the default one, between jobs. megatron-core's
    destroy_model_parallel only forgets the groups initialize_model_parallel made (a score of them, each
    with gloo threads and sockets to every rank): a launch of thirty jobs otherwise ends holding ~2000
    threads, slowing every later job on a 2-core box."""
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
