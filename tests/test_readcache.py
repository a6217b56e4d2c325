"""Source pages dropped from the page cache once read, for sources larger than memory
(ckptool/io/readcache.py): the policy, the ranges it hints, and output unchanged by it."""
import os

import torch

from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.formats.registry import open_checkpoint
from ckptool.io import readcache
from ckptool.io.torchfile import TorchArchive

GiB = 1 << 30


def test_policy_drops_only_sources_larger_than_half_of_memory(monkeypatch):
    monkeypatch.delenv("CKPTOOL_DROP_SOURCE", raising=False)
    assert not readcache.decide(8 * GiB, 24 * GiB)
    assert readcache.decide(13 * GiB, 24 * GiB)
    assert not readcache.decide(13 * GiB, 0)  # memory unknown: leave the cache alone
    monkeypatch.setenv("CKPTOOL_DROP_SOURCE", "1")
    assert readcache.decide(1, 24 * GiB)
    monkeypatch.setenv("CKPTOOL_DROP_SOURCE", "0")
    assert not readcache.decide(100 * GiB, 24 * GiB)


def _tensors(ckpt):
    return {k: v.load() for k, v in ckpt.tensors.items()}


def test_each_tensor_read_is_hinted_once_read_and_output_is_unchanged(fixture_dir, tmp_path, monkeypatch):
    src = fixture_dir("llama_mcore_tp2pp2") / "checkpoint"
    monkeypatch.setenv("CKPTOOL_DROP_SOURCE", "0")
    write_layout(open_checkpoint(src), tmp_path / "plain", Layout(1, 1), warn=lambda m: None)

    hints = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (
        hints.append((os.readlink(f"/proc/self/fd/{fd}"), off, n, advice)), real(fd, off, n, advice))[1])
    monkeypatch.setattr(readcache, "MIN_DROP_BYTES", 0)  # the fixture's tensors are small
    monkeypatch.setenv("CKPTOOL_DROP_SOURCE", "1")
    assert readcache.configure_for(src)
    write_layout(open_checkpoint(src), tmp_path / "dropped", Layout(1, 1), warn=lambda m: None)
    monkeypatch.setattr(readcache, "_drop", False)

    # every hint is DONTNEED on a range inside one record of a source file, and each file's
    # tensor records were hinted
    records, tensor_records = {}, {}
    for f in sorted(src.rglob("*.pt")):
        recs = TorchArchive(f).records
        records[str(f.resolve())] = list(recs.values())
        tensor_records[str(f.resolve())] = [r for k, r in recs.items() if k.startswith("data/")]
    assert hints
    for path, off, n, advice in hints:
        assert advice == os.POSIX_FADV_DONTNEED
        assert any(start <= off and off + n <= start + size for start, size in records[path]), (path, off, n)
    for path, recs in tensor_records.items():
        hinted = [(off, n) for p, off, n, _ in hints if p == path]
        assert any(start <= off and off + n <= start + size for start, size in recs for off, n in hinted), path

    a, b = open_checkpoint(tmp_path / "plain"), open_checkpoint(tmp_path / "dropped")
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) == list(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
