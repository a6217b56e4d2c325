"""A command whose source does not exist, and `verify --files`, answer without importing torch (1.5-2.3 s
on a busy machine before a one-line error): the API and the command modules import torch only where a
checkpoint is read or a forward runs (issue 28)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Runs `ckptool ARGS...` in a fresh interpreter (as the console script does, in-process) and says last
# on stdout whether torch was imported; the exit status is the command's.
PROBE = ("import sys\nfrom ckptool.cli import main\n"
         "try:\n    main(sys.argv[1:], prog_name='ckptool')\n"
         "finally:\n    sys.stderr.flush()\n"
         "    print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n")

MISSING = "/no/such/path"
CASES = {
    "merge": ["merge", MISSING, "{out}"],
    "reshard": ["reshard", MISSING, "{out}", "--tp", "2"],
    "fix-vocab": ["fix-vocab", MISSING, "{out}", "--size", "64"],
    "to-hf": ["to-hf", MISSING, "{out}"],
    "to-hf --dtype": ["to-hf", MISSING, "{out}", "--dtype", "bf16"],
    "from-hf": ["from-hf", MISSING, "{out}"],
    "inspect": ["inspect", MISSING],
    "verify": ["verify", MISSING],
    "verify --files": ["verify", "--files", MISSING],
}


def probe(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_missing_source_is_one_line_and_exit_2_without_torch(case, tmp_path):
    r = probe([a.format(out=tmp_path / "out") for a in CASES[case]], tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and MISSING in lines[0], r.stderr
    assert r.stdout.splitlines() == ["torch not imported"], r.stdout
    assert not (tmp_path / "out").exists()


def test_verify_files_reads_a_manifest_without_torch(tmp_path):
    """The manifest check itself imports no torch either: a manifest (written as ckptool writes one,
    plain sha256 form) whose file changed afterwards FAILs naming it, and one that holds PASSes."""
    import hashlib
    import json
    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.bin").write_bytes(b"x")
    entry = {"path": "weights.bin", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    (out / "ckptool-manifest.json").write_text(json.dumps({"tool": "ckptool", "files": [entry]}))
    r = probe(["verify", "--files", str(out)], tmp_path)
    assert r.returncode == 0 and "result=PASS" in r.stdout, (r.stdout, r.stderr)
    assert r.stdout.splitlines()[-1] == "torch not imported", r.stdout
    (out / "weights.bin").write_bytes(b"y")
    r = probe(["verify", "--files", str(out)], tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "result=FAIL" in r.stdout and "weights.bin: sha256 differs" in r.stdout
    assert r.stdout.splitlines()[-1] == "torch not imported", r.stdout


def test_the_api_imports_no_torch_until_it_reads():
    """`import ckptool.api` (and the commands' modules) cost no torch; a real read still works after."""
    code = ("import sys\nimport ckptool.api\n"
            "from ckptool.commands import convert_cmds, hf_cmds, inspect_cmd, verify_cmd\n"
            "assert 'torch' not in sys.modules, 'torch imported at import time'\n"
            "ckpt = ckptool.api.open(sys.argv[1])\n"
            "from ckptool.write_options import as_dtype\n"
            "print(ckpt.config.num_layers, as_dtype('bf16'))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "fixtures/gpt2_mcore_tp2pp2/checkpoint")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "torch.bfloat16"]
