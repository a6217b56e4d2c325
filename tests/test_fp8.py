"""DeepSeek-V3 / R1 exactly as released: block-FP8 weights (float8_e4m3fn + a float32 weight_scale_inv per
128x128 block, config.json's quantization_config, a sharded index), read without hand editing and written
back by to-hf --fp8.

The "released" directories are made from tiny transformers DeepseekV3 models (weights moved off their init)
by transformers' own quantizer (Fp8Quantize, transformers 5.24 integrations/finegrained_fp8.py) on the
tensors DeepSeek-V3's model.safetensors.index.json stores FP8 (every attention and MLP Linear; not the
embeddings, lm_head, norms or the router). transformers' quantizer leaves a dimension that is not a
multiple of 128 unquantized, where the release has a partial edge block with its own scale (DeepSeek-V3's
kv_a_proj_with_mqa is [576, 7168] with scales [5, 56]): such a weight is zero-padded to whole blocks,
quantized by the same op and cropped (zeros change no block's amax).

transformers reads the FP8 directories itself with from_pretrained on CPU (it dequantizes: no GPU); its
FP8 quantizer's environment check asks for accelerate, which this environment lacks and the CPU dequantize
path does not use, so the check is patched for those loads.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckptool.cli import main
from conftest import ROOT
from ckptool.errors import CkptError
from ckptool.formats.registry import BY_OUTPUT, open_checkpoint
from ckptool.write_options import build_write_options, refuse_unhonoured

transformers = pytest.importorskip("transformers")
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize  # noqa: E402
from transformers.quantizers import quantizer_finegrained_fp8  # noqa: E402
from transformers.utils.quantization_config import FineGrainedFP8Config  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 42, 77, 3, 0, 99, 12, 8, 64, 31], [7, 7, 2, 88, 15, 60, 4, 33, 21, 90, 11, 6]])
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK = 128
# "blocks": every dimension a multiple of 128 or below it (one partial block), which transformers'
# CPU dequantize tiles right; "ragged": also 320 and 192 (a whole block then a partial one), which
# transformers 5.24 refuses to dequantize on CPU ("not divisible by scale grid") or would tile wrong
SIZES = {"blocks": dict(intermediate_size=384, v_head_dim=32), "ragged": dict(intermediate_size=320, v_head_dim=64)}


def _quantizer():
    return quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK]))


def _released_fp8(name: str, w: torch.Tensor, quantizer=None):
    """(fp8 weight, scale_inv) of w by transformers' Fp8Quantize, through whole blocks (see module doc)."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK))
    out = Fp8Quantize(quantizer or _quantizer()).convert({name: padded})
    return out[name][:rows, :cols].contiguous(), out[name + "_scale_inv"]


def _transformers_dequantized(q: torch.Tensor, scale_inv: torch.Tensor, dtype, quantizer=None) -> torch.Tensor:
    """transformers' own Fp8Dequantize arithmetic on q (zero-padded to whole blocks, then cropped)."""
    rows, cols = q.shape
    padded = torch.nn.functional.pad(q.float(), (0, -cols % BLOCK, 0, -rows % BLOCK)).to(q.dtype)
    return Fp8Dequantize(quantizer or _quantizer())._dequantize_one(padded, scale_inv, dtype)[:rows, :cols]


def _is_released_fp8(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's index: the Linear weights are FP8; embeddings, lm_head, norms and the router are not, nor the
    MTP layer's own eh_proj and shared_head (its decoder layer's Linears are)."""
    return t.dim() == 2 and not any(s in name for s in ("embed_tokens", "lm_head", "norm", "mlp.gate.weight",
                                                         "eh_proj", "shared_head"))


def _build(kind: str, root, layers: int = 2):
    torch.manual_seed(7)
    cfg = transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=256, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        moe_intermediate_size=128, num_hidden_layers=layers, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=96,
        q_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, tie_word_embeddings=False, rms_norm_eps=1e-6, **SIZES[kind])
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.05)
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    return root / "bf16"


def _make_released(src, dst):
    """src's bf16 weights as DeepSeek-V3 releases them: FP8 Linear weights with their scales, two shards
    and model.safetensors.index.json, config.json with the quantization_config. {name: tensor} written."""
    dst.mkdir()
    files = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if _is_released_fp8(name, t):
            files[name], files[name + "_scale_inv"] = _released_fp8(name, t)
        else:
            files[name] = t
    names = sorted(files)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: files[k] for k in keys}, str(dst / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in files.values())},
             "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    conf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(conf, quantization_config=QUANT)))
    return files


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind)
            src = _build(kind, root)
            made[kind] = (src, root / "fp8", _make_released(src, root / "fp8"))
        return made[kind]
    return get


def cli(*args, ok=True):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (res.exit_code == 0) == ok, res.output
    return res.output


def saved(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def transformers_model(path, dtype, monkeypatch):
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        monkeypatch.setattr(quantizer_finegrained_fp8, "is_accelerate_available", lambda: True)  # module doc
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    monkeypatch.undo()
    return model.eval()


def logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
        if a.dtype == torch.float8_e4m3fn else a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_release_reads_as_transformers_dequantizes_it(released, tmp_path, monkeypatch, dtype):
    """from-hf of the release as downloaded (index, scales, quantization_config): to-hf of it holds the
    weights transformers' own FP8 loading computes, bit for bit, in bf16 and, asked for fp32, in fp32
    (computed from the FP8 bytes, not through bf16); transformers computes the same logits from both."""
    _, fp8, files = released("blocks")
    ckpt = open_checkpoint(fp8)
    q = ckpt.source.extra["quantization"]
    assert q["tensors"] == sum(k.endswith("_scale_inv") for k in files) == 2 * 5 + 3 + 4 * 3 + 3  # attention x2, dense MLP, experts, shared
    assert (q["weight_block_size"], q["scale_dtype"]) == ([128, 128], "float32")
    assert ckpt.tensors["layers.1.mlp.experts.3.down.weight"].dtype == torch.bfloat16
    out = tmp_path / "hf"
    cli("to-hf", fp8, out, *(["--dtype", "fp32"] if dtype == torch.float32 else []))
    assert not any(k.endswith("_scale_inv") for k in saved(out))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    theirs, ours = transformers_model(fp8, dtype, monkeypatch), transformers_model(out, dtype, monkeypatch)
    a, b = theirs.state_dict(), ours.state_dict()
    assert sorted(a) == sorted(b)
    assert a["model.layers.0.mlp.down_proj.weight"].dtype == dtype
    for k in a:
        assert bytes_equal(a[k], b[k]), k
    assert torch.equal(logits(theirs), logits(ours))


def test_partial_edge_blocks_dequantize_with_transformers_arithmetic(released):
    """Dimensions with a whole block and a partial one (320, 192 rows): each canonical weight equals
    transformers' Fp8Dequantize arithmetic applied block by block (the stored weight zero-padded to whole
    blocks: transformers 5.24 on CPU refuses this grid itself)."""
    _, fp8, files = released("ragged")
    ckpt = open_checkpoint(fp8)
    by_hf = {"model.layers.0.mlp.up_proj.weight": "layers.0.mlp.up.weight",
             "model.layers.0.mlp.down_proj.weight": "layers.0.mlp.down.weight",
             "model.layers.1.self_attn.kv_b_proj.weight": "layers.1.attn.kv_up.weight",
             "model.layers.1.mlp.experts.2.gate_proj.weight": "layers.1.mlp.experts.2.gate.weight"}
    for hf_name, name in by_hf.items():
        q, scale = files[hf_name], files[hf_name + "_scale_inv"]
        want = _transformers_dequantized(q, scale, torch.bfloat16)
        got = ckpt.tensors[name].load()
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    ragged = [k for k, t in files.items() if t.dtype == torch.float8_e4m3fn and any(
        n > BLOCK and n % BLOCK for n in t.shape)]
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"} <= set(ragged)


@pytest.mark.parametrize("stored", ["float8_e8m0fnu", "uint8"])
def test_ue8m0_scales_dequantize_as_transformers_reads_them(released, tmp_path, stored):
    """scale_fmt ue8m0 (power-of-two scales, as transformers' quantizer writes them with that format):
    stored as float8_e8m0fnu or as exponent bytes, each weight reads as transformers dequantizes it."""
    _, fp8, files = released("blocks")
    conf = dict(QUANT, scale_fmt="ue8m0")
    quantizer = quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer(FineGrainedFP8Config(
        weight_block_size=[BLOCK, BLOCK], scale_fmt="ue8m0"))
    out, want = {}, {}
    for k, t in files.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[k] = t
            continue
        q, scale = _released_fp8(k, _transformers_dequantized(t, files[k + "_scale_inv"], torch.bfloat16), quantizer)
        assert scale.dtype == torch.float8_e8m0fnu
        out[k], out[k + "_scale_inv"] = q, scale if stored == "float8_e8m0fnu" else scale.view(torch.uint8)
        want[k] = _transformers_dequantized(q, out[k + "_scale_inv"], torch.bfloat16, quantizer)
    d = tmp_path / "ue8m0"
    d.mkdir()
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(dict(json.loads((fp8 / "config.json").read_text()),
                                                   quantization_config=conf)))
    ckpt = open_checkpoint(d)
    assert ckpt.source.extra["quantization"]["scale_dtype"] == stored
    from ckptool.formats.hf.reader import read_entries
    from ckptool.formats.hf import fp8 as hf_fp8
    read = hf_fp8.dequantize_entries(read_entries(d), json.loads((d / "config.json").read_text()), d)
    for k, w in want.items():
        assert torch.equal(read[k].load(), w), k


@pytest.mark.parametrize("kind", ["ragged", "blocks"])
def test_to_hf_fp8_writes_the_release_back(released, tmp_path, monkeypatch, kind):
    """to-hf --fp8 writes the release's bytes and scales: from the FP8 directory (its stored bytes), from
    the bf16 model (quantized as transformers quantizes), and after a trip through Megatron at TP 2 x EP 2 (bf16
    there, quantized again: a block's amax comes back exactly, so every byte and scale does);
    transformers loads the --fp8 output and computes the release's logits."""
    src, fp8, files = released(kind)
    cli("from-hf", fp8, tmp_path / "meg", "--tp", 2, "--ep", 2)
    for source, out in ((fp8, "direct"), (src, "from_bf16"), (tmp_path / "meg", "through_megatron")):
        assert "(DeepseekV3ForCausalLM, bfloat16, block FP8 e4m3 128x128)" in cli("to-hf", source, tmp_path / out, "--fp8")
        got = saved(tmp_path / out)
        assert sorted(got) == sorted(files), out
        for k, want in files.items():
            assert bytes_equal(got[k], want), (out, k)
        conf = json.loads((tmp_path / out / "config.json").read_text())
        assert conf["quantization_config"] == QUANT and conf["dtype"] == "bfloat16"
    if kind == "blocks":  # transformers' CPU dequantize tiles these dimensions right (see SIZES)
        want = logits(transformers_model(fp8, torch.bfloat16, monkeypatch))
        assert torch.equal(logits(transformers_model(tmp_path / "through_megatron", torch.bfloat16, monkeypatch)), want)


def _with_mtp_layer(deeper, dst):
    """deeper's last layer as the MTP layer of the model one layer shallower, as DeepSeek-V3 releases it (its own
    enorm, hnorm, eh_proj, shared_head.norm beside the decoder layer, and copies of embed_tokens and the head)."""
    dst.mkdir()
    sd = load_file(str(deeper / "model.safetensors"))
    conf = json.loads((deeper / "config.json").read_text())
    last, h = conf["num_hidden_layers"] - 1, conf["hidden_size"]
    pre = f"model.layers.{last}."
    sd.update({pre + "enorm.weight": torch.rand(h) + 0.5, pre + "hnorm.weight": torch.rand(h) + 0.5,
               pre + "shared_head.norm.weight": torch.rand(h) + 0.5, pre + "eh_proj.weight": torch.randn(h, 2 * h) * 0.05,
               pre + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
               pre + "shared_head.head.weight": sd["lm_head.weight"].clone()})
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(dict(conf, num_hidden_layers=last, num_nextn_predict_layers=1)))
    return dst


def test_deepseek_as_downloaded_with_its_mtp_layer(tmp_path):
    """DeepSeek-V3 exactly as downloaded: block FP8 (the MTP layer's decoder Linears too), the index, the
    quantization_config and the MTP layer, read with no hand editing; through Megatron at EP 2 and `to-hf --fp8`
    back, every byte and scale of the release, the MTP layer's included."""
    src = _with_mtp_layer(_build("blocks", tmp_path, layers=3), tmp_path / "with_mtp")
    files = _make_released(src, tmp_path / "release")
    assert "model.layers.2.mlp.experts.0.up_proj.weight_scale_inv" in files  # the MTP decoder layer is FP8
    ckpt = open_checkpoint(tmp_path / "release")
    assert ckpt.config.mtp_num_layers == 1 and ckpt.config.num_layers == 2
    cli("from-hf", tmp_path / "release", tmp_path / "meg", "--ep", 2)
    cli("to-hf", tmp_path / "meg", tmp_path / "back", "--fp8")
    got = saved(tmp_path / "back")
    assert sorted(got) == sorted(files)
    for k, want in files.items():
        assert bytes_equal(got[k], want), k


def test_fp8_is_refused_where_no_release_is_fp8(tmp_path):
    """--fp8 for a family not released in block FP8 (Llama), and for a writer that does not honour it, is
    refused by name; nothing is left at the target."""
    llama = str(ROOT / "fixtures/llama_legacy_norm_tp2pp1/hf")
    res = CliRunner().invoke(main, ["to-hf", llama, str(tmp_path / "out"), "--fp8"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--fp8" in res.output and "LlamaForCausalLM is not released in block FP8" in res.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(CkptError, match="--fp8 stores the Linear weights in block FP8; --format torch does not"):
        refuse_unhonoured(BY_OUTPUT["torch"], build_write_options(fp8=True))


def test_inspect_shows_the_fp8_blocks_without_torch(released, monkeypatch):
    """inspect (the quick path, without torch, and the full reader alike) shows the quantization."""
    from test_quick_inspect import quick_equals_full
    _, fp8, files = released("blocks")
    doc = json.loads(quick_equals_full(monkeypatch, fp8))
    assert doc["quantization"] == {"method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                   "activation_scheme": "dynamic", "scale_fmt": "float", "scale_dtype": "float32",
                                   "tensors": sum(k.endswith("_scale_inv") for k in files), "read_as": "bfloat16"}
    assert doc["storage"].startswith("block FP8 (28 weights float8_e4m3fn in 128x128 blocks")
    assert {t["dtype"] for t in doc["tensors"]} == {"bfloat16"}
    assert not any("scale" in t["name"] for t in doc["tensors"])


@pytest.mark.parametrize("change, says", [
    ({"config": {"quantization_config": dict(QUANT, quant_method="bitsandbytes")}}, "quantization bitsandbytes/e4m3"),
    ({"config": {"quantization_config": dict(QUANT, activation_scheme="static")}}, "activation_scheme 'static'"),
    ({"scale": torch.ones(1, 1)}, "has shape (1, 1), expected (1, 2) for (128, 256)"),
    ({"scale": None}, "FP8 tensors without a weight_scale_inv"),
])
def test_bad_fp8_checkpoints_are_refused_in_one_line(released, tmp_path, change, says):
    _, fp8, files = released("blocks")
    bad = tmp_path / "bad"
    bad.mkdir()
    files = dict(files)
    key = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    if "scale" in change:
        files.pop(key)
        if change["scale"] is not None:
            files[key] = change["scale"]
    save_file(files, str(bad / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((fp8 / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(conf, **change.get("config", {}))))
    for args in (("to-hf", bad, tmp_path / "out"), ("inspect", bad)):
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1 and says in res.output, res.output
    assert not (tmp_path / "out").exists()
