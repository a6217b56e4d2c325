"""Hugging Face round trips, checked by transformers itself.

Tiny models are built with transformers (GPT-2; Llama with GQA where TP 4 > 2 KV heads; Qwen2 with
QKV bias saved as a .bin), converted with from-hf to several Megatron layouts, resharded, exported
back with to-hf and loaded with AutoModelForCausalLM: logits must equal the original's and tensors
must be bit-exact. The real Megatron checkpoints exported with to-hf must give the logits the
frameworks computed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckptool.cli import main
from ckptool.errors import CkptError
from ckptool.formats.hf import reader as hf_reader
from ckptool.formats.hf.writer import write_hf, _rotate_half_order
from ckptool.formats.registry import open_checkpoint
from ckptool.io.safetensors_header import read_safetensors_header
from ckptool.lazy import Const
from ckptool.verify import reference
from conftest import REAL_TRUE_VOCAB

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

REPO = Path(__file__).resolve().parents[1]
TOKENS = torch.tensor([[1, 5, 9, 42, 77, 3, 0, 99, 12, 8, 64, 31],
                       [7, 7, 2, 88, 15, 60, 4, 33, 21, 90, 11, 6]])
VOCAB = 100


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def hf_logits(path_or_model, tokens=TOKENS):
    model = path_or_model
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(str(path_or_model), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def saved_tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    if (d / "pytorch_model.bin").is_file():
        out.update(torch.load(d / "pytorch_model.bin", weights_only=True))
    return out


def assert_same_tensors(original: Path, exported: Path, tied: bool):
    a, b = saved_tensors(original), saved_tensors(exported)
    if tied:
        a.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --- tiny models built by transformers ------------------------------------------------------

def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Weights large enough that a wrong activation, norm or bias mapping moves the logits well
    past the tolerance (the default 0.02 init hides GeLU erf vs tanh below 1e-6)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "ln_" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    return model


def make_gpt2(d: Path) -> Path:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5)
    randomise(GPT2LMHeadModel(cfg)).save_pretrained(d)
    return d


def make_llama(d: Path) -> Path:
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                      tie_word_embeddings=False)
    randomise(LlamaForCausalLM(cfg)).save_pretrained(d)
    return d


def make_qwen2_bin(d: Path) -> Path:
    """Qwen2 with QKV bias, saved the pre-safetensors way (pytorch_model.bin)."""
    torch.manual_seed(2)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = randomise(Qwen2ForCausalLM(cfg))
    d.mkdir(parents=True)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    return d, model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    qdir, qmodel = make_qwen2_bin(root / "qwen2")
    return {"gpt2": (make_gpt2(root / "gpt2"), True, None),
            "llama": (make_llama(root / "llama"), False, None),
            "qwen2": (qdir, False, qmodel)}


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_round_trip_through_megatron_layouts(models, tmp_path, name):
    src, tied, model = models[name]
    want = hf_logits(model if model is not None else src)
    v = want.shape[-1]
    for tp, pp in ((2, 2), (4, 1)):
        meg = tmp_path / f"meg_tp{tp}pp{pp}"
        cli("from-hf", src, meg, "--tp", tp, "--pp", pp)
        ckpt = open_checkpoint(meg)
        assert ckpt.source.layout.tp == tp and ckpt.source.layout.pp == pp
        assert ckpt.config.padded_vocab_size == 128 * tp  # padded for the target TP
        # the reference forward over the Megatron output agrees with transformers
        ref = reference.forward(ckpt, TOKENS)
        assert (ref[..., :v] - want).abs().max().item() <= 1e-5
        # reshard and come back to HF
        resharded = tmp_path / f"re_tp{tp}pp{pp}"
        cli("reshard", meg, resharded, "--tp", 1 if tp == 4 else 4, "--pp", 2 if pp == 1 else 1)
        out = tmp_path / f"hf_tp{tp}pp{pp}"
        cli("to-hf", resharded, out)
        got = hf_logits(out)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5
        if name != "qwen2":
            assert_same_tensors(src, out, tied)
        else:
            a = {k: t for k, t in model.state_dict().items()}
            b = saved_tensors(out)
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        conf = json.loads((out / "config.json").read_text())
        assert conf["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                          "qwen2": "Qwen2ForCausalLM"}[name]]
        assert conf["vocab_size"] == VOCAB


def test_hf_dir_is_a_source_for_reshard(models, tmp_path):
    src = models["llama"][0]
    cli("reshard", src, tmp_path / "r", "--tp", 2)
    ckpt = open_checkpoint(tmp_path / "r")
    assert ckpt.config.num_query_groups == 2 and ckpt.source.layout.tp == 2
    assert hf_reader.looks_like(src) and not hf_reader.looks_like(tmp_path / "r")


def test_llama_config_fields(models, tmp_path):
    cli("to-hf", models["llama"][0], tmp_path / "o", "--dtype", "bf16")
    conf = json.loads((tmp_path / "o" / "config.json").read_text())
    assert conf["num_key_value_heads"] == 2 and conf["head_dim"] == 8
    assert conf["rope_theta"] == 50000.0 and conf["rope_parameters"]["rope_theta"] == 50000.0
    assert conf["tie_word_embeddings"] is False and conf["rms_norm_eps"] == 1e-5
    assert conf["attention_bias"] is False and conf["mlp_bias"] is False
    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "o"))
    assert model.config.rope_parameters["rope_theta"] == 50000.0


def test_sharded_output(models, tmp_path):
    src = models["llama"][0]
    out = tmp_path / "sharded"
    cli("to-hf", src, out, "--max-shard-size", "30KB")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in files:
        read_safetensors_header(out / f)  # an independent parser: offsets tile the data exactly
        size = 0
        with safe_open(str(out / f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
            for k in h.keys():
                t = h.get_tensor(k)
                tensors[k] = t
                size += t.numel() * t.element_size()
                assert index["weight_map"][k] == f
        assert size <= 30_000 or len(list(safe_open(str(out / f), "pt").keys())) == 1
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert (hf_logits(out) - hf_logits(src)).abs().max().item() <= 1e-5
    # and the sharded directory reads back (through its index) to the same logits
    assert (reference.forward(open_checkpoint(out), TOKENS) - hf_logits(src)).abs().max().item() <= 1e-5


def _real_case(name):
    for base in (REPO.parent / "shared" / "real-checkpoints", REPO / "fixtures" / "real"):
        if (base / name / "checkpoint").is_dir():
            return base / name
    pytest.skip(f"real checkpoint {name} not found under ../shared/real-checkpoints or fixtures/real")


@pytest.mark.parametrize("name", ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"])
def test_real_megatron_checkpoint_to_hf(tmp_path, name):
    case = _real_case(name)
    ref = torch.load(case / "reference_logits.pt", weights_only=True)
    out = tmp_path / "hf"
    cli("to-hf", case / "checkpoint", out, "--dtype", "fp32")
    got = hf_logits(out, ref["tokens"])
    want = ref["logits_fp32"][..., :REAL_TRUE_VOCAB[name]].float()
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    conf = json.loads((out / "config.json").read_text())
    assert conf["vocab_size"] == REAL_TRUE_VOCAB[name] and conf["activation_function"] == "gelu"


def test_interleaved_rotary_and_layernorm_1p_are_converted(models, tmp_path):
    """A Megatron model with --rotary-interleaved and --apply-layernorm-1p, made equal to the Llama
    by construction, exports to HF with the same logits."""
    src = models["llama"][0]
    want = hf_logits(src)
    ckpt = hf_reader.read(src)
    hd = ckpt.config.head_dim
    inverse = torch.argsort(torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)]))
    tensors = {}
    for k, t in ckpt.tensors.items():
        x = t.load()
        if ".attn.q." in k or ".attn.k." in k:  # rotate-half rows -> interleaved rows
            x = x.reshape(-1, hd, *x.shape[1:])[:, inverse].reshape(x.shape)
            assert torch.equal(_rotate_half_order(x, hd), t.load())
        if k.endswith("norm.weight"):
            x = x - 1
        tensors[k] = Const(x)
    odd = ckpt.with_tensors(tensors, rotary_interleaved=True, apply_layernorm_1p=True)
    assert (reference.forward(odd, TOKENS)[..., :VOCAB] - want).abs().max().item() <= 1e-5
    write_hf(odd, tmp_path, warn=lambda m: None)
    assert (hf_logits(tmp_path) - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("change, flag", [
    (dict(rotary_percent=0.5), "--rotary-percent"),
    (dict(qk_layernorm=True, normalization="layernorm"), "--qk-layernorm with LayerNorm"),
    (dict(qk_layernorm=True), "lacks layers.0.attn.q_norm.weight"),  # Qwen3's norms, but no tensors for them
    (dict(post_layernorm_residual=True), "--apply-residual-connection-post-layernorm"),
])
def test_unrepresentable_flags_are_refused(models, tmp_path, change, flag):
    ckpt = hf_reader.read(models["llama"][0])
    with pytest.raises(CkptError, match=flag):
        write_hf(ckpt.with_tensors(ckpt.tensors, **change), tmp_path)


def test_console_entry_point(models, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    meg, back = tmp_path / "meg", tmp_path / "back"
    for args in (["from-hf", models["gpt2"][0], meg, "--tp", "2"], ["to-hf", meg, back]):
        res = subprocess.run([sys.executable, "-m", "ckptool", *map(str, args)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
    assert_same_tensors(models["gpt2"][0], back, tied=True)
    bad = subprocess.run([sys.executable, "-m", "ckptool", "from-hf", str(tmp_path), str(tmp_path / "x")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


def test_deeplearningexamples_bert_to_hf(tmp_path):
    """A DLE-style ckpt_N.pt (BertForPreTraining state under `model`, DLE's `dense_act` names,
    vocabulary 30 padded to 32) exports to a transformers BertForPreTraining with the true vocab."""
    from transformers import BertConfig, BertForPreTraining
    torch.manual_seed(3)
    dle_conf = {"vocab_size": 30, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 16, "type_vocab_size": 2,
                "initializer_range": 0.02}
    model = randomise(BertForPreTraining(BertConfig(**dle_conf, layer_norm_eps=1e-12))).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "cls.predictions.decoder.bias"}
    dle = {}
    for k, v in sd.items():
        for mod in ("intermediate.dense.", "pooler.dense.", "transform.dense."):
            k = k.replace(mod, mod.replace("dense.", "dense_act."))
        if k in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
            v = torch.cat([v, torch.randn((2,) + tuple(v.shape[1:]))])  # run_pretraining pads to 32
        dle[k] = v
    dle["cls.predictions.decoder.weight"] = dle["bert.embeddings.word_embeddings.weight"]
    assert "bert.encoder.layer.1.intermediate.dense_act.weight" in dle
    ckpt = tmp_path / "run" / "ckpt_5.pt"
    ckpt.parent.mkdir()
    torch.save({"model": dle, "optimizer": {"state": {}}, "files": [0, "x.hdf5"]}, ckpt)
    (tmp_path / "bert_config.json").write_text(json.dumps(dle_conf))
    out = tmp_path / "hf"
    cli("to-hf", ckpt, out, "--hf-config", tmp_path / "bert_config.json")
    got = BertForPreTraining.from_pretrained(str(out), dtype=torch.float32).eval()
    assert got.config.vocab_size == 30
    b = saved_tensors(out)
    assert sorted(b) == sorted(k for k in sd if k != "cls.predictions.decoder.weight")
    assert all(torch.equal(b[k], sd[k]) for k in b)
    ids = torch.tensor([[2, 5, 7, 29, 0, 11, 3, 1]])
    with torch.no_grad():
        want, have = model(ids), got(ids)
    assert (want.prediction_logits - have.prediction_logits).abs().max().item() <= 1e-5
    assert (want.seq_relationship_logits - have.seq_relationship_logits).abs().max().item() <= 1e-5
    res = CliRunner().invoke(main, ["to-hf", str(ckpt), str(tmp_path / "nocfg")])
    assert res.exit_code == 2 and "--hf-config" in res.output


@pytest.mark.parametrize("kind", ["llama3_tied", "mistral"])
def test_llama_variants(tmp_path, kind):
    """llama3 RoPE scaling with tied embeddings, and Mistral: the reference forward over the read
    state matches transformers, and the export gives the same logits again."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(4)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=4096))
    else:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True))
    randomise(model).save_pretrained(tmp_path / "src")
    want = hf_logits(model)
    ckpt = open_checkpoint(tmp_path / "src")
    if kind == "llama3_tied":
        assert ckpt.config.rope_scaling_factor == 8.0 and ckpt.config.tied_embeddings
        # the scaling matters here: without it the logits move
        plain = ckpt.with_tensors(ckpt.tensors, rope_scaling_factor=None)
        assert (reference.forward(plain, TOKENS) - want).abs().max().item() > 1e-4
    else:
        assert any("sliding_window" in w for w in ckpt.warnings)
    assert (reference.forward(ckpt, TOKENS) - want).abs().max().item() <= 1e-5
    cli("from-hf", tmp_path / "src", tmp_path / "meg", "--tp", 2, "--pp", 2)
    cli("to-hf", tmp_path / "meg", tmp_path / "out")
    assert (hf_logits(tmp_path / "out") - want).abs().max().item() <= 1e-5
    assert_same_tensors(tmp_path / "src", tmp_path / "out", tied=kind == "llama3_tied")


def test_tokenizer_files_are_copied(models, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    (tok / "unrelated.txt").write_text("not a tokenizer file")
    cli("to-hf", models["gpt2"][0], tmp_path / "o", "--tokenizer", tok)
    assert (tmp_path / "o" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (tmp_path / "o" / "tokenizer_config.json").is_file()
    assert not (tmp_path / "o" / "unrelated.txt").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(main, ["to-hf", str(models["gpt2"][0]), str(tmp_path / "o2"), "--tokenizer", str(empty)])
    assert res.exit_code == 2 and "no tokenizer files" in res.output and not (tmp_path / "o2").exists()


def test_megatron_dir_with_an_hf_config_beside_it_reads_as_megatron(tmp_path):
    """People keep the HF config.json next to their Megatron checkpoint; no weights there, so it is
    not an HF model directory."""
    import shutil
    from ckptool.formats.registry import detect_format
    src = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint", src)
    GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1001).save_pretrained(src)
    assert detect_format(src) == "megatron"
    assert open_checkpoint(src).config.num_layers == 4
    (tmp_path / "hf").mkdir()
    GPT2Config().save_pretrained(tmp_path / "hf")  # an HF dir without weights keeps its precise error
    with pytest.raises(CkptError, match="config.json but no model.safetensors"):
        open_checkpoint(tmp_path / "hf")


def test_truncated_safetensors_is_a_clear_error(models, tmp_path):
    import shutil
    src = tmp_path / "cut"
    shutil.copytree(models["gpt2"][0], src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    res = CliRunner().invoke(main, ["from-hf", str(src), str(tmp_path / "o")])
    assert res.exit_code == 2 and "truncated or corrupt" in res.output and not (tmp_path / "o").exists()


def _variant(ckpt, kind):
    """Canonical states no HF source above has: the export must still compute what the reference does."""
    cfg, t = ckpt.config, dict(ckpt.tensors)
    g = torch.Generator().manual_seed(5)
    if kind == "gpt2_squared_relu":
        return ckpt.with_tensors(t, activation="squared_relu")
    if kind == "gpt2_no_bias":
        linear_bias = [k for k in t if k.endswith(".bias") and (".attn." in k or ".mlp." in k)]
        assert linear_bias
        t = {k: v for k, v in t.items() if k not in linear_bias}
        return ckpt.with_tensors(t, add_bias_linear=False, add_qkv_bias=False)
    if kind == "gpt2_untied":
        t["output.weight"] = Const(torch.randn(t["embed.word"].shape, generator=g))
        return ckpt.with_tensors(t, tied_embeddings=False)
    if kind == "llama_all_biases":
        for i in range(cfg.num_layers):
            for lin in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.gate", "mlp.up", "mlp.down"):
                rows = t[f"layers.{i}.{lin}.weight"].shape[0]
                t[f"layers.{i}.{lin}.bias"] = Const(torch.randn(rows, generator=g) * 0.3)
        return ckpt.with_tensors(t, add_bias_linear=True, add_qkv_bias=True)
    raise ValueError(kind)


@pytest.mark.parametrize("kind, arch", [("gpt2_squared_relu", "GPT2LMHeadModel"), ("gpt2_no_bias", "GPT2LMHeadModel"),
                                        ("gpt2_untied", "GPT2LMHeadModel"), ("llama_all_biases", "LlamaForCausalLM")])
def test_export_matches_reference_forward(models, tmp_path, kind, arch):
    ckpt = _variant(hf_reader.read(models[kind.split("_")[0]][0]), kind)
    want = reference.forward(ckpt, TOKENS)[..., :VOCAB]
    write_hf(ckpt, tmp_path, warn=lambda m: None)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == [arch]
    assert (hf_logits(tmp_path) - want).abs().max().item() <= 1e-5
    # and it reads back as the same model
    back = hf_reader.read(tmp_path)
    assert (reference.forward(back, TOKENS) - want).abs().max().item() <= 1e-5


def test_gpt2_export_config_and_files(fixture_dir, tmp_path):
    """to-hf of a Megatron GPT-2 checkpoint (TP2 PP2): the config fields issue #3 names, taken from
    the source's args, the transformers-loadable generation config, and no attention-mask buffers."""
    from transformers import GenerationConfig
    d = fixture_dir("gpt2_mcore_tp2pp2")
    case = json.loads((d / "case.json").read_text())
    out = tmp_path / "hf"
    cli("to-hf", d / "checkpoint", out)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["GPT2LMHeadModel"]
    assert conf["n_positions"] == case["max_position_embeddings"]
    assert conf["n_inner"] == case["ffn_hidden_size"] and conf["n_embd"] == case["hidden_size"]
    assert conf["layer_norm_epsilon"] == 1e-5 and conf["activation_function"] == "gelu"
    assert conf["vocab_size"] == case["vocab_size"] and conf["tie_word_embeddings"] is True
    names = set(saved_tensors(out))
    assert not [n for n in names if n.endswith((".attn.bias", ".attn.masked_bias"))]
    assert "transformer.h.0.attn.c_attn.bias" in names  # the QKV bias itself is there
    assert "lm_head.weight" not in names  # tied: transformers ties it to wte
    GenerationConfig.from_pretrained(str(out))  # loads
    exp = torch.load(d / "expected.pt")
    assert (hf_logits(out, exp["tokens"]) - exp["logits"]).abs().max().item() <= 1e-5
