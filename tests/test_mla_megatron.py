"""Multi-Latent Attention (DeepSeek-V3) in the Megatron torch format (megatron-core, local spec): from-hf at
TP1 / TP2 (PP2, EP2), reshard, to-hf: every tensor bit-exact, transformers' logits equal; with a q latent and
a direct q. The refusals that stay (YaRN, ds-universal, the legacy dialects) are one line each, by name."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_moe import COMMON, _one_line_refusal, cli, family, hf_logits, randomise, saved_tensors, transformers  # noqa: F401

from ckptool.formats.registry import open_checkpoint

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


def _dense_deepseek(tmp_path_factory, seed: int, q_lora_rank, name: str):
    """The same attention, every layer's MLP dense (megatron-core's MLA model then needs no MoE routing)."""
    torch.manual_seed(seed)
    t = transformers
    model = randomise(t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4), intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=2,
        kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6))).eval()
    path = tmp_path_factory.mktemp("mla") / name
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def deepseek_dense(tmp_path_factory):
    return _dense_deepseek(tmp_path_factory, 29, 20, "deepseek_v3_dense")


@pytest.fixture(scope="module")
def deepseek_dense_direct_q(tmp_path_factory):
    """No q latent (q_lora_rank None, as DeepSeek-V2-Lite): q straight from the input, megatron-core's linear_q_proj."""
    return _dense_deepseek(tmp_path_factory, 31, None, "deepseek_v3_dense_direct_q")


@pytest.mark.parametrize("kind, tp", [("deepseek_dense", 1), ("deepseek_dense", 2), ("deepseek_dense_direct_q", 2)])
def test_megatron_core_loads_our_mla_strictly_and_computes_transformers_logits(request, tmp_path, kind, tp):
    """megatron-core's MLASelfAttention (local spec) loads our TP output with load_state_dict(strict=True) and its
    fp32 forward matches transformers' DeepseekV3 within 1e-5 relative: the names, TP rules and row orders
    (q_up and a direct q per head [nope | rope], kv_down [latent | rope], kv_up per head [k nope | v]) are
    megatron-core's, with a q latent and without one (linear_q_proj)."""
    src, model = request.getfixturevalue(kind)
    cli("from-hf", src, tmp_path / "meg", "--tp", tp)
    out = tmp_path / "logits.pt"
    helper = Path(__file__).with_name("mcore_mla_helper.py")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                          "--master-port", str(29600 + tp + 10 * (model.config.q_lora_rank is None)), str(helper), str(tmp_path / "meg"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from mcore_dist_helper import TOKENS
    saved = torch.load(out)
    got = saved["logits"][..., :100]  # [b, s, padded vocab]
    ours = torch.load(tmp_path / "meg" / "iter_0000000" / "mp_rank_00" /
                      "model_optim_rng.pt", weights_only=False)["model"]
    layer0 = [k for k in ours if k.startswith("decoder.layers.0.") and not k.endswith("_extra_state")]
    assert layer0 == [n for n in saved["params"] if n.startswith("decoder.layers.0.")]  # megatron-core's order
    direct = model.config.q_lora_rank is None
    assert ("decoder.layers.0.self_attention.linear_q_proj.weight" in ours) == direct
    assert ("decoder.layers.0.self_attention.linear_q_down_proj.weight" in ours) != direct
    want = hf_logits(model, TOKENS)
    assert got.shape == want.shape
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    # ckptool's own reads of it: an all-dense DeepSeek keeps --num-experts in its args (every layer dense by
    # --moe-layer-freq); the one-process verify runs MLA, the parallel verify refuses it by name
    assert "result=PASS" in cli("verify", tmp_path / "meg", "--reference", src)
    if tp == 2 and not direct:
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                              "29611", "-m", "ckptool", "verify", str(tmp_path / "meg"), "--reference", str(src)],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode != 0 and "does not run Multi-Latent Attention yet" in res.stdout + res.stderr


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
    ("from-hf", "deepseek_v3", ("--dialect", "legacy-norm"), "the legacy-norm dialect predates MLA"),
    ("from-hf", "deepseek_v3_yarn", (), "YaRN")])
def test_mla_megatron_refusals_stay_named(family, tmp_path, command, kind, more, says):
    src, _ = family(kind)
    out = tmp_path / "meg"
    _one_line_refusal(command, src, out, "--tp", 2, *more, says=["Multi-Latent Attention", says])
    assert not out.exists()
