"""The command line ends its process without the interpreter's teardown (ckptool/quick_exit.py), and
still runs the atexit handlers, flushes what it printed and exits with the command's status."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"

# a program that owns its process the way `python -m ckptool` does: an atexit handler, an object whose
# finalizer would print at teardown, and buffered output not yet flushed
PROBE = """
import atexit, sys
from ckptool import quick_exit
atexit.register(lambda: print("atexit ran"))
class Finalized:
    def __del__(self):
        print("teardown ran")
kept = Finalized()
sys.stdout.write("buffered line\\n")
quick_exit.end_process({code})
"""


def run_probe(code: str):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("code, status", [("None", 0), ("0", 0), ("3", 3), ("'bad thing'", 1)])
def test_end_process_runs_atexit_flushes_and_skips_teardown(code, status):
    done = run_probe(code)
    assert done.returncode == status
    assert done.stdout.splitlines() == ["buffered line", "atexit ran"]  # no "teardown ran"
    if status == 1:
        assert done.stderr.strip() == "bad thing"


def test_normal_exit_would_have_run_the_finalizer():
    # the control: the same probe ending the ordinary way prints the finalizer's line, so the probe can
    # tell a skipped teardown from a finalizer that never runs
    done = subprocess.run([sys.executable, "-c", PROBE.format(code="0").replace(
        "quick_exit.end_process(0)", "sys.exit(0)")], capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
    assert done.returncode == 0 and "teardown ran" in done.stdout


def ckptool(*args, **env):
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env), timeout=300)


def test_python_m_ckptool_statuses_and_atexit_output(tmp_path):
    done = ckptool("merge", str(FIXTURE), str(tmp_path / "out"), CKPTOOL_PROFILE="1")
    assert done.returncode == 0, done.stderr
    assert "ckptool-profile" in done.stderr  # printed by an atexit handler
    assert (tmp_path / "out" / "ckptool-manifest.json").exists()
    bad = ckptool("merge", str(tmp_path / "missing"), str(tmp_path / "out2"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such file" in bad.stderr
    # the in-process path stays ordinary for programs that call the command line themselves
    assert ckptool("--version", CKPTOOL_QUICK_EXIT="0").returncode == 0


def test_only_the_process_entry_ends_the_process():
    from click.testing import CliRunner

    from ckptool.cli import main
    result = CliRunner().invoke(main, ["--version"])  # would end pytest itself if it quick-exited
    assert result.exit_code == 0 and "ckptool" in result.output
