"""The main loop of the tests' torchrun helpers, torch-only (no framework import): each command-line argument
is one job, parsed by ap and run in one gloo process group (one torchrun start for several jobs: importing
torch and a framework is the slow part)."""
import argparse
import sys

import torch.distributed as dist


def run_jobs(ap: argparse.ArgumentParser, run_job) -> None:
    jobs = [ap.parse_args(job.split()) for job in sys.argv[1:]]
    dist.init_process_group("gloo")
    for job in jobs:
        run_job(job)
    dist.destroy_process_group()
