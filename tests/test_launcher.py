"""`python -m ckptool.torchrun` on one node starts the ranks itself, without importing torch: the
options it honours, the environment each rank gets, and a team conversion equal to one process's."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FREE_PORT, run_launch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("WORLD_SIZE", None)
    return env


@pytest.mark.parametrize("opts, want", [
    (["--nproc-per-node", "4"], (4, "127.0.0.1", None)),
    (["--nproc_per_node=2", "--master-port", "2345", "--standalone"], (2, "127.0.0.1", 2345)),
    (["--nnodes", "1", "--node-rank", "0", "--master-addr", "localhost"], (1, "localhost", None)),
    (["--nnodes", "2", "--nproc-per-node", "2"], None),  # several nodes: torchrun's rendezvous
    (["--nproc-per-node", "auto"], None),  # torchrun's own rule
    (["--max-restarts", "3"], None),
    (["--nproc-per-node"], None),
])
def test_the_direct_launch_takes_only_options_it_honours_as_torchrun_does(opts, want):
    from ckptool.torchrun import direct_options
    assert direct_options(opts) == want


def test_rank_environment_is_torchruns():
    from ckptool.torchrun import _rank_env
    env = _rank_env(3, 8, "127.0.0.1", 29511, "/tmp/e.json")
    for key, value in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
                       "CKPTOOL_TORCHRUN_LAUNCHER": "1"}.items():
        assert env[key] == value, key


def _digests(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "ckptool-manifest.json"}


# the launcher in-process, to see that it never imported torch
LAUNCH = r"""
import sys
from ckptool import torchrun
status = torchrun.main(sys.argv[1:])
assert "torch" not in sys.modules, "the launcher imported torch"
sys.exit(status)
"""


def test_a_team_of_three_writes_what_one_process_writes(tmp_path):
    one, team = tmp_path / "one", tmp_path / "team"
    args = ["reshard", str(FIXTURE), "--tp", "2", "--pp", "2"]
    r = subprocess.run([sys.executable, "-m", "ckptool", args[0], args[1], str(one), *args[2:]],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    r = run_launch([sys.executable, "-c", LAUNCH, "--nproc-per-node", "3", "--master-port", FREE_PORT,
                    args[0], args[1], str(team), *args[2:]], env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("reshard:") == 1  # rank 0 reports for the team
    assert _digests(team) == _digests(one)
    from ckptool.io.outdir import check_manifest
    assert check_manifest(team) == []


def test_a_failing_team_ends_with_the_ranks_status_through_either_path(tmp_path):
    """Bad input: the direct launch and torchrun's (CKPTOOL_LAUNCHER=torchrun) end alike."""
    for how in ("", "torchrun"):
        r = run_launch([sys.executable, "-m", "ckptool.torchrun", "--nproc-per-node", "2", "--master-port",
                        FREE_PORT, "merge", str(tmp_path / "missing"), str(tmp_path / "out")],
                       env=_env(CKPTOOL_LAUNCHER=how), timeout=300)
        assert r.returncode == 2, (how, r.stderr[-3000:])
        lines = r.stderr.strip().splitlines()
        assert lines[-1] == f"error: {tmp_path / 'missing'}: no such file or directory", (how, r.stderr[-3000:])
        assert sum(line.startswith("error:") for line in lines) == 1, (how, r.stderr[-3000:])


def _read_bytes(stderr: str) -> int:
    """Source bytes the processes read, from their ckptool-profile lines (io/profile.py)."""
    import json
    total = 0
    for line in stderr.splitlines():
        if line.startswith("ckptool-profile "):
            total += json.loads(line[len("ckptool-profile "):])["stages"].get("read", [0, 0])[1]
    return total


def test_a_team_reads_each_source_byte_once_in_all(tmp_path):
    """TP2 -> TP4 by two ranks: each rank writes the two target files cut from one source shard
    (convert.neighbours_together), so the ranks together read the source's sharded tensor bytes once,
    as one process does (plus each rank's own reading of the files' headers)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from synthetic import write_synthetic
    from ckptool.config import GPTConfig
    src = tmp_path / "src"
    write_synthetic(src, cfg=GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256,
                                       padded_vocab_size=512, vocab_size=500, vocab_size_source="test",
                                       max_position_embeddings=64), tp=2, pp=1)
    env = _env(CKPTOOL_PROFILE="1")
    one = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(src), str(tmp_path / "one"), "--tp", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    team = run_launch([sys.executable, "-m", "ckptool.torchrun", "--nproc-per-node", "2", "--master-port",
                       FREE_PORT, "reshard", str(src), str(tmp_path / "team"), "--tp", "4"], env=env, timeout=300)
    assert team.returncode == 0, team.stderr[-2000:]
    assert _digests(tmp_path / "team") == _digests(tmp_path / "one")
    from ckptool.io.torchfile import TorchArchive
    tensor_bytes = 0
    for p in src.rglob("*.pt"):
        a = TorchArchive(p)
        tensor_bytes += sum(n for key, (_, n) in a.records.items() if key.startswith("data/"))
        a.close()
    single = _read_bytes(one.stderr)
    headers = single - tensor_bytes  # one process: every tensor byte once, and the files' headers
    assert 0 < headers < tensor_bytes
    # two ranks: the sharded tensor bytes once in all, the headers once each; both ranks read every
    # copy of the replicated tensors (norms, biases, positions: the replica check), 7% of this tiny
    # model's bytes. Round-robin files read the row-parallel weights twice: 1.3x the tensor bytes.
    team_read = _read_bytes(team.stderr)
    assert tensor_bytes + 2 * headers <= team_read < 1.1 * tensor_bytes + 2 * headers, (team_read, tensor_bytes)


def test_torchruns_launcher_hands_its_readahead_to_the_workers(monkeypatch):
    """Through torchrun's agent (CKPTOOL_LAUNCHER=torchrun), the launcher's start-up read-ahead of
    the source ends when the workers start: from there each reads ahead what it converts next."""
    import torch.distributed.run as tdr
    from ckptool import torchrun
    from ckptool.io import prefetch, startup
    seen = []
    monkeypatch.setenv("CKPTOOL_LAUNCHER", "torchrun")
    monkeypatch.setattr(startup, "prepare", lambda argv: None)
    monkeypatch.setattr(tdr, "run", lambda args: seen.append(prefetch.HANDOVER.is_set()))
    monkeypatch.setattr(torchrun, "_quiet_torchrun_failure_logs", lambda: None)
    monkeypatch.setattr(prefetch, "HANDOVER", __import__("threading").Event())
    from ckptool.distributed import LAUNCHER_ENV
    monkeypatch.setenv(LAUNCHER_ENV, "")  # main() sets it: restored after the test
    assert torchrun.main(["--nproc-per-node", "2", "merge", str(FIXTURE), "/nonexistent/out"]) in (0, None)
    assert seen == [True]


def test_the_direct_launch_holds_its_port_until_rank_0s_store_binds_it():
    """The port the launch picks stays reserved: no other process's port-0 bind is handed it, and
    torch's store (both backends) still binds and serves on it while the launcher holds it."""
    import datetime
    import socket

    import torch.distributed as dist

    from ckptool.torchrun import reserve_port
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        others = set()
        for _ in range(500):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                others.add(s.getsockname()[1])
        assert port not in others
        for libuv in (True, False):
            store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10), use_libuv=libuv)
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store
    finally:
        held.close()
