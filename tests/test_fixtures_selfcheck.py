"""Quick checks of the independent fixture generator (scripts/make_fixtures.py).

Builds a few representative fixtures into tmp_path and runs the generator's own self-check, which
re-merges the shards by hand and compares them with the ground-truth transformers weights and logits.
"""
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "scripts" / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mf = _load_generator()

REPRESENTATIVE = [
    "gpt2_flat2019_tp2",           # 2019 flat keys, stride-3 QKV, no args
    "gpt2_legacy_v1_tp2pp1",       # checkpoint_version 1.0 per-rank [np_l, hn, 3]
    "gpt2_legacy_v3_tp2pp2_vpp2",  # nested encoder dict, PP + virtual pipeline, word_embeddings_for_head
    "llama_mcore_tp4pp1",          # GQA with TP > query groups, SwiGLU, untied output
    "llama_mcore_te_tp2pp2",       # TE names, uint8 _extra_state
]


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_build_and_self_check(tmp_path, name):
    root = mf.build_fixture(name, tmp_path)
    assert (root / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert (root / "hf" / "model.safetensors").is_file()
    result = mf.self_check(name, tmp_path)
    assert result["max_abs_logit_err"] < 1e-5


def test_generator_needs_no_megatron(tmp_path):
    """The fixtures are independent of Megatron: building and checking one in a fresh interpreter
    imports no megatron module (other tests in this process may import megatron-core)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('mf', {str(ROOT / 'scripts' / 'make_fixtures.py')!r})\n"
        "mf = importlib.util.module_from_spec(spec); spec.loader.exec_module(mf)\n"
        f"mf.build_fixture('llama_mcore_te_tp2pp2', {str(tmp_path)!r})\n"
        f"mf.self_check('llama_mcore_te_tp2pp2', {str(tmp_path)!r})\n"
        "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_deterministic(tmp_path):
    name = "gpt2_mcore_tp1pp2"

    def digest(base):
        root = mf.build_fixture(name, base)
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    assert digest(tmp_path / "a") == digest(tmp_path / "b")


@pytest.mark.parametrize("name", ["gpt2_mcore_tp2pp2", "llama_legacy_norm_tp2pp1"])
def test_embedded_fixtures(name):
    assert (ROOT / "fixtures" / name / "case.json").is_file()
    mf.self_check(name, ROOT / "fixtures")


def test_fixture_table_covers_required_cases():
    names = set(mf.FIXTURES)
    for d in mf.DIALECTS:
        assert mf._name("gpt2", d, 1, 1) in names
    for d in mf.LLAMA_DIALECTS:
        assert mf._name("llama", d, 1, 1) in names
    for d in ("mcore", "legacy_v3"):
        for tp, pp in ((2, 1), (1, 2), (2, 2), (4, 1)):
            assert mf._name("gpt2", d, tp, pp) in names
        assert mf._name("gpt2", d, 2, 2, 2) in names
    for d in ("mcore", "legacy_norm"):
        for tp, pp in ((2, 2), (4, 1)):
            assert mf._name("llama", d, tp, pp) in names
    assert "gpt2_flat2019_tp2" in names
    seed = mf.FIXTURES["seed_2019_mp2"]
    assert mf.padded_vocab(seed["vocab_size"], seed["tp"]) == 50432
