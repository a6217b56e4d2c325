"""End to end through the installed console script: inspect, merge, reshard, fix-vocab; the 2019
seed case (mp2 -> mp1 with vocab padding redone); the real framework-written checkpoints."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REAL_TRUE_VOCAB, ROOT, real_checkpoint
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.io.outdir import check_manifest
from ckptool.options import ReadOptions
from ckptool.verify.reference import forward

CLI = [sys.executable, "-m", "ckptool"]


def run(*args, ok=True):
    p = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def console(*args):
    """The real console script `ckptool` (installed by pip install -e .)."""
    import shutil
    exe = shutil.which("ckptool")
    assert exe, "the ckptool console script is not installed"
    p = subprocess.run([exe, *map(str, args)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p


def test_seed_case_2019_mp2_merge_and_fix_vocab(fixture_dir, tmp_path):
    d = fixture_dir("seed_2019_mp2")
    src = d / "checkpoint"
    p = console("merge", src, tmp_path / "mp1", "--num-attention-heads", 2, "--true-vocab-size", 50257)
    assert "50432" not in p.stdout and "padded to 50304" in p.stdout
    merged = read_megatron(tmp_path / "mp1", ReadOptions(overrides={"num_attention_heads": 2}))
    assert merged.source.dialect == "flat2019" and merged.source.layout.tp == 1
    assert merged.config.padded_vocab_size == 50304
    # written as a release checkpoint so the 2019 loader skips optimizer/rng
    assert (tmp_path / "mp1" / "latest_checkpointed_iteration.txt").read_text() == "release"
    f = torch.load(tmp_path / "mp1" / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert "args" not in f and "checkpoint_version" not in f
    assert f["model"]["word_embeddings.weight"].shape == (50304, 32)
    assert "transformer.layers.0.attention.query_key_value.weight" in f["model"]
    exp = torch.load(d / "expected.pt")
    logits = forward(merged, exp["tokens"])[..., :50257]
    assert (logits - exp["logits"]).abs().max() < 1e-5
    # real rows are the source's rows, bit for bit
    src_ck = read_megatron(src, ReadOptions(overrides={"num_attention_heads": 2}))
    assert src_ck.config.padded_vocab_size == 50432 and src_ck.source.layout.tp == 2  # padded for 2 ranks
    assert torch.equal(src_ck.tensors["embed.word"].load()[:50304], merged.tensors["embed.word"].load())
    # fix-vocab: cut the padding off entirely
    console("fix-vocab", tmp_path / "mp1", tmp_path / "true", "--size", 50257, "--num-attention-heads", 2)
    f = torch.load(tmp_path / "true" / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert f["model"]["word_embeddings.weight"].shape == (50257, 32)
    assert check_manifest(tmp_path / "true") == []


def test_fix_vocab_pads_to_multiple_and_never_cuts_real_rows(fixture_dir, tmp_path):
    d = fixture_dir("gpt2_mcore_tp1pp1")
    p = run("fix-vocab", d / "checkpoint", tmp_path / "o", "--multiple", 64)
    ck = read_megatron(tmp_path / "o")
    assert ck.config.padded_vocab_size == 1024  # 1001 -> next multiple of 64
    p = run("fix-vocab", d / "checkpoint", tmp_path / "o2", "--size", 1000, ok=False)
    assert p.returncode != 0 and "true vocabulary has 1001" in p.stderr
    assert not (tmp_path / "o2").exists()


def test_inspect_text_and_json(fixture_dir):
    d = fixture_dir("llama_mcore_tp2pp2")
    p = console("inspect", d / "checkpoint")
    assert "dialect mcore" in p.stdout and "TP2 PP2" in p.stdout and "rmsnorm" in p.stdout
    doc = json.loads(console("inspect", "--json", d / "checkpoint").stdout)
    assert doc["format"] == "megatron" and doc["layout"] == {"tp": 2, "pp": 2, "vpp": None, "dp": 1, "ep": 1,
                                                             "stage_layers": None}
    c = doc["config"]
    assert (c["num_query_groups"], c["vocab_size"], c["padded_vocab_size"]) == (2, 1000, 1024)
    assert doc["vocab_size_source"] == "args.vocab_size"
    assert {"name": "layers.0.mlp.gate.weight", "shape": [96, 64], "dtype": "float32"} in doc["tensors"]


def test_reshard_and_merge_console(fixture_dir, tmp_path):
    d = fixture_dir("gpt2_mcore_tp2pp2")
    console("reshard", d / "checkpoint", tmp_path / "r", "--tp", 4, "--pp", 1)
    assert sorted(p.name for p in (tmp_path / "r" / "iter_0000010").iterdir()) == [
        "mp_rank_00", "mp_rank_01", "mp_rank_02", "mp_rank_03"]
    console("merge", tmp_path / "r", tmp_path / "m")
    a, b = read_megatron(d / "checkpoint"), read_megatron(tmp_path / "m")
    for n in a.tensors:
        assert torch.equal(a.tensors[n].load(), b.tensors[n].load()), n
    assert check_manifest(tmp_path / "m") == []
    p = run("reshard", d / "checkpoint", tmp_path / "m", "--tp", 2, ok=False)
    assert p.returncode == 2 and "already exists" in p.stderr and "--force" in p.stderr
    run("reshard", d / "checkpoint", tmp_path / "m", "--tp", 2, "--force")


def test_help_explains_every_command():
    for cmd in ["inspect", "merge", "reshard", "fix-vocab"]:
        p = console(cmd, "--help")
        assert "Usage:" in p.stdout and len(p.stdout.splitlines()) > 8


@pytest.mark.parametrize("case", ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"])
def test_real_checkpoints_match_framework_logits(case, tmp_path):
    base = real_checkpoint(case)
    ref = torch.load(base / "reference_logits.pt")
    ck = read_megatron(base / "checkpoint")
    assert ck.config.vocab_size == REAL_TRUE_VOCAB[case] and ck.config.padded_vocab_size == 1024
    want = ref["logits_fp32"]
    rel = lambda got: ((got - want).abs().max() / want.abs().max()).item()
    assert rel(forward(ck, ref["tokens"])) < 1e-4
    for layout in [("--tp", 1, "--pp", 1), ("--tp", 4, "--pp", 1), ("--tp", 1, "--pp", 4)]:
        out = tmp_path / ("o" + "".join(map(str, layout)))
        run("reshard", base / "checkpoint", out, *layout)
        got = forward(read_megatron(out), ref["tokens"])
        assert rel(got) < 1e-4, layout
