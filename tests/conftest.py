"""Shared test fixtures: the independent Megatron fixtures (scripts/make_fixtures.py) built once per
session, and the real framework-written checkpoints from ../shared/real-checkpoints."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL_CANDIDATES = [ROOT.parent / "shared" / "real-checkpoints", ROOT / "fixtures" / "real"]


def _load_make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "scripts" / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_fixtures"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def make_fixtures():
    return _load_make_fixtures()


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory, make_fixtures):
    """A callable: name -> directory of that fixture (built on first use, once per session)."""
    out = tmp_path_factory.mktemp("megatron_fixtures")
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = Path(make_fixtures.build_fixture(name, out))
        return built[name]

    return get


def real_checkpoint(case: str) -> Path:
    for base in REAL_CANDIDATES:
        if (base / case / "checkpoint").is_dir():
            return base / case
    pytest.skip(f"real checkpoint {case} not found under ../shared/real-checkpoints or fixtures/real")


def count_tensor_reads(monkeypatch) -> list:
    """From now on, the byte count of every tensor-data read from a torch file (both ways a storage
    record is read) is appended to the returned list: for tests that measure streaming."""
    from ckptool.io import torchfile
    reads: list = []
    read_record, read_record_into = torchfile.TorchArchive.read_record, torchfile.TorchArchive.read_record_into

    def counting(self, key, start=0, length=None):
        data = read_record(self, key, start, length)
        reads.append(len(data))
        return data

    def counting_into(self, key, start, out):
        reads.append(memoryview(out).nbytes)
        return read_record_into(self, key, start, out)
    monkeypatch.setattr(torchfile.TorchArchive, "read_record", counting)
    monkeypatch.setattr(torchfile.TorchArchive, "read_record_into", counting_into)
    return reads


def free_port() -> int:
    """A TCP port nobody listens on now, for a torchrun rendezvous (fixed ports collide between runs)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
