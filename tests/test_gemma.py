"""Gemma 2 and Gemma 3 text models (issue 32), checked by transformers itself.

Tiny Gemma2ForCausalLM / Gemma3ForCausalLM models are built by transformers (4 layers, GQA, head_dim other
than hidden / heads, a sliding window of 5 / 6 tokens, Gemma 2's soft-capping, Gemma 3's q/k norms, its own
local RoPE base and linear scaling of the global layers, tied embeddings), every weight moved off its init (the
zero-centred norms too). They go from-hf to TP2 PP2, reshard through torch_dist and the Transformer Engine dialect,
and to-hf back: every tensor bit-exact, the logits transformers computes equal, the config the same model. Each
Megatron output verifies against the HF model on verify's default rows, which are longer than the window (and
the window is shown to change the logits there), in one process and under torchrun at TP2 PP2. megatron-core's
GPTModel with Megatron-Bridge's post-norm layout loads the outputs strictly (it has no Gemma maths to compare
logits with: docs/formats.md), and its optimizer state, resharded, resumes its run. inspect shows the Gemma maths,
the quick (torch-free) reader as the full one. What ckptool cannot compute is refused by name.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from conftest import once, shared_followups

from ckptool import api, families
from ckptool.cli import main
from ckptool.describe import describe
from ckptool.errors import CkptError
from ckptool.quick_inspect import quick_open
from ckptool.verify import inputs

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,  # noqa: E402
                          Gemma3TextConfig)

QUIET = dict(warn=lambda m: None)
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=64)


def _perturb(model, seed: int) -> None:
    """Every weight off its init; the norms (zeros at init: applied as 1 + w) the most."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.05))


def gemma2() -> Gemma2ForCausalLM:
    conf = Gemma2Config(**SIZES, sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=5.0,
                        final_logit_softcapping=3.0)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(conf)
    _perturb(model, 1)
    return model


def gemma3() -> Gemma3ForCausalLM:
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
    conf = Gemma3TextConfig(**SIZES, sliding_window=6, sliding_window_pattern=3, query_pre_attn_scalar=24,
                            rope_parameters=rope)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(conf)
    _perturb(model, 2)
    return model


def _save_models(root: Path) -> dict:
    out = {}
    for name, build in (("gemma2", gemma2), ("gemma3", gemma3)):
        build().save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return once(_save_models, lambda: tmp_path_factory.mktemp("gemma"))


def hf_logits(path, tokens):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _default_tokens(path):
    """verify's default rows for this model: 16 tokens past its window."""
    cfg = api.open(path).config
    return inputs.make_tokens(None, None, 2, inputs.default_seq_len(None, cfg), 0, vocab=cfg.true_or_padded_vocab)


@pytest.fixture(scope="module")
def round_trips(models, tmp_path_factory):
    """HF -> TP2 PP2 (mcore) -> torch_dist TP1 PP2 -> TP2 PP1 (mcore-te) -> HF, every stage kept."""
    return once(_round_trips, lambda: tmp_path_factory.mktemp("gemma_trips"), models)


def _round_trips(root: Path, models: dict) -> dict:
    out = {}
    for name, src in models.items():
        d = root / name
        api.from_hf(src, d / "tp2pp2", tp=2, pp=2, **QUIET)
        api.reshard(d / "tp2pp2", d / "dist", tp=1, pp=2, format="torch_dist", **QUIET)
        api.reshard(d / "dist", d / "te_tp2", tp=2, pp=1, dialect="mcore-te", **QUIET)
        api.to_hf(d / "te_tp2", d / "hf", **QUIET)
        out[name] = d
    return out


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_round_trip_through_megatron_layouts_is_bit_exact_with_equal_logits(models, round_trips, name):
    want, got = load_file(str(models[name] / "model.safetensors")), load_file(str(round_trips[name] / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert "model.layers.0.post_feedforward_layernorm.weight" in got
    for k in want:
        assert torch.equal(got[k], want[k]), k
    tokens = _default_tokens(models[name])
    assert torch.equal(hf_logits(round_trips[name] / "hf", tokens), hf_logits(models[name], tokens))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_exported_config_is_the_same_model(models, round_trips, name):
    src = transformers.AutoConfig.from_pretrained(str(models[name]))
    back = transformers.AutoConfig.from_pretrained(str(round_trips[name] / "hf"))
    assert type(back) is type(src)
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "rope_parameters", "head_dim", "tie_word_embeddings", "hidden_activation"):
        assert getattr(back, key) == getattr(src, key), key


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
@pytest.mark.parametrize("stage", ["tp2pp2", "dist", "te_tp2"])
def test_each_megatron_stage_verifies_against_transformers(models, round_trips, name, stage):
    r = api.verify(round_trips[name] / stage, reference=models[name], quiet=True)
    assert r.ok, "\n".join(r.lines)
    seq = inputs.default_seq_len(None, api.open(models[name]).config)
    assert seq > transformers.AutoConfig.from_pretrained(str(models[name])).sliding_window


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_default_rows_are_long_enough_for_the_window_to_matter(models, tmp_path, name):
    """The same weights with a window as long as the rows give other logits: verify's default rows exercise it."""
    shutil.copytree(models[name], tmp_path / "wide")
    conf = json.loads((tmp_path / "wide" / "config.json").read_text())
    tokens = _default_tokens(models[name])
    conf["sliding_window"] = tokens.shape[1]
    (tmp_path / "wide" / "config.json").write_text(json.dumps(conf))
    assert not torch.allclose(hf_logits(tmp_path / "wide", tokens), hf_logits(models[name], tokens), atol=1e-3)


# the window, its layers (Gemma 2: every other from 0; Gemma 3: all but each third) and the soft-caps, as built above
MATHS = {"gemma2": (5, [0, 2], 5.0, 3.0, "window 5 on layers 0,2 of 4, score soft-cap 5.0, logit soft-cap 3.0"),
         "gemma3": (6, [0, 1, 3], None, None, "window 6 on layers 0,1,3 of 4")}


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_inspect_shows_the_gemma_maths_full_and_quick(models, round_trips, name):
    """inspect says the (1 + w) norms, the window and its layers, the soft-caps, for the HF model and each Megatron
    stage (torch, torch_dist, mcore-te): the torch-free quick reader's document equal to the full reader's."""
    window, layers, attn_cap, final_cap, said = MATHS[name]
    for d in (models[name], round_trips[name] / "tp2pp2", round_trips[name] / "dist", round_trips[name] / "te_tp2"):
        quick = quick_open(d, {})
        assert quick is not None, d
        doc = describe(quick)
        assert doc == describe(api.open(d)), d
        c = doc["config"]
        assert (c["apply_layernorm_1p"], c["sliding_window"], c["local_layers"], c["attn_softcap"],
                c["final_softcap"]) == (True, window, layers, attn_cap, final_cap), d
        assert (c["attn_sinks"], c["glu_clamp"]) == (False, None), d
        text = CliRunner().invoke(main, ["inspect", str(d)]).output
        assert f"maths       (1 + w) norms, {said}\n" in text and "gemma       embedding x sqrt(hidden)" in text, text


def test_megatron_args_say_the_gemma_maths(round_trips):
    args = api.open(round_trips["gemma3"] / "tp2pp2").source.args
    # transformers' window of 6 tokens is megatron-core's (5, 0); every third layer is full (sliding_window_pattern 3)
    assert args.window_size == (5, 0) and args.window_attn_skip_freq == [1, 1, 0, 1]
    assert args.apply_layernorm_1p and args.gated_linear_unit and args.openai_gelu and not args.swiglu
    assert args.softmax_scale == 24 ** -0.5 and args.query_pre_attn_scalar == 24
    assert (args.ckptool_rotary_base_local, args.ckptool_rope_linear_factor) == (500.0, 4.0)
    assert args.ckptool_post_norms and args.ckptool_embedding_scale
    g2 = api.open(round_trips["gemma2"] / "tp2pp2").source.args
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (5.0, 3.0)
    assert g2.window_attn_skip_freq == [1, 0, 1, 0]  # transformers' Gemma 2: layer 0 is local


def test_post_norms_have_megatron_bridges_keys(round_trips):
    import torch as t
    f = next((round_trips["gemma2"] / "tp2pp2").glob("*/mp_rank_01_001/model_optim_rng.pt"))
    keys = t.load(f, weights_only=False)["model"]
    assert "decoder.layers.1.self_attention.linear_proj.post_layernorm.weight" in keys
    assert "decoder.layers.1.mlp.linear_fc2.post_layernorm.weight" in keys


# --- refusals ----------------------------------------------------------------------------------------

def test_gemma3_multimodal_is_refused_by_name(models, tmp_path):
    shutil.copytree(models["gemma3"], tmp_path / "mm")
    conf = json.loads((tmp_path / "mm" / "config.json").read_text())
    conf.update(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"])
    (tmp_path / "mm" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CkptError, match="Gemma 3 multimodal .*Gemma3ForCausalLM"):
        api.from_hf(tmp_path / "mm", tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_bidirectional_gemma3_is_refused(models, tmp_path):
    shutil.copytree(models["gemma3"], tmp_path / "bi")
    conf = json.loads((tmp_path / "bi" / "config.json").read_text())
    conf["use_bidirectional_attention"] = True
    (tmp_path / "bi" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CkptError, match="use_bidirectional_attention"):
        api.from_hf(tmp_path / "bi", tmp_path / "out", **QUIET)


def test_a_legacy_dialect_has_no_place_for_the_post_norms(models, tmp_path):
    with pytest.raises(CkptError, match="post-MLP norms: the legacy-norm dialect"):
        api.from_hf(models["gemma2"], tmp_path / "out", dialect="legacy-norm", **QUIET)
    assert not (tmp_path / "out").exists()


def test_a_format_without_gemmas_tensors_refuses_before_writing(round_trips, tmp_path):
    """DeepSpeed's universal checkpoint names Megatron-DeepSpeed's modules, which have no post norms: refused by the
    format table (Format.holds), not written without them."""
    with pytest.raises(CkptError, match="Gemma's maths .*ds-universal output"):
        api.reshard(round_trips["gemma2"] / "tp2pp2", tmp_path / "dsu", format="ds-universal", **QUIET)
    assert not (tmp_path / "dsu").exists()


@pytest.mark.parametrize("change, says", [
    (dict(post_norms=False), "uses --window-size .*this model is no Gemma"),
    (dict(activation="swiglu"), "an MLP that is not GeGLU"),
    (dict(qk_layernorm=False, rotary_base_local=500.0), "neither Gemma2ForCausalLM nor Gemma3ForCausalLM"),
])
def test_gemma_maths_no_class_computes_is_refused_on_export(round_trips, change, says):
    cfg = api.open(round_trips["gemma3"] / "tp2pp2").config.replace(**change)
    with pytest.raises(CkptError, match=says):
        families.for_config(cfg)


# --- under torchrun (gloo, CPU) -------------------------------------------------------------------------

@shared_followups
def parallel_runs(framework_runs, d):
    """`torchrun --nproc-per-node 4 -m ckptool verify` at TP2 PP2 against the HF models: the torch files of
    from-hf and the torch_dist checkpoint run at TP2 PP2; in the session's shared launch of 4-process checks."""
    from test_verify import VERIFY_BATCH, verify_jobs, verify_results
    models = once(_save_models, lambda: d / "models")
    round_trips = once(_round_trips, lambda: d / "trips", models)
    cases = {f"{name}_{stage}": [round_trips[name] / stage, "--reference", models[name]] + extra
             for name in models for stage, extra in (("tp2pp2", []), ("dist", ["--tp", "2", "--pp", "2"]))}
    yield [(VERIFY_BATCH, 4, verify_jobs(cases, d / "runs"))]
    return verify_results(cases, d / "runs")


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
@pytest.mark.parametrize("stage", ["tp2pp2", "dist"])
def test_torchrun_verify_at_tp2_pp2_equals_transformers(models, parallel_runs, name, stage):
    from test_verify import metric
    out, rc = parallel_runs[f"{name}_{stage}"]
    assert rc == 0 and "result=PASS" in out, out
    assert "parallel forward: TP2 PP2, 4 processes" in out, out
    want = hf_logits(models[name], _default_tokens(models[name]))  # the rows verify ran: past the window
    assert metric(out, "max_abs_error") <= 1e-5 * want.abs().max().item(), out
    assert "  layer 0 " in out, out


def test_a_llama_with_a_sliding_window_keeps_it_computes_it_and_is_not_exported_as_llama(fixture_dir, tmp_path):
    """megatron-core's window_size / window_attn_skip_freq in a non-Gemma run's args: read into the model (the
    window of transformers' terms is one more than megatron-core's left size), carried by a layout conversion,
    computed by verify (the windowed forward is another model's), refused by to-hf by the flag's name."""
    from ckptool.verify.reference import forward
    src = fixture_dir("llama_mcore_tp2pp2") / "checkpoint"
    shutil.copytree(src, tmp_path / "swa")
    plain = api.open(src)
    for f in (tmp_path / "swa").rglob("model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)
        obj["args"].window_size, obj["args"].window_attn_skip_freq = (2, 0), 2
        torch.save(obj, f)
    swa = api.open(tmp_path / "swa")
    assert (swa.config.sliding_window, swa.config.local_layers) == (3, tuple(range(0, plain.config.num_layers, 2)))
    api.reshard(tmp_path / "swa", tmp_path / "tp1", tp=1, pp=1, **QUIET)
    out = api.open(tmp_path / "tp1").source.args
    assert out.window_size == (2, 0) and out.window_attn_skip_freq == [1, 0] * (plain.config.num_layers // 2)
    tokens = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(forward(swa, tokens), forward(plain, tokens), atol=1e-4)
    assert api.verify(tmp_path / "tp1", reference=tmp_path / "swa", quiet=True).ok
    with pytest.raises(CkptError, match="the model uses --window-size .*no Gemma"):
        api.to_hf(tmp_path / "tp1", tmp_path / "hf", **QUIET)
    assert not (tmp_path / "hf").exists()


# --- megatron-core ------------------------------------------------------------------------------------------

MCORE_HELPER = Path(__file__).with_name("mcore_gemma_helper.py")


@shared_followups
def mcore_runs(framework_runs, d):
    """tests/mcore_gemma_helper.py, in two rounds of 2 processes (shared_followups). First: megatron-core loads
    from-hf's TP2 torch files and their TP2 torch_dist reshard, both models ({(name, kind): {params, keys}}), and
    trains the Gemma 3 layout one step at TP2 and saves (model, Adam state, scheduler). ckptool reshards that save to
    TP1 with and without the optimizer. Second: megatron-core resumes each at TP1 (DP2) and takes the steps the first
    run took after its save ({"trained" | "tp1" | "tp1_weights": losses}). The vocabulary of the trained model is
    padded alike at TP2 and TP1 (divisible by 64): the padded rows are in Megatron's loss."""
    models = once(_save_models, lambda: d / "models")
    jobs, outs = [], {}
    for name, src in models.items():
        api.from_hf(src, d / name / "torch", tp=2, **QUIET)
        api.reshard(d / name / "torch", d / name / "dist", tp=2, format="torch_dist", **QUIET)
        for kind, flag in (("torch", ""), ("dist", " --dist")):
            outs[(name, kind)] = d / name / f"{kind}.pt"
            jobs.append(f"{d / name / kind}{flag} --out {outs[(name, kind)]}")
    api.from_hf(models["gemma3"], d / "init", tp=2, make_vocab_size_divisible_by=64, **QUIET)
    jobs.append(f"{d / 'init'} --train {d / 'trained'} --out {d / 'trained.pt'}")
    yield [(MCORE_HELPER, 2, jobs)]
    api.reshard(d / "trained", d / "tp1", tp=1, **QUIET)
    api.reshard(d / "trained", d / "tp1_weights", tp=1, optimizer=False, **QUIET)
    yield [(MCORE_HELPER, 2, [f"{d / 'tp1'} --tp 1 --resume --out {d / 'tp1.pt'}",
                              f"{d / 'tp1_weights'} --tp 1 --resume --out {d / 'tp1_weights.pt'}"])]
    losses = {k: torch.load(d / f"{k}.pt")["losses"] for k in ("trained", "tp1", "tp1_weights")}
    return {k: torch.load(v) for k, v in outs.items()}, losses


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_megatron_core_loads_the_outputs_strictly_in_its_parameter_order(mcore_runs, name):
    """megatron-core's GPTModel with Megatron-Bridge's post_layernorm submodules takes every tensor of both formats
    (load_state_dict strict; dist_checkpointing.load of its sharded state dict), and the torch files list the
    parameters in the order the model registers them (the order its optimizer state follows)."""
    loads = mcore_runs[0]
    for kind in ("torch", "dist"):
        params = loads[(name, kind)]["params"]
        assert "decoder.layers.3.mlp.linear_fc2.post_layernorm.weight" in params
        assert ("decoder.layers.0.self_attention.q_layernorm.weight" in params) == (name == "gemma3")
    written = [k for k in loads[(name, "torch")]["keys"] if not k.endswith("_extra_state")]
    assert written == loads[(name, "torch")]["params"]


def test_optimizer_state_carried_through_a_reshard_resumes_the_run(mcore_runs):
    """The third step's loss is the first the saved Adam moments move: resumed at TP1 from ckptool's reshard it is the
    run's own up to TP1's other reduction order (and ckptool's rank-0 copy of the q/k norms, whose TP replicas
    megatron-core lets drift); from weights only (fresh moments) it is visibly off."""
    losses = mcore_runs[1]
    run, carried, weights_only = losses["trained"], losses["tp1"], losses["tp1_weights"]
    assert abs(carried[0] - run[1]) < 1e-4 and abs(weights_only[0] - run[1]) < 1e-4  # the same weights
    error = abs(carried[1] - run[2])
    assert error < 1e-4, (run, carried)
    assert abs(weights_only[1] - run[2]) > 20 * error, (run, weights_only)


# --- config.json as the Hub's Gemma releases write it (transformers 4.x fields) ------------------------------

HUB_GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304, "head_dim": 256,
              "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
              "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
              "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0, "rope_theta": 10000.0, "max_position_embeddings": 8192,
              "vocab_size": 256000}
HUB_GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
                 "head_dim": 256, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
                 "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                 "rope_local_base_freq": 10000, "rope_theta": 1000000, "rope_scaling": None,
                 "attn_logit_softcapping": None, "final_logit_softcapping": None, "max_position_embeddings": 32768,
                 "vocab_size": 262144}


def test_hub_configs_without_layer_types_read_as_transformers_builds_them():
    """No layer_types: Gemma 2 windows the even layers (transformers' default; Megatron-Bridge's provider the odd
    ones), Gemma 3 all but every sixth; Gemma 2's soft-caps and one RoPE, Gemma 3's local base and no scaling; and
    what transformers makes of the same config.json agrees."""
    g2 = families.for_model_type("gemma2").read_config(HUB_GEMMA2, 256000)
    assert g2.local_layers == tuple(range(0, 26, 2)) and g2.sliding_window == 4096
    assert (g2.attn_softcap, g2.final_softcap, g2.rotary_base_local, g2.rope_linear_factor) == (50.0, 30.0, None, None)
    g3 = families.for_model_type("gemma3_text").read_config(HUB_GEMMA3_1B, 262144)
    assert g3.local_layers == tuple(i for i in range(26) if (i + 1) % 6) and g3.qk_layernorm
    assert (g3.rotary_base, g3.rotary_base_local, g3.rope_linear_factor, g3.attn_softcap) == (1e6, 10000.0, None, None)
    for conf, cfg in ((HUB_GEMMA2, g2), (HUB_GEMMA3_1B, g3)):
        built = transformers.AutoConfig.for_model(**{k: v for k, v in conf.items() if k != "architectures"})
        assert [t == "sliding_attention" for t in built.layer_types] == [cfg.is_local_layer(i) for i in range(26)]


def test_a_refusal_on_the_command_line_is_one_line_and_exit_2(models, tmp_path):
    from click.testing import CliRunner
    from ckptool.cli import main
    shutil.copytree(models["gemma3"], tmp_path / "mm")
    conf = json.loads((tmp_path / "mm" / "config.json").read_text())
    conf.update(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"])
    (tmp_path / "mm" / "config.json").write_text(json.dumps(conf))
    res = CliRunner().invoke(main, ["from-hf", str(tmp_path / "mm"), str(tmp_path / "out")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "Gemma3ForConditionalGeneration" in res.output and "Traceback" not in res.output
