"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM, families/glm4_moe.py) and MoE experts kept in the layout the source used.

Tiny Glm4Moe models built with transformers 5 (weights off init): partial RoPE 0.5, layer 0 dense then MoE layers with
a shared expert, sigmoid routing steered by e_score_correction_bias over 4 groups (best 2), routed_scaling_factor; one
with q/k norms and q/k/v biases, one with neither. Saved per expert (save_pretrained's default: the Hub names) and
fused (save_original_format=False: [E, 2I, h] gate_up_proj, [E, h, I] down_proj, as the modules hold them).

Shown: the reference forward computes transformers' logits; to-hf keeps each source's expert form bit-exact and
--experts switches it bit-exact (transformers loads every output with the same logits); Megatron torch at TP2 EP2,
TP1 EP2, TP2 EP2 ETP1 and torch_dist at EP2 carry the model and the form back to the same files; megatron-core (CPU,
tests/mcore_glm_helper.py) loads the torch and torch_dist outputs strictly from their args and computes transformers'
logits (it computes every GLM piece: partial RoPE, q/k/v biases, q/k norms, biased group-limited sigmoid routing,
scaling, shared expert, dense first layer); the parallel verify passes under torchrun at TP2 EP2.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT, once, shared_followups
from test_moe import COMMON, TOKENS, VOCAB, _one_line_refusal, cli, hf_logits, randomise, saved_tensors, transformers  # noqa: F401
from test_verify import VERIFY_BATCH, verify_jobs, verify_results

from ckptool.formats.hf import quick as hf_quick
from ckptool.formats.registry import open_checkpoint
from ckptool.verify import reference


def _build(qk_norm: bool):
    """Layers: 0 dense, 1-2 MoE (8 experts, top-4, 4 groups best 2: Megatron's group score needs top-k / groups = 2)."""
    t = transformers
    return t.Glm4MoeForCausalLM(t.Glm4MoeConfig(
        **COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=1.5,
        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=qk_norm, attention_bias=qk_norm,
        partial_rotary_factor=0.5, num_nextn_predict_layers=0))


def _build_glms(root: Path) -> dict:
    out = {}
    for seed, (name, qk) in enumerate((("qk", True), ("plain", False))):
        torch.manual_seed(40 + seed)
        model = randomise(_build(qk)).eval()
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    out["qk"][1].save_pretrained(root / "fused", save_original_format=False)
    out["fused"] = (root / "fused", out["qk"][1])
    return out


def _convert_glms(root: Path, glm: dict) -> Path:
    cli("from-hf", glm["fused"][0], root / "tp2ep2", "--tp", 2, "--ep", 2)
    cli("reshard", root / "tp2ep2", root / "dist", "--format", "torch_dist", "--tp", 1, "--ep", 2)
    cli("from-hf", glm["qk"][0], root / "ep2", "--ep", 2)
    cli("from-hf", glm["plain"][0], root / "plain", "--tp", 2, "--ep", 2)
    cli("reshard", root / "plain", root / "plain_etp1", "--tp", 2, "--ep", 2, "--etp", 1)
    return root


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """name -> (directory, model): "qk" (q/k norms, q/k/v biases; per expert), "fused" (the same model fused),
    "plain" (neither; per expert). Built once: the megatron-core steps below start from the same."""
    return once(_build_glms, lambda: tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def megatron(glm, tmp_path_factory):
    """Megatron checkpoints of the GLMs: name -> directory."""
    return once(_convert_glms, lambda: tmp_path_factory.mktemp("glm_megatron"), glm)


def _same_files(a: Path, b: Path) -> None:
    x, y = saved_tensors(a), saved_tensors(b)
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("name", ["qk", "plain", "fused"])
def test_glm_reads_as_transformers_computes(glm, name):
    src, model = glm[name]
    ckpt = open_checkpoint(src)
    cfg, moe = ckpt.config, ckpt.config.moe
    assert (cfg.rotary_percent, cfg.qk_layernorm, cfg.add_qkv_bias, cfg.add_bias_linear) == (0.5, name != "plain",
                                                                                           name != "plain", False)
    assert (moe.layers, moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk, moe.top_k) == \
        ((1, 2), "sigmoid", True, 4, 2, 4)
    assert (moe.scaling_factor, moe.shared_ffn_hidden_size, moe.topk_norm) == (1.5, 16, True)
    assert ckpt.source.hf_experts == ("fused" if name == "fused" else "per-expert")
    want = hf_logits(model)
    assert (reference.forward(ckpt, TOKENS)[..., :VOCAB] - want).abs().max().item() <= 1e-5 * want.abs().max()
    whole = ckpt.with_tensors(ckpt.tensors, rotary_percent=1.0)  # and partial RoPE matters
    assert (reference.forward(whole, TOKENS)[..., :VOCAB] - want).abs().max().item() > 1e-2
    quick = hf_quick.read(src, "hf")  # inspect's torch-free reader: the same names and shapes, fused or not
    assert quick.source.hf_experts == ckpt.source.hf_experts
    assert {k: tuple(t.shape) for k, t in quick.tensors.items()} == {k: tuple(t.shape) for k, t in ckpt.tensors.items()}


def test_to_hf_keeps_the_sources_expert_form_and_experts_switches_it(glm, tmp_path):
    """per expert -> per expert, fused -> fused by default; --experts the other way gives exactly the other save of
    the same model; transformers loads all four: the logits of the save with the same files, and the model's to fp32
    rounding (transformers' own fused save loads to logits 2e-7 off its per-expert one: its kernels, not the files)."""
    want = hf_logits(glm["qk"][1])
    of_save = {name: hf_logits(glm[name][0]) for name in ("qk", "fused")}
    for name, other in (("qk", "fused"), ("fused", "qk")):
        form = "fused" if other == "fused" else "per-expert"
        cli("to-hf", glm[name][0], tmp_path / name)
        cli("to-hf", glm[name][0], tmp_path / f"{name}_switched", "--experts", form)
        _same_files(tmp_path / name, glm[name][0])
        _same_files(tmp_path / f"{name}_switched", glm[other][0])
        for out, save in ((tmp_path / name, name), (tmp_path / f"{name}_switched", other)):
            conf = json.loads((out / "config.json").read_text())
            assert conf["architectures"] == ["Glm4MoeForCausalLM"] and conf["num_nextn_predict_layers"] == 0
            got = hf_logits(out)
            assert torch.equal(got, of_save[save]) and (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_glm_through_megatron_expert_parallel_layouts_and_back(glm, megatron, tmp_path):
    """TP2 EP2 torch, TP1 EP2 torch_dist, TP2 EP2 ETP1: to-hf gives the source's files bit-exact, fused where the
    source was fused (the form kept in the Megatron args), with transformers' logits."""
    for meg, src in (("tp2ep2", "fused"), ("dist", "fused"), ("ep2", "qk"), ("plain_etp1", "plain")):
        cli("to-hf", megatron / meg, tmp_path / meg)
        _same_files(tmp_path / meg, glm[src][0])
        assert torch.equal(hf_logits(tmp_path / meg), hf_logits(glm[src][0]))
    meg = open_checkpoint(megatron / "tp2ep2")
    hf = open_checkpoint(glm["fused"][0]).config  # config.json -> GPTConfig -> Megatron args -> the same GPTConfig
    assert meg.config.replace(padded_vocab_size=hf.padded_vocab_size, vocab_size_source=hf.vocab_size_source,
                              make_vocab_size_divisible_by=hf.make_vocab_size_divisible_by) == hf
    args = meg.source.args
    assert (args.rotary_percent, args.qk_layernorm, args.add_qkv_bias, args.add_bias_linear) == (0.5, True, True, False)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_num_groups,
            args.moe_router_group_topk, args.moe_router_topk_scaling_factor, args.moe_layer_freq,
            args.moe_shared_expert_intermediate_size) == ("sigmoid", True, 4, 2, 1.5, [0, 1, 1], 16)


MCORE_LOADS = {"ep2": "{megatron}/ep2 --ep 2", "dist_ep2": "{megatron}/dist --ep 2 --dist",
               "dist_tp2": "{megatron}/dist --tp 2 --dist"}


@shared_followups
def mcore_glm_loads(framework_runs, d):
    """megatron-core builds the model from each checkpoint's args (tests/mcore_glm_helper.py, 2 processes: TP1 EP2,
    and TP2 EP1 for the torch_dist one) and loads it strictly: d/NAME.pt of MCORE_LOADS."""
    glm = once(_build_glms, lambda: d / "glm")
    megatron = once(_convert_glms, lambda: d / "megatron", glm)
    yield [(ROOT / "tests" / "mcore_glm_helper.py", 2,
            [f"{job.format(megatron=megatron)} --out {d / name}.pt" for name, job in MCORE_LOADS.items()])]
    return d


def test_megatron_core_loads_the_glm_outputs_strictly_with_transformers_logits(glm, mcore_glm_loads):
    """megatron-core builds the model from each checkpoint's args (2 processes: TP1 EP2, and TP2 EP1 for the
    torch_dist one), loads it strictly and computes transformers' logits at fp32 rounding."""
    for name in MCORE_LOADS:
        ran = torch.load(mcore_glm_loads / f"{name}.pt", weights_only=False)
        want = hf_logits(glm["qk"][1], ran["tokens"])
        assert ran["moe_layers"] == 2
        assert (ran["logits"][..., :VOCAB] - want).abs().max().item() <= 1e-5 * want.abs().max(), name


@shared_followups
def parallel_verify(framework_runs, d):
    """`torchrun -m ckptool verify` at the files' TP2 EP2 against the Hugging Face sources, in the session's shared
    launch of 4-process checks."""
    glm = once(_build_glms, lambda: d / "glm")
    megatron = once(_convert_glms, lambda: d / "megatron", glm)
    cases = {"tp2ep2": [megatron / "tp2ep2", "--reference", glm["fused"][0]],
             "plain": [megatron / "plain", "--reference", glm["plain"][0]]}
    yield [(VERIFY_BATCH, 4, verify_jobs(cases, d / "runs"))]
    return verify_results(cases, d / "runs")


def test_parallel_verify_of_glm_passes(parallel_verify):
    """`torchrun -m ckptool verify` at the files' TP2 EP2 against the Hugging Face sources."""
    assert set(parallel_verify) == {"tp2ep2", "plain"}
    for name, (out, rc) in parallel_verify.items():
        assert rc == 0 and "result=PASS" in out, (name, out)


@pytest.mark.parametrize("conf, says", [
    (dict(num_experts_per_tok=3), "group-limited routing with top-k 3 over 2 groups"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.5,
                           "original_max_position_embeddings": 16}), "rope scaling type 'yarn'"),
])
def test_what_ckptool_cannot_compute_of_a_glm_is_refused_by_name(glm, tmp_path, conf, says):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in glm["qk"][0].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(dict(json.loads((bad / "config.json").read_text()), **conf)))
    _one_line_refusal("from-hf", bad, tmp_path / "out", says=[says])


def test_experts_option_is_refused_where_it_means_nothing(tmp_path):
    """--experts on a dense model, or a form that does not exist, is refused by name (the formats that do not honour
    it: tests/test_write_options.py)."""
    dense = ROOT / "fixtures" / "real" / "mlm_mcore_gpt2_torch_tp2pp2" / "checkpoint"
    _one_line_refusal("to-hf", dense, tmp_path / "out", "--experts", "fused",
                      says=["--experts fused: the model has no MoE layers"])
    assert not (tmp_path / "out").exists()
    from ckptool.api import build_write_options
    from ckptool.errors import CkptError
    with pytest.raises(CkptError, match="unknown experts form 'stacked'"):
        build_write_options(experts="stacked")
