"""`ckptool verify`: the tensor/pipeline-parallel forward under real torchrun (gloo, CPU).

Tiny transformers models (GPT-2, Llama with GQA) are mapped by hand onto canonical names, written
as Megatron mcore checkpoints with ckptool's writer at each layout, and verified against
transformers' own forward. Planted errors are written into the rank files and must be caught and
located. The real framework-written checkpoints are checked against the logits Megatron computed.
Virtual-pipeline checkpoints come from scripts/make_fixtures.py (independent of ckptool's writer);
torch_dist targets are written by `ckptool reshard --format torch_dist` and checked against the
torch-format original.

Start-up of N interpreters under torchrun dominates the cost of a check, so the checks of one
process count share one launch (tests/verify_batch.py runs each as the real `ckptool verify`
command; through conftest.shared_followups and verify_jobs with the other files' checks); a few checks
still launch `torchrun -m ckptool verify` on their own to cover the entry point itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REAL_TRUE_VOCAB, once, run_torchrun, shared_followups
from ckptool.config import GPTConfig, Layout
from ckptool.formats.megatron.checkpoint import write_megatron
from ckptool.lazy import Const
from ckptool.state import Checkpoint, SourceInfo
from ckptool.write_options import WriteOptions

ROOT = Path(__file__).resolve().parents[1]
REAL_CASES = ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"]
VPP_FIXTURES = ["gpt2_legacy_v3_tp2pp2_vpp2", "llama_mcore_tp2pp2_vpp2"]
VOCAB = 100
LAYERS = 4


# --- tiny models, mapped onto canonical names by hand -------------------------------------------

def gpt2_model(tmp: Path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4,
                                    resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()
    hf.save_pretrained(tmp / "hf_gpt2")
    sd = hf.state_dict()
    t = {"embed.word": sd["transformer.wte.weight"], "embed.pos": sd["transformer.wpe.weight"],
         "final_norm.weight": sd["transformer.ln_f.weight"], "final_norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(LAYERS):
        h, p = f"transformer.h.{i}.", f"layers.{i}."
        qkv_w, qkv_b = sd[h + "attn.c_attn.weight"].t(), sd[h + "attn.c_attn.bias"]  # Conv1D is [in, out]
        for j, x in enumerate("qkv"):
            t[f"{p}attn.{x}.weight"] = qkv_w.chunk(3)[j]
            t[f"{p}attn.{x}.bias"] = qkv_b.chunk(3)[j]
        t.update({p + "attn_norm.weight": sd[h + "ln_1.weight"], p + "attn_norm.bias": sd[h + "ln_1.bias"],
                  p + "attn.out.weight": sd[h + "attn.c_proj.weight"].t(), p + "attn.out.bias": sd[h + "attn.c_proj.bias"],
                  p + "mlp_norm.weight": sd[h + "ln_2.weight"], p + "mlp_norm.bias": sd[h + "ln_2.bias"],
                  p + "mlp.up.weight": sd[h + "mlp.c_fc.weight"].t(), p + "mlp.up.bias": sd[h + "mlp.c_fc.bias"],
                  p + "mlp.down.weight": sd[h + "mlp.c_proj.weight"].t(), p + "mlp.down.bias": sd[h + "mlp.c_proj.bias"]})
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
                    padded_vocab_size=VOCAB, vocab_size=VOCAB, max_position_embeddings=32,
                    make_vocab_size_divisible_by=8, activation="gelu_tanh", norm_eps=1e-5)
    return _ckpt(cfg, t), tmp / "hf_gpt2"


def llama_model(tmp: Path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=32, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp / "hf_llama")
    sd = hf.state_dict()
    t = {"embed.word": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    names = {"attn_norm.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
             "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
             "attn.out.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.down.weight": "mlp.down_proj.weight"}
    for i in range(LAYERS):
        t.update({f"layers.{i}.{c}": sd[f"model.layers.{i}.{h}"] for c, h in names.items()})
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                    ffn_hidden_size=96, padded_vocab_size=VOCAB, vocab_size=VOCAB, max_position_embeddings=32,
                    make_vocab_size_divisible_by=8, position_embedding="rope",
                    rotary_base=hf.config.rope_parameters["rope_theta"] if hasattr(hf.config, "rope_parameters")
                    else hf.config.rope_theta,
                    normalization="rmsnorm", norm_eps=1e-5, activation="swiglu", add_bias_linear=False,
                    add_qkv_bias=False, tied_embeddings=False)
    return _ckpt(cfg, t), tmp / "hf_llama"


def _ckpt(cfg, tensors):
    return Checkpoint(cfg, {k: Const(v.detach().clone().contiguous()) for k, v in tensors.items()},
                      SourceInfo(path="test", format="test"))


def _models(tmp: Path) -> dict:
    return {"gpt2": gpt2_model(tmp), "llama": llama_model(tmp), "tmp": tmp}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny models, and the folder the checkpoints written from them go into (built once: batch2's steps too)."""
    return once(_models, lambda: tmp_path_factory.mktemp("verify"))


def megatron(models, kind: str, tp: int, pp: int) -> Path:
    out = models["tmp"] / f"{kind}_tp{tp}pp{pp}"
    if not out.exists():
        write_megatron(models[kind][0], out, Layout(tp=tp, pp=pp), WriteOptions(dialect="mcore"), warn=lambda m: None)
    return out


def fresh_copy(models, kind, tp, pp, name) -> Path:
    dst = models["tmp"] / name
    shutil.copytree(megatron(models, kind, tp, pp), dst)
    return dst


def torch_dist(models, kind: str, tp: int, pp: int) -> Path:
    """`ckptool reshard --format torch_dist` of the torch-format checkpoint (args say TP tp, PP pp)."""
    out = models["tmp"] / f"{kind}_dist_tp{tp}pp{pp}"
    if not out.exists():
        src = megatron(models, kind, 1, 1)
        r = subprocess.run([sys.executable, "-m", "ckptool", "reshard", str(src), str(out), "--format", "torch_dist",
                            "--tp", str(tp), "--pp", str(pp)], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    return out


def verify(nproc, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return run_torchrun(nproc, "-m", "ckptool", "verify", *args, env=env, cwd=ROOT, timeout=120)


VERIFY_BATCH = ROOT / "tests" / "verify_batch.py"


def verify_jobs(cases: dict, tmp: Path) -> list:
    """tests/verify_batch.py's jobs for {name: verify arguments}: each writes tmp/NAME.txt (verify_results reads
    them). A steps function (conftest.shared_followups) yields [(VERIFY_BATCH, nproc, verify_jobs(...))]: the
    checks of every test file at one process count then share one launch."""
    tmp.mkdir(parents=True, exist_ok=True)
    jobs = []
    for name, args in cases.items():
        words = [str(tmp / f"{name}.txt"), *(str(a) for a in args)]
        assert all(w.split() == [w] for w in words), words  # a job's words are split on spaces
        jobs.append(" ".join(words))
    return jobs


def verify_results(cases: dict, tmp: Path) -> dict:
    """{name: (output, exit status)} of the checks verify_jobs(cases, tmp) ran."""
    out = {}
    for name in cases:
        text = (tmp / f"{name}.txt").read_text()
        body, rc = text.rsplit("rc=", 1)
        out[name] = (body, int(rc))
    return out


def verify_batch(nproc: int, cases: dict, tmp: Path) -> dict:
    """{name: (output, exit status)} of several verify commands run in one torchrun launch of their own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = run_torchrun(nproc, VERIFY_BATCH, *verify_jobs(cases, tmp), env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return verify_results(cases, tmp)


def verify_here(*args, env=None):
    """`ckptool verify ARGS` in this process (no torchrun: nothing to start up). .returncode,
    .stdout and .stderr like subprocess.run's; .output is both."""
    from click.testing import CliRunner
    from ckptool.cli import main
    env = {"WORLD_SIZE": None, "RANK": None, **(env or {})}  # never mistake pytest for torchrun
    r = CliRunner().invoke(main, ["verify", *map(str, args)], env=env)
    r.returncode = r.exit_code
    return r


def metric(out: str, key: str) -> float:
    return float(next(l for l in out.splitlines() if l.startswith(key + "=")).split("=", 1)[1])


# --- planted errors: rank files edited after writing --------------------------------------------

def _edit(path: Path, fn):
    obj = torch.load(path, weights_only=False)
    fn(obj["model"])
    torch.save(obj, path)


def _rank_file(ckpt: Path, tp: int, pp: int) -> Path:
    return next(ckpt.glob(f"*/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt"))


def plant_gate_up_swapped(models) -> Path:
    ckpt = fresh_copy(models, "llama", 2, 2, "plant_gate_up")
    key = "decoder.layers.1.mlp.linear_fc1.weight"  # global layer 1 on stage 0

    def swap(m):
        gate, up = m[key].chunk(2)
        m[key] = torch.cat([up, gate]).clone()
    for t in range(2):
        _edit(_rank_file(ckpt, t, 0), swap)
    return ckpt


def plant_qkv_order(models) -> Path:
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_qkv")
    p = "decoder.layers.0.self_attention.linear_qkv."  # global layer 2 (stage 1, local 0)

    def k_v_swapped(m):  # per query group [q..., k, v] -> [q..., v, k]
        for kind in ("weight", "bias"):
            g = m[p + kind].reshape(2, 3, 8, -1)  # 2 local groups (4 heads / TP2), 1 q + k + v, head 8
            m[p + kind] = g[:, [0, 2, 1]].reshape(m[p + kind].shape).clone()
    for t in range(2):
        _edit(_rank_file(ckpt, t, 1), k_v_swapped)
    return ckpt


def plant_tp_files_swapped(models) -> Path:
    # Swapping whole rank files permutes heads and MLP columns consistently, which cancels; what
    # breaks is the vocab-parallel embedding, whose row blocks now map tokens to the wrong rows.
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_swap_files")
    a, b = _rank_file(ckpt, 0, 0), _rank_file(ckpt, 1, 0)
    tmp = a.with_name("tmp.pt")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    return ckpt


def plant_layer_from_another_layer(models) -> Path:
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_layer_copy")

    def copy_layer0_into_1(m):
        for k in [k for k in m if k.startswith("decoder.layers.0.") and isinstance(m[k], torch.Tensor)]:
            m[k.replace("layers.0.", "layers.1.")] = m[k].clone()
    for t in range(2):
        _edit(_rank_file(ckpt, t, 0), copy_layer0_into_1)
    return ckpt


def plant_vocab_padding_off_by_one(models) -> Path:
    # The vocabulary padded with one row too many at the front: every token id reads its neighbour.
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_vocab")
    key = "embedding.word_embeddings.weight"
    files = [_rank_file(ckpt, t, 0) for t in range(2)]
    objs = [torch.load(f, weights_only=False) for f in files]
    full = torch.cat([o["model"][key] for o in objs])
    shifted = torch.roll(full, 1, dims=0).chunk(2)
    for f, o, part in zip(files, objs, shifted):
        o["model"][key] = part.clone()
        torch.save(o, f)
    return ckpt


def plant_drifted_replica(models) -> Path:
    # TP rank 1's copy of layer 2's attention norm drifted (global layer 2 = stage 1, local 0).
    ckpt = fresh_copy(models, "gpt2", 2, 2, "drift")

    def drift(m):
        m["decoder.layers.0.input_layernorm.weight"] += 0.5
    _edit(_rank_file(ckpt, 1, 1), drift)
    return ckpt


def gpt2_vpp(models) -> Path:
    """GPT-2 at TP1 PP2 VPP2 written by ckptool: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3."""
    out = models["tmp"] / "gpt2_tp1pp2vpp2"
    if not out.exists():
        write_megatron(models["gpt2"][0], out, Layout(tp=1, pp=2, vpp=2),
                       WriteOptions(dialect="mcore"), warn=lambda m: None)
    return out


def plant_vpp_chunks_swapped(models) -> Path:
    # Stage 1's file holds model0 (layer 1) and model1 (layer 3) swapped.
    ckpt = models["tmp"] / "plant_vpp_chunks"
    shutil.copytree(gpt2_vpp(models), ckpt)
    f = _rank_file(ckpt, 0, 1)
    obj = torch.load(f, weights_only=False)
    obj["model0"], obj["model1"] = obj["model1"], obj["model0"]
    torch.save(obj, f)
    return ckpt


# planted error -> (builder, reference kind, where the first divergence must be reported)
PLANTED = {
    "gate_up_swapped": (plant_gate_up_swapped, "hf_llama", "layer 1"),
    "qkv_order": (plant_qkv_order, "gpt2_tp1pp1", "layer 2"),
    "tp_files_swapped": (plant_tp_files_swapped, "hf_gpt2", "embedding"),
    "layer_from_another_layer": (plant_layer_from_another_layer, "hf_gpt2", "layer 1"),
    "vocab_padding_off_by_one": (plant_vocab_padding_off_by_one, "hf_gpt2", "embedding"),
    "drifted_replica": (plant_drifted_replica, "hf_gpt2", "layer 2"),
}


# --- tiny tokenizer, built here (no hub) -----------------------------------------------------------

def tiny_tokenizer(tmp: Path) -> Path:
    """A word-level tokenizer whose word `wN` is token id N (N < VOCAB - 1), saved as transformers does."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<unk>"] = VOCAB - 1
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    out = tmp / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
    return out


TOKEN_TEXT = "w5 w17 w3 w98 w42 w0 w7\nw61 w2 w2 w33 w80 w11 w9 w4\n"
TOKEN_IDS = [[5, 17, 3, 98, 42, 0, 7], [61, 2, 2, 33, 80, 11, 9]]  # rows cut to the shortest line


# --- the batched checks ---------------------------------------------------------------------------

LAYOUTS = {1: [("gpt2", 1, 1), ("llama", 1, 1)],
           2: [("gpt2", 2, 1), ("gpt2", 1, 2), ("llama", 2, 1), ("llama", 1, 2)],
           4: [("gpt2", 2, 2), ("llama", 2, 2), ("llama", 4, 1)]}  # llama TP4 > 2 groups: all-gather path


def _layout_cases(models, nproc):
    return {f"{kind}_{tp}_{pp}": [megatron(models, kind, tp, pp), "--reference", models[kind][1], "--seq-len", 12]
            for kind, tp, pp in LAYOUTS[nproc]}


@pytest.fixture(scope="module")
def batch1(models):
    return verify_batch(1, _layout_cases(models, 1), models["tmp"] / "batch1")


@shared_followups
def batch2(framework_runs, d):
    """The 2-process checks, in the session's shared launch of 2-process checks."""
    models = once(_models, lambda: d / "verify")
    cases = _layout_cases(models, 2)
    # torch_dist: args say TP2 PP1 (the default layout), or --pp 2 runs it at TP1 PP2; tied GPT-2 too
    cases["dist_llama_2_1"] = [torch_dist(models, "llama", 2, 1), "--reference", megatron(models, "llama", 1, 1)]
    cases["dist_llama_1_2"] = [torch_dist(models, "llama", 2, 1), "--pp", 2,
                               "--reference", megatron(models, "llama", 1, 1)]
    cases["dist_gpt2_1_2"] = [torch_dist(models, "gpt2", 1, 1), "--tp", 1, "--pp", 2,
                              "--reference", megatron(models, "gpt2", 1, 1)]
    cases["dist_gpt2_1_2_vpp2"] = [torch_dist(models, "gpt2", 1, 1), "--pp", 2, "--vpp", 2,
                                   "--reference", megatron(models, "gpt2", 1, 1)]
    # 16-bit compute: the hidden state crosses stages in that dtype, logits gathered in fp32
    cases["bf16_gpt2_1_2"] = [megatron(models, "gpt2", 1, 2), "--reference", models["gpt2"][1], "--dtype", "bf16"]
    cases["fp16_llama_2_1"] = [megatron(models, "llama", 2, 1), "--reference", models["llama"][1], "--dtype", "fp16"]
    cases["vpp_gpt2_1_2"] = [gpt2_vpp(models), "--reference", models["gpt2"][1]]
    cases["vpp_chunks_swapped"] = [plant_vpp_chunks_swapped(models), "--reference", models["gpt2"][1]]
    text = models["tmp"] / "prompts.txt"
    text.write_text(TOKEN_TEXT)
    cases["tokenizer"] = [megatron(models, "gpt2", 2, 1), "--reference", models["gpt2"][1],
                          "--tokens", text, "--tokenizer", tiny_tokenizer(models["tmp"])]
    yield [(VERIFY_BATCH, 2, verify_jobs(cases, models["tmp"] / "batch2"))]
    return verify_results(cases, models["tmp"] / "batch2")


@shared_followups
def batch4(framework_runs, d):
    """The 4-process checks, in the session's shared launch of 4-process checks."""
    from conftest import REAL_CANDIDATES, fixture_dirs
    models = once(_models, lambda: d / "verify")
    fixture_dir = fixture_dirs(lambda: d / "fixtures")
    cases = _layout_cases(models, 4)
    for case in REAL_CASES:
        found = [b / case for b in REAL_CANDIDATES if (b / case / "checkpoint").is_dir()]
        if found:
            cases[case] = [found[0] / "checkpoint", "--reference-logits",
                           f"{found[0] / 'reference_logits.pt'}:logits_fp32"]
    refs = {"hf_llama": models["llama"][1], "hf_gpt2": models["gpt2"][1],
            "gpt2_tp1pp1": megatron(models, "gpt2", 1, 1)}
    for name, (build, ref, _) in PLANTED.items():
        cases[f"plant_{name}"] = [build(models), "--reference", refs[ref]]
    for name in VPP_FIXTURES:
        cases[name] = [fixture_dir(name) / "checkpoint", "--reference", fixture_dir(name) / "hf"]
    yield [(VERIFY_BATCH, 4, verify_jobs(cases, models["tmp"] / "batch4"))]
    return verify_results(cases, models["tmp"] / "batch4")


# --- correct checkpoints pass at every layout ----------------------------------------------------

def _expect_pass(r, layout: str, max_err: float = 1e-4):
    text, rc = r
    assert rc == 0, text
    assert layout in text
    assert metric(text, "max_abs_error") < max_err
    assert metric(text, "top1_agreement") == 1.0
    assert "result=PASS" in text


def load_recording_chunk_reads(shards):
    """({name: tensor} of every tensor of a rank's shards, [(fqn, chunk offsets)] of each torch_dist chunk
    the loads read): which slices of the stored global tensors a rank really reads."""
    from ckptool.io import dcp_io
    reads = []
    real = dcp_io.DcpDir.read_chunk
    try:
        dcp_io.DcpDir.read_chunk = lambda self, fqn, chunk: reads.append((fqn, tuple(chunk.offsets))) or real(
            self, fqn, chunk)
        loaded = {k: v.load() for k, v in shards.tensors.items()}
    finally:
        dcp_io.DcpDir.read_chunk = real
    return loaded, reads


@pytest.mark.parametrize("kind,tp,pp", LAYOUTS[1] + LAYOUTS[2] + LAYOUTS[4])
def test_parallel_forward_matches_transformers(request, kind, tp, pp):
    results = request.getfixturevalue(f"batch{tp * pp}")
    text, rc = results[f"{kind}_{tp}_{pp}"]
    _expect_pass((text, rc), f"TP{tp} PP{pp}, {tp * pp} processes")
    assert "layer 2 " in text  # per-layer hidden states were gathered and compared (transformers'
    # last one is after the final norm, so layer 3 has no counterpart)


@pytest.mark.parametrize("name", VPP_FIXTURES)
def test_virtual_pipeline_matches_transformers(batch4, name):
    # 8 layers, PP2 x VPP2: stage s chunk c holds model chunk c*2+s; every layer's hidden state is
    # compared with transformers', so a chunk run out of order would diverge at its first layer.
    text, rc = batch4[name]
    _expect_pass((text, rc), "TP2 PP2 VPP2, 4 processes")
    for i in range(7):
        assert f"layer {i} " in text


def test_virtual_pipeline_tp1_matches_transformers(batch2):
    text, rc = batch2["vpp_gpt2_1_2"]
    _expect_pass((text, rc), "TP1 PP2 VPP2, 2 processes")
    assert "layer 2 " in text


def test_virtual_pipeline_chunk_order_error_located(batch2):
    text, rc = batch2["vpp_chunks_swapped"]
    assert rc == 1, text
    assert "first_divergence=layer 1 [pipeline stage 1 virtual chunk 0: mp_rank_00_001]" in text, text


@pytest.mark.parametrize("case,layout", [("dist_llama_2_1", "TP2 PP1"), ("dist_llama_1_2", "TP1 PP2"),
                                         ("dist_gpt2_1_2", "TP1 PP2")])
def test_torch_dist_target_matches_torch_original(batch2, case, layout):
    text, rc = batch2[case]
    _expect_pass((text, rc), f"{layout}, 2 processes")
    assert "torch_dist target" in text
    assert "layer 3 " in text


def test_torch_dist_target_with_virtual_pipeline(batch2):
    """The same torch_dist files run interleaved: stage s chunk c holds model chunk c*2+s, and every
    layer's hidden state is compared, so a chunk run out of order fails at its first layer."""
    text, rc = batch2["dist_gpt2_1_2_vpp2"]
    _expect_pass((text, rc), "TP1 PP2 VPP2, 2 processes")
    assert "torch_dist target" in text
    assert "layer 3 " in text


def test_torch_dist_vpp_needs_a_pipeline_and_even_chunks(models):
    from ckptool.verify.targets import dist_layout
    from ckptool.errors import CkptError
    from ckptool.formats.dcp import torch_dist as dist_format
    ckpt = dist_format.read(torch_dist(models, "gpt2", 1, 1))  # 4 layers
    assert dist_layout(ckpt, None, 2, 2, vpp=2).vpp == 2
    with pytest.raises(CkptError, match="needs a pipeline of more than one stage"):
        dist_layout(ckpt, 2, None, 2, vpp=2)
    with pytest.raises(CkptError, match="cannot be split evenly"):
        dist_layout(ckpt, None, 2, 2, vpp=4)


def test_torch_dist_rank_reads_only_its_slices(models):
    # TP rank 1 of stage 1 (of TP2 PP2) must not read stage 0's layers or the embedding, and its
    # QKV and fc1 slices must be exactly its rows of the merged tensors.
    from ckptool.formats.dcp import torch_dist as dist_format
    from ckptool.formats.megatron.ranks import read_rank_shards, slice_rank_shards
    ckpt = dist_format.read(torch_dist(models, "llama", 2, 1))
    shards = slice_rank_shards(ckpt, Layout(tp=2, pp=2), 1, 1)
    assert shards.chunks == [(2, 2)]
    assert not [k for k in shards.tensors if k.startswith(("layers.0.", "layers.1.", "embed."))]
    loaded, reads = load_recording_chunk_reads(shards)
    assert reads and all(off[0] in (2, 3) for fqn, off in reads if "decoder.layers." in fqn), reads
    assert not [fqn for fqn, _ in reads if "embedding" in fqn]
    # the same slices as the torch-format checkpoint written at TP2 PP2 holds in that rank's file
    theirs = read_rank_shards(megatron(models, "llama", 2, 2), 1, 1)
    for name in ("layers.2.qkv.weight", "layers.3.fc1.weight", "layers.3.fc2.weight", "output.weight"):
        assert torch.equal(loaded[name], theirs.tensors[name].load()), name


@pytest.mark.parametrize("case,dtype,tol", [("bf16_gpt2_1_2", "torch.bfloat16", 1e-1),
                                            ("fp16_llama_2_1", "torch.float16", 2e-2)])
def test_16bit_compute(batch2, case, dtype, tol):
    text, rc = batch2[case]
    assert rc == 0, text
    floor = metric(text, "noise_floor")  # the reference's own 16-bit error against its fp32 run
    assert dtype in text and floor > 0
    assert metric(text, "tolerance") == pytest.approx(max(tol, 3 * floor), rel=1e-2)
    err = metric(text, "max_abs_error")
    assert 0 < err < tol  # rounded, so not bit-equal to the fp32-trained reference run in 16 bits elsewhere


def test_16bit_tolerance_follows_the_noise_floor():
    from ckptool.verify.run import _tolerance
    ref16, ref32 = torch.zeros(1, 2, 5), torch.full((1, 2, 5), 0.5)
    assert _tolerance(None, torch.bfloat16, ref16, 5, None, lambda dt: ref32) == (1.5, 0.5, None)  # 3x the floor
    assert _tolerance(None, torch.bfloat16, ref32, 5, None, lambda dt: ref32) == (0.1, 0.0, None)  # the default
    assert _tolerance(0.2, torch.bfloat16, ref16, 5, None, None) == (0.2, None, None)  # --tolerance wins
    assert _tolerance(None, torch.float32, ref16, 5, None, None) == (1e-4, None, 1e-4)
    assert _tolerance(None, torch.bfloat16, ref16, 5, ref16, None) == (0.1, None, None)  # recorded logits


def test_fp32_tolerance_follows_the_logits_scale():
    """fp32: at least FP32_RELATIVE of the reference logits' largest |value| on the compared columns (an 8B
    model's exact conversion differs by 5.7e-4 at logits of scale 7.7); the per-layer bound stays 1e-4."""
    from ckptool.verify.compare import FP32_RELATIVE
    from ckptool.verify.run import _tolerance
    ref = torch.zeros(2, 3, 7)
    ref[1, 2, 3], ref[0, 0, 6] = -20.0, 1000.0  # column 6 lies outside the 5 compared columns
    tol, floor, relative = _tolerance(None, torch.float32, ref, 5, None, None)
    assert tol == pytest.approx(FP32_RELATIVE * 20.0) and floor is None and relative == 1e-4
    assert _tolerance(None, torch.float32, ref / 100, 5, None, None)[0] == 1e-4  # small logits: the fixed floor


def test_compare_in_pieces_matches_the_whole_tensor_formulas(monkeypatch):
    """The logits metrics computed a few rows at a time equal the whole-tensor definitions."""
    from ckptool.verify import compare as cmp
    g = torch.Generator().manual_seed(3)
    t, r = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    monkeypatch.setattr(cmp, "PIECE_VALUES", 20)  # 2 rows of 10 columns a piece: 8 pieces
    rep = cmp.compare(t, r, 10, 1.0)
    td, rd = t[..., :10].double(), r[..., :10].double()
    log_p, log_q = torch.log_softmax(rd, -1), torch.log_softmax(td, -1)
    assert rep.max_abs_error == (td - rd).abs().max().item()
    assert rep.mean_kl == pytest.approx((log_p.exp() * (log_p - log_q)).sum(-1).mean().item(), rel=1e-12)
    assert rep.top1_agreement == (td.argmax(-1) == rd.argmax(-1)).double().mean().item()
    assert cmp.max_abs_error(t, r, 10) == rep.max_abs_error
    assert cmp.max_abs(r, 10) == rd.abs().max().item()


def test_text_tokens_with_a_local_tokenizer(batch2, models):
    from ckptool.verify.inputs import make_tokens
    tokens = make_tokens(str(models["tmp"] / "prompts.txt"), str(models["tmp"] / "tokenizer"), 2, 16, 0, VOCAB)
    assert tokens.tolist() == TOKEN_IDS
    text, rc = batch2["tokenizer"]
    _expect_pass((text, rc), "TP2 PP1, 2 processes, torch.float32, tokens (2, 7)")


def test_torchrun_entry_point_torch_dist(models):
    # `torchrun -m ckptool verify` on its own (the batch above shares one process group)
    r = verify(2, torch_dist(models, "gpt2", 1, 2), "--reference", models["gpt2"][1])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TP1 PP2, 2 processes" in r.stdout and "result=PASS" in r.stdout


def test_one_process_without_torchrun(models):
    r = verify_here(megatron(models, "llama", 2, 2), "--reference", models["llama"][1])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torchrun --nproc-per-node 4" in r.stdout


def _fake_torchrun(world: int, *args):
    # the layout checks run before any process group is joined, so torchrun's environment is enough
    return verify_here(*args, env={"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})


def test_world_size_must_match_layout(models):
    r = _fake_torchrun(2, megatron(models, "gpt2", 2, 2))
    assert r.returncode == 2
    assert "torchrun started 2 processes" in r.output and "needs 4" in r.output
    r = _fake_torchrun(4, megatron(models, "gpt2", 2, 2), "--tp", 4, "--pp", 1)
    assert r.exit_code == 2 and "runs at the layout of its files" in r.output, r.output


def test_torch_dist_layout_errors(models):
    dist_ckpt = torch_dist(models, "llama", 2, 1)  # args say TP2 PP1
    r = _fake_torchrun(4, dist_ckpt)
    assert r.exit_code == 2 and "needs 2" in r.output and "--tp/--pp" in r.output, r.output
    r = _fake_torchrun(3, dist_ckpt, "--tp", 2)
    assert r.exit_code == 2 and "does not divide the 3 processes" in r.output, r.output


# --- the framework's own logits -----------------------------------------------------------------

@pytest.mark.parametrize("case", REAL_CASES)
def test_real_checkpoints_against_framework_logits(batch4, case):
    if case not in batch4:
        pytest.skip(f"{case} is absent (neither ../shared/real-checkpoints nor fixtures/real)")
    text, rc = batch4[case]
    assert rc == 0, text
    # padding columns left out: 1001..1023 (1002.. for the legacy run, whose NullTokenizer had an EOD row 1001)
    assert f"compared {REAL_TRUE_VOCAB[case]} vocabulary columns" in text
    assert metric(text, "max_abs_error") < 1e-5


# --- planted errors are caught and located -------------------------------------------------------

@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_error_caught_and_located(batch4, name):
    text, rc = batch4[f"plant_{name}"]
    assert rc == 1, text
    assert "result=FAIL" in text
    assert f"first_divergence={PLANTED[name][2]}" in text, text
    if name == "tp_files_swapped":
        assert "mp_rank_00_000, mp_rank_01_000" in text
    if name == "layer_from_another_layer":
        assert "pipeline stage 0" in text


def test_drifted_replicas_pass_in_one_process(models, batch4):
    # The one-process forward of the merged state uses rank 0's copy and matches the reference; the
    # parallel forward uses each rank's own copy, as Megatron did, and shows the drift at layer 2
    # (test_planted_error_caught_and_located[drifted_replica]).
    single = verify_here(models["tmp"] / "drift", "--reference", models["gpt2"][1])
    assert single.returncode == 0 and "replicas differ" in single.stderr, single.stdout + single.stderr


# --- output directories against their manifests --------------------------------------------------

def test_files_manifest_check(models, tmp_path):
    from ckptool.convert import write_layout
    src = megatron(models, "gpt2", 1, 1)
    from ckptool.formats.registry import open_checkpoint
    dst = tmp_path / "out"
    write_layout(open_checkpoint(src), dst, Layout(tp=2, pp=1), warn=lambda m: None)
    ok = verify_here("--files", dst)
    assert ok.returncode == 0 and "result=PASS" in ok.stdout, ok.stdout + ok.stderr
    victim = next(dst.glob("*/mp_rank_01/model_optim_rng.pt"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = verify_here("--files", dst)
    assert bad.returncode == 1 and "digest differs from the manifest" in bad.stdout, bad.stdout + bad.stderr


def test_token_parsing():
    from ckptool.errors import CkptError
    from ckptool.verify.inputs import make_tokens, parse_token_ids
    assert parse_token_ids("1,2,3;4,5,6").tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(CkptError):
        parse_token_ids("1,2;3")
    with pytest.raises(CkptError):
        make_tokens("1,200", None, 1, 2, 0, vocab=100)
    a, b = make_tokens(None, None, 2, 8, 7, vocab=50), make_tokens(None, None, 2, 8, 7, vocab=50)
    assert a.shape == (2, 8) and torch.equal(a, b) and int(a.max()) < 50


def test_hf_reference_loaded_once_for_its_two_dtypes(tmp_path):
    """A 16-bit verify against a transformers directory stored in bf16 runs its reference in bf16 and then
    in fp32 (the noise floor): the second forward widens the model already loaded, and gives exactly what
    a fresh fp32 load gives; a model loaded in another dtype than the stored one is loaded afresh."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from ckptool.verify.inputs import hf_forward
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    tokens = torch.randint(0, 96, (2, 8))
    held = {}
    hf_forward(tmp_path, tokens, torch.bfloat16, held=held)
    first = held["model"]
    widened = hf_forward(tmp_path, tokens, torch.float32, held=held)[0]
    assert held["model"] is first  # not loaded again
    assert torch.equal(widened, hf_forward(tmp_path, tokens, torch.float32)[0])
    held = {}
    hf_forward(tmp_path, tokens, torch.float16, held=held)  # fp16 rounds the stored bf16 values
    fp16_model = held["model"]
    hf_forward(tmp_path, tokens, torch.float32, held=held)
    assert held["model"] is not fp16_model


def test_hf_reference_preloaded_beside_the_target(tmp_path, monkeypatch):
    """verify makes a transformers reference ready on a thread while the target runs (inputs.Preload): the
    model it loads gives exactly the logits of a model loaded afterwards; taken in another dtype than it
    loaded, or never asked to load, it hands over nothing (the caller loads); a load that fails raises in
    the caller; the noise floor's run (hidden=False) returns the same logits without hidden states."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from ckptool.verify.inputs import Preload, hf_forward, preload
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 96, (2, 8))
    fresh, fresh_hidden, _ = hf_forward(tmp_path / "hf", tokens, torch.bfloat16)
    from ckptool.io import startup
    read_ahead = []  # the weight files are read ahead (where read-ahead runs: forced here), until loaded
    monkeypatch.setenv("CKPTOOL_READAHEAD", "1")
    monkeypatch.setattr(startup, "readahead", lambda files, cap, stop: read_ahead.append((files, cap, stop)))
    ahead = preload(tmp_path / "hf", torch.bfloat16)
    ahead.load_on("cpu")
    held = {"preload": ahead}
    logits, hidden, _ = hf_forward(tmp_path / "hf", tokens, torch.bfloat16, held=held)
    assert torch.equal(logits, fresh) and hidden.keys() == fresh_hidden.keys()
    files, cap, stop = read_ahead[0]
    assert [p.name for p in files] == ["model.safetensors"] and 0 < cap <= files[0].stat().st_size
    assert stop.is_set()  # the model is loaded: nothing more to read ahead
    monkeypatch.setenv("CKPTOOL_READAHEAD", "0")
    assert held["model"] is not None and "preload" not in held
    floor, none, _ = hf_forward(tmp_path / "hf", tokens, torch.float32, held=held, hidden=False)
    assert none is None and torch.equal(floor, hf_forward(tmp_path / "hf", tokens, torch.float32)[0])
    other = Preload(tmp_path / "hf", torch.float32)
    other.load_on("cpu")
    assert other.model(torch.bfloat16) is None  # loaded in fp32, asked for bf16: the caller loads
    idle = Preload(tmp_path / "hf", torch.bfloat16)
    idle.cancel()
    assert idle.model(torch.bfloat16) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not safetensors")
    broken = Preload(tmp_path / "bad", torch.bfloat16)
    broken.load_on("cpu")
    with pytest.raises(Exception):
        broken.model(torch.bfloat16)
    assert preload(tmp_path / "nowhere", torch.bfloat16) is None  # not an HF directory: nothing to preload
