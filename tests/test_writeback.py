"""Early write-back of output files (ckptool/io/writeback.py): bytes and manifest digests unchanged."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from ckptool.io import outdir, writeback
from ckptool.io.chunked import file_digest
from ckptool.io.torchfile import save_streaming

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")


def _state():
    g = torch.Generator().manual_seed(0)
    # 1.5 MiB records take the writer's parallel-hash path; the small ones the buffered path
    return {"big": [torch.randn(384, 1024, generator=g) for _ in range(6)],
            "small": [torch.arange(n, dtype=torch.int64) for n in (1, 7, 300)],
            "half": torch.randn(700, 900, generator=g).to(torch.bfloat16)}


def _check(path, state):
    loaded = torch.load(path, weights_only=True)
    for a, b in zip(loaded["big"] + loaded["small"] + [loaded["half"]],
                    state["big"] + state["small"] + [state["half"]]):
        assert torch.equal(a, b)
    assert outdir._digest(path) == file_digest(path)  # the digest remembered while writing is the file's


@linux_only
def test_windows_are_written_back_and_dropped_without_changing_a_byte(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTOOL_WRITEBACK", raising=False)
    real = writeback._load_sync_file_range()
    assert real is not None, "glibc on Linux has sync_file_range"
    calls, drops = [], []

    def spy(fd, offset, nbytes, flags):
        calls.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_sync_file_range", spy)
    monkeypatch.setattr(writeback, "_drop", lambda fd, off, n: drops.append((off, n)))
    monkeypatch.setattr(writeback, "WINDOW", 1 << 20)
    state = _state()
    path = tmp_path / "model.pt"
    save_streaming(state, path)
    _check(path, state)
    started = [(o, n) for o, n, f in calls if f == 2]
    assert len(started) >= 5
    # windows follow each other with no gap and no overlap, and each settled window was started
    assert all(a[0] + a[1] == b[0] for a, b in zip(started, started[1:]))
    assert drops and drops == started[:len(drops)]


def test_a_refused_sync_file_range_leaves_plain_writes(tmp_path, monkeypatch):
    calls = []

    def refuses(fd, offset, nbytes, flags):
        calls.append(flags)
        return -1  # as for a file system that cannot

    monkeypatch.setattr(writeback, "_sync_file_range", refuses)
    monkeypatch.setattr(writeback, "WINDOW", 1 << 20)
    state = _state()
    path = tmp_path / "model.pt"
    save_streaming(state, path)
    _check(path, state)
    assert calls == [2]  # tried once, then given up for this file


def test_no_sync_file_range_no_writeback(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "_sync_file_range", None)
    with open(tmp_path / "f", "wb") as f:
        wb = writeback.for_file(f)
        assert wb is not None and not wb.enabled
        f.write(os.urandom(10))
        wb.written(10)
