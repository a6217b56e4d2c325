"""Mixture-of-Experts: canonical names, which layers are MoE, and the routing maths.

Tiny Mixtral / Qwen2-MoE / Qwen3-MoE models (and dense Qwen3 with its q/k norms) are built by
transformers in the test with weights moved off their init; from-hf then to-hf must give every
tensor bit-exact and transformers must compute identical logits from our output; the reference
forward must match transformers' own routing.
"""
from __future__ import annotations

import pytest

from ckptool.config import (GPTConfig, MoE, moe_layers_first_k_dense, moe_layers_megatron,
                            moe_layers_qwen)
from ckptool.errors import CkptError
from ckptool.state import expected_names


def _moe_cfg(**moe):
    base = dict(num_experts=4, top_k=2, ffn_hidden_size=6, layers=(1, 2))
    base.update(moe)
    return GPTConfig(num_layers=3, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, padded_vocab_size=10,
                     max_position_embeddings=8, activation="swiglu", normalization="rmsnorm",
                     position_embedding="rope", add_bias_linear=False, add_qkv_bias=False, moe=MoE(**base))


def test_moe_layer_index_rules():
    # Qwen: (i + 1) % step == 0, minus mlp_only_layers
    assert moe_layers_qwen(4, 1, []) == (0, 1, 2, 3)
    assert moe_layers_qwen(4, 2, []) == (1, 3)
    assert moe_layers_qwen(6, 2, [3]) == (1, 5)
    # DeepSeek: the first k dense, then every freq-th index
    assert moe_layers_first_k_dense(5, 3) == (3, 4)
    assert moe_layers_first_k_dense(6, 1, 2) == (2, 4)
    # Megatron --moe-layer-freq: an int or a 0/1 pattern
    assert moe_layers_megatron(4, 2) == (0, 2)
    assert moe_layers_megatron(3, [0, 1, 1]) == (1, 2)
    with pytest.raises(CkptError, match="lists 2 layers"):
        moe_layers_megatron(3, [1, 1])


def test_expected_names_follow_the_moe_config():
    cfg = _moe_cfg(shared_ffn_hidden_size=5, shared_gate=True, router_bias=True, expert_bias=True)
    names = expected_names(cfg)
    assert "layers.0.mlp.gate.weight" in names and "layers.0.mlp.router.weight" not in names  # dense layer 0
    for i in (1, 2):
        p = f"layers.{i}.mlp."
        assert p + "gate.weight" not in names
        assert [n for n in names if n.startswith(p + "router.")] == [p + "router.weight", p + "router.bias",
                                                                       p + "router.expert_bias"]
        experts = sorted({n.split(".")[4] for n in names if n.startswith(p + "experts.")}, key=int)
        assert experts == ["0", "1", "2", "3"]
        assert {p + f"experts.3.{m}.weight" for m in ("gate", "up", "down")} <= set(names)
        assert {p + f"shared.{m}.weight" for m in ("gate", "up", "down")} | {p + "shared_gate.weight"} <= set(names)
    plain = expected_names(_moe_cfg())
    assert not any(".shared" in n or "router.bias" in n or "expert_bias" in n for n in plain)
    assert not any(".mlp." in n for n in expected_names(_moe_cfg(layers=(0, 1, 2)))
                   if ".mlp.router" not in n and ".mlp.experts." not in n)


def test_expert_bias_is_the_spec_s_one_buffer():
    """The router's expert bias is a module buffer (spec trait "buffer"): a canonical tensor with no optimizer
    slot; every other canonical tensor of a DeepSeek-V3-like model is a parameter. An unknown trait is refused
    when a spec is built."""
    from ckptool.roles import BUFFER_ROLES, is_parameter
    from ckptool.spec import GPT
    from ckptool.spec.schema import Role, Spec
    assert BUFFER_ROLES == GPT.with_trait("buffer") == ("router.expert_bias",)
    cfg = _moe_cfg(shared_ffn_hidden_size=5, shared_gate=True, router_bias=True, expert_bias=True)
    names = expected_names(cfg)
    assert [n for n in names if not is_parameter(n)] == [n for n in names if n.endswith(".mlp.router.expert_bias")] != []
    with pytest.raises(ValueError, match="unknown trait"):
        Spec((), (Role("x", "replicated", traits=("bufer",)),))


def test_moe_config_checks():
    with pytest.raises(CkptError, match="top-k 5"):
        _moe_cfg(top_k=5)
    with pytest.raises(CkptError, match="outside the 3 layers"):
        _moe_cfg(layers=(3,))
    with pytest.raises(CkptError, match="score function"):
        _moe_cfg(score_function="relu")


# --- Hugging Face MoE families, built by transformers ----------------------------------------

import json  # noqa: E402

import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from ckptool.cli import main  # noqa: E402
from ckptool.formats.hf import reader as hf_reader  # noqa: E402
from ckptool.formats.registry import open_checkpoint  # noqa: E402
from ckptool.verify import reference  # noqa: E402

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 5, 9, 42, 77, 3, 0, 99, 12, 8, 64, 31],
                       [7, 7, 2, 88, 15, 60, 4, 33, 21, 90, 11, 6]])
VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def cli(*args, ok=True):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (res.exit_code == 0) == ok, res.output
    return res.output


def hf_logits(path_or_model, tokens=TOKENS):
    model = path_or_model
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits.float()


def saved_tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def randomise(model):
    """Off the init (Qwen's routers start at zero: every expert would tie): norms near 1, the rest
    large enough that a wrong expert, weight or gate moves the logits far past the tolerance."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:  # DeepSeek's expert bias, zero at init
                b.normal_(0, 0.1)
    return model


def _build(kind):
    t = transformers
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**COMMON, intermediate_size=48, num_hidden_layers=2,
                                                    num_local_experts=4, num_experts_per_tok=2))
    if kind == "qwen2_moe":  # layer 0 dense by mlp_only_layers; 1-3 MoE with a gated shared expert
        return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            **COMMON, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            num_hidden_layers=4, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[0], norm_topk_prob=False))
    if kind == "qwen3_moe":  # decoder_sparse_step 2: layers 1 and 3 are MoE, 0 and 2 dense
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            **COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True))
    if kind.startswith("deepseek_v3"):  # MLA (q latent, or q direct); layer 0 dense; 4 groups, best 2
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "mscale": 0.7, "mscale_all_dim": 1.0}  # cos/sin and the softmax scale both change
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            **dict(COMMON, num_key_value_heads=4, rope_parameters=yarn if kind.endswith("yarn") else None),
            intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, n_shared_experts=2,
            n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=12,
            q_lora_rank=None if kind.endswith("direct_q") else 20, qk_rope_head_dim=8, v_head_dim=10,
            qk_nope_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
            norm_topk_prob=True))
    return t.Qwen3ForCausalLM(t.Qwen3Config(**COMMON, head_dim=8, intermediate_size=64, num_hidden_layers=2))


KINDS = {  # kind -> (architecture, MoE layers, experts)
    "mixtral": ("MixtralForCausalLM", (0, 1), 4),
    "qwen2_moe": ("Qwen2MoeForCausalLM", (1, 2, 3), 6),
    "qwen3_moe": ("Qwen3MoeForCausalLM", (1, 3), 4),
    "qwen3": ("Qwen3ForCausalLM", None, 0),
    "deepseek_v3": ("DeepseekV3ForCausalLM", (1, 2), 8),
    "deepseek_v3_direct_q": ("DeepseekV3ForCausalLM", (1, 2), 8),
    "deepseek_v3_yarn": ("DeepseekV3ForCausalLM", (1, 2), 8),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    built = {}

    def get(kind):
        if kind not in built:
            torch.manual_seed(len(built) + 10)
            model = randomise(_build(kind)).eval()
            model.save_pretrained(root / kind)
            built[kind] = (root / kind, model)
        return built[kind]
    return get


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_family_round_trip(family, tmp_path, kind):
    """from-hf reads every expert under canonical names; the reference forward routes as
    transformers does; to-hf writes every tensor bit-exact under the Hub names and transformers
    computes identical logits from it."""
    src, model = family(kind)
    arch, moe_layers, experts = KINDS[kind]
    want = hf_logits(model)
    ckpt = open_checkpoint(src)
    cfg = ckpt.config
    if moe_layers is None:
        assert cfg.moe is None and cfg.qk_layernorm
    elif kind.startswith("deepseek"):
        assert cfg.mla.kv_lora_rank == 12 and cfg.mla.q_lora_rank == (None if "direct" in kind else 20)
        assert (cfg.moe.score_function, cfg.moe.num_groups, cfg.moe.group_topk, cfg.moe.top_k) == ("sigmoid", 4, 2, 3)
        assert cfg.moe.scaling_factor == 2.5 and cfg.moe.shared_ffn_hidden_size == 32 and cfg.moe.expert_bias
    else:
        assert cfg.moe.layers == moe_layers and cfg.moe.num_experts == experts
        i = moe_layers[-1]
        assert ckpt.tensors[f"layers.{i}.mlp.experts.{experts - 1}.down.weight"].shape == (32, cfg.moe.ffn_hidden_size)
        assert f"layers.{i}.mlp.gate.weight" not in ckpt.tensors
    assert (reference.forward(ckpt, TOKENS)[..., :VOCAB] - want).abs().max().item() <= 1e-5 * want.abs().max()
    out = tmp_path / "hf"
    cli("to-hf", src, out)
    a, b = saved_tensors(src), saved_tensors(out)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [arch]
    assert torch.equal(hf_logits(out), want)
    back = open_checkpoint(out).config
    assert back.moe == cfg.moe and back.mla == cfg.mla and back.qk_layernorm == cfg.qk_layernorm
    assert back.rope_yarn == cfg.rope_yarn and (cfg.rope_yarn is not None) == kind.endswith("yarn")
    if cfg.rope_yarn is not None:  # and it matters
        plain = ckpt.with_tensors(ckpt.tensors, rope_yarn=None)
        assert (reference.forward(plain, TOKENS)[..., :VOCAB] - want).abs().max().item() > 1e-2


def test_qwen3_dense_through_megatron_layouts(family, tmp_path):
    """Dense Qwen3's q/k norms are Megatron's --qk-layernorm: from-hf TP2 PP2, reshard, to-hf bit-exact."""
    src, model = family("qwen3")
    cli("from-hf", src, tmp_path / "meg", "--tp", 2, "--pp", 2)
    meg = open_checkpoint(tmp_path / "meg")
    assert meg.config.qk_layernorm and meg.source.layout.tp == 2
    cli("reshard", tmp_path / "meg", tmp_path / "re", "--tp", 1, "--pp", 1)
    cli("to-hf", tmp_path / "re", tmp_path / "out")
    a, b = saved_tensors(src), saved_tensors(tmp_path / "out")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(hf_logits(tmp_path / "out"), hf_logits(model))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_expert_tensors_are_read(family, tmp_path, kind):
    """transformers 5 holds experts fused ([E, 2I, h] gate_up, [E, h, I] down; Mixtral's router under
    mlp.gate): a raw state_dict saved that way reads to the same model; to-hf writes it fused again, exactly the
    state_dict, and with --experts per-expert exactly the Hub save (tests/test_glm.py: transformers loads both)."""
    src, model = family(kind)
    fused = tmp_path / "fused"
    fused.mkdir()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") and v.dim() == 3 for k, v in sd.items())
    save_file(sd, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((src / "config.json").read_text())
    for out, want in ((tmp_path / "out", fused), (tmp_path / "hub", src)):
        cli("to-hf", fused, out, *(["--experts", "per-expert"] if want == src else []))
        a, b = saved_tensors(want), saved_tensors(out)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_verify_hf_moe_against_transformers(family, kind):
    """`ckptool verify` of an MoE model against transformers' own logits passes in fp32."""
    src, _ = family(kind)
    out = cli("verify", src, "--reference", src, "--dtype", "fp32")
    assert "result=PASS" in out


def test_group_limited_routing_and_expert_bias_matter(family):
    """DeepSeek's routing facts are used: without the group limit or the expert bias the choice moves."""
    import dataclasses
    src, model = family("deepseek_v3")
    ckpt = open_checkpoint(src)
    want = hf_logits(model)
    assert (reference.forward(ckpt, TOKENS)[..., :VOCAB] - want).abs().max().item() <= 1e-5 * want.abs().max()
    no_groups = ckpt.with_tensors(ckpt.tensors, moe=dataclasses.replace(ckpt.config.moe, num_groups=1, group_topk=1))
    no_bias = ckpt.with_tensors({k: v for k, v in ckpt.tensors.items() if "expert_bias" not in k},
                                moe=dataclasses.replace(ckpt.config.moe, expert_bias=False))
    for other in (no_groups, no_bias):
        assert (reference.forward(other, TOKENS)[..., :VOCAB] - want).abs().max().item() > 1e-3


def test_routing_options_change_the_logits(family):
    """The routing facts are used: top-k renormalisation, the shared expert's gate, the scaling."""
    src, model = family("qwen2_moe")
    ckpt = open_checkpoint(src)
    want = hf_logits(model)
    base = (reference.forward(ckpt, TOKENS)[..., :VOCAB] - want).abs().max().item()
    assert base <= 1e-5
    moe = ckpt.config.moe
    import dataclasses
    for change in (dict(topk_norm=True), dict(shared_gate=False), dict(scaling_factor=2.0), dict(top_k=3)):
        other = ckpt.with_tensors(ckpt.tensors, moe=dataclasses.replace(moe, **change))
        if not change.get("shared_gate", True):
            other = other.with_tensors({k: v for k, v in ckpt.tensors.items() if "shared_gate" not in k})
        assert (reference.forward(other, TOKENS)[..., :VOCAB] - want).abs().max().item() > 1e-3, change


def test_inspect_shows_the_experts(family):
    src, _ = family("qwen2_moe")
    out = cli("inspect", src, "--no-tensors")
    assert "6 per MoE layer, top-2 softmax, expert ffn 24, shared expert ffn 40 (gated); MoE layers [1, 2, 3]" in out
    doc = json.loads(cli("inspect", src, "--json"))
    assert doc["config"]["moe"]["layers"] == [1, 2, 3] and doc["config"]["moe"]["num_experts"] == 6
    assert doc["config"]["mla"] is None
    out = cli("inspect", family("deepseek_v3_yarn")[0], "--no-tensors")
    assert "top-3 sigmoid renormalised from the best 2 of 4 groups x 2.5 with expert bias" in out
    assert "Multi-Latent: q latent 20, kv latent 12, head qk 6+8 (nope+rope), v 10; YaRN factor 4.0" in out


# --- refused by name, never dropped -----------------------------------------------------------

def _one_line_refusal(*args, says):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and all(s in res.output for s in says), res.output
    return res.output


@pytest.mark.parametrize("command, kind, says", [
    (("reshard", "--tp", "1", "--format", "ds-universal"), "deepseek_v3", "Multi-Latent Attention: Megatron"),
    (("merge", "--format", "ds-universal"), "mixtral", "MoE layers (4 experts, top-2")])
def test_megatron_targets_refuse_moe_and_mla(family, tmp_path, command, kind, says):
    """MLA has Megatron torch and torch_dist output only (tests/test_mla_megatron.py); MoE has the torch
    and torch_dist formats only (ds-universal is refused)."""
    src, _ = family(kind)
    out = tmp_path / "meg"
    _one_line_refusal(command[0], src, out, *command[1:], says=[says, "not supported yet", "use to-hf"])
    assert not out.exists()


@pytest.mark.parametrize("kind, ep1, ep2, vpp", [("mixtral", 2, 4, 1), ("qwen2_moe", 2, 3, 1), ("qwen3_moe", 2, 4, 2)])
def test_hf_moe_through_expert_parallel_megatron_layouts(family, tmp_path, kind, ep1, ep2, vpp):
    """from-hf to TP2 PP2 (VPP2) EP(ep1), reshard to TP1 PP1 EP(ep2), to-hf: every tensor bit-exact, same logits."""
    src, model = family(kind)
    cli("from-hf", src, tmp_path / "a", "--tp", 2, "--pp", 2, "--ep", ep1, *(["--vpp", vpp] if vpp > 1 else []))
    ranks = sorted(p.name for p in (tmp_path / "a" / "iter_0000000").iterdir())
    assert len(ranks) == 4 * ep1 and ranks[-1] == f"mp_rank_01_001_{ep1 - 1:03d}"
    cli("reshard", tmp_path / "a", tmp_path / "b", "--tp", 1, "--pp", 1, "--ep", ep2)
    assert open_checkpoint(tmp_path / "b").source.layout.describe() == f"TP1 PP1 EP{ep2}"
    cli("to-hf", tmp_path / "b", tmp_path / "hf")
    want, got = saved_tensors(src), saved_tensors(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(model))


def _copy_with(src, dst, extra=None, conf=None):
    """src's model files with extra tensors added to the safetensors file and config.json changed."""
    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    sd.update(extra or {})
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((src / "config.json").read_text())
    c.update(conf or {})
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize("extra, says", [
    ("model.layers.0.block_sparse_moe.experts.1.w4.weight", ["experts.1.w4.weight", "expert module"]),
    ("model.layers.1.block_sparse_moe.experts.4.w1.weight", ["experts.4.w1.weight", "num_experts=4"]),
    ("model.layers.2.eh_proj.weight", ["model.layers.2.eh_proj.weight", "multi-token-prediction (MTP)"]),
])
def test_unknown_expert_tensors_are_refused(family, tmp_path, extra, says):
    src, _ = family("mixtral")
    bad = _copy_with(src, tmp_path / "bad", {extra: torch.zeros(48, 32)})
    _one_line_refusal("to-hf", bad, tmp_path / "out", says=says)
    assert not (tmp_path / "out").exists()


def test_missing_expert_is_refused(family, tmp_path):
    src, _ = family("mixtral")
    bad = _copy_with(src, tmp_path / "bad", conf={"num_local_experts": 5})
    _one_line_refusal("to-hf", bad, tmp_path / "out", says=["missing weights for", "experts.4."])


@pytest.mark.parametrize("conf, says", [
    ({"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 4},
     ["DeepSeek-V2 (Multi-Latent Attention", "not supported yet"]),
    ({"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"]}, ["Mixture-of-Experts model_type 'olmoe'"]),
])
def test_unsupported_moe_families_are_refused_by_name(family, tmp_path, conf, says):
    src, _ = family("mixtral")
    bad = _copy_with(src, tmp_path / "bad", conf=conf)
    _one_line_refusal("to-hf", bad, tmp_path / "out", says=says)
    _one_line_refusal("inspect", bad, says=says)


@pytest.mark.parametrize("change, says", [
    (dict(score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(scaling_factor=2.5), "--moe-router-topk-scaling-factor 2.5"),
    (dict(layers=(1,)), "dense layers among MoE ones (1 of 2)"),
    (dict(topk_norm=False), "shared expert=none, top-k renormalised=False"),
])
def test_routing_no_hf_class_computes_is_refused(family, tmp_path, change, says):
    import dataclasses
    from ckptool.formats.hf.writer import write_hf
    ckpt = open_checkpoint(family("mixtral")[0])
    moe = dataclasses.replace(ckpt.config.moe, **change)
    tensors = {k: v for k, v in ckpt.tensors.items()
               if not (k.startswith("layers.0.mlp.") and 0 not in moe.layers)}
    with pytest.raises(CkptError, match="cannot export to Hugging Face") as e:
        write_hf(ckpt.with_tensors(tensors, moe=moe), tmp_path)
    assert says in str(e.value)


def test_optimizer_slots_and_streaming_groups_take_experts_as_they_are(family):
    """Experts are ordinary canonical names: a layer's group streams its router and every expert,
    and optimizer slots keyed by the same names need nothing MoE-specific."""
    from ckptool.lazy import Const
    from ckptool.state import OptimizerState
    ckpt = open_checkpoint(family("qwen3_moe")[0])
    groups = dict(ckpt.groups())
    assert sorted(n for n in ckpt.tensors if n.startswith("layers.3.")) == sorted(groups["layer 3"])
    assert sum(".experts." in n for n in groups["layer 3"]) == 4 * 3
    moments = {n: Const(torch.zeros(t.shape)) for n, t in ckpt.tensors.items()}
    ckpt.optimizer = OptimizerState("test", {"exp_avg": moments})
    assert set(ckpt.slot("exp_avg")) == set(expected_names(ckpt.config)) == set(ckpt.tensors)


def _fp8_blocks(w: torch.Tensor, block):
    """Quantize w the DeepSeek way: per block, scale = amax / 448, stored as its inverse use."""
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.zeros(nr, nc)
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale[i, j]).to(q.dtype)
    dequant = torch.empty(rows, cols)
    for i in range(nr):
        for j in range(nc):
            sl = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            dequant[sl] = q[sl].float() * scale[i, j]
    return q, scale, dequant.to(torch.bfloat16)


def test_deepseek_fp8_weights_are_dequantized(family, tmp_path):
    """DeepSeek's block-FP8 files (float8_e4m3fn + weight_scale_inv; 8x10 blocks here so the tiny
    matrices have several, ragged at the edges) read as bf16 equal to an independent block-wise
    dequantization; to-hf writes plain bf16 that transformers runs like the original model holding
    the dequantized weights."""
    src, model = family("deepseek_v3")
    block = (8, 10)
    sd = load_file(str(src / "model.safetensors"))
    files, expect = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and (".self_attn." in k or ".experts." in k or "_proj" in k) and "norm" not in k:
            q, scale, expect[k] = _fp8_blocks(v, block)
            files[k], files[k + "_scale_inv"] = q, scale
        else:
            files[k] = v
    assert len(expect) > 50
    fp8 = _copy_with(src, tmp_path / "fp8", conf={"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}})
    save_file(files, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    ckpt = open_checkpoint(fp8)
    got = {k: t for k, t in hf_reader.read_entries(fp8).items()}
    assert got["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == torch.float8_e4m3fn
    out = tmp_path / "hf"
    cli("to-hf", fp8, out)
    written = saved_tensors(out)
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" not in written
    for k, want in expect.items():
        assert written[k].dtype == torch.bfloat16 and torch.equal(written[k], want), k
    conf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in conf
    plain = _copy_with(src, tmp_path / "plain")  # the original model holding the dequantized weights
    save_file({k: expect[k].float() if k in expect else v for k, v in sd.items()}, str(plain / "model.safetensors"),
              metadata={"format": "pt"})
    want_logits = hf_logits(plain)
    assert (hf_logits(out) - want_logits).abs().max().item() <= 1e-5
    assert (reference.forward(ckpt, TOKENS)[..., :VOCAB] - want_logits).abs().max().item() <= 1e-5 * want_logits.abs().max()


def test_fp8_without_scales_is_refused(family, tmp_path):
    src, _ = family("mixtral")
    sd = load_file(str(src / "model.safetensors"))
    bad = _copy_with(src, tmp_path / "bad")
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    sd[name] = sd[name].to(torch.float8_e4m3fn)
    sd[name.replace("w1", "w3") + "_scale_inv"] = torch.ones(1, 1)
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _one_line_refusal("to-hf", bad, tmp_path / "out", says=["scales no float8_e4m3fn matrix"])


@pytest.mark.parametrize("conf, says", [({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
                                        ({"topk_method": "greedy"}, "topk_method='greedy' is not supported")])
def test_deepseek_options_transformers_ignores_are_refused(family, tmp_path, conf, says):
    src, _ = family("deepseek_v3")
    bad = _copy_with(src, tmp_path / "bad", conf=conf)
    _one_line_refusal("to-hf", bad, tmp_path / "out", says=[says])


def test_tensors_the_config_does_not_describe_are_refused(family, tmp_path):
    """A dense MLP beside the experts of an MoE layer maps onto canonical names but is not in the
    model config.json describes: refused, never dropped."""
    src, _ = family("mixtral")
    bad = _copy_with(src, tmp_path / "bad", {"model.layers.1.mlp.gate_proj.weight": torch.zeros(48, 32)})
    _one_line_refusal("to-hf", bad, tmp_path / "out", says=["layers.1.mlp.gate.weight", "never drops tensors"])
