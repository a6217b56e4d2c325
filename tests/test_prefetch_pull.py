"""ckptool/io/prefetch.py pull(): read-ahead that reads every byte of a range (a WILLNEED hint is
capped by the kernel at one read-ahead window), with sendfile to /dev/null or a reused buffer."""
import os
import threading

import pytest

from ckptool.io import prefetch


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(2 * prefetch.PIECE + 12345))
    fd = os.open(path, os.O_RDONLY)
    yield fd, path.stat().st_size
    os.close(fd)


def test_pull_reads_the_whole_range_and_stops_at_the_end_of_the_file(data):
    fd, size = data
    assert prefetch.pull(fd, 0, size) == size
    assert prefetch.pull(fd, 1000, 3 * prefetch.PIECE) == size - 1000  # past the end: what is there
    assert prefetch.pull(fd, size, 10) == 0
    assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # positional reads only: a shared fd's offset untouched


def test_pull_without_sendfile_reads_through_a_buffer(data, monkeypatch):
    fd, size = data
    seen = []
    real = os.preadv

    def preadv(f, bufs, off):
        seen.append((off, sum(len(b) for b in bufs)))
        return real(f, bufs, off)

    def no_sendfile(*a):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(os, "sendfile", no_sendfile)
    monkeypatch.setattr(os, "preadv", preadv)
    assert prefetch.pull(fd, 5, size - 5) == size - 5
    assert seen == [(5, prefetch.PIECE), (5 + prefetch.PIECE, prefetch.PIECE),
                    (5 + 2 * prefetch.PIECE, size - 5 - 2 * prefetch.PIECE)]


def test_pull_stops_between_pieces_when_told(data):
    fd, size = data
    stop = threading.Event()
    stop.set()
    assert prefetch.pull(fd, 0, size, stop) == 0


def test_prefetcher_reads_what_it_is_asked_and_close_drops_the_rest(tmp_path, monkeypatch):
    import time
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(prefetch.PIECE + 100))
    pulled = []
    real = prefetch.pull
    monkeypatch.setattr(prefetch, "pull", lambda fd, off, n, stop=None: pulled.append((off, n)) or real(fd, off, n, stop))

    class Stored:  # a lazy tensor stored in a file, as the readers' tensors tell their bytes
        def __init__(self, off, n):
            self.r = (str(path), off, n)

        def file_ranges(self):
            return [self.r]
    p = prefetch.Prefetcher()
    p.ask([Stored(1000, 10), Stored(0, 50), Stored(50, 50)])  # adjacent ranges joined, in file order
    deadline = time.monotonic() + 10
    while len(pulled) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.close()
    assert pulled == [(0, 100), (1000, 10)]
    # after close(), what is still queued is dropped: its thread ends without reading it
    p = prefetch.Prefetcher()
    p._stop.set()
    p.ask([Stored(0, prefetch.PIECE)])
    p.close()
    assert pulled == [(0, 100), (1000, 10)]


def test_a_conversions_prefetcher_ends_the_startup_readahead(monkeypatch):
    monkeypatch.setenv("CKPTOOL_PREFETCH", "0")
    prefetch.HANDOVER.clear()
    assert prefetch.prefetcher() is None and prefetch.HANDOVER.is_set()
