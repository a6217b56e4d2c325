"""MoE in megatron-core's torch_dist format, against the real megatron-core.

tests/mcore_moe_helper.py builds the tiny MoE GPTModels of test_moe_megatron.py (Mixtral-like: every layer
MoE, so megatron-core stacks the layers; Qwen2-MoE-like: a dense first layer, a gated shared expert, so it
keys each layer) at TP2 EP2 on 4 CPU processes (gloo) and saves GPTModel.sharded_state_dict() with
dist_checkpointing.save, as a Megatron-LM run with --ckpt-format torch_dist does. ckptool reads it (every
tensor equal to the live model's), converts it to Hugging Face (transformers computes megatron-core's logits),
to the torch format at EP1 / EP4 and back to torch_dist at other TP / EP / PP; megatron-core loads each
output strictly at its layout and computes the same logits. The same for a save with singleton_local_shards
(per-expert keys) and one of the legacy GroupedMLP experts (--moe-grouped-gemm without Transformer Engine).
"""
from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.dcp import torch_dist as dist
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.write_options import WriteOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_megatron import HAVE_MCORE, HELPER, relative  # noqa: E402
from conftest import copy_run, declare_runs, shared_followups  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
# outputs ckptool writes from the TP2 EP2 save, loaded by megatron-core at their layout: (format, tp, pp, ep)
OUTPUTS = [("torch", 1, 1, 1), ("torch", 1, 1, 4), ("torch_dist", 1, 1, 4), ("torch_dist", 2, 1, 1),
           ("torch_dist", 1, 2, 2)]


# the legacy GroupedMLP save (--moe-grouped-gemm without Transformer Engine; the helper stands in for the CUDA
# grouped_gemm kernel) written as torch_dist, loaded into SequentialMLP and GroupedMLP models: (tp, pp, ep), arch
GROUPED_OUTPUTS = [((1, 1, 4), "mixtral"), ((2, 1, 1), "grouped")]


def _name(fmt, tp, pp, ep):
    return f"{fmt}_{tp}{pp}{ep}"


# the megatron-core saves (run once per session: test_verify_moe saves the Mixtral one too)
SAVES = declare_runs(HELPER, 4, {
    **{f"{a}/src": f"save-dist {{out}} --tp 2 --ep 2 --arch {a} --out {{out}}.pt"
       for a in list(ARCHS) + ["grouped", "biased"]},
    **{f"{a}/single": f"save-dist {{out}} --tp 2 --ep 2 --arch {a} --singleton --out {{out}}.pt" for a in ARCHS},
    **{f"{a}/pp2": f"save-dist {{out}} --tp 1 --pp 2 --ep 2 --arch {a} --out {{out}}.pt" for a in ARCHS}})


@shared_followups
def root(framework_runs, root):
    """Per arch: the megatron-core save (src/), its logits and live parameters (src.pt), ckptool's OUTPUTS
    and megatron-core's logits after loading each (the loads in one launch with the other files' 4-process MoE
    follow-ups)."""
    for name, stem in framework_runs(HELPER, 4, SAVES, timeout=400).items():
        copy_run(stem, root / name)
    # the per-expert (singleton) save of the all-MoE model back to megatron-core's default stacked form
    out = root / "mixtral" / "single_to_stacked"
    api.reshard(root / "mixtral" / "single", out, tp=1, ep=4, format="torch_dist", warn=lambda m: None)
    jobs = [f"load-dist {out} --tp 1 --ep 4 --arch mixtral --out {out}.pt"]
    # sigmoid routing steered by an expert bias: the float32 bias stays float32 in a bf16 output
    out = root / "biased" / "out_114"
    api.reshard(root / "biased" / "src", out, tp=1, ep=4, format="torch_dist", warn=lambda m: None)
    api.reshard(root / "biased" / "src", root / "biased" / "bf16", tp=1, ep=4, format="torch_dist",
                dtype=torch.bfloat16, warn=lambda m: None)
    jobs.append(f"load-dist {out} --tp 1 --ep 4 --arch biased --out {out}.pt")
    for (tp, pp, ep), arch in GROUPED_OUTPUTS:
        out = root / "grouped" / f"{arch}_{tp}{pp}{ep}"
        api.reshard(root / "grouped" / "src", out, tp=tp, pp=pp, ep=ep, format="torch_dist", warn=lambda m: None)
        jobs.append(f"load-dist {out} --tp {tp} --pp {pp} --ep {ep} --arch {arch} --out {out}.pt")
    for a in ARCHS:
        for fmt, tp, pp, ep in OUTPUTS:
            out = root / a / _name(fmt, tp, pp, ep)
            api.reshard(root / a / "src", out, tp=tp, pp=pp, ep=ep, format=fmt, warn=lambda m: None)
            mode = "load-dist" if fmt == "torch_dist" else "load-torch"
            jobs.append(f"{mode} {out} --tp {tp} --pp {pp} --ep {ep} --arch {a} --out {out}.pt")
    yield [(HELPER, 4, jobs)]
    return root


# megatron-core parameter names (experts by global index, as the helper reports them) -> canonical names;
# fused tensors are split here by their documented layouts, independently of ckptool's tables.
LIVE = {
    "embedding.word_embeddings.weight": ["embed.word"],
    "output_layer.weight": ["output.weight"],
    "decoder.final_layernorm.weight": ["final_norm.weight"],
    "input_layernorm.weight": ["attn_norm.weight"],
    "self_attention.linear_qkv.weight": ["attn.{}.weight"],
    "self_attention.linear_qkv.bias": ["attn.{}.bias"],
    "self_attention.linear_proj.weight": ["attn.out.weight"],
    "pre_mlp_layernorm.weight": ["mlp_norm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate.weight", "mlp.up.weight"],
    "mlp.linear_fc2.weight": ["mlp.down.weight"],
    "mlp.router.weight": ["mlp.router.weight"],
    "mlp.experts.local_experts.{e}.linear_fc1.weight": ["mlp.experts.{e}.gate.weight", "mlp.experts.{e}.up.weight"],
    "mlp.experts.local_experts.{e}.linear_fc2.weight": ["mlp.experts.{e}.down.weight"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared.gate.weight", "mlp.shared.up.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared.down.weight"],
    "mlp.shared_experts.gate_weight": ["mlp.shared_gate.weight"],
}


def canonical_live(params: dict, heads=4, groups=2, head_dim=8) -> dict:
    out = {}
    for name, t in params.items():
        layer, rest, e = None, name, None
        if name.startswith("decoder.layers."):
            layer, rest = name[len("decoder.layers."):].split(".", 1)
        if ".local_experts." in rest:
            head, tail = rest.split(".local_experts.")
            e, tail = tail.split(".", 1)
            rest = f"{head}.local_experts.{{e}}.{tail}"
        targets = LIVE[rest]
        prefix = f"layers.{layer}." if layer is not None else ""
        if "attn.{}" in targets[0]:  # grouped QKV rows: per group, its query heads then one k and one v head
            g = t.reshape(groups, heads // groups + 2, head_dim, *t.shape[1:])
            parts = {"q": g[:, :-2], "k": g[:, -2], "v": g[:, -1]}
            for x, p in parts.items():
                out[prefix + targets[0].format(x)] = p.reshape(-1, *t.shape[1:])
        elif len(targets) == 2:  # GLU fc1 as megatron-core's sharded form stores it: [all gate; all up]
            for target, half in zip(targets, t.chunk(2, dim=0)):
                out[prefix + target.format(e=e)] = half
        else:
            out[prefix + targets[0].format(e=e)] = t
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("save", ["src", "single", "pp2"])
def test_reads_every_tensor_equal_to_the_live_model(root, arch, save):
    """src: megatron-core's default keys (experts stacked on an expert axis; layers too when all are MoE);
    single: singleton_local_shards (every layer keyed, one key per expert, GLU fc1 as weight_w / weight_v);
    pp2: TP1 PP2 EP2, each pipeline stage saving its own layers."""
    ck = dist.read(root / arch / save)
    assert ck.source.layout.describe() == ("TP1 PP2 EP2" if save == "pp2" else "TP2 PP1 EP2")
    stacked = arch == "mixtral" and save != "single"
    assert ck.source.dialect == ("mcore-dist" if stacked else "mcore-dist-per-layer")
    keys = _metadata(root / arch / save)
    assert ("decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w" in keys) == (save == "single")
    m = ck.config.moe
    assert (m.num_experts, m.top_k, m.ffn_hidden_size) == (4, 2, 24)
    assert m.layers == ((0, 1) if arch == "mixtral" else (1,))
    live = canonical_live(torch.load(root / arch / f"{save}.pt")["params"])
    assert sorted(live) == sorted(ck.tensors)
    for name, t in live.items():
        assert torch.equal(ck.tensors[name].load(), t), name
    gates = [ck.tensors[f"layers.1.mlp.experts.{e}.gate.weight"].load() for e in range(4)]
    assert all(not torch.equal(gates[a], gates[b]) for a in range(4) for b in range(a + 1, 4))


@pytest.mark.parametrize("arch", list(ARCHS) + ["grouped"])
def test_to_hf_computes_megatron_cores_logits(root, tmp_path, arch):
    import transformers
    result = api.to_hf(root / arch / "src", tmp_path / "hf", warn=lambda m: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == ARCHS.get(arch, "MixtralForCausalLM"), result.summary
    ref = torch.load(root / arch / "src.pt")
    with torch.no_grad():
        got = model(ref["tokens"]).logits
    assert relative(got, ref["logits"][..., :got.shape[-1]]) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("output", OUTPUTS, ids=lambda o: "{}-TP{}PP{}EP{}".format(*o))
def test_megatron_core_loads_every_output_strictly_with_the_same_logits(root, arch, output):
    fmt, tp, pp, ep = output
    out = root / arch / _name(*output)
    ref = torch.load(root / arch / "src.pt")["logits"]
    got = torch.load(f"{out}.pt")["logits"]
    assert relative(got, ref) <= 1e-5
    src = dist.read(root / arch / "src")
    back = dist.read(out) if fmt == "torch_dist" else read_megatron(out)
    assert back.source.layout.ep == ep and back.config.moe == src.config.moe
    assert list(back.tensors) == list(src.tensors)
    for name in src.tensors:  # every tensor bit-exact through the conversion
        assert torch.equal(back.tensors[name].load(), src.tensors[name].load()), name
    if fmt == "torch_dist":  # megatron-core's key form: stacked when every layer is MoE, per layer otherwise
        keys = _metadata(out)
        stacked = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        assert (stacked in keys) == (arch == "mixtral")
        assert ("decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in keys) == (arch != "mixtral")


def test_singleton_save_converts_to_the_stacked_form_megatron_core_loads(root):
    out = root / "mixtral" / "single_to_stacked"
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in _metadata(out)
    ref = torch.load(root / "mixtral" / "single.pt")["logits"]
    assert relative(torch.load(f"{out}.pt")["logits"], ref) <= 1e-5


@pytest.mark.parametrize("layout, arch", GROUPED_OUTPUTS, ids=lambda x: str(x))
def test_grouped_gemm_save_loads_as_sequential_and_grouped_experts(root, layout, arch):
    """GroupedMLP stores the same sharded form as SequentialMLP (weights transposed back per expert)."""
    ck = dist.read(root / "grouped" / "src")
    gates = [ck.tensors[f"layers.0.mlp.experts.{e}.gate.weight"].load() for e in range(4)]
    assert all(not torch.equal(gates[a], gates[b]) for a in range(4) for b in range(a + 1, 4))
    out = root / "grouped" / "{}_{}{}{}".format(arch, *layout)
    ref = torch.load(root / "grouped" / "src.pt")["logits"]
    assert relative(torch.load(f"{out}.pt")["logits"], ref) <= 1e-5
    back = dist.read(out)
    for name in ck.tensors:
        assert torch.equal(back.tensors[name].load(), ck.tensors[name].load()), name


def test_expert_bias_round_trips_and_steers_megatron_cores_routing(root):
    src = dist.read(root / "biased" / "src")
    m = src.config.moe
    assert (m.score_function, m.expert_bias, m.topk_norm) == ("sigmoid", True, True)
    bias = src.tensors["layers.1.mlp.router.expert_bias"].load()
    assert bias.dtype == torch.float32 and bias.abs().min() > 0  # the helper's, off megatron-core's zeros
    out = root / "biased" / "out_114"
    ref = torch.load(root / "biased" / "src.pt")["logits"]
    assert relative(torch.load(f"{out}.pt")["logits"], ref) <= 1e-5
    assert torch.equal(dist.read(out).tensors["layers.1.mlp.router.expert_bias"].load(), bias)
    half = dist.read(root / "biased" / "bf16")
    assert half.tensors["layers.1.mlp.router.weight"].dtype == torch.bfloat16
    assert torch.equal(half.tensors["layers.1.mlp.router.expert_bias"].load(), bias)


def _metadata(ckpt_dir: Path) -> dict:
    it = next(ckpt_dir.glob("iter_*"))
    with open(it / ".metadata", "rb") as f:
        return pickle.load(f).state_dict_metadata


def _rename_key(src: Path, dst: Path, old: str, new: str) -> Path:
    """A copy of a torch_dist checkpoint whose tensor `old` is stored under the name `new`."""
    shutil.copytree(src, dst)
    f = next(dst.glob("iter_*")) / ".metadata"
    md = pickle.loads(f.read_bytes())
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md.storage_data = {(type(i)(new, i.offset, i.index) if i.fqn == old else i): v for i, v in md.storage_data.items()}
    f.write_bytes(pickle.dumps(md))
    return dst


STACKED_FC1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"


@pytest.mark.parametrize("save, old, new, says", [
    ("src", STACKED_FC1, "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight", "multi-token-prediction"),
    ("src", STACKED_FC1, "decoder.layers.1.mlp.experts.grouped.linear_fc1.weight", "expert layout other than"),
    ("src", STACKED_FC1, "decoder.layers.1.mlp.experts.local_experts.0.fc1.weight", "expert layout other than"),
    # a name of another known form with this form's shape: every expert's fc1 but that one is missing (one key per
    # expert; Megatron-FSDP's grouped and SequentialMLP names, read since issue 31)
    ("src", STACKED_FC1, "decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight", "6 tensors missing"),
    ("src", STACKED_FC1, "decoder.layers.1.mlp.experts.linear_fc1.weight0", "6 tensors missing"),
    ("src", STACKED_FC1, "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", "6 tensors missing"),
    ("single", "decoder.layers.1.mlp.experts.experts.1.linear_fc1.weight_v",
     "decoder.layers.1.mlp.experts.experts.1.linear_fc1.weight_u", "expert layout other than"),
])
def test_unknown_expert_layouts_and_mtp_are_refused_by_name(root, tmp_path, save, old, new, says):
    bad = _rename_key(root / "qwen2moe" / save, tmp_path / "bad", old, new)
    with pytest.raises(CkptError, match=says) as e:
        dist.read(bad)
    assert new in str(e.value) or "missing" in says


def test_a_lost_glu_half_is_refused(root, tmp_path):
    bad = _rename_key(root / "qwen2moe" / "single", tmp_path / "bad",
                      "decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v", "rng_state_unused")
    with pytest.raises(CkptError, match="only its gate half"):
        dist.read(bad)


def test_moe_without_args_asks_for_them(root, tmp_path):
    """A bare dist_checkpointing save stores no args: top-k and the score function are not in any shape."""
    bare = tmp_path / "bare"
    shutil.copytree(root / "mixtral" / "src" / "iter_0000007", bare)
    (bare / "common.pt").unlink(missing_ok=True)
    md = pickle.loads((bare / ".metadata").read_bytes())
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith("common_state")}
    (bare / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CkptError, match="--args-from"):
        dist.read(bare, None)
    ck = dist.read(bare, dist.ReadOptions(args_from=str(root / "mixtral" / "src")))
    assert ck.config.moe == dist.read(root / "mixtral" / "src").config.moe


def test_inspect_shows_experts_top_k_and_ep(root):
    from click.testing import CliRunner
    from ckptool.cli import main
    r = CliRunner().invoke(main, ["inspect", str(root / "qwen2moe" / "src"), "--no-tensors"])
    assert r.exit_code == 0, r.output
    assert "layout      TP2 PP1 EP2" in r.output
    assert "experts     4 per MoE layer, top-2 softmax, expert ffn 24, shared expert ffn 16 (gated); MoE layers [1]" \
        in r.output
    doc = json.loads(CliRunner().invoke(main, ["inspect", str(root / "mixtral" / "src"), "--json"]).output)
    assert doc["layout"]["ep"] == 2 and doc["config"]["moe"]["num_experts"] == 4 and doc["config"]["moe"]["top_k"] == 2


def test_moe_optimizer_state_is_written_as_the_target_eps_chain(root, tmp_path):
    """megatron-core keeps expert parameters in a separate (chained) optimizer at EP > 1: the torch_dist
    writer lists the groups as that chain ({0: dense, 1: expert}) and stores the experts' slots beside
    their weights; they read back unchanged (real megatron-core runs: tests/test_dist_optim_moe.py)."""
    import dataclasses
    from ckptool.convert import write_layout
    from ckptool.config import Layout
    from ckptool.io.torchfile import load_torch_file
    from ckptool.state import OptimizerState, ParamGroup
    ck = dist.read(root / "mixtral" / "src")
    moments = {n: t for n, t in ck.tensors.items()}
    ck = dataclasses.replace(ck, optimizer=OptimizerState(
        "megatron", {"exp_avg": moments, "exp_avg_sq": moments}, step=1,
        param_groups=[ParamGroup(list(ck.tensors), {"lr": 1e-3, "weight_decay": 0.01, "wd_mult": 1.0})]))
    said = []
    write_layout(ck, tmp_path / "out", Layout(tp=1, ep=2), WriteOptions(format="torch_dist"), warn=said.append)
    assert not [m for m in said if "optimizer" in m], said
    keys = _metadata(tmp_path / "out")
    assert any(k.startswith("optimizer.state.exp_avg.") and "experts" in k for k in keys)
    common = load_torch_file(next((tmp_path / "out").glob("iter_*")) / "common.pt")["optimizer"]
    assert sorted(common) == [0, 1] and common[1]["optimizer"]["param_groups"][0]["is_expert_parallel"]
    back = dist.read(tmp_path / "out")
    assert back.source.layout.ep == 2 and list(back.tensors) == list(ck.tensors)
    assert all(torch.equal(back.optimizer.slots["exp_avg"][n].load(), t.load()) for n, t in moments.items())


@pytest.mark.parametrize("kind, ep", [("mixtral", 2), ("qwen2_moe", 3), ("qwen3_moe", 4)])
def test_hf_moe_through_torch_dist_is_bit_exact(tmp_path, kind, ep):
    """A tiny random HF model of each family -> torch_dist at TP2 and an EP -> to-hf: every tensor bit-exact,
    transformers' logits equal (the all-MoE model stacked, the others keyed per layer)."""
    from test_moe import _build, hf_logits, randomise
    from ckptool.formats.registry import open_checkpoint
    torch.manual_seed(7)
    model = randomise(_build(kind)).eval()
    model.save_pretrained(tmp_path / "hf")
    api.reshard(tmp_path / "hf", tmp_path / "dist", tp=2, ep=ep, format="torch_dist", warn=lambda m: None)
    src, back = open_checkpoint(tmp_path / "hf"), dist.read(tmp_path / "dist")
    assert back.source.dialect == ("mcore-dist" if kind == "mixtral" else "mcore-dist-per-layer")
    assert back.source.layout.ep == ep and back.config.moe == src.config.moe
    for name, t in src.tensors.items():
        assert torch.equal(back.tensors[name].load()[:t.shape[0]], t.load()), name
    # args say transformer_engine (no source run to follow): an MoE layer's norm under the TE spec's own name
    # (megatron-core's local spec, which the tests above load, maps it onto mlp.linear_fc1.layer_norm_weight)
    assert back.source.args.transformer_impl == "transformer_engine"
    keys = _metadata(tmp_path / "dist")
    moe_layer = src.config.moe.layers[0]
    layer = "decoder.layers." if kind == "mixtral" else f"decoder.layers.{moe_layer}."
    assert layer + "pre_mlp_layernorm.weight" in keys and layer + "mlp.linear_fc1.layer_norm_weight" not in keys
    api.to_hf(tmp_path / "dist", tmp_path / "hf2", warn=lambda m: None)
    assert torch.equal(hf_logits(tmp_path / "hf2"), hf_logits(model))


@pytest.mark.parametrize("arch", list(ARCHS) + ["grouped"])
def test_verify_routes_like_megatron_core(root, tmp_path, arch):
    """ckptool's single-process reference forward of the torch_dist source against megatron-core's own logits."""
    from click.testing import CliRunner
    from ckptool.cli import main
    ref = torch.load(root / arch / "src.pt")
    torch.save({"tokens": ref["tokens"], "logits": ref["logits"]}, tmp_path / "ref.pt")
    r = CliRunner().invoke(main, ["verify", str(root / arch / "src"), "--reference-logits", str(tmp_path / "ref.pt")])
    assert r.exit_code == 0 and "result=PASS" in r.output and "top1_agreement=1" in r.output, r.output
