"""MoE in Megatron's torch format with expert parallelism, against the real megatron-core.

tests/mcore_moe_helper.py builds a tiny megatron-core GPTModel whose every layer is MoE (4 SequentialMLP
experts, top-2 softmax router, SwiGLU) at TP2 EP2 on 4 CPU processes (gloo) and saves it as Megatron-LM's
torch format (mp_rank_TT_EEE); megatron-core's own forward at that layout gives the reference logits.
ckptool reads it, reshards it (EP1 merge, EP4, PP2 EP2, the same TP2 EP2) and megatron-core loads
each output strictly at its layout and computes the same logits; to-hf gives a MixtralForCausalLM
whose logits transformers computes equal to megatron-core's.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, shared_followups

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.megatron.checkpoint import read_megatron

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_moe_helper.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

# (tp, pp, ep) layouts written by ckptool and loaded by megatron-core (4 processes: DP fills the rest)
LAYOUTS = [(1, 1, 1), (1, 1, 4), (1, 2, 2), (2, 1, 2)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


ARCHS = ("mixtral", "qwen2moe")  # the helper's two models (see mcore_moe_helper.ARCHS)
# ckptool outputs with expert TP != TP or from the ETP1 save: (name, source, (tp, pp, ep, etp or None = tp))
ETP_OUTPUTS = [("tp2ep2etp1", "mixtral", (2, 1, 2, 1)), ("tp2ep1etp1", "mixtral", (2, 1, 1, 1)),
               ("tp2pp2ep2etp1", "mixtral", (2, 2, 2, 1)), ("tp2ep2", "etp", (2, 1, 2, 2)),
               ("tp1ep4", "etp", (1, 1, 4, None))]


# the megatron-core saves (run once per session: test_verify_moe saves the same)
SAVES = declare_runs(HELPER, 4, {**{f"{a}/src": f"save {{out}} --tp 2 --ep 2 --arch {a} --out {{out}}.pt"
                                    for a in ARCHS},
                                 "etp/src": "save {out} --tp 2 --ep 2 --etp 1 --out {out}.pt"})


@shared_followups
def moe_root(framework_runs, root):
    """Per arch: the megatron-core TP2 EP2 save (run once per session: test_verify_moe saves the same),
    ckptool's outputs at LAYOUTS, megatron-core's logits of each (the loads in one launch with the other files'
    4-process MoE follow-ups)."""
    for name, stem in framework_runs(HELPER, 4, SAVES, timeout=400).items():
        copy_run(stem, root / name)
    jobs = []
    for name, src, (tp, pp, ep, etp) in ETP_OUTPUTS:  # expert TP != TP, both ways (mixtral)
        out = root / "etp" / name
        api.reshard(root / src / "src", out, tp=tp, pp=pp, ep=ep, etp=etp, warn=lambda m: None)
        jobs.append(f"load-torch {out} --tp {tp} --pp {pp} --ep {ep} --etp {etp or tp} --out {out}.pt")
    for a in ARCHS:
        d = root / a
        for tp, pp, ep in LAYOUTS:
            out = d / f"out_{tp}{pp}{ep}"
            if (tp, pp, ep) == (1, 1, 1):
                api.merge(d / "src", out, warn=lambda m: None)
            else:
                api.reshard(d / "src", out, tp=tp, pp=pp, ep=ep, warn=lambda m: None)
            jobs.append(f"load-torch {out} --tp {tp} --pp {pp} --ep {ep} --arch {a} --out {d / f'out_{tp}{pp}{ep}.pt'}")
    yield [(HELPER, 4, jobs)]
    return root


@pytest.fixture(scope="module")
def moe(moe_root):
    return moe_root / "mixtral"


def test_reads_the_expert_parallel_save(moe):
    ck = read_megatron(moe / "src")
    assert ck.source.layout.describe() == "TP2 PP1 EP2"
    m = ck.config.moe
    assert (m.num_experts, m.top_k, m.ffn_hidden_size, m.layers, m.score_function, m.topk_norm) == \
        (4, 2, 24, (0, 1), "softmax", True)  # Megatron's default router: top-k logits, softmax among them
    # expert 3 of layer 1 is local expert 1 of EP rank 1: its gate is both TP ranks' gate halves, in order
    files = [torch.load(moe / "src" / "iter_0000007" / f"mp_rank_{t:02d}_001" / "model_optim_rng.pt",
                        weights_only=False)["model"] for t in range(2)]
    fc1 = [f["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"] for f in files]
    assert torch.equal(ck.tensors["layers.1.mlp.experts.3.gate.weight"].load(), torch.cat([x[:12] for x in fc1]))
    assert torch.equal(ck.tensors["layers.1.mlp.experts.3.up.weight"].load(), torch.cat([x[12:] for x in fc1]))
    fc2 = [f["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"] for f in files]
    assert torch.equal(ck.tensors["layers.1.mlp.experts.3.down.weight"].load(), torch.cat(fc2, 1))
    assert torch.equal(ck.tensors["layers.0.mlp.router.weight"].load(), files[0]["decoder.layers.0.mlp.router.weight"])
    # every expert distinct (the helper moved each off the shared init)
    gates = [ck.tensors[f"layers.0.mlp.experts.{e}.gate.weight"].load() for e in range(4)]
    assert all(not torch.equal(gates[a], gates[b]) for a in range(4) for b in range(a + 1, 4))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "TP{}PP{}EP{}".format(*l))
def test_megatron_core_loads_every_layout_strictly_with_the_same_logits(moe_root, arch, layout):
    tp, pp, ep = layout
    d = moe_root / arch
    out = d / f"out_{tp}{pp}{ep}"
    names = sorted(p.name for p in (out / "iter_0000007").iterdir())
    assert len(names) == tp * pp * ep and all(n.count("_") == 2 + (pp > 1) + (ep > 1) for n in names)
    ref = torch.load(d / "src.pt")["logits"]
    got = torch.load(d / f"out_{tp}{pp}{ep}.pt")["logits"]
    assert relative(got, ref) <= 1e-5
    src, back = read_megatron(d / "src"), read_megatron(out)
    assert back.source.layout.ep == ep and back.config.moe == src.config.moe
    assert list(back.tensors) == list(src.tensors)
    for name in src.tensors:  # every tensor bit-exact through the reshard
        assert torch.equal(back.tensors[name].load(), src.tensors[name].load()), name


@pytest.mark.parametrize("arch, hf_class", [("mixtral", "MixtralForCausalLM"), ("qwen2moe", "Qwen2MoeForCausalLM")])
def test_to_hf_computes_megatron_cores_logits(moe_root, tmp_path, arch, hf_class):
    """Mixtral: Megatron's default router (top-k logits softmaxed = softmax, top-k, renormalised).
    Qwen2-MoE: --moe-router-pre-softmax (no renormalisation), a gated shared expert, a dense first layer."""
    import transformers
    d = moe_root / arch
    cfg = read_megatron(d / "src").config
    if arch == "qwen2moe":
        assert cfg.moe.layers == (1,) and cfg.moe.shared_gate and cfg.moe.shared_ffn_hidden_size == 16
        assert not cfg.moe.topk_norm and cfg.add_qkv_bias
    result = api.to_hf(d / "src", tmp_path / "hf", warn=lambda m: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == hf_class, result.summary
    ref = torch.load(d / "src.pt")
    with torch.no_grad():
        got = model(ref["tokens"]).logits
    assert relative(got, ref["logits"][..., :got.shape[-1]]) <= 1e-5


def _with_args(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        for k, v in changes.items():
            setattr(state["args"], k, v)
        torch.save(state, f)
    return dst


def test_router_forms_no_hf_class_computes_are_refused(moe, tmp_path):
    # --moe-router-pre-softmax: softmax over all experts, top-k NOT renormalised (no Mixtral / Qwen-MoE
    # class without a shared expert computes it)
    src = _with_args(moe / "src", tmp_path / "pre", moe_router_pre_softmax=True)
    assert read_megatron(src).config.moe.topk_norm is False
    with pytest.raises(CkptError, match="renormalised=False"):
        api.to_hf(src, tmp_path / "hf", warn=lambda m: None)
    with pytest.raises(CkptError, match="capacity"):
        read_megatron(_with_args(moe / "src", tmp_path / "cap", moe_expert_capacity_factor=1.0))


def test_bad_layouts_and_formats_are_refused(moe, tmp_path):
    with pytest.raises(CkptError, match="--ep 0: the expert-parallel size is at least 1"):
        api.reshard(moe / "src", tmp_path / "a", tp=1, ep=0, warn=lambda m: None)
    with pytest.raises(CkptError, match="--ep 3 does not divide the 4 experts"):
        api.reshard(moe / "src", tmp_path / "a", tp=1, ep=3, warn=lambda m: None)
    with pytest.raises(CkptError, match="ds-universal output of MoE models is not supported"):
        api.reshard(moe / "src", tmp_path / "b", tp=1, format="ds-universal", warn=lambda m: None)
    with pytest.raises(CkptError, match="legacy-norm dialect has no place for MoE experts"):
        api.reshard(moe / "src", tmp_path / "c", tp=1, dialect="legacy-norm", warn=lambda m: None)
    assert not any((tmp_path / n).exists() for n in "abc")
    # a missing expert-parallel rank is named
    broken = tmp_path / "broken"
    shutil.copytree(moe / "src", broken)
    shutil.rmtree(broken / "iter_0000007" / "mp_rank_01_001")
    with pytest.raises(CkptError, match="missing rank directory mp_rank_01_001"):
        read_megatron(broken)
    # expert files whose args say dense
    with pytest.raises(CkptError, match="hold MoE experts but the args describe a dense model"):
        read_megatron(_with_args(moe / "out_111", tmp_path / "dense", num_experts=None))
    # args saying expert TP 1 over a full TP2 EP2 grid: mp_rank_00_001 is no file of such a save
    with pytest.raises(CkptError, match="rank directory mp_rank_00_001 is not part of a TP2 EP2 expert-TP 1 save"):
        read_megatron(_with_args(moe / "src", tmp_path / "etp", expert_tensor_parallel_size=1))
    with pytest.raises(CkptError, match="has 48 rows over the TP ranks, expected 24 for the expert FFN size 12"):
        read_megatron(_with_args(moe / "src", tmp_path / "ffn", moe_ffn_hidden_size=12))


class _Group:
    """A process group's size and rank: all GroupedMLP's constructor and sharded_state_dict ask of one."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_legacy_grouped_mlp_layout_is_megatron_cores(monkeypatch):
    """ckptool's reading of GroupedMLP's weight1 / weight2 against megatron-core's own GroupedMLP.sharded_state_dict
    (transformer/moe/experts.py), which states where each local expert's fc1 / fc2 shard lies in the global
    [experts, out, in] tensors (the SequentialMLP-compatible form). grouped_gemm is only needed for the
    forward, so its availability check is lifted to build the module on CPU, at every (TP, EP) rank of TP2 EP2."""
    from types import SimpleNamespace
    from megatron.core.transformer.moe import experts as mcore_experts
    from megatron.core.transformer.transformer_config import TransformerConfig
    from ckptool.formats.megatron.checkpoint import unstack_grouped
    from ckptool.formats.megatron.names import stack_expert_weights
    from ckptool.lazy import Const
    monkeypatch.setattr(mcore_experts.gg, "assert_grouped_gemm_is_available", lambda: None)
    hidden, ffn, experts, tp, ep = 8, 6, 4, 2, 2
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, moe_ffn_hidden_size=ffn,
                            num_moe_experts=experts, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            add_bias_linear=False, use_cpu_initialization=True, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=tp)
    fc1 = torch.zeros(experts, 2 * ffn, hidden)  # megatron-core's global tensors, filled from its shards
    fc2 = torch.zeros(experts, hidden, ffn)
    ranks = {}
    for t in range(tp):
        for e in range(ep):
            m = mcore_experts.GroupedMLP(experts // ep, cfg, SimpleNamespace(ep=_Group(ep, e), expt_tp=_Group(tp, t),
                                                                           expt_dp=_Group(1, 0)))
            with torch.no_grad():
                m.weight1.normal_(), m.weight2.normal_()
            ranks[(t, e)] = (m.weight1.detach().clone(), m.weight2.detach().clone())
            for name, glob in (("weight1", fc1), ("weight2", fc2)):
                built = m.sharded_state_dict(prefix="mlp.")[f"mlp.{name}"].build()
                for sh in built if isinstance(built, list) else [built]:
                    glob[tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.data.shape))] = sh.data
    r = ffn // tp
    for (t, e), (w1, w2) in ranks.items():
        pieces1 = dict(unstack_grouped("experts.*.fc1.weight", Const(w1), experts // ep))
        pieces2 = dict(unstack_grouped("experts.*.fc2.weight", Const(w2), experts // ep))
        for j in range(experts // ep):
            g = e * (experts // ep) + j
            want1 = torch.cat([fc1[g, t * r:(t + 1) * r], fc1[g, ffn + t * r:ffn + (t + 1) * r]])  # [gate_t; up_t]
            assert torch.equal(pieces1[f"experts.{j}.fc1.weight"].load(), want1)
            assert torch.equal(pieces2[f"experts.{j}.fc2.weight"].load(), fc2[g][:, t * r:(t + 1) * r])
        # and the inverse gives GroupedMLP's tensors back, bit for bit
        assert torch.equal(stack_expert_weights("fc1.weight", [pieces1[f"experts.{j}.fc1.weight"].load() for j in range(2)]), w1)
        assert torch.equal(stack_expert_weights("fc2.weight", [pieces2[f"experts.{j}.fc2.weight"].load() for j in range(2)]), w2)


def _as_legacy_grouped(src: Path, dst: Path) -> Path:
    """megatron-core's SequentialMLP save with each rank's local experts stacked as GroupedMLP keeps them
    (weight1 / weight2, the layout pinned to megatron-core's by the test above)."""
    from ckptool.formats.megatron.names import stack_expert_weights
    shutil.copytree(src, dst)
    for f in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        model, stacks = {}, {}
        for k, v in state["model"].items():
            head, sep, rest = k.partition("mlp.experts.local_experts.")
            if not sep:
                model[k] = v
            elif rest.endswith(".weight"):
                j, fc = rest.split(".", 1)
                stacks.setdefault((head, fc), {})[int(j)] = v
        for (head, fc), by_j in stacks.items():
            base = "fc1.weight" if fc.startswith("linear_fc1") else "fc2.weight"
            model[f"{head}mlp.experts.weight{base[2]}"] = stack_expert_weights(base, [by_j[j] for j in sorted(by_j)])
        state["model"] = model
        state["args"].moe_grouped_gemm = True
        torch.save(state, f)
    return dst


def test_legacy_grouped_mlp_save_reads_as_the_same_model(moe, tmp_path):
    legacy = _as_legacy_grouped(moe / "src", tmp_path / "legacy")
    f = torch.load(next(legacy.glob("iter_*/mp_rank_01_001/model_optim_rng.pt")), weights_only=False)["model"]
    assert f["decoder.layers.1.mlp.experts.weight1"].shape == (32, 2 * 24)  # [hidden, 2 experts x [gate_r; up_r]]
    assert not any("local_experts" in k for k in f)
    ck, src = read_megatron(legacy), read_megatron(moe / "src")
    assert ck.source.dialect == "mcore" and ck.config.moe == src.config.moe and list(ck.tensors) == list(src.tensors)
    for n in src.tensors:
        assert torch.equal(ck.tensors[n].load(), src.tensors[n].load()), n
    # written as SequentialMLP (ckptool does not write the legacy form), args saying so
    said = []
    api.reshard(legacy, tmp_path / "seq", tp=1, ep=2, warn=said.append)
    out = torch.load(next((tmp_path / "seq").glob("iter_*/mp_rank_00_001/model_optim_rng.pt")), weights_only=False)
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in out["model"]
    assert out["args"].moe_grouped_gemm is False
    back = read_megatron(tmp_path / "seq")
    assert all(torch.equal(back.tensors[n].load(), src.tensors[n].load()) for n in src.tensors)
    with pytest.raises(CkptError, match="legacy GroupedMLP .* which ckptool reads but does not write"):
        api.reshard(legacy, tmp_path / "no", tp=1, moe_grouped_gemm=True, warn=lambda m: None)
    # a file mixing the two forms is refused by name, never read half
    mixed = tmp_path / "mixed"
    shutil.copytree(moe / "out_111", mixed)
    fm = next(mixed.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    state = torch.load(fm, weights_only=False)
    state["model"] = {k.replace("experts.local_experts.0.linear_fc1.weight", "experts.weight1"): v
                      for k, v in state["model"].items()}
    torch.save(state, fm)
    with pytest.raises(CkptError, match=r"legacy GroupedMLP tensors .* beside per-expert ones \(e\.g\. decoder\.layers\.0\.mlp\.experts\.local_experts"):
        read_megatron(mixed)


def test_verify_routes_the_expert_parallel_output_and_torchrun_runs_it_at_its_ep(moe, tmp_path):
    from click.testing import CliRunner
    from ckptool.cli import main
    from ckptool.verify.targets import parallel_target
    from ckptool.options import ReadOptions
    api.to_hf(moe / "src", tmp_path / "hf", warn=lambda m: None)
    res = CliRunner().invoke(main, ["verify", str(moe / "out_114"), "--reference", str(tmp_path / "hf")])
    assert res.exit_code == 0 and "result=PASS" in res.output, res.output
    # under torchrun it runs at its files' TP1 PP1 EP4 (tests/test_verify_moe.py runs it)
    assert parallel_target(str(moe / "out_114"), ReadOptions(), None, None, 4).layout.ep == 4


# The experts' optimizer state (EP 1 and the chained optimizer at EP > 1): tests/test_optimizer_groups.py.


def test_te_grouped_experts_are_read_by_their_documented_layout(moe, tmp_path):
    """TEGroupedMLP needs Transformer Engine (absent here), so this file is built from the documented
    layout, not by megatron-core: the TP2 EP2 save renamed to the TE spec (norm of QKV fused into
    linear_qkv, MoE layers' own pre_mlp_layernorm, local expert j's fc under `experts.linear_fc1.weight{j}`).
    It reads as the same model, every tensor equal."""
    dst = tmp_path / "te"
    shutil.copytree(moe / "src", dst)
    for f in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        model = {}
        for k, v in state["model"].items():
            if ".local_experts." in k and k.endswith("_extra_state"):
                continue
            k = k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            head, sep, rest = k.partition("mlp.experts.local_experts.")
            if sep:
                j, fc = rest.split(".", 1)
                k = f"{head}mlp.experts.{fc}{j}"
            model[k] = v
        for i in range(2):
            model[f"decoder.layers.{i}.mlp.experts.linear_fc1._extra_state"] = None
        state["model"] = model
        state["args"].transformer_impl, state["args"].moe_grouped_gemm = "transformer_engine", True
        torch.save(state, f)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight1" in model
    te, src = read_megatron(dst), read_megatron(moe / "src")
    assert te.source.dialect == "mcore-te" and te.config.moe == src.config.moe
    assert list(te.tensors) == list(src.tensors)
    assert all(torch.equal(te.tensors[n].load(), src.tensors[n].load()) for n in src.tensors)
    api.reshard(dst, tmp_path / "mcore", tp=1, ep=2, dialect="mcore", warn=lambda m: None)
    assert read_megatron(tmp_path / "mcore").source.dialect == "mcore"
    # ckptool writes the same files from the SequentialMLP save: every weight where the documented layout puts it
    api.reshard(moe / "src", tmp_path / "ours", tp=2, ep=2, dialect="mcore-te", moe_grouped_gemm=True, warn=lambda m: None)
    for f in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        want = torch.load(f, weights_only=False)
        got = torch.load(tmp_path / "ours" / f.relative_to(dst), weights_only=False)
        weights = {k: v for k, v in got["model"].items() if not k.endswith("_extra_state")}
        assert sorted(weights) == sorted(k for k in want["model"] if not k.endswith("_extra_state"))
        assert all(torch.equal(v, want["model"][k]) for k, v in weights.items())
        # a grouped linear's parameters fc by fc (weight0, weight1 of fc1, then of fc2): the optimizer's order
        layer1 = [k for k in weights if k.startswith("decoder.layers.1.mlp.")]
        assert layer1 == ["decoder.layers.1.mlp.router.weight"] + [
            f"decoder.layers.1.mlp.experts.linear_fc{n}.weight{j}" for n in (1, 2) for j in range(2)]
        assert {"decoder.layers.1.mlp.experts.linear_fc1._extra_state",
                "decoder.layers.1.mlp.experts.linear_fc2._extra_state"} <= set(got["model"])
        assert (got["args"].moe_grouped_gemm, got["args"].transformer_impl) == (True, "transformer_engine")
    # the default keeps the source's form; --no-moe-grouped-gemm writes SequentialMLP of TE linears
    for grouped, key in ((None, "mlp.experts.linear_fc2.weight0"), (False, "mlp.experts.local_experts.0.linear_fc2.weight")):
        out = tmp_path / f"te_{grouped}"
        api.reshard(dst, out, tp=1, ep=1, moe_grouped_gemm=grouped, warn=lambda m: None)
        model = torch.load(next(out.glob("iter_*/mp_rank_00/model_optim_rng.pt")), weights_only=False)["model"]
        assert f"decoder.layers.0.{key}" in model and "decoder.layers.0.pre_mlp_layernorm.weight" in model
        back = read_megatron(out)
        assert all(torch.equal(back.tensors[n].load(), src.tensors[n].load()) for n in src.tensors)
    with pytest.raises(CkptError, match="--moe-grouped-gemm: the model has no MoE layers"):
        api.reshard(REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint", tmp_path / "d", tp=1,
                    moe_grouped_gemm=True, warn=lambda m: None)
    from click.testing import CliRunner
    from ckptool.cli import main
    res = CliRunner().invoke(main, ["merge", str(moe / "src"), str(tmp_path / "cli"), "--dialect", "mcore-te",
                                    "--moe-grouped-gemm"])
    assert res.exit_code == 0, res.output
    model = torch.load(next((tmp_path / "cli").glob("iter_*/mp_rank_00/model_optim_rng.pt")), weights_only=False)["model"]
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in model  # TP1 EP1: all four experts local


def test_reads_the_expert_tp_save_of_megatron_core(moe_root):
    """megatron-core at TP2 ETP1 EP2 (4 ranks): Megatron-LM saves from data-parallel rank 0 and expert-data-
    parallel rank 0, so only mp_rank_00_000 and mp_rank_01_001 exist, each with whole (ETP1) experts. The
    helper seeds both saves alike, so the ETP1 save reads as the same model as the TP2 EP2 one."""
    src = moe_root / "etp" / "src"
    assert sorted(p.name for p in (src / "iter_0000007").iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    f = torch.load(src / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)["model"]
    assert f["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (48, 32)  # whole expert
    assert f["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 16)  # dense: TP2 shard
    ck, ref = read_megatron(src), read_megatron(moe_root / "mixtral" / "src")
    assert ck.source.layout.describe() == "TP2 PP1 EP2 ETP1" and ck.source.layout.expert_tp == 1
    assert list(ck.tensors) == list(ref.tensors)
    for name in ref.tensors:
        assert torch.equal(ck.tensors[name].load(), ref.tensors[name].load()), name
    assert relative(torch.load(moe_root / "etp" / "src.pt")["logits"], torch.load(moe_root / "mixtral" / "src.pt")["logits"]) <= 1e-5


@pytest.mark.parametrize("name, source, layout", ETP_OUTPUTS, ids=[o[0] for o in ETP_OUTPUTS])
def test_megatron_core_loads_expert_tp_layouts_strictly_with_the_same_logits(moe_root, name, source, layout):
    from ckptool.formats.megatron.checkpoint import expert_grid
    tp, pp, ep, etp = layout
    out = moe_root / "etp" / name
    names = sorted(p.name for p in (out / "iter_0000007").iterdir())
    want = sorted(f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                  for p in range(pp) for t, e in expert_grid(tp, ep, etp or tp))
    assert names == want
    if (tp, pp, ep, etp) == (2, 1, 2, 1):
        assert names == ["mp_rank_00_000", "mp_rank_01_001"]  # as megatron-core's own save above
    if (tp, pp, ep, etp) == (2, 2, 2, 1):
        assert names == ["mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_01_000_001", "mp_rank_01_001_001"]
    if (tp, pp, ep, etp) == (2, 1, 1, 1):
        assert names == ["mp_rank_00", "mp_rank_01"]  # TP > EP x ETP: data-parallel rank 0 saves the second
    ref = torch.load(moe_root / "etp" / "src.pt")["logits"]
    assert relative(torch.load(f"{out}.pt")["logits"], ref) <= 1e-5
    back, src = read_megatron(out), read_megatron(moe_root / source / "src")
    assert (back.source.layout.pp, back.source.layout.ep, back.source.layout.expert_tp) == (pp, ep, etp or tp)
    assert back.source.args.expert_tensor_parallel_size == (etp or tp)
    for n in src.tensors:
        assert torch.equal(back.tensors[n].load(), src.tensors[n].load()), n


def test_expert_tp_refusals(moe_root, tmp_path):
    etp = moe_root / "etp"
    # expert TP above TP has no torch-format layout (ranks of different expert-TP rank share one file name)
    with pytest.raises(CkptError, match="expert tensor parallelism 2 above TP 1 has no torch-format layout"):
        api.reshard(etp / "src", tmp_path / "a", tp=1, ep=2, etp=2, warn=lambda m: None)
    with pytest.raises(CkptError, match="--etp 0: the expert tensor-parallel size is at least 1"):
        api.reshard(etp / "src", tmp_path / "b", tp=2, ep=1, etp=0, warn=lambda m: None)
    with pytest.raises(CkptError, match="expert tensor parallelism 3 does not divide TP 2"):
        api.reshard(etp / "src", tmp_path / "b", tp=2, ep=1, etp=3, warn=lambda m: None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(CkptError, match="expert tensor parallelism 4 above TP 2"):
        read_megatron(_with_args(etp / "src", tmp_path / "big", expert_tensor_parallel_size=4))
    # Megatron-LM before 2026-05 saved only expert-data-parallel rank 0's files: at TP2 EP1 ETP1 the second
    # TP rank's dense shard is missing, and the reader says so
    old = tmp_path / "old"
    shutil.copytree(etp / "tp2ep1etp1", old)
    shutil.rmtree(old / "iter_0000007" / "mp_rank_01")
    with pytest.raises(CkptError, match="missing rank directory mp_rank_01 .*before 2026-05"):
        read_megatron(old)
    # the CLI: reshard --etp
    from click.testing import CliRunner
    from ckptool.cli import main
    res = CliRunner().invoke(main, ["reshard", str(etp / "src"), str(tmp_path / "cli"), "--tp", "4", "--ep", "2", "--etp", "2"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "cli" / "iter_0000007").iterdir()) == [
        "mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001"]
    assert read_megatron(tmp_path / "cli").source.layout.describe() == "TP4 PP1 EP2 ETP2"
    with pytest.raises(CkptError, match="--etp 1: the model has no MoE experts to cut"):
        api.reshard(REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint", tmp_path / "c", tp=2, etp=1,
                    warn=lambda m: None)
    assert not (tmp_path / "c").exists()


def test_mtp_layers_and_unknown_expert_modules_are_refused_by_name(moe, tmp_path):
    """Nothing is dropped silently: multi-token prediction layers (megatron-core's GPTModel.mtp: enorm, hnorm,
    eh_proj, transformer_layer, final_layernorm per MTP layer) and expert modules ckptool does not know are
    named, and no output is written."""
    def with_keys(name, extra, **args):
        dst = tmp_path / name
        shutil.copytree(moe / "out_111", dst)
        f = next(dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
        state = torch.load(f, weights_only=False)
        state["model"].update(extra)
        for k, v in args.items():
            setattr(state["args"], k, v)
        torch.save(state, f)
        return dst
    w = torch.zeros(32, 64)
    mtp = with_keys("mtp", {"mtp.layers.0.eh_proj.weight": w, "mtp.layers.0.enorm.weight": torch.ones(32),
                            "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight": w})
    with pytest.raises(CkptError, match=r"multi-token prediction \(MTP\) layers \(--mtp-num-layers\): 3 keys such as mtp\.layers\.0\."):
        read_megatron(mtp)
    with pytest.raises(CkptError, match="multi-token prediction"):
        api.reshard(mtp, tmp_path / "out", tp=1, warn=lambda m: None)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CkptError, match="the args say --mtp-num-layers 1"):
        read_megatron(with_keys("mtp_args", {}, mtp_num_layers=1))
    # expert biases (--add-bias-linear) are read since GPT-OSS: tests/test_gpt_oss.py
    odd = with_keys("odd", {"decoder.layers.0.mlp.experts.experts.linear_fc1.weight": torch.zeros(4, 48, 32)})
    with pytest.raises(CkptError, match=r"an MoE expert module ckptool does not know: 1 keys such as decoder\.layers\.0\.mlp\.experts\.experts"):
        read_megatron(odd)


# Runs in a child: a synthetic MoE model (lazy random bf16, scripts/synthetic.py) written at EP2; reports the
# peak-RSS growth during the write. argv: out dir, "expert" (ckptool's unit) or "layer" (a whole layer per unit).
MEMORY_PROBE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from synthetic import _random
from make_random_gpt import canonical_shape
from ckptool.config import GPTConfig, Layout, MoE
from ckptool.state import Checkpoint, SourceInfo, expected_names
from ckptool.convert import write_layout
import ckptool.formats.megatron.checkpoint as megatron
if sys.argv[2] == "layer":
    megatron._write_unit = lambda layer, role: (layer, 0)
H, F, E = 512, 2048, 8
cfg = GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=F,
                padded_vocab_size=1024, vocab_size=1000, vocab_size_source="test", max_position_embeddings=256,
                position_embedding="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
                tied_embeddings=False, moe=MoE(num_experts=E, top_k=2, ffn_hidden_size=F, layers=(0, 1), topk_norm=True))
shape = lambda n: (E, H) if n.endswith("router.weight") else canonical_shape(cfg, n)
ckpt = Checkpoint(cfg, {n: _random(n, shape(n), torch.bfloat16) for n in expected_names(cfg)},
                  SourceInfo(path="<synthetic>", format="synthetic", dialect="mcore"))
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status("VmRSS:")
write_layout(ckpt, sys.argv[1], Layout(tp=1, ep=2), warn=lambda m: None)
print(json.dumps({"growth": status("VmHWM:") - before, "expert": 3 * H * F * 2, "layer_experts": E * 3 * H * F * 2}))
"""


def test_the_writer_streams_an_moe_layer_expert_by_expert(tmp_path):
    """A layer's experts can be many GB (issue 16, Memory): the torch writer's unit of work is one expert (all its
    ranks' pieces), so peak RSS grows by about two experts in flight, not by the layer. Measured against the
    same write with a whole layer per unit (8 experts of 6 MiB: the layer's experts are 48 MiB)."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    got = {}
    for unit in ("expert", "layer"):
        r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / unit), unit, str(REPO / "scripts")],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        got[unit] = json.loads(r.stdout.strip().splitlines()[-1])
    expert, layer = got["expert"]["expert"], got["expert"]["layer_experts"]
    assert got["expert"]["growth"] < 4 * expert + (32 << 20), got  # two units in flight, each ~2 experts' bytes
    assert got["layer"]["growth"] > layer, got  # the measurement sees a layer when the unit is one
    back = read_megatron(tmp_path / "expert")  # and the output is whole
    assert back.source.layout.ep == 2 and len([n for n in back.tensors if ".experts." in n]) == 2 * 8 * 3


def _group_rank(gen, token: str) -> dict:
    """global rank -> its rank inside its `token` group, from megatron-core's RankGenerator."""
    return {r: i for group in gen.get_ranks(token) for i, r in enumerate(group)}


# (TP, CP, EP, expert TP, PP, world size); expert TP divides TP (the ones the torch format holds)
GRIDS = [(2, 1, 2, 1, 1, 4), (2, 1, 2, 1, 1, 8), (4, 1, 2, 1, 1, 4), (4, 1, 2, 2, 1, 8), (2, 1, 1, 1, 1, 2),
         (2, 1, 3, 1, 1, 6), (2, 2, 2, 1, 1, 8), (4, 2, 4, 2, 2, 32), (8, 1, 2, 2, 2, 32), (2, 1, 4, 2, 1, 8),
         (1, 1, 4, 1, 1, 4), (2, 2, 4, 1, 2, 16)]


@pytest.mark.parametrize("tp, cp, ep, etp, pp, world", GRIDS)
def test_expert_grid_is_megatron_cores_rank_layout(tp, cp, ep, etp, pp, world):
    """ckptool's expert_grid against megatron-core's own RankGenerator (parallel_state, default order
    tp-cp-ep-dp-pp; the expert grid with expert TP, EP, expert DP) and Megatron-LM's save rule (data-parallel
    rank 0 or expert-data-parallel rank 0 writes mp_rank_<TP rank>[_<PP rank>][_<EP rank>]): every rank
    loads a file ckptool writes, whose experts are that rank's expert-TP shard; every file Megatron-LM
    saves lies on the grid with one expert shard, and covers what the reader requires."""
    from megatron.core.parallel_state import RankGenerator
    from ckptool.formats.megatron.checkpoint import _check_rank_dirs, _rank_name, expert_grid
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    tpr, dpr, ppr = (_group_rank(dense, x) for x in ("tp", "dp", "pp"))
    etpr, epr, edpr = (_group_rank(expert, x) for x in ("tp", "ep", "dp"))
    assert all(ppr[r] == _group_rank(expert, "pp")[r] for r in range(world))
    grid = expert_grid(tp, ep, etp)
    saved = {}
    for r in range(world):
        assert grid[(tpr[r], epr[r])] == etpr[r]  # the file this rank loads holds its expert shard
        if dpr[r] == 0 or edpr[r] == 0:
            saved.setdefault((tpr[r], ppr[r], epr[r]), set()).add(etpr[r])
    assert all(len(shards) == 1 for shards in saved.values())  # no two savers of one file disagree
    assert {(t, e) for t, _, e in saved} <= set(grid)
    _check_rank_dirs({rk: Path(_rank_name(*rk, pp, ep)) for rk in saved}, grid, tp, pp, ep, etp, Path("it"))


def test_expert_tp_above_tp_has_no_torch_layout():
    """Why ckptool refuses expert TP above TP in the torch format: at TP1 ETP2 EP2 (4 ranks) two ranks of
    different expert-TP rank save the same mp_rank_00_EEE file (megatron-core's RankGenerator)."""
    from megatron.core.parallel_state import RankGenerator
    dense = RankGenerator(tp=1, ep=1, dp=4, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=2, ep=2, dp=1, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    tpr, dpr = _group_rank(dense, "tp"), _group_rank(dense, "dp")
    etpr, epr, edpr = (_group_rank(expert, x) for x in ("tp", "ep", "dp"))
    names = {}
    for r in range(4):
        if dpr[r] == 0 or edpr[r] == 0:  # Megatron-LM's savers: here every rank (expert DP is 1)
            names.setdefault(f"mp_rank_{tpr[r]:02d}_{epr[r]:03d}", set()).add(etpr[r])
    assert names == {"mp_rank_00_000": {0, 1}, "mp_rank_00_001": {0, 1}}
