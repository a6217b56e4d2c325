"""GPT-OSS (issue 32): attention sinks, alternating sliding-window / full attention, clamped quick GeGLU experts with
biases and an interleaved gate/up, a biased router, YaRN; MXFP4 experts.

A tiny GptOssForCausalLM built by transformers (2 layers: one sliding, one full; window 4; 4 experts top-2; every
parameter perturbed off its init, the sinks and biases too) goes through Megatron's torch format (TP2 EP2) and
torch_dist and back bit-exact; ckptool's forward, single-process and under torchrun (TP2 PP2 EP2), computes
transformers' logits on inputs longer than the window; megatron-core (CPU) loads the outputs strictly and computes
the same logits. An MXFP4 checkpoint made by transformers' own quantizer (fixtures/gpt_oss_mxfp4) is dequantized by
ckptool bit-exact with transformers' own loading. inspect shows the sinks, windows and clamp, the quick (torch-free)
reader as the full one.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from click.testing import CliRunner
from conftest import once, shared_followups

from ckptool import api
from ckptool.cli import main
from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.describe import describe
from ckptool.errors import CkptError
from ckptool.families import for_config
from ckptool.formats.hf.mxfp4 import dequantize
from ckptool.formats.megatron.args import config_from_args
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.quick_inspect import quick_open
from ckptool.verify import reference
from ckptool.verify.inputs import default_seq_len

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_gpt_oss_helper.py"
WINDOW, SEQ = 4, 20  # the helper's TOKENS and the verify inputs below are longer than the window
SIZES = dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128, hidden_size=64,
             intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
             layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})


def build_hf(out: Path, seed: int = 0) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**SIZES)).eval()
    with torch.no_grad():  # off init: sinks, biases and norms too
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


def hf_logits(path: Path, tokens: torch.Tensor, **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _build_oss(root: Path) -> Path:
    """The tiny HF model and ckptool's Megatron torch output at TP2 EP2."""
    hf = build_hf(root / "hf")
    # 128 rows at TP1 and TP2 alike (64 x 2, 128 x 1): no padding rows, whose trained values a training loss over
    # the padded vocabulary would see and a re-padding would change
    api.from_hf(hf, root / "tp2ep2", tp=2, ep=2, etp=1, make_vocab_size_divisible_by=64, warn=lambda m: None)
    return root


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """The tiny HF model and ckptool's Megatron torch output at TP2 EP2 (the mcore steps' own too)."""
    return once(_build_oss, lambda: tmp_path_factory.mktemp("gpt_oss"))


def same_files(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def test_reads_the_gpt_oss_maths_from_config_json(oss):
    cfg = api.open(oss / "hf").config
    assert (cfg.activation, cfg.glu_clamp, cfg.glu_linear_offset, cfg.attn_sinks) == ("quick_geglu", 7.0, 1.0, True)
    assert (cfg.sliding_window, cfg.local_layers, cfg.window_of(0), cfg.window_of(1)) == (WINDOW, (0,), WINDOW, None)
    assert cfg.moe.router_bias and cfg.moe.topk_norm and cfg.add_bias_linear and not cfg.rope_yarn.truncate


def test_megatron_round_trips_are_bit_exact(oss, tmp_path):
    """HF -> torch TP2 EP2 -> HF, and on through torch_dist and torch TP1 PP2 EP4: every tensor bit-exact."""
    api.to_hf(oss / "tp2ep2", tmp_path / "back", warn=lambda m: None)
    same_files(oss / "hf", tmp_path / "back")
    api.reshard(oss / "tp2ep2", tmp_path / "dist", format="torch_dist", tp=2, ep=2, etp=1, warn=lambda m: None)
    api.reshard(tmp_path / "dist", tmp_path / "pp2ep4", format="torch", tp=1, pp=2, ep=4, etp=1, warn=lambda m: None)
    api.to_hf(tmp_path / "pp2ep4", tmp_path / "back2", warn=lambda m: None)
    same_files(oss / "hf", tmp_path / "back2")
    conf = json.loads((tmp_path / "back" / "config.json").read_text())
    assert conf["layer_types"] == SIZES["layer_types"] and conf["sliding_window"] == WINDOW


def test_written_args_say_the_gpt_oss_maths_to_megatron(oss):
    args = torch.load(oss / "tp2ep2" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt",
                      weights_only=False)["args"]
    assert (args.quick_geglu, args.swiglu, args.softmax_type) == (True, False, "learnable")
    # transformers' window 4 = the query and 3 keys before it: megatron-core's (3, 0); layer 1 (1-based 2) full
    assert (tuple(args.window_size), args.window_attn_skip_freq) == ((WINDOW - 1, 0), [1, 0])
    assert (args.glu_linear_offset, args.activation_func_clamp_value, args.add_bias_linear) == (1.0, 7.0, True)
    assert (args.position_embedding_type, args.yarn_rotary_scaling_factor, args.yarn_correction_range_round_to_int) \
        == ("yarn", 4.0, False)
    # Megatron-LM's own integer form of the pattern reads as the same layers
    args.window_attn_skip_freq = 2
    assert config_from_args(args, 128).local_layers == (0,)


def inspect_text(path) -> str:
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    return r.output


def test_inspect_shows_the_gpt_oss_maths_full_and_quick(oss, tmp_path):
    """inspect says sinks, the window and its layers, the clamped GLU, for the HF model, the MXFP4 release form, the
    Megatron torch output and torch_dist: the torch-free quick reader's document equal to the full reader's."""
    api.reshard(oss / "tp2ep2", tmp_path / "dist", format="torch_dist", tp=2, ep=2, etp=1, warn=lambda m: None)
    for d in (oss / "hf", MXFP4, oss / "tp2ep2", tmp_path / "dist"):
        quick = quick_open(d, {})
        assert quick is not None, d
        doc = describe(quick)
        assert doc == describe(api.open(d)), d
        c = doc["config"]
        assert (c["attn_sinks"], c["sliding_window"], c["local_layers"], c["glu_clamp"], c["glu_linear_offset"]) \
            == (True, WINDOW, [0], 7.0, 1.0), d
        assert (c["attn_softcap"], c["final_softcap"], c["apply_layernorm_1p"]) == (None, None, False), d
        text = inspect_text(d)
        assert f"maths       attention sinks, window {WINDOW} on layers 0 of 2, GLU clamp 7.0, linear half + 1.0, " \
            "YaRN factor 4.0\n" in text and "gemma" not in text, text
    q = describe(quick_open(MXFP4, {}))
    assert q["quantization"] == {"method": "mxfp4", "fmt": "e2m1", "block_size": 32, "scale_fmt": "e8m0",
                                 "tensors": 4, "read_as": "bfloat16"}
    assert q["storage"].startswith("MXFP4 (4 stacked expert weights")
    assert {t["name"]: (t["shape"], t["dtype"]) for t in q["tensors"]}["layers.1.mlp.experts.3.gate.weight"] \
        == ([64, 32], "bfloat16")


def test_verify_computes_transformers_logits_and_the_window_and_sinks_matter(oss, tmp_path):
    """On its default inputs (no seq_len given: longer than the window, so windowing is exercised)."""
    res = api.verify(oss / "tp2ep2", reference=oss / "hf", quiet=True, warn=lambda m: None)
    assert res.ok, res.lines
    # the same weights with a wider window, or without sinks, compute something else: verify says so
    for name, edit in (("window", lambda c, w: c.update(sliding_window=WINDOW + 4)),
                       ("sinks", lambda c, w: w.update({k: torch.zeros_like(v) for k, v in w.items()
                                                         if k.endswith("sinks")}))):
        other = tmp_path / name
        shutil.copytree(oss / "hf", other)
        conf, weights = json.loads((other / "config.json").read_text()), load_file(other / "model.safetensors")
        edit(conf, weights)
        (other / "config.json").write_text(json.dumps(conf))
        save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
        res = api.verify(other, reference=oss / "hf", quiet=True, warn=lambda m: None)
        assert not res.ok, name


def test_verify_default_inputs_are_longer_than_the_window(oss):
    cfg = api.open(oss / "hf").config
    assert default_seq_len(None, cfg) == 16 + WINDOW and default_seq_len(7, cfg) == 7
    assert default_seq_len(None, cfg.replace(sliding_window=128)) == 264  # gpt-oss-20b / 120b's window
    assert default_seq_len(None, cfg.replace(sliding_window=None, local_layers=())) == 16


@shared_followups
def parallel_verify(framework_runs, d):
    """`ckptool verify` under torchrun of the TP2 PP2 EP2 reshard, in the session's shared launch of 4-process
    checks (tests/verify_batch.py: the real command): (output, exit status)."""
    from test_verify import VERIFY_BATCH, verify_jobs, verify_results
    oss = once(_build_oss, lambda: d / "oss")
    api.reshard(oss / "tp2ep2", d / "t", format="torch", tp=2, pp=2, ep=2, etp=1, warn=lambda m: None)
    # expert TP 1 (biased experts): a stage's ranks are lcm(TP2, ETP1 x EP2) = 2, so 4 processes
    cases = {"t": [d / "t", "--reference", oss / "hf", "--seq-len", SEQ]}
    yield [(VERIFY_BATCH, 4, verify_jobs(cases, d / "runs"))]
    return verify_results(cases, d / "runs")["t"]


def test_torchrun_verify_at_tp2_pp2_ep2(parallel_verify):
    out, rc = parallel_verify
    assert rc == 0 and "result=PASS" in out, out


@shared_followups
def mcore(framework_runs, d):
    """megatron-core (mcore_gpt_oss_helper.py, 2 processes, TP2 EP2 ETP1), two rounds (shared_followups). First: the
    torch and torch_dist outputs loaded strictly, with their logits; and the torch output trained one Adam step and
    saved with its optimizer (d/trained). ckptool then carries that optimizer state: d/same (TP2 EP2 again), d/tp1
    (merged over TP), d/dist (torch_dist, from d/tp1) and d/back (TP2 EP2 from d/tp1). Second: the run resumed from
    d/same and d/back takes its next two steps (d/NAME.pt.losses)."""
    oss = once(_build_oss, lambda: d / "oss")
    api.reshard(oss / "tp2ep2", d / "dist_load", format="torch_dist", tp=2, ep=2, etp=1, warn=lambda m: None)
    yield [(HELPER, 2, [f"load-torch {oss / 'tp2ep2'} --tp 2 --ep 2 --out {d / 'torch.pt'}",
                        f"load-dist {d / 'dist_load'} --tp 2 --ep 2 --out {d / 'dist.pt'}",
                        f"train {oss / 'tp2ep2'} --tp 2 --ep 2 --save {d / 'trained'} --out {d / 'train.pt'}"])]
    api.reshard(d / "trained", d / "same", tp=2, ep=2, etp=1, optimizer=True, warn=lambda m: None)
    api.reshard(d / "trained", d / "tp1", tp=1, ep=2, etp=1, optimizer=True, warn=lambda m: None)
    api.reshard(d / "tp1", d / "dist", format="torch_dist", tp=2, ep=2, etp=1, optimizer=True, warn=lambda m: None)
    api.reshard(d / "tp1", d / "back", tp=2, ep=2, etp=1, optimizer=True, warn=lambda m: None)
    yield [(HELPER, 2, [f"resume {d / 'same'} --tp 2 --ep 2 --out {d / 'same.pt'}",
                        f"resume {d / 'back'} --tp 2 --ep 2 --out {d / 'back.pt'}"])]
    return d


def test_megatron_core_loads_the_outputs_strictly_with_transformers_logits(oss, mcore):
    for name in ("torch.pt", "dist.pt"):
        got = torch.load(mcore / name)
        want = hf_logits(oss / "hf", got["tokens"])
        mcore_logits = got["logits"][..., :want.shape[-1]]
        assert torch.allclose(mcore_logits, want, atol=1e-4, rtol=0), (name, (mcore_logits - want).abs().max())


# --- MXFP4 ---------------------------------------------------------------------------------------------------

def test_dequantizes_like_transformers_own_function():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 8, 2), generator=g, dtype=torch.uint8)  # every exponent, extremes too
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    got = dequantize(blocks, scales)
    assert got.shape == want.shape == (3, 64, 8) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit (infinities, signed zeros)


MXFP4 = REPO / "fixtures" / "gpt_oss_mxfp4"  # made by transformers' own quantizer: fixtures/README.md


def test_transformers_quantized_mxfp4_converts_to_what_transformers_dequantizes(tmp_path):
    """fixtures/gpt_oss_mxfp4 (scripts/make_mxfp4_gpt_oss.py: transformers' Mxfp4Quantize with triton's
    triton_kernels, saved by save_pretrained) through Megatron TP2 EP2 and back: every tensor bit for bit what
    transformers' dequantizing load holds, and ckptool's forward of the Megatron output computes its logits."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    model = AutoModelForCausalLM.from_pretrained(MXFP4, dtype=torch.bfloat16,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    theirs = {k: v.detach() for k, v in model.state_dict().items()}
    api.from_hf(MXFP4, tmp_path / "meg", tp=2, ep=2, etp=1, make_vocab_size_divisible_by=64, warn=lambda m: None)
    api.to_hf(tmp_path / "meg", tmp_path / "bf16", warn=lambda m: None)
    ours = load_file(tmp_path / "bf16" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]), k
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))  # longer than the window
    want = hf_logits(MXFP4, tokens, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    got = reference.forward(api.open(tmp_path / "meg"), tokens)[..., :want.shape[-1]]
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_incomplete_mxfp4_is_refused(tmp_path):
    q = tmp_path / "mxfp4"
    shutil.copytree(MXFP4, q)
    packed = load_file(q / "model.safetensors")
    packed.pop("model.layers.0.mlp.experts.down_proj_scales")
    save_file(packed, q / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CkptError, match="down_proj_blocks has no .*down_proj_scales"):
        api.open(q)


# --- refusals -------------------------------------------------------------------------------------------------

def test_what_megatron_or_transformers_cannot_compute_is_refused_by_name(oss, tmp_path):
    other = tmp_path / "alpha"
    shutil.copytree(oss / "hf", other)
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(conf, swiglu_alpha=1.5)))
    with pytest.raises(CkptError, match="swiglu_alpha=1.5"):
        api.open(other)
    args = torch.load(oss / "tp2ep2" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt",
                      weights_only=False)["args"]
    with pytest.raises(CkptError, match="give --etp 1"):  # megatron-core's rule for biased experts
        api.from_hf(oss / "hf", tmp_path / "etp2", tp=2, ep=2, warn=lambda m: None)
    assert not (tmp_path / "etp2").exists()
    with pytest.raises(CkptError, match="sinks and sliding windows exist only in megatron-core"):
        api.reshard(oss / "tp2ep2", tmp_path / "legacy", tp=2, ep=2, etp=1, dialect="legacy-norm", warn=lambda m: None)
    with pytest.raises(CkptError, match="off-by-one"):
        config_from_args(argparse.Namespace(**dict(vars(args), softmax_type="off-by-one")), 128)
    with pytest.raises(CkptError, match="not causal"):
        config_from_args(argparse.Namespace(**dict(vars(args), window_size=(3, 2))), 128)
    # a Llama-style model with a sliding window: no HF class ckptool writes computes it
    cfg = api.open(oss / "hf").config.replace(attn_sinks=False, activation="swiglu", glu_clamp=None,
                                                glu_linear_offset=0.0, moe=None, rope_yarn=None)
    with pytest.raises(CkptError, match="--window-size"):
        for_config(cfg)


def test_megatron_cores_optimizer_state_is_carried_through_reshards(mcore):
    """megatron-core trains the TP2 EP2 output one Adam step and saves model and optimizer (a chain [dense, expert]).
    ckptool reads every parameter's moments equal to the live optimizer's, the sinks and the expert biases too, and
    carries them to TP1 and torch_dist; written again at TP2 EP2 (from the source, and after a merge to TP1) the run
    resumed there takes the next two steps with the losses the uninterrupted run had. (A resume at TP1 matches the first loss exactly but not the
    second: Adam's first steps move each weight by about lr whatever its gradient's size, so rounding noise in a
    near-zero gradient computed at another TP moves the loss; the same-layout resume is the exact check.)"""
    ck = api.open(mcore / "trained")
    ea = ck.optimizer.slots["exp_avg"]
    assert set(ea) == set(ck.tensors)
    live = {}
    for tp, ep, moments in torch.load(mcore / "train.pt.moments"):
        for name, m in moments.items():
            live[(tp, ep, name)] = m
    for i in range(2):
        p = f"decoder.layers.{i}."
        sinks = torch.cat([live[(t, t, p + "self_attention.core_attention.softmax_offset")] for t in range(2)])
        assert torch.equal(ea[f"layers.{i}.attn.sinks"].load(), sinks)
        assert torch.equal(ea[f"layers.{i}.mlp.router.bias"].load(), live[(0, 0, p + "mlp.router.bias")])
        for e in range(4):  # EP rank e // 2 (its TP rank too: ranks 0 and 1), local expert e % 2, whole (ETP 1)
            q = f"{p}mlp.experts.local_experts.{e % 2}."
            fc1 = live[(e // 2, e // 2, q + "linear_fc1.bias")]
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.gate.bias"].load(), fc1[:64])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.up.bias"].load(), fc1[64:])
            fc2 = live[(e // 2, e // 2, q + "linear_fc2.bias")]
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.down.bias"].load(), fc2)
    for other in ("tp1", "dist"):  # merged over TP; and in torch_dist (the mcore steps' reshards)
        moved = api.open(mcore / other).optimizer.slots["exp_avg"]
        assert all(torch.equal(moved[k].load(), ea[k].load()) for k in ea), other
    want = torch.load(mcore / "train.pt.losses")["next"]
    for name in ("same", "back"):  # resumed by megatron-core in the steps' second round
        assert torch.load(mcore / f"{name}.pt.losses")["next"] == want, name


def test_a_llama_run_with_sliding_windows_keeps_them_and_is_not_exported(fixture_dir, tmp_path):
    """A megatron-core Llama run's --window-size 7,0 --window-attn-skip-freq 2 (Megatron-LM's integer form): read as
    windows of 8 keys on layers 0 and 2, carried through a reshard (as a 0/1 list), computed by verify, and refused
    by to-hf (no HF class ckptool writes computes Llama with windows) leaving nothing behind."""
    src = read_megatron(fixture_dir("llama_mcore_tp2pp2") / "checkpoint")
    write_layout(src, tmp_path / "plain", Layout(2, 1), warn=lambda m: None)
    for f in (tmp_path / "plain").glob("iter_*/mp_rank_*/model_optim_rng.pt"):  # the run's args say the windows
        state = torch.load(f, weights_only=False)
        state["args"].window_size, state["args"].window_attn_skip_freq = (7, 0), 2
        torch.save(state, f)
    ck = read_megatron(tmp_path / "plain")
    assert (ck.config.sliding_window, ck.config.local_layers) == (8, (0, 2))
    api.reshard(tmp_path / "plain", tmp_path / "tp1", tp=1, warn=lambda m: None)
    args = read_megatron(tmp_path / "tp1").source.args
    assert (tuple(args.window_size), args.window_attn_skip_freq) == ((7, 0), [1, 0, 1, 0])
    assert api.verify(tmp_path / "tp1", reference=tmp_path / "plain", quiet=True, warn=lambda m: None).ok
    # the windows matter on the default inputs (16 tokens > 8): without them the same weights compute otherwise
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    windowed = reference.forward(ck, tokens)
    unwindowed = reference.forward(ck.with_tensors(ck.tensors, sliding_window=None, local_layers=()), tokens)
    assert (windowed - unwindowed).abs().max() > 1e-4
    text = inspect_text(tmp_path / "tp1")  # a Llama's windows are no Gemma's
    assert "maths       window 8 on layers 0,2 of 4\n" in text and "gemma" not in text, text
    with pytest.raises(CkptError, match="the model uses --window-size"):
        api.to_hf(tmp_path / "tp1", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def lose(checkpoint: Path, rank: str, key: str) -> Path:
    """checkpoint with key deleted from rank's file."""
    f = checkpoint / "iter_0000000" / rank / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    del state["model"][key]
    torch.save(state, f)
    return checkpoint


def test_a_lost_expert_bias_is_refused(oss, tmp_path):
    """Expert biases are read like every other role: one missing from a rank file is named, never left out."""
    shutil.copytree(oss / "tp2ep2", tmp_path / "lost")
    lose(tmp_path / "lost", "mp_rank_00_000", "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.bias")
    with pytest.raises(CkptError, match="layer 1 experts.1.fc2.bias missing from the files"):
        api.open(tmp_path / "lost")


def test_a_lost_expert_weight_at_expert_tp_1_is_refused_on_read(tmp_path):
    """At expert TP 1 one file holds an expert whole; a weight lost from it was noticed only by a writer (3b1487c
    opened the checkpoint). A tiny Mixtral, written at TP2 EP2 ETP1."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                     hidden_size=32, intermediate_size=16, num_attention_heads=4,
                                     num_key_value_heads=2)).save_pretrained(tmp_path / "hf")
    api.from_hf(tmp_path / "hf", tmp_path / "meg", tp=2, ep=2, etp=1, warn=lambda m: None)
    lose(tmp_path / "meg", "mp_rank_01_001", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    with pytest.raises(CkptError, match="layer 0 experts.2.fc2.weight missing from the files"):
        api.open(tmp_path / "meg")
