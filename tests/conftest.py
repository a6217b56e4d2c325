"""Shared test fixtures: the independent Megatron fixtures (scripts/make_fixtures.py) built once per
session, the real framework-written checkpoints from ../shared/real-checkpoints, and the megatron-core
helper runs several test files start from (declare_runs / framework_runs: once per session)."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL_CANDIDATES = [ROOT.parent / "shared" / "real-checkpoints", ROOT / "fixtures" / "real"]


def _load_make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "scripts" / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_fixtures"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def make_fixtures():
    return sys.modules.get("make_fixtures") or _load_make_fixtures()


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory, make_fixtures):
    """A callable: name -> directory of that fixture (built on first use, once per session; the same for a
    shared_followups steps function asking through fixture_dirs)."""
    return once(_fixture_dirs, lambda: tmp_path_factory.mktemp("megatron_fixtures"), make_fixtures)


def fixture_dirs(folder) -> callable:
    """fixture_dir's callable for a steps function (which gets no fixtures): folder() where it goes if it is the
    first to ask."""
    return once(_fixture_dirs, folder, sys.modules.get("make_fixtures") or _load_make_fixtures())


def _fixture_dirs(out: Path, make_fixtures):
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = Path(make_fixtures.build_fixture(name, out))
        return built[name]

    return get


# The true vocabulary of each real run (Megatron-LM's tokenizer, not the case notes): both ran NullTokenizer with
# --vocab-size 1001; the legacy run's Megatron-LM (67f3515c, 2026-01) predates c9dfe34, whose NullTokenizer had the
# end-of-document token 1001 beyond it (its mock data ends every document with it: a trained row).
REAL_TRUE_VOCAB = {"mlm_mcore_gpt2_torch_tp2pp2": 1001, "mlm_legacy_gpt2_torch_tp2pp2": 1002,
                   "mds_gpt2_pipe_tp2pp2_bf16_zero1": 1001}


def real_checkpoint(case: str) -> Path:
    for base in REAL_CANDIDATES:
        if (base / case / "checkpoint").is_dir():
            return base / case
    pytest.skip(f"real checkpoint {case} not found under ../shared/real-checkpoints or fixtures/real")


def count_tensor_reads(monkeypatch) -> list:
    """From now on, the byte count of every tensor-data read from a torch file (both ways a storage
    record is read) is appended to the returned list: for tests that measure streaming."""
    from ckptool.io import torchfile
    reads: list = []
    read_record, read_record_into = torchfile.TorchArchive.read_record, torchfile.TorchArchive.read_record_into

    def counting(self, key, start=0, length=None):
        data = read_record(self, key, start, length)
        reads.append(len(data))
        return data

    def counting_into(self, key, start, out):
        reads.append(memoryview(out).nbytes)
        return read_record_into(self, key, start, out)
    monkeypatch.setattr(torchfile.TorchArchive, "read_record", counting)
    monkeypatch.setattr(torchfile.TorchArchive, "read_record_into", counting_into)
    return reads


def free_port() -> int:
    """A TCP port nobody listens on now. Racy: another process may bind it before the one it is given to
    does; launches under torchrun use torchrun_cmd (no port chosen here), and a launcher that must be
    given a port goes through run_launch (one more try when the port was taken)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, *argv) -> list:
    """The command running argv (a script and its arguments, or -m MODULE ...) under torch's torchrun
    with nproc processes on this host. --standalone: torch 2.13's agent binds its rendezvous store and
    the store it shares with the workers (their MASTER_PORT) on port 0, so the kernel picks the port
    while binding it and no other launch can take it first (a port chosen beforehand, as free_port
    does, was taken now and then by a parallel launch: EADDRINUSE)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *map(str, argv)]


PORT_TAKEN = ("eaddrinuse", "address already in use")  # how a failed bind is said (torch's TCPStore), lowered
FREE_PORT = "<free port>"  # in run_launch's cmd: a port free_port() picks afresh for each try


def run_launch(cmd: list, *, tries: int = 2, **kw):
    """subprocess.run(cmd, capture_output=True, text=True, **kw) for launchers that must be given a port
    (FREE_PORT in cmd: free_port()'s pick), run again with another port when it failed only because the
    port was taken meanwhile."""
    import subprocess
    for _ in range(tries):
        port = str(free_port())
        r = subprocess.run([port if a == FREE_PORT else a for a in cmd], capture_output=True, text=True, **kw)
        if r.returncode == 0 or not any(s in (r.stdout + r.stderr).lower() for s in PORT_TAKEN):
            break
    return r


def run_torchrun(nproc: int, *argv, env: dict | None = None, timeout: float = 600, **kw):
    """torchrun_cmd(nproc, *argv) run to its end: the CompletedProcess (stdout, stderr as text). env:
    the whole environment (default: this one with PYTHONPATH=the repository and OMP_NUM_THREADS=1)."""
    import subprocess
    import time
    if env is None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    start = time.monotonic()
    r = subprocess.run(torchrun_cmd(nproc, *argv), capture_output=True, text=True, env=env, timeout=timeout, **kw)
    log = os.environ.get("CKPTOOL_TEST_LAUNCH_LOG")  # FILE: a line per launch, to see where the suite's time goes
    if log:
        with open(log, "a") as f:
            f.write(f"{time.monotonic() - start:.1f}s nproc={nproc} jobs={len(argv) - 1} "
                    f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {Path(str(argv[0])).name}\n")
    return r


# --- framework runs shared by the whole session -------------------------------------------------------
# Training and saving a tiny model with megatron-core under torchrun costs seconds per job and more per
# launch (every rank imports torch and megatron-core). Test files declare the runs their fixtures start
# from (declare_runs, at import); the first fixture that needs a run of some helper at some process count
# runs every declared job of that helper and count, of every test file this session selected, in one
# torchrun launch; a job several files declare (the same text) runs once. Each file copies the results it
# changes or writes beside into its own folder (copy_run): the shared results stay as written.

# The megatron-core helpers whose runs at one process count share one launch, through tests/mcore_jobs.py (each
# helper has parser() and run_job()): every rank then imports torch and megatron-core once for all of them.
SHARED_LAUNCH = {f"mcore_{name}_helper.py" for name in
                 ("dist", "optim_dist", "train", "moe", "sidecar", "gemma", "glm", "gpt_oss", "mla", "mtp")} | \
    {"mds_mcore_forward.py"}  # megatron-core's forward of a Megatron-DeepSpeed checkpoint (test_verify_deepspeed)
MCORE_JOBS = ROOT / "tests" / "mcore_jobs.py"


def launch_group(helper_name: str) -> str:
    """The launch a helper's jobs go into: mcore_jobs.py for the helpers sharing one, else the helper's own."""
    return MCORE_JOBS.name if helper_name in SHARED_LAUNCH else helper_name


def launch(nproc: int, helper, jobs: list, timeout: float):
    """One torchrun launch of [(helper file name or path, job)], every helper of one launch group (launch_group):
    the shared ones through mcore_jobs.py ('HELPER JOB' arguments), another helper with its jobs."""
    if Path(helper).name in SHARED_LAUNCH:
        return run_torchrun(nproc, MCORE_JOBS, *(f"{Path(h).name} {job}" for h, job in jobs), timeout=timeout)
    return run_torchrun(nproc, helper, *(job for _, job in jobs), timeout=timeout)


_DECLARED: list = []  # (declaring test file, helper file name, nproc, job) in import order
_SELECTED: set = set()  # the test files of the session's selected tests (pytest_collection_finish)


def declare_runs(helper: Path, nproc: int, jobs: dict) -> dict:
    """Declare {name: job} of `helper` under torchrun with nproc processes (see FrameworkRuns for the
    job's text); returns jobs. Called at a test file's import."""
    file = str(Path(sys._getframe(1).f_globals["__file__"]).resolve())
    _DECLARED.extend((file, Path(helper).name, nproc, job) for job in jobs.values())
    return jobs


_SELECTED_FIXTURES: set = set()  # every fixture a selected test uses (directly or through another)


_SELECTED_FILE_FIXTURES: set = set()  # (test file, fixture name) of every selected test's fixtures


def pytest_collection_finish(session):
    _SELECTED.update(str(Path(str(item.fspath)).resolve()) for item in session.items)
    _SELECTED_FIXTURES.update(name for item in session.items for name in getattr(item, "fixturenames", ()))
    _SELECTED_FILE_FIXTURES.update((str(Path(str(item.fspath)).resolve()), name)
                                   for item in session.items for name in getattr(item, "fixturenames", ()))


class FrameworkRuns:
    """runs(helper, nproc, {name: job}) -> {name: stem}. A job is the helper's command line with `{out}`
    where its output goes: every file or folder it writes is named `{out}...` (the checkpoint `{out}`, its
    `{out}.pt`, `{out}_live`, `{out}_continued`...). The jobs asked for and the declared ones of the same
    helper and process count not run yet run in one torchrun launch, in the order declared; the stem
    returned is where `{out}` pointed."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict = {}  # (helper file name, nproc, job) -> stem
        self.followed: dict = {}  # steps (see shared_followups) -> (True, its value) or (False, what failed)

    def __call__(self, helper: Path, nproc: int, jobs: dict, timeout: int = 900) -> dict:
        keys = {name: (Path(helper).name, nproc, job) for name, job in jobs.items()}
        declared = [(h, n, job) for file, h, n, job in _DECLARED if file in _SELECTED]
        group = launch_group(Path(helper).name)
        todo = {}
        for key in [k for k in declared if (launch_group(k[0]), k[1]) == (group, nproc)] + list(keys.values()):
            if key not in self.done and key not in todo:
                todo[key] = self.root / f"run{len(self.done) + len(todo)}" / "out"
        if todo:
            for stem in todo.values():
                stem.parent.mkdir(parents=True)
            # the timeout asked for is one file's; a launch may hold the jobs of several
            r = launch(nproc, helper, [(k[0], k[2].format(out=s)) for k, s in todo.items()],
                       timeout=timeout * max(1, len(todo) / max(1, len(keys))))
            assert r.returncode == 0, f"{group} {[k[2] for k in todo]}: " + r.stdout[-3000:] + r.stderr[-6000:]
            self.done.update(todo)
        return {name: self.done[key] for name, key in keys.items()}

    def followup(self, steps):
        """The value of a shared_followups steps function (see there), run with the selected tests' other ones."""
        if steps not in self.followed:
            todo = [steps] + [s for file, fixture, s in _FOLLOWUPS
                              if s is not steps and s not in self.followed and (file, fixture) in _SELECTED_FILE_FIXTURES]
            gens = {}
            for s in todo:
                d = self.root / f"followup{len(self.followed)}_{s.__name__}"
                d.mkdir()
                gens[s] = s(self, d)
                self.followed[s] = (False, RuntimeError(f"{s.__module__}.{s.__name__} did not finish"))
            self._advance(gens)
        ok, value = self.followed[steps]
        if not ok:
            raise value
        return value

    def _advance(self, gens: dict) -> None:
        """Run the generators in rounds: each goes on to its next yield (or its end); the launches they asked
        for run, every job of one helper at one process count in one torchrun launch; again until all ended."""
        while gens:
            asked: dict = {}  # (launch group, nproc) -> [(steps, helper, job)]
            for s, g in list(gens.items()):
                try:
                    launches = next(g)
                except StopIteration as end:
                    self.followed[s] = (True, end.value)
                    del gens[s]
                    continue
                except (Exception, pytest.skip.Exception, pytest.fail.Exception) as e:  # its fixture raises it; the others go on
                    self.followed[s] = (False, e)
                    del gens[s]
                    continue
                for helper, nproc, jobs in launches:
                    group = launch_group(Path(helper).name) if Path(helper).name in SHARED_LAUNCH else Path(helper).resolve()
                    asked.setdefault((group, nproc), []).extend((s, helper, job) for job in jobs)
            for (group, nproc), jobs in asked.items():
                owners = list(dict.fromkeys(s for s, _, _ in jobs))
                r = launch(nproc, jobs[0][1], [(helper, job) for _, helper, job in jobs], timeout=600 * len(owners))
                if r.returncode != 0:
                    why = AssertionError(f"{Path(str(group)).name} {[job for _, _, job in jobs]}: "
                                         + r.stdout[-3000:] + r.stderr[-6000:])
                    for s in owners:
                        if s in gens:
                            gens.pop(s).close()
                            self.followed[s] = (False, why)

# --- follow-up runs shared by the session ---------------------------------------------------------------
# A test file's module fixture that starts from framework runs, converts them with ckptool and has the same
# helpers load or resume the results (its own launch after the shared ones) declares those steps with
# shared_followups: the first such fixture the session needs runs every selected file's steps together, so
# one torchrun launch per helper and process count serves all of them, round after round.

_FOLLOWUPS: list = []  # (declaring test file, fixture name, steps)


def shared_followups(steps):
    """Decorator: steps(framework_runs, folder) is a generator making a module fixture's value in its own fresh
    folder. Each `yield [(helper, nproc, [job, ...]), ...]` asks for helper runs (the FrameworkRuns job text with
    paths filled in) and resumes once they ran, beside every other selected file's steps' runs of the same helper
    and process count (one launch); `return` gives the fixture's value. Returns the module-scoped fixture named as
    steps is (its tests see that value, or the error its steps or launches met)."""
    file = str(Path(sys._getframe(1).f_globals["__file__"]).resolve())
    _FOLLOWUPS.append((file, steps.__name__, steps))

    @pytest.fixture(scope="module", name=steps.__name__)
    def fixture(framework_runs):
        return framework_runs.followup(steps)
    fixture.__doc__ = steps.__doc__
    return fixture


_ONCE: dict = {}  # build function -> its value, for the session


def once(build, folder, *args):
    """build(folder(), *args) the first time the session asks for it, that same value after. A steps function (run
    before its file's fixtures, with other files' steps) and the module fixtures of its file start from the same
    inputs this way (the same files, built once): folder() makes the folder they go into, the first caller's."""
    if build not in _ONCE:
        where = folder()
        where.mkdir(parents=True, exist_ok=True)
        _ONCE[build] = build(where, *args)
    return _ONCE[build]


def copy_run(stem: Path, dest: Path) -> None:
    """Copy everything a shared run wrote (`stem`, `stem.pt`, `stem_live`...) beside dest, named dest...:
    the test file's own copy, which it may change or write beside."""
    import shutil
    dest.parent.mkdir(parents=True, exist_ok=True)
    for p in stem.parent.iterdir():
        if p.name.startswith(stem.name):
            target = dest.parent / (dest.name + p.name[len(stem.name):])
            if p.is_dir():
                shutil.copytree(p, target)
            else:
                shutil.copy2(p, target)


@pytest.fixture(scope="session")
def framework_runs(tmp_path_factory):
    """The session's FrameworkRuns (see there)."""
    return FrameworkRuns(tmp_path_factory.mktemp("framework_runs"))


# --- real DeepSpeed runs shared by the session ----------------------------------------------------------
# Two helpers train tiny Hugging Face models with the real deepspeed package on CPU (2 ranks, gloo), every
# case of both in one torchrun launch (DsSaves); test_deepspeed.py, test_ds_universal.py and
# test_quick_inspect.py read the same saves (read only: a file that changes one copies it first).
DS_TRAIN_CASES = ["gpt2-1-bf16", "gpt2-2-bf16", "gpt2-3-bf16", "gpt2-1-fp16", "gpt2-2-fp16", "gpt2-3-fp16",
                  "bert-3-bf16", "bert-2-fp16", "llama-3-bf16"]  # tests/ds_train_cases.py MODEL-STAGE-DTYPE
# tests/ds_universal_cases.py: bf16opt runs BF16_Optimizer, 3s ZeRO-3 with small optimizer sub-groups
DS_UNIVERSAL_CASES = ["gpt2-1-bf16", "gpt2-2-bf16", "gpt2-3-bf16", "gpt2-1-fp32", "gpt2-2-fp32", "gpt2-3-fp32",
                      "gpt2-1-bf16opt", "llama-2-bf16", "gpt2-2-fp16", "gpt2-3s-bf16"]
# runs with no canonical GPT form (a module of its own without config.json, a Hugging Face BERT), saved
# in the same launch: ds-universal writes them under the engine's own parameter names
DS_UNIVERSAL_OWN_NAME_CASES = ["plain-1-fp32", "plain-3-bf16", "bert-2-bf16"]


def ds_torchrun(nproc: int, helper: str, *argv) -> None:
    """Run tests/HELPER under torchrun with DeepSpeed's CPU accelerator."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the deepspeed package cannot be imported")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    res = run_torchrun(nproc, ROOT / "tests" / helper, *argv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


class DsSaves:
    """The session's real DeepSpeed saves by kind: "train" (DS_TRAIN_CASES, tests/ds_train_cases.py) and
    "universal" (DS_UNIVERSAL_CASES, tests/ds_universal_cases.py save), each CASE/ckpt and CASE/truth.pt.
    The first kind asked for is made together with the other when this session's tests use both (its
    fixture among the selected tests' fixtures): one torchrun launch, one start of torch, deepspeed and
    transformers in each rank, for both."""
    # kind -> (its fixture, the env var keeping its folder between runs, cases, ds_universal_cases.py mode)
    KINDS = {"train": ("ds_cases", "CKPTOOL_DS_CASES", DS_TRAIN_CASES, "train"),
             "universal": ("ds_universal_saves", "CKPTOOL_DS_UNIVERSAL",
                           DS_UNIVERSAL_CASES + DS_UNIVERSAL_OWN_NAME_CASES, "save")}

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.done: dict = {}

    def __call__(self, kind: str) -> Path:
        if kind not in self.done:
            todo = [kind] + [k for k, (fixture, *_) in self.KINDS.items()
                             if k != kind and k not in self.done and fixture in _SELECTED_FIXTURES]
            groups: list = []
            for k in todo:
                fixture, var, cases, mode = self.KINDS[k]
                keep = os.environ.get(var)  # a folder kept between runs while developing (made there once)
                if keep and all((Path(keep) / c / "truth.pt").is_file() for c in cases):
                    self.done[k] = Path(keep)
                    continue
                out = Path(keep) if keep else self.tmp_path_factory.mktemp(fixture)
                out.mkdir(parents=True, exist_ok=True)
                groups += ["then", mode, str(out), *cases]
                self.done[k] = out
            if groups:
                ds_torchrun(2, "ds_universal_cases.py", *groups[1:])
        return self.done[kind]


@pytest.fixture(scope="session")
def ds_saves(tmp_path_factory):
    """The session's DsSaves (see there)."""
    return DsSaves(tmp_path_factory)


@pytest.fixture(scope="session")
def ds_cases(ds_saves):
    """The folder holding DS_TRAIN_CASES: CASE/ckpt (the save, config.json beside it) and CASE/truth.pt.
    CKPTOOL_DS_CASES=DIR keeps the cases between runs while developing (built there once)."""
    return ds_saves("train")


@pytest.fixture(scope="session")
def ds_universal_saves(ds_saves):
    """The folder holding DS_UNIVERSAL_CASES and DS_UNIVERSAL_OWN_NAME_CASES saved at DP 2: CASE/ckpt and CASE/truth.pt.
    CKPTOOL_DS_UNIVERSAL=DIR keeps the saves between runs while developing (for the readers of the saves:
    test_ds_universal.py converts into CASE/universal, so it wants a fresh DIR each time)."""
    return ds_saves("universal")
