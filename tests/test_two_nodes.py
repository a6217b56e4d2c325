"""A conversion split over two nodes: two torchrun agents (here on one host, as two nodes would start
them), meeting through torchrun's c10d rendezvous, one process each, writing into one shared output
folder. Each node writes its share of the target files; rank 0 seals the output (manifest, rename).
docs/behaviour.md "Converting together under torchrun" says how to start it on real nodes."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import PORT_TAKEN, free_port
from ckptool.io.outdir import MANIFEST, check_manifest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", CKPTOOL_PROFILE="1")
    env.pop("WORLD_SIZE", None)
    return env


def _node(port: int, host: bool, command: list) -> subprocess.Popen:
    """One node's agent: `python -m ckptool.torchrun --nnodes 2 ...` with the c10d rendezvous on this host
    (is_host: which agent serves the rendezvous store; on separate machines each agent works it out
    from the endpoint's host name)."""
    agent = [sys.executable, "-m", "ckptool.torchrun", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ckptool-two-nodes",
             "--rdzv-conf", f"is_host={int(host)}"]
    return subprocess.Popen(agent + command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())


def _two_nodes(command: list, tries: int = 2) -> list:
    """Both agents run to their end: [(returncode, stdout, stderr)] for node 0 (the rendezvous host), node 1;
    once more on another port when the one picked was taken meanwhile."""
    for _ in range(tries):
        port = free_port()
        nodes = [_node(port, host, command) for host in (True, False)]
        ends = []
        for p in nodes:
            out, err = p.communicate(timeout=400)
            ends.append((p.returncode, out, err))
        if not any(s in e[2].lower() for e in ends for s in PORT_TAKEN):
            break
    return ends


def _written_bytes(stderr: str) -> int:
    """Output bytes this node's process wrote, from its ckptool-profile line (io/profile.py)."""
    lines = [l for l in stderr.splitlines() if l.startswith("ckptool-profile ")]
    assert len(lines) == 1, stderr[-2000:]  # one process on each node
    return json.loads(lines[0][len("ckptool-profile "):])["stages"].get("write", [0, 0])[1]


def _digests(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != MANIFEST}


def test_two_nodes_write_one_output_and_its_manifest(tmp_path):
    out, one = tmp_path / "shared" / "out", tmp_path / "one"
    ends = _two_nodes(["reshard", str(FIXTURE), str(out), "--tp", "2", "--pp", "2"])
    for rc, stdout, stderr in ends:
        assert rc == 0, stdout[-2000:] + stderr[-2000:]
    assert sum(e[1].count("reshard:") for e in ends) == 1  # rank 0's node reports for the team
    written = [_written_bytes(e[2]) for e in ends]
    assert all(w > 0 for w in written), written  # each node wrote its share of the target files
    files = sum(p.stat().st_size for p in out.rglob("*.pt"))
    assert sum(written) >= files, (written, files)
    assert check_manifest(out) == []  # every file listed, sizes and digests right
    check = subprocess.run([sys.executable, "-m", "ckptool", "verify", "--files", str(out)], capture_output=True,
                           text=True, env=_env(), timeout=300)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    # the same bytes as one process writes
    r = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(FIXTURE), str(one), "--tp", "2", "--pp", "2"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _digests(out) == _digests(one)
