"""Checksums over the cores (ckptool/io/chunked.py) and torch archives written with them
(ckptool/io/torchzip.py): the same bytes as torch's own writer, the same CRC32 as zlib."""
from __future__ import annotations

import hashlib
import json
import os
import random
import zipfile
import zlib

import pytest
import torch

from ckptool.errors import CkptError
from ckptool.io import chunked, outdir, torchfile, torchzip
from ckptool.lazy import Const


@pytest.fixture(params=[True, False], ids=["one-pass", "two-pass"])
def small_pieces(monkeypatch, request):
    """Pieces of a few KiB, so small test data crosses many piece boundaries; every test using it
    runs with the CRC taken in the hash's pass (CKPTOOL_FUSED_SUMS=1) and in a pass of its own
    (the default)."""
    monkeypatch.setattr(chunked, "PIECE", 1 << 14)
    monkeypatch.setattr(chunked, "CRC_PIECE", 1 << 12)
    monkeypatch.setattr(chunked, "_SMALL", 1 << 10)
    monkeypatch.setattr(chunked, "BLOCK", 1 << 9)
    monkeypatch.setattr(chunked, "FUSED", request.param)


def _by_definition(data: bytes) -> str:
    p = chunked.PIECE
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + p]).digest()
                                   for i in range(0, len(data), p))).hexdigest()


def test_crc32_pieces_combine_to_zlibs(small_pieces):
    rng = random.Random(0)
    for _ in range(30):
        data = os.urandom(rng.randrange(0, 5 << 14))
        cut = rng.randrange(0, len(data) + 1)
        assert chunked.crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]),
                                     len(data) - cut) == zlib.crc32(data)
        assert chunked.crc32_parallel(memoryview(data)) == zlib.crc32(data)
        assert chunked.crc32_finish(chunked.crc32_start(memoryview(data))) == zlib.crc32(data)


def test_crc32_combine_is_associative_at_any_length():
    """Lengths far past 4 GiB (records of a large checkpoint) cannot be checked against zlib of the
    whole in a test, but the combine must agree however the parts are grouped."""
    rng = random.Random(7)
    for _ in range(200):
        a, b, c = (rng.getrandbits(32) for _ in range(3))
        lb, lc = rng.randrange(0, 1 << 40), rng.randrange(0, 1 << 40)
        left = chunked.crc32_combine(chunked.crc32_combine(a, b, lb), c, lc)
        right = chunked.crc32_combine(a, chunked.crc32_combine(b, c, lc), lb + lc)
        assert left == right
    # appending n zero bytes by the combine equals zlib over them (n up to 3 MiB here)
    for n in (1, 63, 1 << 16, 3 << 20):
        crc = zlib.crc32(b"head")
        assert chunked.crc32_combine(crc, zlib.crc32(bytes(n)), n) == zlib.crc32(b"head" + bytes(n))


def test_one_pass_sums_equal_separate_ones(small_pieces):
    """feed(view, crc=True): the record's CRC32 from the hash's pass over it equals zlib.crc32 of
    the record, and the file digest is unchanged, wherever the record starts within a piece."""
    rng = random.Random(5)
    for _ in range(40):
        head = os.urandom(rng.randrange(0, 3 << 14))
        record = os.urandom(rng.choice([0, 1, 700, rng.randrange(0, 7 << 14)]))
        d = chunked.PieceDigest()
        d.feed(head)
        parts = d.feed(memoryview(record), crc=True)
        d.settle()
        assert chunked.crc32_finish(parts) == zlib.crc32(record)
        assert sum(n for n, _ in parts) == len(record)
        assert d.hexdigest() == _by_definition(head + record)


def test_a_record_across_a_piece_boundary_does_not_wait_for_the_first_pieces_hash(small_pieces, monkeypatch):
    """feed() of bytes that end the open piece and begin the next hands both hashes to the pool and
    returns: the next piece's hasher does not wait for the first's (that wait, on the writing thread,
    serialised the hashing of streamed records: distrib_optim.pt's flat tensors, 16 MiB at a time).
    The pool here runs nothing until told, so a feed() that waited would never return."""
    import threading
    from concurrent.futures import Future

    held: list = []

    class HeldPool:  # jobs run only when the test says so
        def submit(self, fn, *args):
            fut = Future()
            held.append((fut, fn, args))
            return fut

    monkeypatch.setattr(chunked, "pool", lambda: HeldPool())
    piece = chunked.PIECE
    data = os.urandom(3 * piece + 3000)  # the second feed: the open piece's end, two pieces, a tail
    d = chunked.PieceDigest()
    d.feed(data[:piece // 2 + 5000])  # opens a piece with a job on its hasher
    for fut, fn, args in held:  # that job done (the writer settles before its next record)
        fut.set_result(fn(*args))
    held.clear()
    d.settle()
    fed = threading.Thread(target=d.feed, args=(memoryview(data)[piece // 2 + 5000:],), daemon=True)
    fed.start()
    fed.join(5)
    assert not fed.is_alive(), "feed() waited for a hash the pool had not run"
    for fut, fn, args in held:  # in submission order: one hasher's updates stay in order
        fut.set_result(fn(*args))
    assert d.hexdigest() == _by_definition(data)


def test_piece_digest_is_independent_of_how_the_bytes_arrive(small_pieces, tmp_path):
    rng = random.Random(1)
    for _ in range(30):
        data = os.urandom(rng.randrange(0, 6 << 14))
        d, pos = chunked.PieceDigest(), 0
        while pos < len(data):
            step = rng.choice([1, 5, 300, 3000, 20000, 70000])
            d.feed(data[pos:pos + step])
            pos += step
        assert d.hexdigest() == _by_definition(data)
    (tmp_path / "f").write_bytes(data)
    assert chunked.file_digest(tmp_path / "f") == _by_definition(data)
    assert chunked.digest_bytes(b"") == hashlib.sha256(b"").hexdigest()


def _write(path, obj, parallel: bool, monkeypatch):
    monkeypatch.setattr(torchzip, "supported", lambda: parallel)
    w = torchfile.StreamingTorchWriter(path, obj)
    for ps in w.pending:
        w.write(ps)
    w.finish()


@pytest.mark.skipif(not torchzip.supported(), reason="this torch has no write_record_metadata")
def test_archive_bytes_equal_torchs_own_writer(small_pieces, tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, 200, generator=g)
    obj = {"big": Const(torch.randn(700, 1024, generator=g).to(torch.bfloat16)),  # > 1 MiB: parallel path
           "view": Const(base[1000:2500]),  # a view into the middle of a buffer: written in place
           "small": Const(torch.arange(10)), "empty": Const(torch.empty(0)), "iteration": 7}
    _write(tmp_path / "ours.pt", obj, True, monkeypatch)
    _write(tmp_path / "torch.pt", obj, False, monkeypatch)
    ours, theirs = (tmp_path / "ours.pt").read_bytes(), (tmp_path / "torch.pt").read_bytes()
    assert ours == theirs  # CRCs, data descriptors, central directory and serialization id alike
    loaded = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert torch.equal(loaded["view"], base[1000:2500]) and loaded["iteration"] == 7
    for name in ("ours.pt", "torch.pt"):  # digests taken while writing are the files'
        assert outdir._digest(tmp_path / name) == chunked.file_digest(tmp_path / name)


def test_manifests_old_and_new_verify(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    (root / "a.bin").write_bytes(os.urandom(5000))
    manifest = outdir.write_manifest(root)
    assert manifest["hash"] == chunked.HASH_NAME and outdir.check_manifest(root) == []
    # a manifest as ckptool wrote it before (plain sha256 per file, no "hash") still verifies
    old = {"tool": "ckptool", "files": [{"path": "a.bin", "size": 5000,
                                         "sha256": hashlib.sha256((root / "a.bin").read_bytes()).hexdigest()}]}
    (root / outdir.MANIFEST).write_text(json.dumps(old))
    assert outdir.check_manifest(root) == []
    (root / "a.bin").write_bytes(b"x" + (root / "a.bin").read_bytes()[1:])
    assert any("sha256 differs" in p for p in outdir.check_manifest(root))
    outdir.write_manifest(root)
    data = bytearray((root / "a.bin").read_bytes())
    data[-1] ^= 1
    (root / "a.bin").write_bytes(bytes(data))
    assert any("digest differs" in p for p in outdir.check_manifest(root))
    new = json.loads((root / outdir.MANIFEST).read_text())
    new["hash"] = "blake9"
    (root / outdir.MANIFEST).write_text(json.dumps(new))
    assert any("unknown hash 'blake9'" in p for p in outdir.check_manifest(root))


@pytest.mark.skipif(not torchzip.supported(), reason="this torch has no write_record_metadata")
def test_record_from_chunks_is_torch_saves_archive(small_pieces, tmp_path):
    """A record written from chunks of any sizes (write_record_chunks, the streamed distrib_optim.pt
    tensors) gives torch.save's own file byte for byte when the records come in torch.save's order."""
    g = torch.Generator().manual_seed(2)
    obj = {"big": torch.randn(600, 1000, generator=g), "small": torch.arange(5),
           "odd": torch.randn(300001, generator=g).to(torch.bfloat16)}
    torch.save(obj, tmp_path / "archive.pt")  # torch names the archive's folder after the file
    (tmp_path / "ours").mkdir()
    out = torchzip.ArchiveOut(tmp_path / "ours" / "archive.pt")
    rng = random.Random(3)
    with zipfile.ZipFile(tmp_path / "archive.pt") as z:
        for info in z.infolist():
            name = info.filename.split("/", 1)[1]
            if name in ("version", ".data/serialization_id"):
                continue  # written by the archive's end, as torch does
            data = z.read(info)
            if len(data) < 1 << 20:
                out.write_small(name, data)
                continue
            cuts = [0] + sorted(rng.sample(range(1, len(data)), 6)) + [len(data)]
            out.write_record_chunks(name, len(data), (memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])))
    out.finish()
    assert (tmp_path / "ours" / "archive.pt").read_bytes() == (tmp_path / "archive.pt").read_bytes()
    with pytest.raises(CkptError, match="planned"):
        bad = torchzip.ArchiveOut(tmp_path / "bad.pt")
        bad.write_record_chunks("data/0", 1 << 20, [memoryview(bytes(1000))])


@pytest.mark.parametrize("parallel", [True, False], ids=["archive-out", "torch-writer"])
def test_streaming_writer_chunks_equal_whole_tensor(small_pieces, tmp_path, monkeypatch, parallel):
    """StreamingTorchWriter.write_chunks with a producer that refills one buffer gives the file write()
    of the whole tensor gives, on both archive paths."""
    if parallel and not torchzip.supported():
        pytest.skip("this torch has no write_record_metadata")
    whole = torch.randn(700, 1024, generator=torch.Generator().manual_seed(4))
    _write(tmp_path / "whole.pt", {"t": Const(whole), "tiny": Const(whole[0, :3].clone())}, parallel, monkeypatch)

    def refilled(t, rows):  # one buffer reused for every chunk, as megatron_distopt's producer does
        buf = torch.empty(rows, t.shape[1])
        for r in range(0, t.shape[0], rows):
            n = min(rows, t.shape[0] - r)
            buf[:n] = t[r:r + n]
            yield buf[:n]
            buf.fill_(float("nan"))

    monkeypatch.setattr(torchzip, "supported", lambda: parallel)
    w = torchfile.StreamingTorchWriter(tmp_path / "chunks.pt", {"t": Const(whole), "tiny": Const(whole[0, :3].clone())})
    seen = []
    w.write_chunks(w.pending[0], refilled(whole, 97), on_bytes=seen.append)
    w.write_chunks(w.pending[1], iter([whole[0, :1], whole[0, 1:3]]))
    w.finish()
    assert sum(seen) == whole.numel() * 4
    assert (tmp_path / "chunks.pt").read_bytes() == (tmp_path / "whole.pt").read_bytes()
