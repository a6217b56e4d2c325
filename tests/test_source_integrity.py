"""Integrity of source checkpoints (integrity.py, io/torchfile.py's CRC check, io/dcp_io.py's):
`verify --files` checks any checkpoint by its format's own integrity data and names the damaged file
and tensor; conversions refuse a source whose record fails its CRC-32 and write no target.

Damage is planted where it cannot be guessed around: a byte inside a tensor's data record, located
through the zip's central directory and that record's local header (not by its offset in the file).
"""
from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, real_checkpoint

MCORE = "mlm_mcore_gpt2_torch_tp2pp2"
MDS = "mds_gpt2_pipe_tp2pp2_bf16_zero1"
WORD_PATH = ("model", "embedding.word_embeddings.weight")  # a tensor of pipeline stage 0's rank files
WORD = ".".join(WORD_PATH)  # as the messages name it


def ckptool(*argv, env=None):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckptool", *map(str, argv)], capture_output=True, text=True,
                          env=full_env, timeout=300)


def record_data_span(path, member: str) -> tuple:
    """(first byte, size) of a zip member's data (path: a file, or an archive's bytes): the central
    directory gives its local header's offset, the local header the lengths of the name and extra
    field that precede the data."""
    with zipfile.ZipFile(io.BytesIO(path) if isinstance(path, bytes) else path) as z:
        info = z.getinfo(member)
    with (io.BytesIO(path) if isinstance(path, bytes) else open(path, "rb")) as f:
        f.seek(info.header_offset)
        header = f.read(30)
    assert header[:4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def storage_record(path: Path, keys: tuple) -> str:
    """The zip member holding the storage of the tensor at tree[keys[0]][keys[1]]..., found by the
    full (torch) reader."""
    from ckptool.io.torchfile import TorchArchive
    node = TorchArchive(path).load_tree()
    for k in keys:
        node = node[k]
    return f"{node.storage.archive.prefix}/data/{node.storage.key}"


def flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.fixture
def damaged(tmp_path):
    """(intact copy, damaged copy, the damaged file): one byte flipped inside the word embeddings'
    record of one model_optim_rng.pt of the real Megatron-LM checkpoint."""
    src = real_checkpoint(MCORE) / "checkpoint"
    intact, bad = tmp_path / "intact", tmp_path / "bad"
    shutil.copytree(src, intact)
    shutil.copytree(src, bad)
    victim = next(bad.glob("iter_*/mp_rank_01_000/model_optim_rng.pt"))
    start, size = record_data_span(victim, storage_record(victim, WORD_PATH))
    flip_byte(victim, start + size // 2)
    return intact, bad, victim


def test_verify_files_names_the_damaged_file_and_tensor(damaged):
    intact, bad, victim = damaged
    r = ckptool("verify", "--files", bad)
    assert r.returncode == 1 and "result=FAIL" in r.stdout, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if str(victim) in x)
    assert WORD in line and "CRC-32" in line, r.stdout
    ok = ckptool("verify", "--files", intact)
    assert ok.returncode == 0 and "result=PASS" in ok.stdout, ok.stdout + ok.stderr
    assert "zip records' CRC-32" in ok.stdout


def test_merge_refuses_a_damaged_source_and_writes_nothing(damaged, tmp_path):
    intact, bad, victim = damaged
    dst = tmp_path / "merged"
    r = ckptool("merge", bad, dst)
    assert r.returncode == 2, r.stdout + r.stderr
    error = [x for x in r.stderr.splitlines() if "error" in x]
    assert len(error) == 1 and str(victim) in error[0] and WORD in error[0], r.stderr
    assert "Traceback" not in r.stderr and not dst.exists()
    assert not any(p.name.startswith(dst.name) for p in tmp_path.iterdir())  # no partial directory left either
    # CKPTOOL_CRC=0 turns the check off (the benchmark's baseline): the damaged weight then goes through
    # (without the optimizer state, whose fp32 master would no longer match it)
    off = ckptool("merge", bad, tmp_path / "unchecked", "--no-optimizer", env={"CKPTOOL_CRC": "0"})
    assert off.returncode == 0, off.stdout + off.stderr


def test_inspect_reads_a_damaged_source(damaged):
    _, bad, _ = damaged
    r = ckptool("inspect", bad)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr


def test_real_megatron_deepspeed_checkpoint_passes_and_a_missing_shard_fails(tmp_path):
    src = real_checkpoint(MDS) / "checkpoint"
    r = ckptool("verify", "--files", src)
    assert r.returncode == 0 and "result=PASS" in r.stdout, r.stdout + r.stderr
    copy = tmp_path / "mds"
    shutil.copytree(src, copy)
    tag = next(copy.glob("global_step*"))
    # another rank's optimizer shard in rank 02's place: its partition of group 1 is not rank 02's size
    shard = "bf16_zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"
    shutil.copy(tag / shard.format(0), tag / shard.format(2))
    swapped = ckptool("verify", "--files", copy)
    assert swapped.returncode == 1 and "parameter group 1's fp32 partitions hold 1216 values" in swapped.stdout, \
        swapped.stdout
    (tag / shard.format(2)).unlink()
    bad = ckptool("verify", "--files", copy)
    assert bad.returncode == 1 and "no optimizer shards for model-parallel rank 02" in bad.stdout, bad.stdout


def test_safetensors_truncated_by_one_byte_fails(fixture_dir, tmp_path):
    hf = fixture_dir("gpt2_mcore_tp2pp2") / "hf"
    ok = ckptool("verify", "--files", hf)
    assert ok.returncode == 0 and "result=PASS" in ok.stdout, ok.stdout + ok.stderr
    assert "safetensors headers" in ok.stdout
    copy = tmp_path / "hf"
    shutil.copytree(hf, copy)
    victim = next(copy.glob("*.safetensors"))
    os.truncate(victim, victim.stat().st_size - 1)
    bad = ckptool("verify", "--files", copy)
    assert bad.returncode == 1 and "result=FAIL" in bad.stdout, bad.stdout + bad.stderr
    assert any(str(victim) in x and "data buffer" in x for x in bad.stdout.splitlines()), bad.stdout


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    """A torch_dist save written by ckptool, its manifest removed so that the DCP check answers."""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from ckptool.formats.registry import open_checkpoint
    from ckptool.write_options import WriteOptions
    out = tmp_path_factory.mktemp("dcp") / "dist"
    write_layout(open_checkpoint(str(real_checkpoint(MCORE) / "checkpoint")), out, Layout(tp=1),
                 WriteOptions(format="torch_dist"), warn=lambda m: None)
    (out / "ckptool-manifest.json").unlink()
    return out


def _distcp(root: Path) -> Path:
    return next(root.rglob("*.distcp"))


def test_dcp_intact_passes_and_truncated_distcp_fails(dcp_dir, tmp_path):
    ok = ckptool("verify", "--files", dcp_dir)
    assert ok.returncode == 0 and "DCP storage entries" in ok.stdout, ok.stdout + ok.stderr
    copy = tmp_path / "dist"
    shutil.copytree(dcp_dir, copy)
    victim = _distcp(copy)
    os.truncate(victim, victim.stat().st_size - 1)
    bad = ckptool("verify", "--files", copy)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert any(str(victim) in x and "truncated" in x for x in bad.stdout.splitlines()), bad.stdout


def test_dcp_chunk_with_a_flipped_byte_fails_verify_and_conversion(dcp_dir, tmp_path):
    """A tensor chunk of a .distcp file is a torch.save blob: its records' CRCs catch a flipped byte."""
    copy = tmp_path / "dist"
    shutil.copytree(dcp_dir, copy)
    victim = _distcp(copy)
    from ckptool.quick.torch_pickle import loads
    md = loads(next(copy.rglob(".metadata")).read_bytes())
    fqn, info = next((k.fqn, v) for k, v in md.storage_data.items() if k.fqn.endswith("word_embeddings.weight"))
    blob = victim.read_bytes()[info.offset:info.offset + info.length]
    member = next(n for n in zipfile.ZipFile(io.BytesIO(blob)).namelist() if n.endswith("/data/0"))
    start, size = record_data_span(blob, member)
    flip_byte(victim, info.offset + start + size // 2)
    bad = ckptool("verify", "--files", copy)
    assert bad.returncode == 1 and any(fqn in x and "CRC-32" in x for x in bad.stdout.splitlines()), bad.stdout
    dst = tmp_path / "merged"
    r = ckptool("merge", copy, dst)
    assert r.returncode == 2 and fqn in r.stderr and "corrupt" in r.stderr and not dst.exists(), r.stderr


def test_legacy_torch_file_is_not_called_verified(tmp_path):
    import torch
    f = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3)}, f, _use_new_zipfile_serialization=False)
    r = ckptool("verify", "--files", f)
    assert r.returncode == 1 and "no checksum in this format" in r.stdout and "result=PASS" not in r.stdout, r.stdout


def test_verify_files_imports_no_torch(damaged):
    """The integrity check itself is torch-free (the command's start-up is firstrun's business)."""
    code = ("import sys; from pathlib import Path; from ckptool.integrity import check_checkpoint; "
            f"f = check_checkpoint(Path({str(damaged[1])!r})); "
            "assert f.problems and 'torch' not in sys.modules, (f.problems, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("piece", [4096, 1 << 30])  # a checked read in many pieces over threads, and in one
def test_checked_reads_in_pieces_sum_to_the_record_crc(tmp_path, monkeypatch, piece):
    import torch
    from ckptool.errors import CkptError
    from ckptool.io import torchfile
    monkeypatch.setattr(torchfile, "CRC_READ_PIECE", piece)
    t = torch.randn(3, 40_001)  # not a multiple of the piece
    f = tmp_path / "x.pt"
    torch.save({"t": t, "small": torch.arange(5)}, f)
    assert torch.equal(torchfile.load_torch_file(f)["t"].load(), t)
    start, size = record_data_span(f, "x/data/0")
    flip_byte(f, start + size - 5)  # in the last, short piece
    tree = torchfile.load_torch_file(f)
    assert torch.equal(tree["small"].load(), torch.arange(5))  # another record: still read
    with pytest.raises(CkptError, match=r"x\.pt: tensor t \(record x/data/0\) is corrupt"):
        tree["t"].load()
    assert tree["t"].narrow(0, 0, 1).load().shape == (1, 40_001)  # a part of a record is not checked


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6),
       st.floats(0, 1) | st.none())
def test_verify_files_on_damaged_bytes_reports_and_never_crashes(flips, cut):
    """Any bytes changed or cut anywhere in a torch file (headers, directory, pickle, data): the check
    reports problems as lines or passes, and raises nothing."""
    from ckptool.integrity import check_checkpoint
    original = _small_file()
    data = bytearray(original)
    for at, value in flips:
        data[int(at * len(data))] = value
    in_a_record = any(data[i] != original[i] for a, b in _record_spans() for i in range(a, b))
    if cut is not None:
        data = data[:int(cut * len(data))]
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "x.pt"
        f.write_bytes(bytes(data))
        found = check_checkpoint(f)
    assert all(isinstance(p, str) and "\n" not in p for p in found.problems)
    if in_a_record or cut is not None and len(data) < len(original):
        assert found.problems  # a changed byte of any record's data, or a cut file, never passes


def _record_spans() -> list:
    f = io.BytesIO(_small_file())
    names = zipfile.ZipFile(f).namelist()
    return [(a, a + n) for a, n in (record_data_span(_small_file(), m) for m in names)]


_SMALL: list = []


def _small_file() -> bytes:
    if not _SMALL:
        import io as io_
        import torch
        buf = io_.BytesIO()
        torch.save({"w": torch.arange(300, dtype=torch.float32), "b": torch.ones(7)}, buf)
        _SMALL.append(buf.getvalue())
    return _SMALL[0]
