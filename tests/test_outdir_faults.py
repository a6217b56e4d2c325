"""Output directories under faults from outside: SIGTERM and SIGHUP mid-write, two runs writing the
same DST, the leftovers of a killed run, --force stopped half-way.

A run is caught mid-write without any delay in ckptool: the test waits until the run's partial output
holds bytes and freezes the run there with SIGSTOP (the write of the scaled-up checkpoint takes about a
second, the freeze a few milliseconds), checks that it really is mid-write, then does what the test is
about (another run, a signal) and lets it go on with SIGCONT.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli import main
from ckptool.io import outdir
from ckptool.io.outdir import PARTIAL_TAG, check_manifest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """The TP2 PP2 fixture scaled up (52 MB) so that writing it takes about a second."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_reliability import _big_checkpoint
    path = tmp_path_factory.mktemp("big") / "ckpt"
    _big_checkpoint(path, hidden=512)
    return path


def beside(dst: Path) -> list:
    """Everything a run keeps beside dst while it writes (partial output, lock, old DST set aside)."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}{PARTIAL_TAG}"))


def ckptool(*argv) -> list:
    return [sys.executable, "-m", "ckptool", *map(str, argv)]


_FROZEN: list = []  # (run, pids frozen) of the test now running: ended at its teardown, whatever it asserted


@pytest.fixture(autouse=True)
def _no_frozen_leftovers():
    """A test that fails between freezing a run and resuming it must not leave stopped processes behind."""
    yield
    while _FROZEN:
        p, pids = _FROZEN.pop()
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if p.poll() is None:
            p.kill()
            p.wait()


def start_frozen_mid_write(argv: list, dst: Path, freeze=lambda pid: [pid]) -> subprocess.Popen:
    """Start a writing run and freeze it (SIGSTOP to freeze(its pid): the processes that write) once its
    partial output holds bytes."""
    earlier = set(beside(dst))  # a killed run's leftovers
    p = subprocess.Popen(argv, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        partial = next((dst.parent / n for n in beside(dst)
                        if n not in earlier and "." not in n.split(PARTIAL_TAG)[1]), None)
        if partial is not None and any(f.is_file() and f.stat().st_size for f in partial.rglob("*")):
            pids = freeze(p.pid)
            _FROZEN.append((p, pids))
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            break
        time.sleep(0.002)
    assert p.poll() is None, f"the run ended before it was caught writing: {p.communicate()}"
    return p


def resume(p: subprocess.Popen, *signals, freeze=None) -> tuple:
    """Send signals to a frozen run, let it go on (SIGCONT to freeze: the pids frozen, default the run),
    and wait for it: (status, stdout, stderr)."""
    for sig in signals:
        p.send_signal(sig)
    for pid in freeze or [p.pid]:
        os.kill(pid, signal.SIGCONT)
    out, err = p.communicate(timeout=300)
    _FROZEN[:] = [(q, pids) for q, pids in _FROZEN if q is not p]  # resumed and ended: nothing to clean
    return p.returncode, out, err


def tree_hashes(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def tree_size(root: Path) -> tuple:
    sizes = [p.stat().st_size for p in root.rglob("*") if p.is_file()]
    return len(sizes), sum(sizes)


def verify_files(dst: Path) -> int:
    """`ckptool verify --files dst`'s status (0: every file matches the manifest)."""
    return CliRunner().invoke(main, ["verify", "--files", str(dst)]).exit_code


@pytest.mark.parametrize("sig,words", [(signal.SIGTERM, "terminated (SIGTERM)"), (signal.SIGHUP, "hung up (SIGHUP)")],
                         ids=["SIGTERM", "SIGHUP"])
def test_signal_mid_write_leaves_nothing(big, tmp_path, sig, words):
    before = tree_hashes(big)
    dst = tmp_path / "out"
    p = start_frozen_mid_write(ckptool("reshard", big, dst, "--tp", 2, "--pp", 2), dst)
    assert beside(dst) and not dst.exists()
    status, out, err = resume(p, sig)
    assert status == 128 + sig
    assert err.strip().splitlines() == [f"{words}: nothing was written to {dst}"]
    assert not dst.exists() and beside(dst) == []
    assert tree_hashes(big) == before


def test_second_writer_is_refused_and_the_first_completes(big, tmp_path):
    dst = tmp_path / "out"
    first = start_frozen_mid_write(ckptool("reshard", big, dst, "--tp", 2, "--pp", 2), dst)
    second = subprocess.run(ckptool("merge", FIXTURE, dst, "--force"), env=ENV, cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 2
    line, = second.stderr.strip().splitlines()
    assert line.startswith(f"error: {dst} is being written by process {first.pid} ")
    assert "wait for it or choose another output" in line
    status, out, err = resume(first)
    assert status == 0, err
    assert verify_files(dst) == 0
    assert sorted(p.name for p in (dst / "iter_0000010").iterdir()) == [
        f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(2)]
    assert beside(dst) == []


def test_killed_runs_leftovers_go_a_live_runs_stay(big, tmp_path):
    """The same partial output is left alone while its run lives (frozen), removed once it is killed."""
    dst = tmp_path / "out"
    argv = ckptool("reshard", big, dst, "--tp", 2, "--pp", 2)
    frozen = start_frozen_mid_write(argv, dst)
    left = beside(dst)
    refused = subprocess.run(argv, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"being written by process {frozen.pid}" in refused.stderr
    assert beside(dst) == left
    frozen.kill()  # kill -9: no clean-up; the kernel lets its lock go
    frozen.communicate()
    assert beside(dst) == left and not dst.exists()
    rerun = subprocess.run(argv, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert beside(dst) == [] and check_manifest(dst) == []


def test_force_says_what_it_replaced(tmp_path):
    dst = tmp_path / "out"
    assert CliRunner().invoke(main, ["reshard", str(FIXTURE), str(dst), "--tp", "2", "--pp", "2"]).exit_code == 0
    files, size = tree_size(dst)
    r = CliRunner().invoke(main, ["merge", str(FIXTURE), str(dst), "--force"])
    assert r.exit_code == 0, r.output
    assert f"replaced {dst}: {files} files, {size} bytes" in r.stdout
    assert check_manifest(dst) == [] and (dst / "iter_0000010" / "mp_rank_00").is_dir()


def test_force_stopped_mid_write_keeps_the_old_dst(big, tmp_path):
    """kill -9 and SIGTERM while --force writes: the old DST stays as it was (SIGTERM: with one line)."""
    dst = tmp_path / "out"
    assert CliRunner().invoke(main, ["merge", str(FIXTURE), str(dst)]).exit_code == 0
    old = tree_hashes(dst)
    argv = ckptool("reshard", big, dst, "--tp", 2, "--pp", 2, "--force")
    resume(start_frozen_mid_write(argv, dst), signal.SIGKILL)
    assert tree_hashes(dst) == old
    status, out, err = resume(start_frozen_mid_write(argv, dst), signal.SIGTERM)  # also clears the kill's leftovers
    assert status == 143 and err.strip().splitlines() == [f"terminated (SIGTERM): {dst} is left as it was"]
    assert tree_hashes(dst) == old and beside(dst) == []
    assert verify_files(dst) == 0


def test_failed_swap_puts_the_old_dst_back(tmp_path, monkeypatch):
    """--force: the new output cannot take DST's place (the second rename fails): the old DST is back."""
    dst = tmp_path / "out"
    assert CliRunner().invoke(main, ["merge", str(FIXTURE), str(dst)]).exit_code == 0
    old = tree_hashes(dst)
    real_replace, calls = os.replace, []

    def replace(a, b):
        calls.append((a, b))
        if Path(b) == dst and len(calls) > 1 and Path(calls[-2][0]) == dst:
            raise OSError(28, "No space left on device")
        return real_replace(a, b)

    monkeypatch.setattr(outdir.os, "replace", replace)
    r = CliRunner().invoke(main, ["reshard", str(FIXTURE), str(dst), "--tp", "1", "--pp", "2", "--force"])
    assert r.exit_code == 2
    assert any(Path(b) == dst for _, b in calls), "the swap was never tried"
    assert tree_hashes(dst) == old and beside(dst) == []


def test_leftover_of_a_swap_cut_short_is_put_back(tmp_path):
    """A --force run killed between its two renames (DST set aside, the new one not yet in place):
    the next run puts the old DST back instead of removing it with the other leftovers."""
    dst = tmp_path / "out"
    assert CliRunner().invoke(main, ["merge", str(FIXTURE), str(dst)]).exit_code == 0
    old = tree_hashes(dst)
    aside = tmp_path / f".out{PARTIAL_TAG}0badf00d.old"
    os.replace(dst, aside)
    shutil.copytree(dst.parent / aside.name, tmp_path / f".out{PARTIAL_TAG}0badf00d")  # its unsealed output
    r = CliRunner().invoke(main, ["merge", str(FIXTURE), str(dst)])
    assert r.exit_code == 2 and "already exists" in r.stderr
    assert tree_hashes(dst) == old and beside(dst) == []


# --- under torchrun: the team's partial output belongs to rank 0 -------------------------------------

def ranks_of(launcher: int) -> list:
    """The pids of the ckptool ranks a launcher started: its children running `-m ckptool` (both
    launchers start the ranks themselves)."""
    ranks = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == launcher and \
                    b"\0-m\0ckptool\0" in (stat.parent / "cmdline").read_bytes():
                ranks.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return ranks


def pending(pid: int, sig: int) -> bool:
    """Whether sig waits to be delivered to pid (sent to the process or its group: ShdPnd)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


LAUNCHERS = {"ckptool.torchrun": ["--nproc-per-node", "2"],
             "torch.distributed.run": ["--standalone", "--nproc-per-node", "2", "-m", "ckptool"]}  # standalone: port 0


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_sigterm_to_a_torchrun_team_leaves_nothing(big, tmp_path, launcher):
    """A scheduler's SIGTERM to the launcher reaches every rank (the launcher passes it on); rank 0, which
    holds the lock on the team's partial output, removes it; the line is said once. The ranks are frozen
    mid-write until the launcher's SIGTERM is pending at each."""
    dst = tmp_path / "out"
    argv = [sys.executable, "-m", launcher, *LAUNCHERS[launcher], "reshard", big, dst, "--tp", 2, "--pp", 2]
    p = start_frozen_mid_write([str(a) for a in argv], dst, freeze=ranks_of)
    ranks = ranks_of(p.pid)
    assert len(ranks) == 2 and beside(dst) and not dst.exists()
    p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not all(pending(r, signal.SIGTERM) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    status, out, err = resume(p, freeze=ranks)
    line = f"terminated (SIGTERM): nothing was written to {dst}"
    assert err.count(line) == 1, (status, err[-3000:])
    assert not dst.exists() and beside(dst) == [], err[-3000:]
    if launcher == "ckptool.torchrun":
        assert status == 143 and err.strip().splitlines()[-1] == line, err[-3000:]
