"""Streaming conversion: memory stays at about a layer whatever the model's size, and a torchrun
team of processes writes exactly what one process writes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from ckptool.config import GPTConfig  # noqa: E402
from synthetic import write_synthetic  # noqa: E402

HIDDEN, LAYERS = 1024, 12
LAYER_BYTES = 2 * 12 * HIDDEN * HIDDEN  # bf16 weights of one layer: ~25 MiB; the model ~300 MB


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """A checkpoint whose bytes are nearly all in its layers (tiny vocabulary), TP2 PP2 bf16."""
    out = tmp_path_factory.mktemp("synthetic") / "ckpt"
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=16, ffn_hidden_size=4 * HIDDEN,
                    padded_vocab_size=1024, vocab_size=1000, vocab_size_source="test", max_position_embeddings=256)
    write_synthetic(out, cfg=cfg)
    return out


# Runs in a child: open the checkpoint, reset the peak-RSS counter, convert, report the growth.
PROBE = r"""
import json, sys
from ckptool.formats.registry import open_checkpoint
from ckptool.convert import write_layout
from ckptool.config import Layout
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
ckpt = open_checkpoint(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS:")
write_layout(ckpt, sys.argv[2], Layout(int(sys.argv[3]), 1), warn=lambda m: None)
print(json.dumps({"before": before, "peak": status("VmHWM:")}))
"""


@pytest.mark.parametrize("tp", [1, 4])
def test_peak_memory_is_about_a_layer_not_the_model(layered, tmp_path, tp):
    model_bytes = sum(p.stat().st_size for p in layered.rglob("*.pt"))
    assert model_bytes > 10 * LAYER_BYTES
    r = subprocess.run([sys.executable, "-c", PROBE, str(layered), str(tmp_path / "out"), str(tp)],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["before"]
    # two groups in flight (one loading, one being written), each a merged layer plus its
    # shards: ~4 layers, plus slack for allocator noise; loading the model would be ~12 layers
    assert growth < 5 * LAYER_BYTES + (32 << 20), (
        f"peak RSS grew by {growth / 2**20:.0f} MiB converting a {model_bytes / 2**20:.0f} MiB model "
        f"(layer {LAYER_BYTES / 2**20:.0f} MiB)")


def _tensor_digests(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "ckptool-manifest.json"}


FIXTURE = ROOT / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"


def _torchrun(*args):
    return subprocess.run(["torchrun", "--nproc-per-node", "2", "-m", "ckptool", *args],
                          capture_output=True, text=True, env=_env(), timeout=300)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_team_writes_what_one_process_writes(tmp_path):
    one, team = tmp_path / "one", tmp_path / "team"
    r = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(FIXTURE), str(one), "--tp", "2",
                        "--pp", "2"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    r = _torchrun("reshard", str(FIXTURE), str(team), "--tp", "2", "--pp", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("reshard:") == 1  # rank 0 reports for the team
    from ckptool.io.outdir import check_manifest
    assert check_manifest(one) == [] and check_manifest(team) == []  # digests taken while writing hold
    want, got = _tensor_digests(one), _tensor_digests(team)
    assert len([k for k in want if k.endswith(".pt")]) == 4
    assert got == want
    manifest = json.loads((team / "ckptool-manifest.json").read_text())
    from ckptool.io.chunked import HASH_NAME, file_digest
    assert manifest["hash"] == HASH_NAME
    assert {e["path"]: e["digest"] for e in manifest["files"]} == {k: file_digest(one / k) for k in want}
    assert not list(tmp_path.glob(".team*"))  # no partial directory left behind

    # a refused destination is refused on every rank, and nothing is written
    r = _torchrun("merge", str(FIXTURE), str(team))
    assert r.returncode != 0
    assert "already exists" in r.stdout + r.stderr
    assert _tensor_digests(team) == want


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_team_to_hf_shares_the_shards(tmp_path):
    """to-hf under torchrun: the ranks divide the safetensors shards; the result is the same files."""
    one, team = tmp_path / "one", tmp_path / "team"
    common = ["--max-shard-size", "40KB", "--true-vocab-size", "1000"]
    r = subprocess.run([sys.executable, "-m", "ckptool", "to-hf", str(FIXTURE), str(one), *common],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    r = _torchrun("to-hf", str(FIXTURE), str(team), *common)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("to-hf:") == 1  # rank 0 reports for the team
    from ckptool.io.outdir import check_manifest
    assert check_manifest(one) == [] and check_manifest(team) == []  # digests taken while writing hold
    want = _tensor_digests(one)
    assert len([k for k in want if k.endswith(".safetensors")]) >= 2  # really shared out
    assert _tensor_digests(team) == want
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(team)  # index, config and every shard present
