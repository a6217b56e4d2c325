"""The README's two commands on a fresh machine (issue 28).

scripts/_python.sh, which scripts/demo.sh and scripts/test.sh source, picks the interpreter: on an
externally managed python3 (PEP 668, Debian 12 / Ubuntu 24.04) outside a virtual environment it makes
and uses one. Here an interpreter is made to look externally managed by a sitecustomize that points
sysconfig's stdlib directory at a directory holding EXTERNALLY-MANAGED (and can hide ensurepip, as
Debian's python3 without python3-venv does); the decision, the venv and its reuse are the script's own.
(The installs themselves were run for real on Debian 12's /usr/bin/python3: see the session's report.)

scripts/demo.sh writes under $TMPDIR and leaves nothing there (unless KEEP=1): run for real once, and
with stand-in tools for its failure, interruption and KEEP paths.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

SITECUSTOMIZE = """\
import os, sys, sysconfig
if os.environ.get("FAKE_STDLIB"):  # the stdlib directory pip looks in for EXTERNALLY-MANAGED
    _get_path = sysconfig.get_path
    sysconfig.get_path = lambda name, *a, **k: os.environ["FAKE_STDLIB"] if name == "stdlib" else _get_path(name, *a, **k)
if os.environ.get("FAKE_NO_ENSUREPIP"):  # Debian's python3 without the python3-venv package
    sys.modules["ensurepip"] = None
"""

# Sources the shared logic as the two scripts do, then says what it chose.
CHOOSE = 'set -euo pipefail; cd "$1"; source scripts/_python.sh; echo "PY=$PY"; echo "python=$(command -v python)"'


def base_python() -> Path:
    """The interpreter this one runs on: itself, or the one its virtual environment was made from (as
    when the suite runs under scripts/test.sh in the .venv it made)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return base if base.exists() else Path(sys.executable)


@pytest.fixture
def box(tmp_path):
    """A PATH whose python3 is the base interpreter, a sitecustomize, a stdlib directory with the marker
    and one without (the interpreter's own may have one, as Debian's does), a venv location."""
    bin_dir, site, stdlib, plain = (tmp_path / d for d in ("bin", "site", "stdlib", "plain"))
    for d in (bin_dir, site, stdlib, plain):
        d.mkdir()
    (bin_dir / "python3").symlink_to(base_python())
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (stdlib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use a virtual environment\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CKPTOOL_VENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(site), CKPTOOL_VENV=str(tmp_path / "venv"),
               FAKE_STDLIB=str(plain))
    return {"env": env, "stdlib": stdlib, "venv": tmp_path / "venv"}


def choose(env, **extra):
    r = subprocess.run(["bash", "-c", CHOOSE, "choose", str(ROOT)], env=dict(env, **extra), capture_output=True,
                       text=True, timeout=300)
    chosen = dict(line.split("=", 1) for line in r.stdout.splitlines())
    return r.returncode, chosen, r.stderr.splitlines()


def is_venv(python) -> bool:
    r = subprocess.run([str(python), "-c", "import sys; print(sys.prefix != sys.base_prefix)"], capture_output=True,
                       text=True, timeout=120)
    return r.stdout.strip() == "True"


def test_a_python_pip_may_install_into_is_used_as_before(box):
    rc, chosen, said = choose(box["env"])  # no marker (CI's pyenv python)
    assert (rc, chosen["PY"], said) == (0, "python3", [])
    assert not box["venv"].exists()


def test_an_externally_managed_python_gets_a_venv_made_once_then_reused(box):
    env = dict(box["env"], FAKE_STDLIB=str(box["stdlib"]))
    # a half-made venv (what `python3 -m venv` leaves on Debian without python3-venv): no pip in it
    subprocess.run([str(base_python()), "-m", "venv", "--without-pip", str(box["venv"])], check=True, timeout=120)
    rc, chosen, said = choose(env)
    venv_python = str(box["venv"] / "bin" / "python")
    assert rc == 0, said
    assert said == [f"ckptool: creating the virtual environment {box['venv']} (python3 is externally managed, PEP 668)"]
    assert chosen["PY"] == venv_python and is_venv(venv_python)
    assert chosen["python"] == str(box["venv"] / "bin" / "python")  # its scripts (ckptool, torchrun) come first
    subprocess.run([venv_python, "-m", "pip", "--version"], check=True, capture_output=True, timeout=120)
    rc, chosen, said = choose(env)
    assert (rc, chosen["PY"]) == (0, venv_python)
    assert said == [f"ckptool: using the virtual environment {box['venv']} (python3 is externally managed, PEP 668)"]
    # run from inside that venv (its python3 first on PATH): the venv itself is used, no other made
    inside = dict(env, PATH=f"{box['venv'] / 'bin'}{os.pathsep}{env['PATH']}", CKPTOOL_VENV=str(box["venv"]) + "2")
    rc, chosen, said = choose(inside)
    assert (rc, chosen["PY"], said) == (0, "python3", [])
    assert not Path(str(box["venv"]) + "2").exists()


def test_no_venv_module_is_one_line_saying_what_to_install(box):
    rc, chosen, said = choose(box["env"], FAKE_STDLIB=str(box["stdlib"]), FAKE_NO_ENSUREPIP="1")
    assert rc != 0 and "PY" not in chosen
    assert len(said) == 1 and "externally managed" in said[0] and "apt-get install python3-venv" in said[0], said
    assert not box["venv"].exists()


# --- scripts/demo.sh -------------------------------------------------------------------------------
def demo(tmp_path, extra_path=None, **env_extra):
    """demo.sh with TMPDIR=tmp_path/tmp and the installs skipped (they would repoint this environment's
    editable ckptool at the tree under test)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), CKPTOOL_NO_INSTALL="1", PYTHONPATH=str(ROOT / "src"), **env_extra)
    env.pop("KEEP", None)
    env.update(env_extra)
    if extra_path:
        env["PATH"] = f"{extra_path}{os.pathsep}{env['PATH']}"
    return tmp, env


def test_demo_runs_under_tmpdir_and_leaves_nothing(tmp_path):
    tmp, env = demo(tmp_path)
    r = subprocess.run(["bash", str(ROOT / "scripts/demo.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result=PASS" in r.stdout and f"-> {tmp}/ckptool-demo." in r.stdout
    assert "optimizer   megatron, step 3" in r.stdout
    assert list(tmp.iterdir()) == []  # outputs and torchrun's own scratch directory


# Stand-ins for ckptool and the torchrun launch: the demo's outputs handling without its minute of work.
FAKE_CKPTOOL = """#!/bin/sh
[ "$1" = "$FAIL_AT" ] && { echo "error: failing $1 as asked" >&2; exit 3; }
[ "$1" = "$HANG_AT" ] && { touch "$HANG_MARK"; exec sleep 60; }
case "$1" in merge|reshard) mkdir -p "$3"; echo written > "$3/weights" ;; inspect) echo "layout      TP1 PP1" ;; esac
"""


@pytest.fixture
def stand_ins(tmp_path):
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "ckptool").write_text(FAKE_CKPTOOL)
    # python3: the real one (the interpreter choice), except the torchrun launch (`-m torch.distributed.run`)
    (bin_dir / "python3").write_text(f'#!/bin/sh\n[ "$1" = -m ] && {{ echo result=PASS; exit 0; }}\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_demo_removes_its_outputs_when_a_step_fails(tmp_path, stand_ins):
    tmp, env = demo(tmp_path, stand_ins, FAIL_AT="reshard")
    r = subprocess.run(["bash", str(ROOT / "scripts/demo.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "failing reshard" in r.stderr
    assert f"-> {tmp}/ckptool-demo." in r.stdout  # the merge ran, into TMPDIR
    assert list(tmp.iterdir()) == []


def test_demo_keeps_its_outputs_with_keep_and_says_where(tmp_path, stand_ins):
    tmp, env = demo(tmp_path, stand_ins, KEEP="1")
    r = subprocess.run(["bash", str(ROOT / "scripts/demo.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (out,) = tmp.iterdir()
    assert r.stdout.splitlines()[-1] == f"outputs kept in {out} (KEEP=1)"
    assert sorted(p.name for p in out.iterdir()) == ["merged", "mlm_tp1", "tp4"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_removes_its_outputs_when_interrupted(tmp_path, stand_ins, sig):
    mark = tmp_path / "hanging"
    tmp, env = demo(tmp_path, stand_ins, HANG_AT="reshard", HANG_MARK=str(mark))
    p = subprocess.Popen(["bash", str(ROOT / "scripts/demo.sh")], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists() and len(list(tmp.iterdir())) == 1
        os.killpg(p.pid, sig)  # as a terminal's Ctrl-C (or a TERM to the job) reaches the whole group
        assert p.wait(timeout=30) == 128 + sig
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert list(tmp.iterdir()) == []
