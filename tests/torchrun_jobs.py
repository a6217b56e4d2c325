"""The main loop of the tests' torchrun helpers, torch-only (no framework import): each command-line argument
is one job, parsed by the helper's parser and run in one gloo process group (one torchrun start for several
jobs: importing torch and a framework is the slow part). tests/mcore_jobs.py runs the jobs of several
megatron-core helpers in one start through the same loop."""
import argparse
import sys

import torch.distributed as dist


def run_jobs(ap: argparse.ArgumentParser, run_job) -> None:
    """Run every command-line argument as a job of one helper (its parser ap, its run_job)."""
    run_parsed([(run_job, ap.parse_args(job.split())) for job in sys.argv[1:]])


def run_parsed(jobs: list) -> None:
    """Run [(run_job, parsed arguments)] in order in one gloo process group (every job parsed before the
    first starts: a typo fails the launch at once)."""
    dist.init_process_group("gloo")
    for run_job, args in jobs:
        run_job(args)
        destroy_job_groups()
    dist.destroy_process_group()


def destroy_job_groups() -> None:
    """Destroy every process group but the default one, between jobs. megatron-core's
    destroy_model_parallel only forgets the groups initialize_model_parallel made (a score of them, each
    with gloo threads and sockets to every rank): a launch of thirty jobs otherwise ends holding ~2000
    threads, slowing every later job on a 2-core box."""
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
