"""The fp32 master check reads no weight twice, and a finer TP target no master twice. Each master, cast
to the model dtype, must equal its stored 16-bit weight (megatron_optim.master_matching_weight), and the
weight is also what the writer writes: the reader memoises each weight (megatron._read_once), so a
writer's load of a layer reads it once for both. On the real Megatron-LM checkpoints, a merge carrying
the optimizer reads no byte range of the source twice; without the memo it re-reads the 16-bit weights
(~1/7 of the bytes a mixed-precision optimizer conversion reads)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ckptool import api
from ckptool.formats.megatron import checkpoint as megatron
from ckptool.io import torchfile

REAL = Path("/work/shared/real-checkpoints")
CASES = ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"]


def _reads(monkeypatch, fn) -> Counter:
    """(file, offset, length) -> how often the source was read there while fn ran."""
    seen: Counter = Counter()
    read_into = torchfile.TorchArchive._read_into

    def counted(self, offset, view, **kw):  # kw: the reader's own options (crc: check the record as read)
        seen[(str(self.path), offset, len(view))] += 1
        return read_into(self, offset, view, **kw)
    monkeypatch.setattr(torchfile.TorchArchive, "_read_into", counted)
    fn()
    monkeypatch.setattr(torchfile.TorchArchive, "_read_into", read_into)
    return seen


@pytest.mark.parametrize("case", CASES)
def test_carrying_the_optimizer_reads_each_weight_once(case, tmp_path, monkeypatch):
    src = REAL / case / "checkpoint"
    if not src.is_dir():
        pytest.skip(f"{src} is not on this machine")
    once = _reads(monkeypatch, lambda: api.reshard(src, tmp_path / "once", tp=1, pp=1, warn=lambda m: None))
    assert sum(once.values()) > 0 and [k for k, n in once.items() if n > 1] == []
    monkeypatch.setattr(megatron, "_read_once", lambda role, value: value)  # the check reads its own weight
    twice = _reads(monkeypatch, lambda: api.reshard(src, tmp_path / "twice", tp=1, pp=1, warn=lambda m: None))
    again = sum(length * (n - 1) for (_, _, length), n in twice.items())
    total = sum(length * n for (_, _, length), n in once.items())
    print(f"{case}: {total} bytes read once; without the memo {again} more")
    assert again > total // 10


@pytest.mark.parametrize("case", CASES)
def test_a_finer_tensor_parallel_target_reads_each_master_once(case, tmp_path, monkeypatch):
    """TP2 -> TP4: each target rank takes half of a source rank's master and checks it against the same
    half of the weight (lazy.Checked cut like the tensor it checks), so no byte range of the source is
    read twice; checking each whole source master once per target rank re-read them (26% of the bytes
    of the real mcore checkpoint)."""
    src = REAL / case / "checkpoint"
    if not src.is_dir():
        pytest.skip(f"{src} is not on this machine")
    reads = _reads(monkeypatch, lambda: api.reshard(src, tmp_path / "tp4", tp=4, pp=1, warn=lambda m: None))
    assert sum(reads.values()) > 0 and [k for k, n in reads.items() if n > 1] == []
