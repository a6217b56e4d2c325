"""Errors under real torchrun (2 ranks, gloo, CPU): an error every rank finds is printed once, every
rank exits with the same status, and torchrun's own report names ckptool's error. torchrun itself
always exits 1 when a rank fails and always prints its ChildFailedError report (docs/errors.md: "Errors
under torchrun")."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FREE_PORT, run_launch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"
pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")


def _torchrun(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", *args]  # port 0: no port for another launch to take
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _rank_statuses(report: str) -> dict:
    """rank -> exitcode from torchrun's ChildFailedError report."""
    return {int(r): int(c) for r, c in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", report)}


def test_bad_input_is_reported_once_with_every_rank_exiting_2(tmp_path):
    r = _torchrun("-m", "ckptool", "merge", str(tmp_path / "missing"), str(tmp_path / "out"))
    out = r.stdout + r.stderr
    line = f"error: {tmp_path / 'missing'}: no such file or directory"
    ours = [x for x in out.splitlines() if x.startswith("error:")]
    assert ours == [line], out[-3000:]
    assert r.returncode == 1  # torchrun's own status whenever a rank fails
    statuses = _rank_statuses(out)
    assert statuses and set(statuses.values()) == {2}, out[-3000:]  # ckptool's "bad input"
    # torchrun's report carries ckptool's line (our error files) for every rank, never its traceback hint
    assert out.count(f"traceback : ckptool {line}") == 2 and "To enable traceback" not in out, out[-3000:]
    # no rank printed a Python traceback: the one there is torchrun's own agent raising ChildFailedError
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]
    assert out.index("Traceback (most recent call last)") < out.index("ChildFailedError")
    # ... and ckptool's line comes after it: the last thing printed (stderr is a pipe here)
    assert r.stderr.strip().splitlines()[-1] == line, r.stderr[-3000:]
    assert r.stderr.index("ChildFailedError") < r.stderr.index(line)
    assert not (tmp_path / "out").exists()


def test_a_refused_output_under_a_conversion_team(tmp_path):
    """Both ranks refuse an existing destination inside the team protocol: said once, status 2."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    r = _torchrun("-m", "ckptool", "merge", str(FIXTURE), str(tmp_path / "out"))
    out = r.stdout + r.stderr
    ours = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and "already exists" in ours[0], out[-3000:]
    assert set(_rank_statuses(out).values()) == {2}, out[-3000:]
    assert (tmp_path / "out" / "keep").read_text() == "x"


SCRIPT = """
import os, sys, time
from ckptool import distributed
distributed.REPORTER_GRACE_S = {grace}
distributed.PEER_WAIT_S = {peer_wait}
if {as_cli}:
    distributed.stop_with_the_team()  # what the command line does first
rank = int(os.environ["RANK"])
time.sleep({late}.get(rank, 0))  # a rank still starting up (imports on a loaded machine)
if rank in {failing}:
    distributed.fail_as_team("error: seen by rank " + str(rank), 2, reporter={reporter},
                             say=lambda line: print(line, file=sys.stderr, flush=True))
time.sleep(60)  # a rank that did not meet the error (waiting in a collective, say)
"""


def test_the_reporter_says_it_and_the_others_stay_silent(tmp_path):
    """The team agreed that rank 1 reports (the lowest rank whose share failed): rank 0 is silent and
    still exits with rank 1's status."""
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT.format(grace=30, failing=(0, 1), reporter=1, peer_wait=20, as_cli=False, late={}))
    r = _torchrun(str(script), timeout=120)
    out = r.stdout + r.stderr
    assert [line for line in out.splitlines() if line.startswith("error:")] == ["error: seen by rank 1"], out
    assert set(_rank_statuses(out).values()) == {2}, out[-3000:]


def test_an_error_only_one_rank_found_is_still_said(tmp_path):
    """Rank 1 alone meets an error that rank 0 would report: rank 0 never exits, so after the grace
    period rank 1 says it itself (once)."""
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT.format(grace=2, failing=(1,), reporter=0, peer_wait=20, as_cli=False, late={}))
    r = _torchrun(str(script), timeout=120)
    out = r.stdout + r.stderr
    assert [line for line in out.splitlines() if line.startswith("error:")] == ["error: seen by rank 1"], out
    assert _rank_statuses(out).get(1) == 2, out[-3000:]


def test_a_rank_late_to_the_error_is_not_killed_before_it(tmp_path):
    """Rank 0 reports at once; rank 1 meets the same error 3 s later (still starting). The reporter
    waits for its neighbour's error file before it exits, so torchrun's SIGTERM does not end rank 1
    with -15 first (seen in CI on a loaded 2-core machine)."""
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT.format(grace=30, failing=(0, 1), reporter=0, peer_wait=60, as_cli=False, late={1: 3}))
    r = _torchrun(str(script), timeout=120)
    out = r.stdout + r.stderr
    assert [line for line in out.splitlines() if line.startswith("error:")] == ["error: seen by rank 0"], out
    assert _rank_statuses(out) == {0: 2, 1: 2}, out[-3000:]


def test_a_rank_that_never_met_the_error_ends_with_the_teams_status(tmp_path):
    """Rank 1 waits elsewhere (a collective, say) and never fails itself: once the reporter exits,
    torchrun stops it, and the handler the command line installs ends it with the status rank 0 left
    in its error file, not -15."""
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT.format(grace=30, failing=(0,), reporter=0, peer_wait=1, as_cli=True, late={}))
    r = _torchrun(str(script), timeout=120)
    out = r.stdout + r.stderr
    assert [line for line in out.splitlines() if line.startswith("error:")] == ["error: seen by rank 0"], out
    assert _rank_statuses(out) == {0: 2, 1: 2}, out[-3000:]


def test_a_users_sigterm_keeps_its_meaning(tmp_path):
    """With no failed peer on record, the command line's handler leaves a SIGTERM its default effect."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), WORLD_SIZE="2",
               RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x",
               TORCHELASTIC_ERROR_FILE=str(tmp_path / "attempt_0" / "1" / "error.json"))
    code = ("import os, signal; from ckptool import distributed; distributed.stop_with_the_team(); "
            "os.kill(os.getpid(), signal.SIGTERM)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == -15, r.stderr


def test_the_launcher_ends_with_ckptools_line_and_status(tmp_path):
    """python -m ckptool.torchrun: the same launch, ending with ckptool's error line and its status."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    r = run_launch([sys.executable, "-m", "ckptool.torchrun", "--nproc-per-node", "2", "--master-port", FREE_PORT,
                    "merge", str(tmp_path / "missing"), str(tmp_path / "out")], env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == f"error: {tmp_path / 'missing'}: no such file or directory", r.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("env, why", [
    ({}, "not under a torchrun agent"),
    ({"TORCHELASTIC_RUN_ID": "x", "CKPTOOL_TORCHRUN_LAUNCHER": "1"}, "python -m ckptool.torchrun ends with the line"),
    ({"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"},
     "the agent will start the ranks again"),
])
def test_the_line_is_said_at_once_where_a_late_line_would_mislead(monkeypatch, env, why):
    from ckptool import distributed
    for k in ("TORCHELASTIC_RUN_ID", "CKPTOOL_TORCHRUN_LAUNCHER", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: spawned.append(a))
    assert distributed.say_after_torchrun("error: x") is False, why
    assert not spawned


def test_the_late_line_waits_for_torchrun_to_end(tmp_path):
    """The detached printer says the line only once the agent process has ended (here: a sleeping
    stand-in for torchrun), on the stderr it was given."""
    import time
    from ckptool import distributed
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        printer = subprocess.Popen([sys.executable, "-c", distributed._TAIL_SCRIPT, str(agent.pid), "error: late", "60"],
                                   stderr=f)
        time.sleep(0.5)
        assert err.read_text() == ""  # the agent still runs
        agent.wait()
        printer.wait(timeout=30)
    assert err.read_text() == "error: late\n"


def test_the_error_file_is_the_form_torchruns_agent_reads(tmp_path, monkeypatch):
    """The file a failing rank writes is read by torch's own ProcessFailure (the agent's parser) into
    ckptool's line and a timestamp; its ChildFailedError report shows that line, not "<N/A>"."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from ckptool import distributed
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    distributed._write_error_file("error: /data/missing: no such file or directory")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert failure.message["message"] == "error: /data/missing: no such file or directory"
    assert failure.timestamp > 0
    report = ChildFailedError("ckptool", {0: failure}).format_msg()
    assert "traceback : ckptool error: /data/missing: no such file or directory" in report
    assert "<N/A>" not in report and "To enable traceback" not in report
    assert list(tmp_path.iterdir()) == [path]  # written whole through a renamed part file

