"""Multi-Latent Attention (DeepSeek-V2/V3) in Megatron's torch format (megatron-core local and Transformer-Engine
names) and torch_dist: from-hf at TP1 / TP2 (PP2, EP2), reshard, to-hf: every tensor bit-exact, transformers' logits
equal; with a q latent and a direct q; YaRN and rope_interleave false as megatron-core computes them
(docs/fidelity.md). The refusals that stay (ds-universal, the legacy dialects, YaRN without truncation) are one line
each, by name."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from test_moe import COMMON, _one_line_refusal, cli, family, hf_logits, randomise, saved_tensors, transformers  # noqa: F401

from ckptool.formats.registry import open_checkpoint
from conftest import once, shared_followups

MLA_KEYS = ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
            "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight")


def _moe_deepseek(tmp_path_factory, seed: int, q_lora_rank, layers: int, name: str):
    return _save_moe_deepseek(tmp_path_factory.mktemp("mla") / name, seed, q_lora_rank, layers)


def _save_moe_deepseek(path: Path, seed: int, q_lora_rank, layers: int):
    torch.manual_seed(seed)
    t = transformers
    model = randomise(t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4), intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=12,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True))).eval()
    model.save_pretrained(path)
    return path, model


def _deepseek(root: Path):
    return _save_moe_deepseek(root / "deepseek_v3", 23, 20, 4)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """test_moe's tiny DeepSeek-V3 with routing Megatron computes too: top-4 over the best 2 of 4 groups (a group
    scored by its top 4/2 = 2 experts, as Hugging Face does); MLA with a q latent, layer 0 dense. Built once (for
    test_verify_mla's steps too)."""
    return once(_deepseek, lambda: tmp_path_factory.mktemp("mla"))


@pytest.fixture(scope="module")
def deepseek_direct_q(tmp_path_factory):
    """The same routing, MLA without a q latent, two layers (layer 1 MoE)."""
    return _moe_deepseek(tmp_path_factory, 37, None, 2, "deepseek_v3_direct_q")


# YaRN as DeepSeek-V3 has it (factor 40) with the correction range, mscales and original context moved off
# megatron-core's defaults, so every one of them has to reach megatron-core through the args ckptool writes
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 512,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.8}
DENSE_KINDS = {"rope": {}, "yarn": {"rope_parameters": YARN}, "halves": {"rope_interleave": False},
               "yarn_halves": {"rope_parameters": YARN, "rope_interleave": False},
               "direct_q": {"q_lora_rank": None}}  # no q latent (as DeepSeek-V2-Lite): megatron-core's linear_q_proj


def _dense_models(root: Path):
    """kind -> (dir, model) of DENSE_KINDS, each built into root when first asked for."""
    built = {}

    def get(kind):
        if kind not in built:
            torch.manual_seed(29)
            t = transformers
            model = randomise(t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
                **dict(COMMON, num_key_value_heads=4), intermediate_size=64, num_hidden_layers=2,
                first_k_dense_replace=2, kv_lora_rank=12, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6,
                **{"q_lora_rank": 20, **DENSE_KINDS[kind]}))).eval()
            path = root / f"deepseek_v3_dense_{kind}"
            model.save_pretrained(path)
            built[kind] = path, model
        return built[kind]
    return get


@pytest.fixture(scope="module")
def deepseek_dense(tmp_path_factory):
    """kind -> (dir, model): the same attention, every layer's MLP dense (megatron-core's MLA model then needs no MoE
    routing); plain RoPE, YaRN, RoPE on halves (rope_interleave false) or both, or a direct q. The same models (and
    files) as mla_runs' below."""
    return once(_dense_models, lambda: tmp_path_factory.mktemp("mla"))


MLA_HELPER = Path(__file__).with_name("mcore_mla_helper.py")
# test_megatron_core_loads_our_mla_strictly_...: (dense kind, TP of ckptool's from-hf output)
LOADS = [("rope", 1), ("rope", 2), ("yarn", 2), ("halves", 1), ("direct_q", 2)]


@shared_followups
def mla_runs(framework_runs, d):
    """ckptool's outputs the three megatron-core tests below load, and megatron-core's runs on them
    (tests/mcore_mla_helper.py's jobs 'DIR [--tp T] [--dist] [--save-dist DIR2] --out FILE': megatron-core's own MLA
    GPTModel built from the checkpoint's args and loaded strictly; {logits, params, moe_layers} into FILE), in two
    rounds of 2 processes (a TP 1 job runs at DP 2: each rank loads the whole model; each job's file NAME.pt beside
    its checkpoint): LOADS (NAME KIND_tpTP/meg), the all-dense model's torch format and torch_dist (dense/meg,
    dense/dist, at TP 1), megatron-core's own TP 2 torch_dist save of the rope model (mcore/mcore_dist, from
    mcore/meg), then ckptool's TP 1 torch_dist of that save (mcore/ours) loaded at TP 1 (the second round: it starts
    from the first's save). Each test checks its own conversions' output here."""
    deepseek_dense = once(_dense_models, lambda: d / "models")
    jobs = []
    for kind, tp in LOADS:
        out = d / f"{kind}_tp{tp}" / "meg"
        cli("from-hf", deepseek_dense(kind)[0], out, "--tp", tp)
        jobs.append(f"{out} --tp {tp} --out {out}.pt")
    src = deepseek_dense("rope")[0]
    cli("from-hf", src, d / "dense" / "meg")
    cli("reshard", d / "dense" / "meg", d / "dense" / "dist", "--tp", 1, "--format", "torch_dist")
    jobs += [f"{d / 'dense' / 'meg'} --tp 1 --out {d / 'dense' / 'meg'}.pt",
             f"{d / 'dense' / 'dist'} --tp 1 --dist --out {d / 'dense' / 'dist'}.pt"]
    cli("from-hf", src, d / "mcore" / "meg", "--tp", 2)
    jobs.append(f"{d / 'mcore' / 'meg'} --tp 2 --save-dist {d / 'mcore' / 'mcore_dist'} --out {d / 'mcore' / 'meg'}.pt")
    yield [(MLA_HELPER, 2, jobs)]
    cli("reshard", d / "mcore" / "mcore_dist", d / "mcore" / "ours", "--tp", 1, "--format", "torch_dist")
    yield [(MLA_HELPER, 2, [f"{d / 'mcore' / 'ours'} --tp 1 --dist --out {d / 'mcore' / 'ours'}.pt"])]
    return d


def ran(path: Path) -> dict:
    """What megatron-core's job on the checkpoint at path saved: {logits, params, moe_layers}."""
    return torch.load(f"{path}.pt")


def relative_error(got, want) -> float:
    assert got.shape == want.shape
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kind, tp", LOADS)
def test_megatron_core_loads_our_mla_strictly_and_computes_transformers_logits(deepseek_dense, mla_runs, tmp_path, kind,
                                                                               tp):
    """megatron-core's MLASelfAttention (local spec) loads our TP output with load_state_dict(strict=True) and its
    fp32 forward matches transformers' DeepseekV3 within 1e-5 relative: the names, TP rules and row orders
    (q_up per head [nope | rope], kv_down [latent | rope], kv_up per head [k nope | v]) are megatron-core's; YaRN is
    megatron-core's YarnRotaryEmbedding from the args we write; a model rotating RoPE halves runs as megatron-core's
    interleaved pairs with its rope rows reordered."""
    src, model = deepseek_dense(kind)
    meg = mla_runs / f"{kind}_tp{tp}" / "meg"  # ckptool's from-hf at TP tp (mla_runs)
    from mcore_dist_helper import TOKENS
    saved = ran(meg)
    got = saved["logits"][..., :100]  # [b, s, padded vocab]
    ours = torch.load(meg / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    layer0 = [k for k in ours["model"] if k.startswith("decoder.layers.0.") and not k.endswith("_extra_state")]
    assert layer0 == [n for n in saved["params"] if n.startswith("decoder.layers.0.")]  # megatron-core's order
    direct = model.config.q_lora_rank is None
    assert ("decoder.layers.0.self_attention.linear_q_proj.weight" in ours["model"]) == direct
    assert ("decoder.layers.0.self_attention.linear_q_down_proj.weight" in ours["model"]) != direct
    want = hf_logits(model, TOKENS)
    assert relative_error(got, want) < 1e-5
    args, cfg = ours["args"], open_checkpoint(meg).config
    if kind == "yarn":
        assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == ("yarn", 40.0, 1.0, 0.8)
        assert (args.original_max_position_embeddings, args.beta_fast, args.beta_slow) == (512, 16.0, 2.0)
        assert cfg.rope_yarn == open_checkpoint(src).config.rope_yarn  # read back as it was
        plain = open_checkpoint(meg)  # and it matters at this length: without it the logits move
        plain = plain.with_tensors(plain.tensors, rope_yarn=None)
        from ckptool.verify import reference
        assert relative_error(reference.forward(plain, TOKENS)[..., :100], want) > 1e-2
    else:
        assert args.rope_type == "rope" and cfg.rope_yarn is None  # said, or megatron-core's MLA would take yarn
    if kind == "halves":  # stored as interleaved pairs: to-hf says so, and computes the same
        assert cfg.rotary_interleaved
        cli("to-hf", meg, tmp_path / "hf")
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_interleave"] is True
        assert relative_error(hf_logits(tmp_path / "hf", TOKENS), want) < 1e-5
    # megatron-core built it from our args as a dense model (test_all_dense_deepseek_...); the one-process verify
    # runs MLA
    assert saved["moe_layers"] == 0
    assert "result=PASS" in cli("verify", meg, "--reference", src)


def test_all_dense_deepseek_is_written_as_a_dense_megatron_run(deepseek_dense, mla_runs, tmp_path):
    """A DeepSeek-V3 whose first_k_dense_replace covers every layer is a dense MLA model: ckptool writes a dense
    run's args (no --num-experts, --moe-layer-freq 1, no routing flags: Megatron-LM builds the MoE block spec
    whenever --num-experts is set, and a --moe-layer-freq list keys torch_dist layers one by one) and torch_dist
    with the layers stacked as a dense megatron-core model keys them. megatron-core builds the model from those
    args as Megatron-LM does (no MoE layer), loads our torch format and our torch_dist strictly, and computes
    transformers' logits (1e-5); to-hf gives a DeepseekV3 with every layer dense again."""
    from mcore_dist_helper import TOKENS
    from ckptool.io.dcp_io import DcpDir
    src, model = deepseek_dense("rope")
    assert model.config.first_k_dense_replace == model.config.num_hidden_layers
    assert open_checkpoint(src).config.moe is None
    meg, dist = mla_runs / "dense" / "meg", mla_runs / "dense" / "dist"  # from-hf, reshard to torch_dist (mla_runs)
    args = torch.load(meg / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"]
    assert getattr(args, "num_experts", None) is None and getattr(args, "moe_layer_freq", 1) == 1
    assert not getattr(args, "moe_router_enable_expert_bias", False)
    assert getattr(args, "expert_model_parallel_size", 1) == 1
    keys = set(DcpDir(dist / "iter_0000000").entries)
    assert "decoder.layers.mlp.linear_fc1.weight" in keys and not any(k.startswith("decoder.layers.0.") for k in keys)
    want = hf_logits(model, TOKENS)
    for saved in (ran(meg), ran(dist)):
        assert saved["moe_layers"] == 0
        assert relative_error(saved["logits"][..., :100], want) < 1e-5
    cli("to-hf", meg, tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["first_k_dense_replace"] == conf["num_hidden_layers"] == 2
    assert relative_error(hf_logits(tmp_path / "hf", TOKENS), want) < 1e-5


def test_torch_dist_mla_between_megatron_core_and_ckptool(deepseek_dense, mla_runs):
    """megatron-core's own dist_checkpointing saves an MLA model at TP2 (local spec: its modules' own names,
    q_layernorm the q latent norm, layers stacked); ckptool reads it bit-exact, writes it as torch_dist
    again, and megatron-core loads ours at TP1 strictly and computes transformers' logits (1e-5)."""
    from mcore_dist_helper import TOKENS
    from ckptool.io.dcp_io import DcpDir
    src, model = deepseek_dense("rope")
    want = hf_logits(model, TOKENS)
    d = mla_runs / "mcore"  # ckptool's from-hf at TP 2 (meg), megatron-core's save of it, ckptool's reshard of that
    theirs = ran(d / "meg")
    keys = set(DcpDir(d / "mcore_dist" / "iter_0000003").entries)
    assert {"decoder.layers.self_attention.q_layernorm.weight", "decoder.layers.input_layernorm.weight"} <= keys
    read, ref = open_checkpoint(d / "mcore_dist"), open_checkpoint(d / "meg")
    assert read.config.mla == ref.config.mla and sorted(read.tensors) == sorted(ref.tensors)
    for name, t in ref.tensors.items():
        assert torch.equal(read.tensors[name].load(), t.load()), name
    ours = set(DcpDir(d / "ours" / "iter_0000003").entries)
    assert {k for k in keys if ".weight" in k} == {k for k in ours if ".weight" in k}
    loaded = ran(d / "ours")
    for got in (theirs["logits"][..., :100], loaded["logits"][..., :100]):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, err


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
    cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", 2 if tp == 1 else 1, "--pp", 1, "--ep", 1)
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


def _models(path):
    """{rank dir: the model's tensors} of a torch-format checkpoint (extra state left out)."""
    return {d.name: {k: v for k, v in torch.load(d / "model_optim_rng.pt", weights_only=False)["model"].items()
                     if not k.endswith("_extra_state")} for d in sorted((path / "iter_0000000").iterdir())}


@pytest.mark.parametrize("kind", ["deepseek", "deepseek_direct_q"])
def test_mla_in_the_te_dialect_and_in_torch_dist_with_either_names(request, tmp_path, kind):
    """The mcore-te dialect's MLA layer, from megatron-core's TE spec (gpt_layer_specs
    get_gpt_layer_with_transformer_engine_spec: input_layernorm a TENorm of its own, the up projections
    TELayerNormColumnParallelLinear holding the latent norms; MLASelfAttention.__init__ makes the TELinear down
    projections parallel_mode 'duplicated', whole on every TP rank). Transformer Engine does not install here, so
    megatron-core never loads these files in a test: local -> te -> local is bit-exact file for file, and te output
    goes to Hugging Face bit-exact. torch_dist is written with the local spec's names (--dialect mcore) or the TE
    spec's (mcore-te) and read back bit-exact from either."""
    src, _ = request.getfixturevalue(kind)
    direct = kind.endswith("direct_q")
    cli("from-hf", src, tmp_path / "local", "--tp", 2)
    cli("reshard", tmp_path / "local", tmp_path / "te", "--tp", 2, "--dialect", "mcore-te")
    cli("reshard", tmp_path / "te", tmp_path / "back", "--tp", 2, "--dialect", "mcore")
    local, back, te = _models(tmp_path / "local"), _models(tmp_path / "back"), _models(tmp_path / "te")
    assert list(local) == list(back) == list(te) == ["mp_rank_00", "mp_rank_01"]
    for rank in local:
        assert list(back[rank]) == list(local[rank])
        assert all(torch.equal(back[rank][k], local[rank][k]) for k in local[rank])
    pre = "decoder.layers.1.self_attention."
    for rank in te:  # an MoE layer: the MLP norm stays pre_mlp_layernorm
        names = [k[len("decoder.layers.1."):] for k in te[rank] if k.startswith("decoder.layers.1.")]
        assert names[:2] == ["input_layernorm.weight", "self_attention.linear_proj.weight"]
        assert "pre_mlp_layernorm.weight" in names and not any("layernorm.weight" in k for k in names
                                                               if k.startswith("self_attention."))
        kv_down = local["mp_rank_00"][pre + "linear_kv_down_proj.weight"]
        assert torch.equal(te[rank][pre + "linear_kv_down_proj.weight"],  # whole on each rank
                           torch.cat([local[r][pre + "linear_kv_down_proj.weight"] for r in local]))
        assert kv_down.shape[0] * 2 == te[rank][pre + "linear_kv_down_proj.weight"].shape[0]
        assert torch.equal(te[rank][pre + "linear_kv_up_proj.layer_norm_weight"], local[rank][pre + "kv_layernorm.weight"])
        assert (pre + "linear_q_proj.weight" in te[rank]) == direct
        assert (pre + "linear_q_up_proj.layer_norm_weight" in te[rank]) != direct
        if not direct:
            assert te[rank][pre + "linear_q_down_proj.weight"].shape == (20, 32)
    want = saved_tensors(src)
    outputs = [("te", tmp_path / "te")]
    for dialect, key in (("mcore", "self_attention.kv_layernorm.weight"),
                         ("mcore-te", "self_attention.linear_kv_up_proj.layer_norm_weight")):
        cli("reshard", tmp_path / "te", tmp_path / dialect, "--tp", 1, "--format", "torch_dist", "--dialect", dialect)
        from ckptool.io.dcp_io import DcpDir
        keys = set(DcpDir(tmp_path / dialect / "iter_0000000").entries)
        assert "decoder.layers.0." + key in keys and "decoder.layers.0.input_layernorm.weight" in keys
        outputs.append((dialect, tmp_path / dialect))
    for name, path in outputs:
        cli("to-hf", path, tmp_path / f"hf_{name}")
        got = saved_tensors(tmp_path / f"hf_{name}")
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)


@pytest.mark.parametrize("dialect", ["mcore", "mcore-te"])
def test_every_reader_labels_the_q_latent_norm_of_an_mla_checkpoint(deepseek_dense, tmp_path, dialect):
    """megatron-core's q_layernorm is GQA's q norm or, in an MLA model, the q latent norm: the verify rank reader
    labels it (and the TE dialect's fused names) as the full reader does; the quick inspect matches keys with the
    same MLA flag and gives the full reader's shapes (tests/test_quick_inspect.py compares the whole output)."""
    from ckptool.formats.megatron.ranks import read_rank_shards
    from ckptool.formats.megatron import quick
    src, _ = deepseek_dense("rope")
    cli("from-hf", src, tmp_path / "meg", "--tp", 2, "--dialect", dialect)
    full = open_checkpoint(tmp_path / "meg")
    assert "layers.0.attn.q_down_norm.weight" in full.tensors and "layers.0.attn.q_norm.weight" not in full.tensors
    for t in (0, 1):
        shards = read_rank_shards(tmp_path / "meg", t, 0)
        layer0 = sorted(n for n in shards.tensors if n.startswith("layers.0."))
        assert layer0 == sorted(f"layers.0.{r}" for r in (
            "attn_norm.weight", "mla.q_down.weight", "mla.q_down_norm.weight", "mla.q_up.weight",
            "mla.kv_down.weight", "mla.kv_down_norm.weight", "mla.kv_up.weight", "proj.weight",
            "mlp_norm.weight", "fc1.weight", "fc2.weight"))
        norm = shards.tensors["layers.0.mla.q_down_norm.weight"].load()
        assert torch.equal(norm, full.tensors["layers.0.attn.q_down_norm.weight"].load())
        # TE files hold the down projections whole on each rank; the rank view the parallel forward computes with
        # is the local spec's rows either way, cut from the whole tensor for TE
        down = shards.tensors["layers.0.mla.kv_down.weight"].load()
        assert torch.equal(down, full.tensors["layers.0.attn.kv_down.weight"].load().chunk(2)[t])
        stored = torch.load(next((tmp_path / "meg").glob(f"*/mp_rank_0{t}/model_optim_rng.pt")), weights_only=False)
        rows = stored["model"]["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape[0]
        assert rows == (12 + 8) // (1 if dialect == "mcore-te" else 2)
    quick_ck = quick.read(tmp_path / "meg", "megatron")
    assert {n: tuple(t.shape) for n, t in quick_ck.tensors.items()} == {n: tuple(t.shape) for n, t in full.tensors.items()}
