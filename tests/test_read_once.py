"""Resharding reads every source byte once: a target rank's slice of a source shard is read as that
slice (row blocks) or served from one read of the shard shared by the target ranks cut from it
(column blocks of row-parallel weights), and the output is what the reference split gives."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from conftest import count_tensor_reads  # noqa: E402
from ckptool.config import GPTConfig, Layout  # noqa: E402
from ckptool.convert import write_layout  # noqa: E402
from ckptool.formats.registry import open_checkpoint  # noqa: E402
from ckptool.io.torchfile import TorchArchive  # noqa: E402
from ckptool.write_options import WriteOptions
from synthetic import write_synthetic  # noqa: E402


def _tensor_record_bytes(root: Path) -> int:
    """Bytes of every tensor record (data/N) of the torch files under root."""
    total = 0
    for p in root.rglob("*.pt"):
        a = TorchArchive(p)
        total += sum(size for key, (_, size) in a.records.items() if key.startswith("data/"))
        a.close()
    return total


def _tiny(tmp_path, style: str) -> Path:
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256,
                    padded_vocab_size=256, vocab_size=250, vocab_size_source="test", max_position_embeddings=64)
    if style == "llama":
        from make_random_gpt import LLAMA_STYLE
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                        ffn_hidden_size=192, padded_vocab_size=256, vocab_size=256, vocab_size_source="test",
                        max_position_embeddings=64, **LLAMA_STYLE)
    src = tmp_path / f"src-{style}"
    write_synthetic(src, cfg=cfg, tp=2, pp=1)
    return src


def _check(tmp_path, monkeypatch, style: str) -> None:
    src = _tiny(tmp_path, style)
    source_bytes = _tensor_record_bytes(src)
    ckpt = open_checkpoint(src)
    reads = count_tensor_reads(monkeypatch)
    write_layout(ckpt, tmp_path / f"tp4-{style}", Layout(4, 1), warn=lambda m: None)
    # every source tensor byte read once in all (replicated norms and biases: each rank's copy, once)
    assert sum(reads) == source_bytes, (sum(reads), source_bytes)
    monkeypatch.undo()
    # and the target ranks hold the reference split of the merged model
    merged = open_checkpoint(src).tensors
    out = open_checkpoint(tmp_path / f"tp4-{style}").tensors
    assert merged.keys() == out.keys()
    for name, t in merged.items():
        a, b = out[name].load(), t.load()
        if a.shape != b.shape:  # the vocabulary padded for TP4: the real rows unchanged
            a, b = a[:250], b[:250]
        assert torch.equal(a, b), name


def test_tp2_to_tp4_reads_each_source_byte_once(tmp_path, monkeypatch):
    _check(tmp_path, monkeypatch, "gpt2")


def test_tp2_to_tp4_llama_reads_each_source_byte_once(tmp_path, monkeypatch):
    _check(tmp_path, monkeypatch, "llama")


def _covered(ranges) -> dict:
    """path -> merged [start, end) intervals."""
    out: dict = {}
    for path, off, n in sorted(ranges):
        iv = out.setdefault(path, [])
        if iv and off <= iv[-1][1]:
            iv[-1][1] = max(iv[-1][1], off + n)
        else:
            iv.append([off, off + n])
    return out


def _record_spans(root: Path) -> dict:
    spans: dict = {}
    for p in root.rglob("*.pt"):
        a = TorchArchive(p)
        spans[str(p)] = sorted((start, start + size) for key, (start, size) in a.records.items()
                               if key.startswith("data/") and size)
        a.close()
    return spans


def test_the_next_layers_source_bytes_are_asked_for_ahead(tmp_path, monkeypatch):
    """Reshard and to-hf hint every source tensor byte they read to the kernel (io/prefetch.py), a
    group ahead; reshard reads every record whole (to-hf not the embedding's padding rows)."""
    from ckptool.io import prefetch
    src = _tiny(tmp_path, "gpt2")
    asked: list = []
    real = prefetch.source_ranges
    monkeypatch.setattr(prefetch, "source_ranges", lambda lazies: asked.extend(real(lazies)) or real([]))
    read: list = []
    real_read = TorchArchive.read_record_into

    def reading(self, key, start, out):
        read.append((str(self.path), self.records[f"data/{key}"][0] + start, memoryview(out).nbytes))
        return real_read(self, key, start, out)
    monkeypatch.setattr(TorchArchive, "read_record_into", reading)
    monkeypatch.delenv("CKPTOOL_PREFETCH", raising=False)
    monkeypatch.delenv("CKPTOOL_READAHEAD", raising=False)
    from ckptool import api
    for out, write in (("tp4", lambda d: write_layout(open_checkpoint(src), d, Layout(4, 1), warn=lambda m: None)),
                       ("hf", lambda d: api.to_hf(src, d, max_shard_size="40KB", warn=lambda m: None))):
        asked.clear()
        read.clear()
        write(tmp_path / out)
        covered = _covered(asked)
        for path, start, n in read:  # each read inside one hinted interval
            assert any(a <= start and start + n <= b for a, b in covered.get(path, [])), (out, path, start, n)
        if out == "tp4":
            for path, spans in _record_spans(src).items():
                for start, end in spans:  # each record inside one hinted interval
                    assert any(a <= start and end <= b for a, b in covered.get(path, [])), (out, path, start, end)
        assert read
    monkeypatch.setenv("CKPTOOL_PREFETCH", "0")
    asked.clear()
    write_layout(open_checkpoint(src), tmp_path / "off", Layout(1, 1), warn=lambda m: None)
    assert asked == []


def test_a_large_read_in_pieces_over_threads_gives_the_same_bytes(tmp_path, monkeypatch):
    from ckptool.io import torchfile
    t = torch.randn(3, 40_001)  # not a multiple of the piece
    torch.save({"t": t, "small": torch.arange(5)}, tmp_path / "x.pt")
    monkeypatch.setattr(torchfile, "READ_PIECE", 4096)
    monkeypatch.setattr(torchfile, "READ_SPLIT", 8192)
    assert len(torchfile._read_pieces(t.numel() * 4)) > 100
    tree = torchfile.load_torch_file(tmp_path / "x.pt")
    assert torch.equal(tree["t"].load(), t) and torch.equal(tree["small"].load(), torch.arange(5))
    assert torch.equal(tree["t"].narrow(0, 1, 2).load(), t[1:])


def test_torch_dist_tensors_name_their_chunk_records(tmp_path):
    """Read-ahead finds a torch_dist source's bytes too: every tensor chunk record is in some
    tensor's ranges, and each tensor still loads as the source's."""
    from ckptool.io import prefetch
    from ckptool.io.dcp_io import DcpDir
    src = _tiny(tmp_path, "gpt2")
    write_layout(open_checkpoint(src), tmp_path / "dist", Layout(1, 1),
                 WriteOptions(format="torch_dist"), warn=lambda m: None)
    ckpt = open_checkpoint(tmp_path / "dist")
    covered = _covered(prefetch.source_ranges(ckpt.tensors.values()))
    (meta,) = list((tmp_path / "dist").rglob(".metadata"))
    d = DcpDir(meta.parent)
    tensor_records = [(str(d.path / info.relative_path), info.offset, info.length)
                      for fqn in d.tensor_keys() for info in d.storage.get(fqn, {}).values()]
    assert tensor_records
    for path, off, n in tensor_records:
        assert any(a <= off and off + n <= b for a, b in covered.get(path, [])), (path, off, n)
    merged = open_checkpoint(src).tensors
    for name, t in ckpt.tensors.items():
        assert torch.equal(t.load(), merged[name].load()), name


def test_safetensors_sources_are_asked_for_ahead(tmp_path, monkeypatch):
    """from-hf hints every safetensors entry's bytes (io/prefetch.py), and a row slice's range is
    exactly the bytes it loads."""
    from ckptool import api
    from ckptool.formats.hf.reader import read_entries
    from ckptool.io import prefetch
    from ckptool.io.safetensors_header import read_safetensors_header
    api.to_hf(_tiny(tmp_path, "llama"), tmp_path / "hf", max_shard_size="40KB", warn=lambda m: None)
    entry = read_entries(tmp_path / "hf")["model.layers.0.mlp.down_proj.weight"]
    part = entry.narrow(0, 5, 7)
    (path, off, n), = part.file_ranges()
    with open(path, "rb") as f:
        f.seek(off)
        assert f.read(n) == part.load().contiguous().view(torch.uint8).numpy().tobytes()
    asked: list = []
    real = prefetch.source_ranges
    monkeypatch.setattr(prefetch, "source_ranges", lambda lazies: asked.extend(real(lazies)) or real([]))
    monkeypatch.delenv("CKPTOOL_PREFETCH", raising=False)
    monkeypatch.delenv("CKPTOOL_READAHEAD", raising=False)
    api.from_hf(tmp_path / "hf", tmp_path / "back", tp=2, warn=lambda m: None)
    covered = _covered(asked)
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1
    for p in files:
        for e in read_safetensors_header(p).tensors.values():
            assert any(a <= e.start and e.end <= b for a, b in covered.get(str(p), [])), (p.name, e.name)
