"""One torchrun launch for the jobs of several megatron-core test helpers: each argument is 'HELPER JOB', the
helper's file name (tests/mcore_*_helper.py, tests/mds_mcore_forward.py: each with parser() and run_job()) and one
of its jobs.

tests/conftest.py sends the framework runs of every helper in SHARED_LAUNCH at one process count here: every
rank imports torch and megatron-core once for all of them (5-7 s a launch on a 2-core box) instead of once per
helper. The helpers' CPU shims are stand-ins for GPU-only pieces that compute the same thing, so importing
them side by side changes no job's result; each job builds its own model, groups and optimizer."""
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchrun_jobs import run_parsed  # noqa: E402


def parsed(arg: str) -> tuple:
    """'HELPER JOB' -> (the helper's run_job, the job parsed by its parser)."""
    helper, job = arg.split(" ", 1)
    module = importlib.import_module(Path(helper).stem)
    return module.run_job, module.parser().parse_args(job.split())


def main() -> None:
    run_parsed([parsed(arg) for arg in sys.argv[1:]])


if __name__ == "__main__":
    main()
