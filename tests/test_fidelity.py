"""Issue 9: the Megatron arguments that change the maths, checked against megatron-core itself.

tests/mcore_flags_helper.py builds one tiny megatron-core GPTModel per argument (the real
`megatron-core` package, CPU) and saves it as Megatron-LM does in torch format, with the args its
parser would give. For each one: ckptool reads the flag from the args, its reference forward and
`verify --reference-logits` reproduce the logits megatron-core computed, and to-hf either gives a
transformers model with those logits or refuses with a message naming the flag. A control (the
same checkpoint read with the flag switched off) shows each flag really moves the logits.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import once, shared_followups
from click.testing import CliRunner

from ckptool.cli import main
from ckptool.formats.registry import open_checkpoint
from ckptool.verify.reference import forward
from ckptool.write_options import WriteOptions

REPO = Path(__file__).resolve().parents[1]
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
VOCAB = 100

# variant -> (config field it sets, value read, the value that switches it off, to-hf: None = exports
#             with the same logits, else the flag the refusal must name)
FLAGS = {
    "gelu_exact": ("activation", "gelu", "gelu_tanh", None),
    "bias_gelu_fusion": ("activation", "gelu_tanh", "gelu", None),
    "openai_gelu": ("activation", "gelu_tanh", "gelu", None),
    "squared_relu": ("activation", "squared_relu", "gelu", None),
    "layernorm_eps": ("norm_eps", 0.5, 1e-5, None),
    "layernorm_1p": ("apply_layernorm_1p", True, False, None),
    "qk_layernorm": ("qk_layernorm", True, False, None),  # RMSNorm per head: exports as Qwen3ForCausalLM
    "add_qkv_bias": ("add_qkv_bias", True, False, None),
    "rotary_base": ("rotary_base", 37.0, 10000.0, None),
    "rotary_percent": ("rotary_percent", 0.5, 1.0, "--rotary-percent"),
    "rotary_interleaved": ("rotary_interleaved", True, False, None),
    "rope_scaling": ("rope_scaling_factor", 8.0, None, None),
    # megatron-core's TransformerLayer never reads this flag (only legacy layers do): the run
    # computed the plain pre-norm residual, and ckptool must read it so
    "post_ln_residual": ("post_layernorm_residual", False, True, None),
}


# several flags in one model, for the tensor-parallel verify: variant -> flags it sets
COMBOS = {"combo_llama": ("qk_layernorm", "add_qkv_bias", "rotary_interleaved", "rotary_percent", "rotary_base"),
          "combo_gpt2": ("squared_relu", "layernorm_eps")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """megatron-core's models with each flag (tests/mcore_flags_helper.py), built once (tp2_verifies' steps too)."""
    return once(_build_flags, lambda: tmp_path_factory.mktemp("mcore_flags"))


def _build_flags(root: Path) -> Path:
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    # port 0: the one process binds its store on a port the kernel picks (no port chosen beforehand to lose)
    r = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_flags_helper.py"), f"{root}:0", *FLAGS,
                        *COMBOS],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return root


@pytest.fixture
def real_mds_case():
    from conftest import real_checkpoint
    return real_checkpoint("mds_gpt2_pipe_tp2pp2_bf16_zero1")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("variant", list(FLAGS))
def test_flag_read_and_computed_like_megatron_core(built, variant):
    field, value, off, _ = FLAGS[variant]
    ckpt = open_checkpoint(built / variant / "checkpoint")
    assert getattr(ckpt.config, field) == value
    ref = torch.load(built / variant / "logits.pt")
    want = ref["logits"]
    assert (forward(ckpt, ref["tokens"]) - want).abs().max().item() <= 1e-5
    # the flag matters: read with it switched the other way, the logits move
    tensors = ckpt.tensors
    if variant == "add_qkv_bias":  # the forward adds whatever biases are present: drop them
        tensors = {k: v for k, v in tensors.items() if not (".attn." in k and k.endswith(".bias"))}
        assert len(tensors) == len(ckpt.tensors) - 6
    other = ckpt.with_tensors(tensors, **{field: off})
    assert (forward(other, ref["tokens"]) - want).abs().max().item() > 1e-4
    if variant == "post_ln_residual":
        assert any("apply_residual_connection_post_layernorm" in w for w in ckpt.warnings)


@pytest.mark.parametrize("variant", list(FLAGS))
def test_flag_through_verify(built, variant):
    r = cli("verify", built / variant / "checkpoint", "--reference-logits", f"{built / variant / 'logits.pt'}:logits")
    assert r.exit_code == 0 and "result=PASS" in r.output, r.output


@pytest.mark.parametrize("variant", list(FLAGS))
def test_flag_through_to_hf(built, variant, tmp_path):
    refusal = FLAGS[variant][3]
    out = tmp_path / "hf"
    r = cli("to-hf", built / variant / "checkpoint", out)
    if refusal:
        assert r.exit_code == 2 and refusal in r.output and not out.exists(), r.output
        return
    assert r.exit_code == 0, r.output
    from transformers import AutoModelForCausalLM
    ref = torch.load(built / variant / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(ref["tokens"]).logits.float()
    assert got.shape[-1] == VOCAB
    assert (got - ref["logits"][..., :VOCAB]).abs().max().item() <= 1e-5
    if variant in ("bias_gelu_fusion", "openai_gelu"):
        assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu_new"


# --- vocabulary: the most reliable source, named by inspect ---------------------------------------

def inspect_json(*args):
    r = cli("inspect", "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_real_mds_true_vocab_is_one_more_than_args(real_mds_case):
    """The real Megatron-DeepSpeed run stores args.vocab_size 1000 (NullTokenizer adds an EOD row):
    the true 1001 comes from universal_checkpoint_info, and --true-vocab-size overrides it."""
    rank0 = real_mds_case / "checkpoint" / "global_step3" / "mp_rank_00_model_states.pt"
    stored = torch.load(rank0, weights_only=False)  # a real checkpoint from the shared set: trusted
    assert stored["args"].vocab_size == 1000  # the trap: trimming to it would drop token 1000
    assert stored["universal_checkpoint_info"]["original_vocab_size"] == 1001
    doc = inspect_json(real_mds_case / "checkpoint", "--weights", "model")
    assert (doc["config"]["vocab_size"], doc["vocab_size_source"]) == \
        (1001, "universal_checkpoint_info.original_vocab_size")
    doc = inspect_json(real_mds_case / "checkpoint", "--weights", "model", "--true-vocab-size", 1010)
    assert (doc["config"]["vocab_size"], doc["vocab_size_source"]) == (1010, "--true-vocab-size")


def test_gpt2_bpe_tokenizer_implies_the_vocab():
    """Megatron-LM args of a GPT-2 BPE run (vocab_size unset: the tokenizer decides it)."""
    import argparse
    from ckptool.formats.megatron.args import config_from_args
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, tokenizer_type="GPT2BPETokenizer",
                              vocab_file="gpt2-vocab.json", merge_file="gpt2-merges.txt", vocab_size=None,
                              padded_vocab_size=50304, make_vocab_size_divisible_by=128)
    cfg = config_from_args(args, 50304)
    assert (cfg.vocab_size, cfg.vocab_size_source) == (50257, "tokenizer_type GPT2BPETokenizer")
    # universal_checkpoint_info outranks the tokenizer; a tokenizer larger than the rows is not believed
    cfg = config_from_args(args, 50304, {"universal_checkpoint_info": {"original_vocab_size": 50260}})
    assert (cfg.vocab_size, cfg.vocab_size_source) == (50260, "universal_checkpoint_info.original_vocab_size")
    cfg = config_from_args(args, 1024)
    assert (cfg.vocab_size, cfg.vocab_size_source) == (None, "unknown")


def test_2019_files_state_no_vocab(fixture_dir, tmp_path):
    src = fixture_dir("gpt2_flat2019_tp1") / "checkpoint"
    doc = inspect_json(src, "--num-attention-heads", 4)
    assert doc["config"]["vocab_size"] is None and doc["vocab_size_source"] == "unknown"
    rows = doc["config"]["padded_vocab_size"]
    doc = inspect_json(src, "--num-attention-heads", 4, "--true-vocab-size", 1001)
    assert (doc["config"]["vocab_size"], doc["vocab_size_source"]) == (1001, "--true-vocab-size")
    r = cli("inspect", src, "--num-attention-heads", 4, "--true-vocab-size", 1001)
    assert "--true-vocab-size" in r.output
    # never below a real row: cutting under the given true size is refused, output absent
    r = cli("fix-vocab", src, tmp_path / "o", "--size", 1000, "--num-attention-heads", 4, "--true-vocab-size", 1001)
    assert r.exit_code == 2 and "1001" in r.output and not (tmp_path / "o").exists()
    assert rows >= 1001


# --- the 2019 dialect ----------------------------------------------------------------------------

def test_2019_to_hf_is_gelu_new_with_the_ground_truth_logits(fixture_dir, tmp_path):
    """scripts/make_fixtures.py builds the 2019 files from a transformers GPT-2 with gelu_new."""
    d = fixture_dir("gpt2_flat2019_tp2")
    case = json.loads((d / "case.json").read_text())
    r = cli("to-hf", d / "checkpoint", tmp_path / "hf", "--num-attention-heads", case["num_attention_heads"],
            "--true-vocab-size", case["vocab_size"])
    assert r.exit_code == 0, r.output
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["activation_function"] == "gelu_new" and conf["vocab_size"] == case["vocab_size"]
    from transformers import AutoModelForCausalLM
    exp = torch.load(d / "expected.pt")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(exp["tokens"]).logits
    assert (got - exp["logits"]).abs().max().item() <= 1e-5


# --- torch-format file variants ------------------------------------------------------------------

def _expected_logits_match(d: Path, ckpt_dir: Path):
    exp = torch.load(d / "expected.pt")
    ckpt = open_checkpoint(ckpt_dir)
    v = exp["logits"].shape[-1]
    assert (forward(ckpt, exp["tokens"])[..., :v] - exp["logits"]).abs().max().item() <= 1e-5
    return ckpt


def test_model_rng_files_of_the_distributed_optimizer_era(fixture_dir, tmp_path):
    """2022-03..2023-05 with --use-distributed-optimizer (megatron.md 1.1): mp_rank_XX_YYY/model_rng.pt
    (no optimizer) plus one mp_rank_XX_YYY_DDD/optim.pt per data-parallel rank (here DP 2)."""
    import shutil
    d = fixture_dir("gpt2_legacy_v3_tp2pp2")
    ck = tmp_path / "ck"
    shutil.copytree(d / "checkpoint", ck)
    rank_dirs = sorted(ck.glob("iter_*/mp_rank_*"))
    assert len(rank_dirs) == 4
    for rd in rank_dirs:
        obj = torch.load(rd / "model_optim_rng.pt", weights_only=False)  # a fixture we built: trusted
        optim = {k: obj.pop(k) for k in ("optimizer", "opt_param_scheduler") if k in obj}
        (rd / "model_optim_rng.pt").unlink()
        torch.save(obj, rd / "model_rng.pt")
        for dp in range(2):
            od = rd.parent / f"{rd.name}_{dp:03d}"
            od.mkdir()
            torch.save(optim, od / "optim.pt")
    ckpt = _expected_logits_match(d, ck)
    assert (ckpt.source.layout.tp, ckpt.source.layout.pp) == (2, 2)


def test_pre_torch_1_6_files_read_without_mmap(fixture_dir, tmp_path, monkeypatch):
    """Files saved before torch 1.6 are not zip archives (torch's legacy tar-less format)."""
    import shutil
    import ckptool.io.torchfile as torchfile
    d = fixture_dir("gpt2_legacy_v0_tp2pp1")
    ck = tmp_path / "ck"
    shutil.copytree(d / "checkpoint", ck)
    for f in ck.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)
        torch.save(obj, f, _use_new_zipfile_serialization=False)
        assert f.read_bytes()[:2] != b"PK"
    real_load, seen = torch.load, []

    def spy(*a, **k):
        seen.append(k.get("mmap"))
        return real_load(*a, **k)
    monkeypatch.setattr(torchfile.torch, "load", spy)
    _expected_logits_match(d, ck)
    assert seen and not any(seen)  # torch.load ran, never with mmap (legacy files cannot be mapped)


def test_te_extra_state_with_fp8_metadata_is_skipped(fixture_dir, tmp_path):
    """TE layers with FP8 on store a non-empty uint8 _extra_state buffer (megatron.md 2.3)."""
    import shutil
    d = fixture_dir("gpt2_mcore_te_tp1pp1")
    ck = tmp_path / "ck"
    shutil.copytree(d / "checkpoint", ck)
    f = next(ck.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    obj = torch.load(f, weights_only=False)
    extra = [k for k in obj["model"] if k.endswith("_extra_state") and isinstance(obj["model"][k], torch.Tensor)]
    assert extra and any("linear_qkv.layer_norm_weight" in k for k in obj["model"])
    for k in extra:
        obj["model"][k] = torch.arange(37, dtype=torch.uint8)
    torch.save(obj, f)
    _expected_logits_match(d, ck)


# --- verify --reference-logits FILE[:KEY] --------------------------------------------------------

def test_reference_logits_from_safetensors_default_key(built, tmp_path):
    from safetensors.torch import save_file
    ref = torch.load(built / "rotary_interleaved" / "logits.pt")
    f = tmp_path / "ref.safetensors"
    save_file({"tokens": ref["tokens"], "logits": ref["logits"].contiguous()}, str(f))
    ck = built / "rotary_interleaved" / "checkpoint"
    r = cli("verify", ck, "--reference-logits", f)
    assert r.exit_code == 0 and "result=PASS" in r.output, r.output
    save_file({"tokens": ref["tokens"], "logits": (ref["logits"] * 1.01).contiguous()}, str(f))
    r = cli("verify", ck, "--reference-logits", f)
    assert r.exit_code == 1 and "result=FAIL" in r.output, r.output
    r = cli("verify", ck, "--reference-logits", f"{f}:nokey")
    assert r.exit_code == 2 and "nokey" in r.output


# --- inspect --json: the documented schema (docs/inspect-json.md) --------------------------------

SCHEMA_TOP = {"schema_version", "path", "format", "dialect", "iteration", "release", "checkpoint_version", "layout",
              "config", "vocab_size_source", "total_bytes", "tensors", "warnings"}
SCHEMA_CONFIG = {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
                 "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings",
                 "normalization", "norm_eps", "activation", "position_embedding", "rotary_base", "rotary_percent",
                 "rotary_interleaved", "tied_embeddings", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                 "apply_layernorm_1p", "moe",
                 # issue 32's maths under their own keys (describe.MATHS_FIELDS), in every document
                 "attn_sinks", "sliding_window", "local_layers", "attn_softcap", "final_softcap", "glu_clamp",
                 "glu_linear_offset"}


def test_inspect_json_schema_is_the_documented_one(fixture_dir, built):
    doc_md = (REPO / "docs" / "inspect-json.md").read_text()
    for field in SCHEMA_TOP | SCHEMA_CONFIG | {"tp", "pp", "vpp", "dp"}:
        assert f"`{field}`" in doc_md, field
    for src in (fixture_dir("llama_mcore_tp2pp2") / "checkpoint", built / "qk_layernorm" / "checkpoint"):
        doc = inspect_json(src)
        assert SCHEMA_TOP <= set(doc) and doc["schema_version"] == 1
        assert SCHEMA_CONFIG <= set(doc["config"])
        assert {"tp", "pp", "vpp", "dp"} <= set(doc["layout"])
        assert all(set(t) == {"name", "shape", "dtype"} for t in doc["tensors"])
        assert doc["total_bytes"] > 0 and doc["format"] == "megatron"


def test_post_layernorm_residual_written_only_where_megatron_honours_it(built, tmp_path):
    """Legacy layers honour --apply-residual-connection-post-layernorm; megatron-core layers ignore
    it, so a model that uses it is refused for mcore and torch_dist and kept for legacy."""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from ckptool.errors import CkptError
    src = open_checkpoint(built / "post_ln_residual" / "checkpoint")
    post = src.with_tensors(src.tensors, post_layernorm_residual=True)
    for fmt, dialect in (("torch", "mcore"), ("torch_dist", None)):
        with pytest.raises(CkptError, match="apply-residual-connection-post-layernorm"):
            kw = {"dialect": dialect} if dialect else {}
            write_layout(post, tmp_path / fmt, Layout(tp=1), WriteOptions(format=fmt, **kw), warn=lambda m: None)
        assert not (tmp_path / fmt).exists()
    write_layout(post, tmp_path / "legacy", Layout(tp=2),
                 WriteOptions(format="torch", dialect="legacy"), warn=lambda m: None)
    back = open_checkpoint(tmp_path / "legacy")
    assert back.source.dialect == "legacy" and back.config.post_layernorm_residual
    tokens = torch.load(built / "post_ln_residual" / "logits.pt")["tokens"]
    assert torch.allclose(forward(back, tokens)[..., :VOCAB], forward(post, tokens)[..., :VOCAB], atol=1e-5)


@shared_followups
def tp2_verifies(framework_runs, d):
    """Each COMBOS model resharded to TP 2 by ckptool (d/VARIANT) and verified under torchrun against the logits
    megatron-core computed at TP 1, in the session's shared launch of 2-process checks: {variant: (output, rc)}."""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from test_verify import VERIFY_BATCH, verify_jobs, verify_results
    built = once(_build_flags, lambda: d / "built")
    cases = {}
    for variant in COMBOS:
        write_layout(open_checkpoint(built / variant / "checkpoint"), d / variant, Layout(tp=2), warn=lambda m: None)
        cases[variant] = [d / variant, "--reference-logits", f"{built / variant / 'logits.pt'}:logits"]
    yield [(VERIFY_BATCH, 2, verify_jobs(cases, d / "runs"))]
    return verify_results(cases, d / "runs")


@pytest.mark.parametrize("variant", list(COMBOS))
def test_flags_through_tensor_parallel_verify(built, tp2_verifies, variant):
    """verify under torchrun runs each TP rank on its own shards (verify/parallel.py): the flags must
    hold there too. The megatron-core model is resharded to TP 2 by ckptool, then verified against
    the logits megatron-core computed at TP 1 (tp2_verifies)."""
    src = open_checkpoint(built / variant / "checkpoint")
    for flag in COMBOS[variant]:
        field, value, _, _ = FLAGS[flag]
        assert getattr(src.config, field) == value, flag
    out, rc = tp2_verifies[variant]
    assert rc == 0 and "result=PASS" in out and "2 processes" in out, out
