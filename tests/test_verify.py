"""`ckptool verify`: the tensor/pipeline-parallel forward under real torchrun (gloo, CPU).

Tiny transformers models (GPT-2, Llama with GQA) are mapped by hand onto canonical names, written
as Megatron mcore checkpoints with ckptool's writer at each layout, and verified against
transformers' own forward. Planted errors are written into the rank files and must be caught and
located. The real framework-written checkpoints are checked against the logits Megatron computed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptool.config import GPTConfig, Layout
from ckptool.formats.megatron import write_megatron
from ckptool.lazy import Const
from ckptool.state import Checkpoint, SourceInfo

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "real-checkpoints"
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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    return {"gpt2": gpt2_model(tmp), "llama": llama_model(tmp), "tmp": tmp}


def megatron(models, kind: str, tp: int, pp: int) -> Path:
    out = models["tmp"] / f"{kind}_tp{tp}pp{pp}"
    if not out.exists():
        write_megatron(models[kind][0], out, Layout(tp=tp, pp=pp), dialect="mcore", warn=lambda m: None)
    return out


def fresh_copy(models, kind, tp, pp, name) -> Path:
    dst = models["tmp"] / name
    shutil.copytree(megatron(models, kind, tp, pp), dst)
    return dst


def verify(nproc, *args, torchrun=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if torchrun else []
    cmd = [sys.executable, *launcher, "-m", "ckptool", "verify", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def metric(out: str, key: str) -> float:
    return float(next(l for l in out.splitlines() if l.startswith(key + "=")).split("=", 1)[1])


# --- correct checkpoints pass at every layout ----------------------------------------------------

@pytest.mark.parametrize("kind,tp,pp", [("gpt2", 1, 1), ("gpt2", 2, 1), ("gpt2", 1, 2), ("gpt2", 2, 2),
                                        ("llama", 1, 2), ("llama", 2, 2), ("llama", 4, 1)])
def test_parallel_forward_matches_transformers(models, kind, tp, pp):
    # llama: 8 heads, 2 query groups, so TP 4 > groups takes the all-gather path
    r = verify(tp * pp, megatron(models, kind, tp, pp), "--reference", models[kind][1], "--seq-len", 12)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"TP{tp} PP{pp}, {tp * pp} processes" in r.stdout
    assert metric(r.stdout, "max_abs_error") < 1e-4
    assert metric(r.stdout, "top1_agreement") == 1.0
    assert "layer 2" in r.stdout  # per-layer hidden states were gathered and compared


def test_one_process_without_torchrun(models):
    r = verify(1, megatron(models, "llama", 2, 2), "--reference", models["llama"][1], torchrun=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torchrun --nproc-per-node 4" in r.stdout


def test_world_size_must_match_layout(models):
    r = verify(2, megatron(models, "gpt2", 2, 2))
    assert r.returncode != 0
    assert "torchrun started 2 processes" in r.stderr and "needs 4" in r.stderr


# --- the framework's own logits -----------------------------------------------------------------

@pytest.mark.parametrize("case", ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"])
def test_real_checkpoints_against_framework_logits(case):
    if not (REAL / case).is_dir():
        pytest.skip(f"{REAL / case} is absent (the shared real checkpoints are not on this machine)")
    r = verify(4, REAL / case / "checkpoint", "--reference-logits",
               f"{REAL / case / 'reference_logits.pt'}:logits_fp32")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compared 1001 vocabulary columns" in r.stdout  # padding columns 1001..1023 left out
    assert metric(r.stdout, "max_abs_error") < 1e-5


# --- planted errors are caught and located -------------------------------------------------------

def _edit(path: Path, fn):
    obj = torch.load(path, weights_only=False)
    fn(obj["model"])
    torch.save(obj, path)


def _rank_file(ckpt: Path, tp: int, pp: int) -> Path:
    return next(ckpt.glob(f"*/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt"))


def _expect_divergence(r, where: str):
    assert r.returncode == 1, r.stdout + r.stderr
    assert "result=FAIL" in r.stdout
    assert f"first_divergence={where}" in r.stdout, r.stdout


def test_planted_gate_up_swapped(models):
    ckpt = fresh_copy(models, "llama", 2, 2, "plant_gate_up")
    key = "decoder.layers.1.mlp.linear_fc1.weight"  # global layer 1 on stage 0

    def swap(m):
        gate, up = m[key].chunk(2)
        m[key] = torch.cat([up, gate]).clone()
    for t in range(2):
        _edit(_rank_file(ckpt, t, 0), swap)
    _expect_divergence(verify(4, ckpt, "--reference", models["llama"][1]), "layer 1")


def test_planted_qkv_order(models):
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_qkv")
    p = "decoder.layers.0.self_attention.linear_qkv."  # global layer 2 (stage 1, local 0)

    def k_v_swapped(m):  # per query group [q..., k, v] -> [q..., v, k]
        for kind in ("weight", "bias"):
            g = m[p + kind].reshape(2, 3, 8, -1)  # 2 local groups (4 heads / TP2), 1 q + k + v, head 8
            m[p + kind] = g[:, [0, 2, 1]].reshape(m[p + kind].shape).clone()
    for t in range(2):
        _edit(_rank_file(ckpt, t, 1), k_v_swapped)
    _expect_divergence(verify(4, ckpt, "--reference", megatron(models, "gpt2", 1, 1)), "layer 2")


def test_planted_tp_files_swapped(models):
    # Swapping whole rank files permutes heads and MLP columns consistently, which cancels; what
    # breaks is the vocab-parallel embedding, whose row blocks now map tokens to the wrong rows.
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_swap_files")
    a, b = _rank_file(ckpt, 0, 0), _rank_file(ckpt, 1, 0)
    tmp = a.with_name("tmp.pt")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    r = verify(4, ckpt, "--reference", models["gpt2"][1])
    _expect_divergence(r, "embedding")
    assert "mp_rank_00_000, mp_rank_01_000" in r.stdout


def test_planted_layer_from_another_layer(models):
    ckpt = fresh_copy(models, "gpt2", 2, 2, "plant_layer_copy")

    def copy_layer0_into_1(m):
        for k in [k for k in m if k.startswith("decoder.layers.0.")]:
            m[k.replace("layers.0.", "layers.1.")] = m[k].clone()
    for t in range(2):
        _edit(_rank_file(ckpt, t, 0), copy_layer0_into_1)
    r = verify(4, ckpt, "--reference", models["gpt2"][1])
    _expect_divergence(r, "layer 1")
    assert "pipeline stage 0" in r.stdout


def test_planted_vocab_padding_off_by_one(models):
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
    _expect_divergence(verify(4, ckpt, "--reference", models["gpt2"][1]), "embedding")


def test_drifted_replicas_run_as_the_framework_ran_them(models):
    # TP rank 1's copy of layer 3's attention norm drifted. The one-process forward of the merged
    # state uses rank 0's copy and matches the reference; the parallel forward uses each rank's
    # own copy, as Megatron did, and shows the drift at layer 3.
    ckpt = fresh_copy(models, "gpt2", 2, 2, "drift")

    def drift(m):
        m["decoder.layers.1.input_layernorm.weight"] += 0.5
    _edit(_rank_file(ckpt, 1, 1), drift)
    single = verify(1, ckpt, "--reference", models["gpt2"][1], torchrun=False)
    assert single.returncode == 0 and "replicas differ" in single.stderr, single.stdout + single.stderr
    _expect_divergence(verify(4, ckpt, "--reference", models["gpt2"][1]), "layer 3")


# --- output directories against their manifests --------------------------------------------------

def test_files_manifest_check(models, tmp_path):
    from ckptool.convert import write_layout
    src = megatron(models, "gpt2", 1, 1)
    from ckptool.formats.registry import open_checkpoint
    dst = tmp_path / "out"
    write_layout(open_checkpoint(src), dst, Layout(tp=2, pp=1), warn=lambda m: None)
    ok = verify(1, "--files", dst, torchrun=False)
    assert ok.returncode == 0 and "result=PASS" in ok.stdout, ok.stdout + ok.stderr
    victim = next(dst.glob("*/mp_rank_01/model_optim_rng.pt"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = verify(1, "--files", dst, torchrun=False)
    assert bad.returncode == 1 and "sha256 differs" in bad.stdout, bad.stdout + bad.stderr
