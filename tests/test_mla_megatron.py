"""Multi-Latent Attention (DeepSeek-V3) in the Megatron torch format (megatron-core, local spec): from-hf at
TP1 / TP2 (PP2, EP2), reshard, to-hf: every tensor bit-exact, transformers' logits equal; with a q latent and
a direct q; YaRN and rope_interleave false as megatron-core computes them (docs/fidelity.md). The refusals that
stay (ds-universal, the legacy dialects, YaRN without truncation) are one line each, by name."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_moe import COMMON, _one_line_refusal, cli, family, hf_logits, randomise, saved_tensors, transformers  # noqa: F401

from ckptool.formats.registry import open_checkpoint
from conftest import free_port

MLA_KEYS = ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
            "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """test_moe's tiny DeepSeek-V3 with routing Megatron computes too: top-4 over the best 2 of 4 groups (a group
    scored by its top 4/2 = 2 experts, as Hugging Face does); MLA with a q latent, layer 0 dense."""
    torch.manual_seed(23)
    t = transformers
    model = randomise(t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4), intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=20,
        qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, norm_topk_prob=True))).eval()
    path = tmp_path_factory.mktemp("mla") / "deepseek_v3"
    model.save_pretrained(path)
    return path, model


# YaRN as DeepSeek-V3 has it (factor 40) with the correction range, mscales and original context moved off
# megatron-core's defaults, so every one of them has to reach megatron-core through the args ckptool writes
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 512,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.8}
DENSE_KINDS = {"rope": {}, "yarn": {"rope_parameters": YARN}, "halves": {"rope_interleave": False},
               "yarn_halves": {"rope_parameters": YARN, "rope_interleave": False},
               "direct_q": {"q_lora_rank": None}}  # no q latent (as DeepSeek-V2-Lite): megatron-core's linear_q_proj


@pytest.fixture(scope="module")
def deepseek_dense(tmp_path_factory):
    """kind -> (dir, model): the same attention, every layer's MLP dense (megatron-core's MLA model then needs no MoE
    routing); plain RoPE, YaRN, RoPE on halves (rope_interleave false) or both, or a direct q."""
    built = {}

    def get(kind):
        if kind not in built:
            torch.manual_seed(29)
            t = transformers
            model = randomise(t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
                **dict(COMMON, num_key_value_heads=4), intermediate_size=64, num_hidden_layers=2,
                first_k_dense_replace=2, kv_lora_rank=12, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6,
                **{"q_lora_rank": 20, **DENSE_KINDS[kind]}))).eval()
            path = tmp_path_factory.mktemp("mla") / f"deepseek_v3_dense_{kind}"
            model.save_pretrained(path)
            built[kind] = path, model
        return built[kind]
    return get


def mcore_mla_logits(meg: Path, out: Path, tp: int) -> dict:
    """megatron-core's own MLA GPTModel built from meg's args, loaded strictly: {logits, params} (mcore_mla_helper)."""
    helper = Path(__file__).with_name("mcore_mla_helper.py")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                          "--master-port", str(free_port()), str(helper), str(meg), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def relative_error(got, want) -> float:
    assert got.shape == want.shape
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kind, tp", [("rope", 1), ("rope", 2), ("yarn", 2), ("halves", 1), ("direct_q", 2)])
def test_megatron_core_loads_our_mla_strictly_and_computes_transformers_logits(deepseek_dense, tmp_path, kind, tp):
    """megatron-core's MLASelfAttention (local spec) loads our TP output with load_state_dict(strict=True) and its
    fp32 forward matches transformers' DeepseekV3 within 1e-5 relative: the names, TP rules and row orders
    (q_up per head [nope | rope], kv_down [latent | rope], kv_up per head [k nope | v]) are megatron-core's; YaRN is
    megatron-core's YarnRotaryEmbedding from the args we write; a model rotating RoPE halves runs as megatron-core's
    interleaved pairs with its rope rows reordered."""
    src, model = deepseek_dense(kind)
    cli("from-hf", src, tmp_path / "meg", "--tp", tp)
    from mcore_dist_helper import TOKENS
    saved = mcore_mla_logits(tmp_path / "meg", tmp_path / "logits.pt", tp)
    got = saved["logits"][..., :100]  # [b, s, padded vocab]
    ours = torch.load(tmp_path / "meg" / "iter_0000000" / "mp_rank_00" /
                      "model_optim_rng.pt", weights_only=False)
    layer0 = [k for k in ours["model"] if k.startswith("decoder.layers.0.") and not k.endswith("_extra_state")]
    assert layer0 == [n for n in saved["params"] if n.startswith("decoder.layers.0.")]  # megatron-core's order
    direct = model.config.q_lora_rank is None
    assert ("decoder.layers.0.self_attention.linear_q_proj.weight" in ours["model"]) == direct
    assert ("decoder.layers.0.self_attention.linear_q_down_proj.weight" in ours["model"]) != direct
    want = hf_logits(model, TOKENS)
    assert relative_error(got, want) < 1e-5
    args, cfg = ours["args"], open_checkpoint(tmp_path / "meg").config
    if kind == "yarn":
        assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == ("yarn", 40.0, 1.0, 0.8)
        assert (args.original_max_position_embeddings, args.beta_fast, args.beta_slow) == (512, 16.0, 2.0)
        assert cfg.rope_yarn == open_checkpoint(src).config.rope_yarn  # read back as it was
        plain = open_checkpoint(tmp_path / "meg")  # and it matters at this length: without it the logits move
        plain = plain.with_tensors(plain.tensors, rope_yarn=None)
        from ckptool.verify import reference
        assert relative_error(reference.forward(plain, TOKENS)[..., :100], want) > 1e-2
    else:
        assert args.rope_type == "rope" and cfg.rope_yarn is None  # said, or megatron-core's MLA would take yarn
    if kind == "halves":  # stored as interleaved pairs: to-hf says so, and computes the same
        assert cfg.rotary_interleaved
        cli("to-hf", tmp_path / "meg", tmp_path / "hf")
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_interleave"] is True
        assert relative_error(hf_logits(tmp_path / "hf", TOKENS), want) < 1e-5
    # ckptool's own reads of it: an all-dense DeepSeek keeps --num-experts in its args (every layer dense by
    # --moe-layer-freq); the one-process verify runs MLA
    assert "result=PASS" in cli("verify", tmp_path / "meg", "--reference", src)


def _layer0(path, rank):
    sd = torch.load(path / "iter_0000000" / rank / "model_optim_rng.pt", weights_only=False)
    return sd, {k: v for k, v in sd["model"].items() if k.startswith("decoder.layers.0.self_attention.")}


@pytest.mark.parametrize("tp, more", [(1, ()), (2, ("--pp", 2, "--ep", 2))])
def test_deepseek_mla_through_megatron_torch(deepseek, tmp_path, tp, more):
    src, model = deepseek
    cli("from-hf", src, tmp_path / "a", "--tp", tp, *more)
    rank = "mp_rank_00" if not more else "mp_rank_00_000_000"
    sd, att = _layer0(tmp_path / "a", rank)
    for k in MLA_KEYS:
        assert "decoder.layers.0.self_attention." + k in att, sorted(att)
    assert not any("linear_qkv" in k for k in sd["model"])
    args = sd["args"]
    assert args.multi_latent_attention and args.qk_layernorm and (args.q_lora_rank, args.kv_lora_rank) == (20, 12)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (6, 8, 10)
    conf = model.config
    # local spec: every MLA linear column-parallel, the down projections too; latent norms whole
    pre = "decoder.layers.0.self_attention."
    assert att[pre + "linear_kv_down_proj.weight"].shape == ((12 + 8) // tp, 32)
    assert att[pre + "linear_q_down_proj.weight"].shape == (20 // tp, 32)
    assert att[pre + "linear_q_up_proj.weight"].shape == (4 * (6 + 8) // tp, 20)
    assert att[pre + "linear_kv_up_proj.weight"].shape == (4 * (6 + 10) // tp, 12)
    assert att[pre + "kv_layernorm.weight"].shape == (12,)
    want = model.state_dict()
    hf0 = "model.layers.0.self_attn."
    assert torch.equal(att[pre + "linear_kv_up_proj.weight"], want[hf0 + "kv_b_proj.weight"].chunk(tp)[0])
    assert torch.equal(att[pre + "q_layernorm.weight"], want[hf0 + "q_a_layernorm.weight"])
    assert conf.q_lora_rank == 20
    back = open_checkpoint(tmp_path / "a")
    assert back.config.mla == open_checkpoint(src).config.mla and not back.config.qk_layernorm
    cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", 2 if tp == 1 else 1)
    cli("to-hf", tmp_path / "b", tmp_path / "hf")
    # megatron-core's MLA always rotates interleaved pairs (DeepSeek's rope_interleave): no flag says so
    assert not args.rotary_interleaved and open_checkpoint(tmp_path / "a").config.rotary_interleaved
    want, got = saved_tensors(src), saved_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(model))


@pytest.mark.parametrize("command, kind, more, says", [
    ("reshard", "deepseek_v3", ("--format", "ds-universal"), "Megatron ds-universal output of MLA models"),
    ("from-hf", "deepseek_v3", ("--dialect", "legacy-norm"), "the legacy-norm dialect predates MLA")])
def test_mla_megatron_refusals_stay_named(family, tmp_path, command, kind, more, says):
    src, _ = family(kind)
    out = tmp_path / "meg"
    _one_line_refusal(command, src, out, "--tp", 2, *more, says=["Multi-Latent Attention", says])
    assert not out.exists()


def test_deepseek_moe_with_yarn_through_megatron_torch(tmp_path):
    """The MoE DeepSeek above with YaRN (mscale 0.7 / mscale_all_dim 1.0: cos/sin and the softmax both scaled) at TP2
    PP2 EP2 and back: the YaRN settings survive the args, every tensor bit-exact, the same logits."""
    torch.manual_seed(31)
    t = transformers
    model = randomise(t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4, rope_parameters=dict(YARN, factor=4.0, mscale=0.7, mscale_all_dim=1.0)),
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, n_shared_experts=1, n_routed_experts=4,
        kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True))).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    cli("from-hf", src, tmp_path / "meg", "--tp", 2, "--pp", 2, "--ep", 2)
    args = torch.load(tmp_path / "meg" / "iter_0000000" / "mp_rank_00_000_000" / "model_optim_rng.pt",
                      weights_only=False)["args"]
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == ("yarn", 4.0, 0.7, 1.0)
    assert open_checkpoint(tmp_path / "meg").config.rope_yarn == open_checkpoint(src).config.rope_yarn
    cli("to-hf", tmp_path / "meg", tmp_path / "hf")
    want, got = saved_tensors(src), saved_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(model))


def _yarn_variant(src: Path, dst: Path, change: dict) -> Path:
    """A copy of the HF model src whose YaRN settings are changed."""
    shutil.copytree(src, dst)
    conf = json.loads((dst / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        if conf.get(key):
            conf[key].update(change)
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


def test_yarn_megatron_core_cannot_compute_is_refused(deepseek_dense, tmp_path):
    src = _yarn_variant(deepseek_dense("yarn")[0], tmp_path / "src", {"truncate": False})
    _one_line_refusal("from-hf", src, tmp_path / "meg", "--tp", 2, says=[
        "Multi-Latent Attention", "YaRN truncate=false: megatron-core's MLA always rounds the correction range"])
    assert not (tmp_path / "meg").exists()


@pytest.mark.parametrize("change, gain", [({"attention_factor": 1.5}, 1.5),
                                          ({"mscale": None}, 1 + 0.1 * math.log(40))])
def test_yarn_gains_megatron_core_reaches_through_mscale(deepseek_dense, tmp_path, change, gain):
    """An explicit attention factor, or mscale_all_dim without mscale (transformers then takes the plain
    correction 0.1 ln f + 1): megatron-core's gain is (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1), so
    ckptool writes the mscale that gives transformers' gain; read back, the Megatron checkpoint computes the
    transformers model's logits."""
    src = _yarn_variant(deepseek_dense("yarn")[0], tmp_path / "src", change)
    cli("from-hf", src, tmp_path / "meg")
    args = torch.load(next((tmp_path / "meg").glob("*/mp_rank_00/model_optim_rng.pt")), weights_only=False)["args"]
    f, m = args.rotary_scaling_factor, lambda ms: 0.1 * ms * math.log(args.rotary_scaling_factor) + 1
    assert f == 40.0 and args.mscale_all_dim == 0.8 and abs(m(args.mscale) / m(0.8) - gain) < 1e-12
    back = open_checkpoint(tmp_path / "meg")
    assert abs(back.config.rope_yarn.attention_gain - gain) < 1e-12
    from ckptool.verify import reference
    from mcore_dist_helper import TOKENS
    want = hf_logits(src, TOKENS)
    assert relative_error(reference.forward(back, TOKENS)[..., :100], want) < 1e-5
