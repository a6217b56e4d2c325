"""Work spread over threads gives the bytes the serial path gives: safetensors shards written in
parallel under a byte budget, and blocked transposes (ckptool/io/safetensors_writer.py, transpose.py)."""
from __future__ import annotations

import threading
import time

import torch

from ckptool.io import chunked, outdir, safetensors_writer, transpose
from ckptool.lazy import Const, Derived


def _items():
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(6):
        w = torch.randn(96 + 32 * i, 160, generator=g).to(torch.bfloat16)
        items.append((f"layer{i}.weight", Derived(transpose.transposed, [Const(w)], shape=(160, w.shape[0]),
                                                  dtype=w.dtype), f"g{i}"))
        items.append((f"layer{i}.bias", Const(torch.randn(160, generator=g)), f"g{i}"))
    return items


def test_parallel_shards_write_the_serial_bytes(tmp_path, monkeypatch):
    out = {}
    for threads in (1, 3):
        monkeypatch.setattr(safetensors_writer, "SHARD_THREADS", threads)
        d = tmp_path / f"t{threads}"
        d.mkdir()
        summary = safetensors_writer.write_sharded(d, _items(), 60_000)
        assert len(summary["files"]) >= 4
        out[threads] = {p.name: p.read_bytes() for p in sorted(d.iterdir())}
        for p in d.glob("*.safetensors"):  # digests taken while writing are the files'
            assert outdir._digest(p) == chunked.file_digest(p)
    assert out[1] == out[3]


def test_byte_budget_holds_threads_back():
    budget = safetensors_writer.ByteBudget(100)
    held, peak, lock = [0], [0], threading.Lock()

    def worker():
        for _ in range(20):
            budget.take(40)
            with lock:
                held[0] += 40
                peak[0] = max(peak[0], held[0])
            time.sleep(0.001)
            with lock:
                held[0] -= 40
            budget.give(40)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and peak[0] <= 100
    budget.take(500)  # larger than the whole budget: admitted alone rather than never
    budget.give(500)


def test_blocked_transposes_equal_torchs():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(700 + 64 * i, 1600, generator=g).to(torch.float16) for i in range(3)]
    assert torch.equal(transpose.transposed_cat(parts), torch.cat(parts, 0).t().contiguous())
    assert torch.equal(transpose.transposed(parts[0]), parts[0].t().contiguous())
    small = torch.randn(5, 7, generator=g)
    assert torch.equal(transpose.transposed(small), small.t().contiguous())
