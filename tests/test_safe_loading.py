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


@pytest.mark.parametrize("name,cmd,via", [
    ("os.system", "inspect", "subprocess"), ("torch.load-of-bytes", "reshard", "subprocess"),
    ("builtins.eval", "reshard", "inprocess"), ("subprocess.call", "merge", "inprocess"),
    ("numpy-object-bytes", "fix-vocab", "inprocess")])
def test_cli_refuses_planted_checkpoint(tmp_path, marker, name, cmd, via):
    src = _plant(tmp_path, _payloads(marker)[name])
    dst = tmp_path / "out"
    argv = {"inspect": ["inspect", str(src)], "merge": ["merge", str(src), str(dst)],
            "reshard": ["reshard", str(src), str(dst), "--tp", "1"],
            "fix-vocab": ["fix-vocab", str(src), str(dst), "--size", "1024"]}[cmd]
    if via == "subprocess":
        r = subprocess.run([sys.executable, "-m", "ckptool", *argv], capture_output=True, text=True,
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        code, stderr = r.returncode, r.stderr
    else:
        from click.testing import CliRunner
        from ckptool.cli import main
        r = CliRunner().invoke(main, argv)
        code, stderr = r.exit_code, r.stderr
    assert code != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert "refusing" in lines[0], lines[0]
    assert "Traceback" not in stderr
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


def _memo_bomb(data: bytes) -> bytes:
    """data with its first BINPUT (memo slot n) turned into LONG_BINPUT 2**31: 5 bytes that make
    the C unpickler allocate and zero a 32 GiB memo table."""
    i = data.index(b"q", 2)  # BINPUT, after the PROTO opcode
    return data[:i] + b"r" + (2 ** 31).to_bytes(4, "little") + data[i + 2:]


def test_memo_index_bomb_is_refused_before_allocating(tmp_path):
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    plain = pickle.dumps(__import__("argparse").Namespace(num_layers=2, seq=[1, 2]), protocol=2)
    with pytest.raises(UnsafePickleError, match="memo entry 2147483648"):
        safe_loads(_memo_bomb(plain), "args.pkl")
    # the same inside a torch archive's data.pkl: the reader refuses it with one line
    import zipfile
    good, bad = tmp_path / "good.pt", tmp_path / "model_optim_rng.pt"
    torch.save({"args": __import__("argparse").Namespace(num_layers=2), "model": {"w": torch.ones(2)}}, good)
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, _memo_bomb(data) if info.filename.endswith("/data.pkl") else data)
    with pytest.raises(CkptError, match="memo entry") as err:
        load_torch_file(bad)
    assert "\n" not in str(err.value)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024, f"peak memory grew by {grown_kib} KiB"
    assert safe_loads(plain).num_layers == 2  # an ordinary pickle still loads



class _Python311Early(pickle.Pickler):
    """Pickles enums as Python 3.11's early releases (Debian 12's 3.11.2) do: a signal by its global
    name (signal.SIGTERM, as 3.10 does too), any other member as getattr(its class, its name)."""

    def reducer_override(self, obj):
        import enum
        import signal
        if isinstance(obj, signal.Signals):
            return obj.name
        return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented


def test_enums_pickled_by_name_load_and_write_back(tmp_path):
    """Megatron's args (exit_signal, model_type) saved by such a Python, or ckptool's output written there
    (the demo on Debian 12 refused to inspect its own reshard), read on the full path and in the torch-free
    inspect, and a merge writes the members back as they were named; getattr of anything but an enum's
    member, and the signal module's other names, are still refused."""
    import signal
    import types
    from ckptool import api
    from ckptool.io.standin import StandIn
    from ckptool.quick_inspect import quick_open
    ModelType = pytest.importorskip("megatron.core.enums").ModelType  # the test-mcore extra
    assert safe_loads(b"\x80\x02csignal\nSIGTERM\nq\x00.") is signal.SIGTERM
    with pytest.raises(UnsafePickleError, match="signal.signal"):
        safe_loads(b"\x80\x02csignal\nsignal\nq\x00.")
    with pytest.raises(UnsafePickleError, match="getattr.*'fromkeys'"):
        safe_loads(pickle.dumps(Reduce(getattr, collections.OrderedDict, "fromkeys"), protocol=2))
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt_dir)
    for f in ckpt_dir.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["args"].exit_signal, state["args"].model_type = signal.SIGTERM, ModelType.encoder_or_decoder
        torch.save(state, f, pickle_module=types.SimpleNamespace(Pickler=_Python311Early, __name__="pickle"))
        data = f.read_bytes()  # the zip stores data.pkl uncompressed
        assert b"csignal\nSIGTERM\n" in data and b"getattr" in data and b"encoder_or_decoder" in data
    for ckpt in (api.open(ckpt_dir), quick_open(ckpt_dir, {})):
        args = ckpt.source.args
        assert args.exit_signal is signal.SIGTERM and isinstance(args.model_type, StandIn)
        assert repr(args.model_type).endswith("ModelType.encoder_or_decoder>")
    api.merge(ckpt_dir, tmp_path / "merged")
    (out,) = (tmp_path / "merged").glob("iter_*/mp_rank_00/model_optim_rng.pt")
    assert torch.load(out, weights_only=False)["args"].model_type is ModelType.encoder_or_decoder
    assert api.open(tmp_path / "merged").source.args.exit_signal is signal.SIGTERM
