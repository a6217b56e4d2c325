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
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.megatron import read_megatron

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_moe_helper.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

# (tp, pp, ep) layouts written by ckptool and loaded by megatron-core (4 processes: DP fills the rest)
LAYOUTS = [(1, 1, 1), (1, 1, 4), (1, 2, 2), (2, 1, 2)]


def torchrun(jobs, nproc=4, timeout=400):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(HELPER), *jobs]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


ARCHS = ("mixtral", "qwen2moe")  # the helper's two models (see mcore_moe_helper.ARCHS)


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    """Per arch: the megatron-core TP2 EP2 save, ckptool's outputs at LAYOUTS, megatron-core's logits of
    each (two torchrun launches in all)."""
    root = tmp_path_factory.mktemp("mcore_moe")
    torchrun([f"save {root / a / 'src'} --tp 2 --ep 2 --arch {a} --out {root / a / 'src.pt'}" for a in ARCHS])
    jobs = []
    for a in ARCHS:
        d = root / a
        for tp, pp, ep in LAYOUTS:
            out = d / f"out_{tp}{pp}{ep}"
            if (tp, pp, ep) == (1, 1, 1):
                api.merge(d / "src", out, warn=lambda m: None)
            else:
                api.reshard(d / "src", out, tp=tp, pp=pp, ep=ep, warn=lambda m: None)
            jobs.append(f"load-torch {out} --tp {tp} --pp {pp} --ep {ep} --arch {a} --out {d / f'out_{tp}{pp}{ep}.pt'}")
    torchrun(jobs)
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
    with pytest.raises(CkptError, match="mcore-te dialect has no place for MoE experts"):
        api.reshard(moe / "src", tmp_path / "c", tp=1, dialect="mcore-te", warn=lambda m: None)
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
    # expert tensor parallelism different from TP is not read yet, and says so
    with pytest.raises(CkptError, match="expert tensor parallelism 1 differs from tensor parallelism 2"):
        read_megatron(_with_args(moe / "src", tmp_path / "etp", expert_tensor_parallel_size=1))
    # ... also when its save is sparse as megatron-core writes it (TP2 ETP1 EP2: only (tp0, ep0), (tp1, ep1))
    shutil.rmtree(tmp_path / "etp" / "iter_0000007" / "mp_rank_00_001")
    with pytest.raises(CkptError, match="expert tensor parallelism 1 differs"):
        read_megatron(tmp_path / "etp")
    with pytest.raises(CkptError, match="has 48 rows over the TP ranks, expected 24 for the expert FFN size 12"):
        read_megatron(_with_args(moe / "src", tmp_path / "ffn", moe_ffn_hidden_size=12))


def test_legacy_grouped_gemm_experts_are_refused_by_name(moe, tmp_path):
    """The legacy GroupedMLP (`experts.weight1` [h, experts x fc1], `weight2`) needs grouped_gemm, absent
    here: not read yet, and never silently left out."""
    for form, rename in (("legacy", lambda k: k.replace("experts.local_experts.0.linear_fc1.weight", "experts.weight1")),):
        dst = tmp_path / form
        shutil.copytree(moe / "out_111", dst)
        f = next(dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
        state = torch.load(f, weights_only=False)
        state["model"] = {rename(k): v for k, v in state["model"].items()}
        torch.save(state, f)
        with pytest.raises(CkptError, match=r"keys are not part of a mcore GPT model \(e\.g\. decoder\.layers\.0\.mlp\.experts\."):
            read_megatron(dst)


def test_verify_routes_the_expert_parallel_output_and_torchrun_refuses_moe(moe, tmp_path):
    from click.testing import CliRunner
    from ckptool.cli import main
    from ckptool.commands.verify_cmd import parallel_target
    from ckptool.options import ReadOptions
    api.to_hf(moe / "src", tmp_path / "hf", warn=lambda m: None)
    res = CliRunner().invoke(main, ["verify", str(moe / "out_114"), "--reference", str(tmp_path / "hf")])
    assert res.exit_code == 0 and "result=PASS" in res.output, res.output
    with pytest.raises(CkptError, match="parallel verify .* does not run MoE layers yet"):
        parallel_target(str(moe / "out_114"), ReadOptions(), None, None, 4)


def test_expert_optimizer_state_at_ep1_needs_no_extra_code(tmp_path):
    """A real megatron-core Adam step (fp32) saved with its optimizer: at EP1 the experts sit in the one
    optimizer in parameter order and ckptool ties their moments like any parameter; at EP2 megatron-core
    saves a chained [dense, expert] list, which is dropped with a warning, never mis-tied."""
    torchrun([f"train {tmp_path / 'ep1'} --tp 1 --ep 1 --out {tmp_path / 'ep1.pt'}",
              f"train {tmp_path / 'ep2'} --tp 1 --ep 2 --out {tmp_path / 'ep2.pt'}"], nproc=2)
    ck = read_megatron(tmp_path / "ep1")
    live = dict(torch.load(tmp_path / "ep1.pt.moments")["exp_avg"][0][1])
    ea = ck.optimizer.slots["exp_avg"]
    for i in range(2):
        assert torch.equal(ea[f"layers.{i}.mlp.router.weight"].load(), live[f"decoder.layers.{i}.mlp.router.weight"])
        for e in range(4):
            fc1 = live[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.gate.weight"].load(), fc1[:24])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.up.weight"].load(), fc1[24:])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.down.weight"].load(),
                               live[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"])
    # carried through a TP2 reshard at EP1 (read back equal); dropped, with a warning, at EP2
    api.reshard(tmp_path / "ep1", tmp_path / "tp2", tp=2, warn=lambda m: None)
    back = read_megatron(tmp_path / "tp2").optimizer.slots["exp_avg"]
    assert all(torch.equal(back[n].load(), ea[n].load()) for n in ea)
    said = []
    api.reshard(tmp_path / "ep1", tmp_path / "ep2out", tp=1, ep=2, warn=said.append)
    assert any("optimizer state dropped: at EP > 1" in m for m in said) and read_megatron(tmp_path / "ep2out").optimizer is None
    two = read_megatron(tmp_path / "ep2")
    assert two.optimizer is None and any("chained optimizer" in w for w in two.warnings)
    with pytest.raises(CkptError, match="distributed optimizer's buffers of MoE models are not written yet"):
        api.reshard(tmp_path / "ep1", tmp_path / "d", tp=1, distributed_optimizer=True, dp=2, warn=lambda m: None)
    assert not (tmp_path / "d").exists()



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
    with pytest.raises(CkptError, match="mcore-te dialect has no place for MoE experts"):
        api.reshard(dst, tmp_path / "out", tp=1, warn=lambda m: None)  # written only as mcore
    api.reshard(dst, tmp_path / "mcore", tp=1, ep=2, dialect="mcore", warn=lambda m: None)
    assert read_megatron(tmp_path / "mcore").source.dialect == "mcore"
