"""conftest's shared follow-up phase (shared_followups / FrameworkRuns.followup) without starting anything:
run_torchrun stood in by a recorder. The launches the suite's files share must be the ones asked for, grouped
per helper and process count, round by round; one file's failure stays that file's."""
from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest

import conftest


@pytest.fixture
def launches(monkeypatch, tmp_path):
    """[(nproc, helper file name, jobs)] of every launch from now on; a job containing "fail" makes its launch
    fail. The declared and selected follow-ups: none but those a test adds (select)."""
    seen: list = []

    def fake_run_torchrun(nproc, helper, *jobs, **_kw):
        seen.append((nproc, Path(helper).name, jobs))
        rc = 1 if any("fail" in j for j in jobs) else 0
        return subprocess.CompletedProcess([], rc, stdout="", stderr="rank 0 failed" if rc else "")
    monkeypatch.setattr(conftest, "run_torchrun", fake_run_torchrun)
    monkeypatch.setattr(conftest, "_FOLLOWUPS", [])
    monkeypatch.setattr(conftest, "_SELECTED_FILE_FIXTURES", set())
    return seen


def select(*steps_functions):
    for steps in steps_functions:
        conftest._FOLLOWUPS.append(("file.py", steps.__name__, steps))
        conftest._SELECTED_FILE_FIXTURES.add(("file.py", steps.__name__))


def test_one_launch_per_helper_and_process_count_each_round(launches, tmp_path):
    order = []

    def a(runs, d):
        order.append(("a", d.is_dir()))
        yield [("h.py", 2, ["a1"]), ("h.py", 1, ["a2"]), ("g.py", 2, ["a3"])]
        order.append("a after its launches")
        yield [("h.py", 2, ["a4"])]
        return "A"

    def b(runs, d):
        yield [("h.py", 2, ["b1", "b2"])]
        return "B"

    def unselected(runs, d):
        yield [("h.py", 2, ["never"])]
        return "U"
    select(a, b)
    conftest._FOLLOWUPS.append(("file.py", "unselected", unselected))
    runs = conftest.FrameworkRuns(tmp_path)
    assert runs.followup(b) == "B" and runs.followup(a) == "A"  # a ran with b's launches
    assert launches == [(2, "h.py", ("b1", "b2", "a1")), (1, "h.py", ("a2",)), (2, "g.py", ("a3",)),
                        (2, "h.py", ("a4",))]
    assert order == [("a", True), "a after its launches"]
    assert runs.followup(unselected) == "U" and launches[-1] == (2, "h.py", ("never",))  # asked for itself


def test_a_failure_stays_with_the_steps_it_belongs_to(launches, tmp_path):
    def broken(runs, d):
        raise ValueError("broken before its launch")
        yield

    def failing(runs, d):
        yield [("h.py", 2, ["fail here"])]
        return "never"

    def sharing(runs, d):  # in the failed launch too
        yield [("h.py", 2, ["s1"])]
        return "never"

    def fine(runs, d):
        yield [("h.py", 4, ["f1"])]
        return "F"

    def skipped(runs, d):
        pytest.skip("not here")
        yield
    select(broken, failing, sharing, fine, skipped)
    runs = conftest.FrameworkRuns(tmp_path)
    assert runs.followup(fine) == "F"
    with pytest.raises(ValueError, match="broken before its launch"):
        runs.followup(broken)
    for steps in (failing, sharing):
        with pytest.raises(AssertionError, match="h.py .*fail here.*rank 0 failed"):
            runs.followup(steps)
    with pytest.raises(pytest.skip.Exception):
        runs.followup(skipped)
    assert sorted(launches) == [(2, "h.py", ("fail here", "s1")), (4, "h.py", ("f1",))]


def test_megatron_core_helpers_share_one_launch_per_process_count(launches, tmp_path):
    """Jobs of two helpers in SHARED_LAUNCH at one process count go to mcore_jobs.py as 'HELPER JOB', in one launch,
    in the order asked; another process count or a helper outside the set launches apart."""
    dist, moe = "mcore_dist_helper.py", "mcore_moe_helper.py"
    assert {dist, moe} <= conftest.SHARED_LAUNCH

    def a(runs, d):
        yield [(conftest.ROOT / "tests" / dist, 2, ["load x"]), ("h.py", 2, ["a2"]), (moe, 4, ["save y"])]
        return "A"

    def b(runs, d):
        yield [(moe, 2, ["load-dist z"])]
        return "B"
    select(a, b)
    assert conftest.FrameworkRuns(tmp_path).followup(a) == "A"
    assert sorted(launches) == sorted([(2, "mcore_jobs.py", (f"{dist} load x", f"{moe} load-dist z")),
                                       (2, "h.py", ("a2",)), (4, "mcore_jobs.py", (f"{moe} save y",))])


def test_mcore_jobs_runs_each_helpers_parser(monkeypatch):
    """mcore_jobs.py hands each 'HELPER JOB' to that helper's own parser and run_job (no launch: the parse only)."""
    import mcore_jobs
    fake = types.ModuleType("mcore_fake_helper")
    fake.run_job = lambda a: None
    fake.parser = _parser
    monkeypatch.setitem(sys.modules, "mcore_fake_helper", fake)
    run_job, args = mcore_jobs.parsed("mcore_fake_helper.py somewhere --tp 2")
    assert run_job is fake.run_job and (args.dir, args.tp) == ("somewhere", 2)


def _parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int)
    return ap


def test_verify_jobs_are_one_argument_each_for_verify_batch(tmp_path):
    """A check becomes one job of tests/verify_batch.py (its parser: the file rank 0 writes, then verify's own
    arguments, options included); a word with a space, which the job's split would cut, is refused."""
    import verify_batch
    from test_verify import verify_jobs, verify_results
    [job] = verify_jobs({"a": [tmp_path / "ckpt", "--reference", tmp_path / "hf", "--seq-len", 8]}, tmp_path / "runs")
    args = verify_batch.parser().parse_args(job.split())
    assert args.out == str(tmp_path / "runs" / "a.txt")
    assert args.args == [str(tmp_path / "ckpt"), "--reference", str(tmp_path / "hf"), "--seq-len", "8"]
    (tmp_path / "runs" / "a.txt").write_text("result=PASS\n\nrc=0\n")
    assert verify_results({"a": []}, tmp_path / "runs") == {"a": ("result=PASS\n\n", 0)}
    with pytest.raises(AssertionError):
        verify_jobs({"b": [tmp_path / "with space"]}, tmp_path / "runs")


def test_once_builds_once_in_the_first_callers_folder(tmp_path, monkeypatch):
    """conftest.once: the first caller's folder (made), the same value after; a build that raised is tried again."""
    monkeypatch.setattr(conftest, "_ONCE", {})
    calls = []

    def build(where, x):
        calls.append(where)
        if len(calls) == 1:
            raise ValueError("first try fails")
        return where, x
    with pytest.raises(ValueError):
        conftest.once(build, lambda: tmp_path / "a", 1)
    assert conftest.once(build, lambda: tmp_path / "b", 2) == (tmp_path / "b", 2)
    assert conftest.once(build, lambda: tmp_path / "c", 3) == (tmp_path / "b", 2)
    assert calls == [tmp_path / "a", tmp_path / "b"] and (tmp_path / "b").is_dir()
