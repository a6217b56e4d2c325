"""Loading a checkpoint never runs code from it.

Each test plants a payload that would create a marker file if anything executed it, puts it in a
real torch.save archive (or a hand-built pickle for the constructor corner cases), and checks that
ckptool refuses it with a CkptError, that the CLI exits non-zero with one "error:" line, and that
the marker file does not exist.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptool.errors import CkptError
from ckptool.io.safe_pickle import UnsafePickleError, safe_loads
from ckptool.io.torchfile import load_torch_file

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"


class Reduce:
    """An object that pickles as fn(*args): what a malicious checkpoint would hold."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker: Path) -> dict:
    """name -> an object whose unpickling would create `marker`."""
    cmd = f"touch {marker}"
    inner = io.BytesIO()
    torch.save({"x": Reduce(os.system, cmd)}, inner)
    nested = pickle.dumps(Reduce(os.system, cmd))
    return {
        "os.system": Reduce(os.system, cmd),
        "builtins.eval": Reduce(eval, f"open({str(marker)!r}, 'w').close()"),
        "builtins.exec": Reduce(exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess.call": Reduce(subprocess.call, ["touch", str(marker)]),
        "subprocess.Popen": Reduce(subprocess.Popen, ["touch", str(marker)]),
        "torch.load-of-bytes": Reduce(torch.storage._load_from_bytes, inner.getvalue()),
        "torch.load": Reduce(torch.load, io.BytesIO(inner.getvalue())),
        "pickle.loads": Reduce(pickle.loads, nested),
        "numpy.load": Reduce(np.load, io.BytesIO(nested)),
        # numpy pickles an object array's elements inline: the element is a nested pickle blob and a reduce
        "numpy-object-array": np.array([nested, Reduce(os.system, cmd)], dtype=object),
        "numpy-object-bytes": np.array([nested], dtype=object),
        "builtins.__import__": Reduce(__import__, "os"),
    }


def _save(obj, path: Path, zip_format: bool = True) -> None:
    torch.save(obj, path, _use_new_zipfile_serialization=zip_format)


@pytest.fixture
def marker(tmp_path):
    m = tmp_path / "pwned"
    yield m
    assert not m.exists(), "a payload ran"


NAMES = sorted(_payloads(Path("/x")))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_file_payload_is_refused(tmp_path, marker, name, zip_format):
    path = tmp_path / "model_optim_rng.pt"
    _save({"args": _payloads(marker)[name], "model": {"w": torch.ones(2)}}, path, zip_format)
    with pytest.raises(CkptError) as err:
        load_torch_file(path)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def _plant(tmp_path: Path, payload) -> Path:
    """A copy of the TP2 PP2 fixture whose rank (0, 0) file is replaced by one carrying `payload`
    inside args (the reader opens every rank file before it looks at any tensor)."""
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, src)
    f = src / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    args = __import__("argparse").Namespace(num_layers=4, evil=payload)
    _save({"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": {}}, f)
    return src


@pytest.mark.parametrize("name,cmd", [("os.system", "inspect"), ("builtins.eval", "reshard"),
                                      ("subprocess.call", "merge"), ("torch.load-of-bytes", "inspect"),
                                      ("numpy-object-bytes", "reshard")])
def test_cli_refuses_planted_checkpoint(tmp_path, marker, name, cmd):
    src = _plant(tmp_path, _payloads(marker)[name])
    dst = tmp_path / "out"
    argv = {"inspect": ["inspect", str(src)], "merge": ["merge", str(src), str(dst)],
            "reshard": ["reshard", str(src), str(dst), "--tp", "1"]}[cmd]
    for cmd in (argv,):
        r = subprocess.run([sys.executable, "-m", "ckptool", *cmd], capture_output=True, text=True,
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
        assert "refusing" in lines[0] or "object array" in lines[0], lines[0]
        assert "Traceback" not in r.stderr
        assert not marker.exists()
        assert not dst.exists()


# --- hand-built pickles for the constructors the allow list keeps ---------------------------

def _call(module: str, name: str, *args) -> bytes:
    """Protocol-2 pickle of module.name(*args) (args pickled normally)."""
    body = pickle.dumps(tuple(args), protocol=2)[2:-1]
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n" + body + b"R."


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


CRAFTED = {
    # base.__new__(cls, state) with a base that is not a plain type
    "reconstructor-io-base": b"\x80\x02" + _global("copyreg", "_reconstructor")
    + b"(" + _global("argparse", "Namespace") + _global("io", "BytesIO") + b"N" + b"tR.",
    "reconstructor-non-class": b"\x80\x02" + _global("copyreg", "_reconstructor")
    + b"(" + _global("_codecs", "encode") + _global("builtins", "object") + b"N" + b"tR.",
    "newobj-function": b"\x80\x02" + _global("copyreg", "__newobj__")
    + b"(" + _global("_codecs", "encode") + b"X\x01\x00\x00\x00a" + b"tR.",
    # a defaultdict factory runs whenever a missing key is read
    "defaultdict-factory": b"\x80\x02" + _global("collections", "defaultdict")
    + b"(" + _global("torch._utils", "_rebuild_tensor_v2") + b"tR.",
    # _rebuild_from_type_v2(func, type, args, state) calls func(*args)
    "rebuild-from-type-func": b"\x80\x02" + _global("torch._tensor", "_rebuild_from_type_v2")
    + b"(" + _global("builtins", "bytearray") + _global("torch", "Tensor") + b"K\x03\x85}tR.",
    "rebuild-from-type-standin": b"\x80\x02" + _global("torch._tensor", "_rebuild_from_type_v2")
    + b"(" + _global("torch._utils", "_rebuild_tensor_v2") + _global("megatron.x", "Evil") + b")}tR.",
    "rebuild-wrapper-subclass": _call("torch._utils", "_rebuild_wrapper_subclass", 1, 2),
    "numpy-object-dtype": _call("numpy", "dtype", "O"),
    "storage-load-from-bytes": _call("torch.storage", "_load_from_bytes", b"x"),
    "torch-load": _call("torch", "load", "x"),
    "dcp-filesystem-writer": _call("torch.distributed.checkpoint.filesystem", "FileSystemWriter", "/tmp/x"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_constructor_is_refused(name):
    with pytest.raises(CkptError) as err:
        safe_loads(CRAFTED[name], source="t")
    assert isinstance(err.value, UnsafePickleError) or "does not read" in str(err.value), str(err.value)


def test_what_checkpoints_need_still_loads():
    """The tightening keeps everything real checkpoints hold."""
    obj = {
        "od": collections.OrderedDict(a=1),
        "dd": collections.defaultdict(list, {"k": [1]}),
        "rng": np.random.RandomState(0).get_state(),
        "arr": np.arange(4, dtype=np.float32),
        "scalar": np.float64(1.5),
        "ns": __import__("argparse").Namespace(x=1, params_dtype=torch.bfloat16),
        "t": torch.arange(6, dtype=torch.float32).view(2, 3),
        "p": torch.nn.Parameter(torch.ones(2)),
        "set": {1, 2},
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ckptool-safe-{os.getpid()}.pt"
    path.write_bytes(buf.getvalue())
    try:
        out = load_torch_file(path)
    finally:
        path.unlink()
    assert out["dd"]["k"] == [1] and out["dd"].default_factory is list
    assert out["rng"][0] == "MT19937" and np.array_equal(out["rng"][1], obj["rng"][1])
    assert np.array_equal(out["arr"], obj["arr"]) and out["scalar"] == 1.5
    assert out["ns"].params_dtype is torch.bfloat16
    assert torch.equal(out["t"].load(), obj["t"]) and torch.equal(out["p"].load(), obj["p"].detach())
    assert float(safe_loads(pickle.dumps(np.float32(2.0), protocol=2))) == 2.0
