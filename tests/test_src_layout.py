"""The package lives under src/ (PyPA's src layout), so a folder named `ckptool` in the working
directory (a clone of this repository, as users keep them) cannot shadow the installed package:
`python -m ckptool` from the clone's parent runs the installed ckptool, not a namespace package
made of the clone that has no __version__ (issue 28)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_clone_named_ckptool_does_not_shadow_the_install(tmp_path):
    (tmp_path / "ckptool").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-m", "ckptool", "--version"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ckptool, version" in res.stdout
    where = subprocess.run([sys.executable, "-c", "import ckptool; print(ckptool.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).parent.parent.name == "src", where.stdout


def test_repository_root_holds_no_importable_package():
    assert not (ROOT / "ckptool").exists()
    assert (ROOT / "src" / "ckptool" / "__init__.py").is_file()
