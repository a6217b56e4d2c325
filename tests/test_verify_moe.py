"""`torchrun -m ckptool verify` on MoE checkpoints with expert parallelism (gloo, CPU, 2 and 4 processes).

tests/mcore_moe_helper.py saves tiny megatron-core MoE GPTs (4 SequentialMLP experts, top-2) in
Megatron-LM's torch format at TP2 EP2 and PP2 EP2 (mp_rank_TT[_PPP]_EEE), at TP2 EP2 with expert TP 1
(two files: mp_rank_00_000, mp_rank_01_001) and at TP2 EP2 with the legacy GroupedMLP (weight1 /
weight2), with megatron-core's own logits. The parallel verify runs each at its files' layout (world =
PP x TP x EP, or PP x lcm(TP, ETP x EP) at expert TP != TP; the ranks beyond TP split the batch as the
data-parallel ranks they are), every rank on its own file, and must reproduce megatron-core's logits,
the single-process forward and transformers' (to-hf of the same source). ckptool's own outputs at
expert TP != TP (reshard --etp) and with a virtual pipeline and EP (from-hf --vpp --ep) run too. An
expert corrupted in one EP rank's file is caught and the file named.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, once, shared_followups
from test_verify import VERIFY_BATCH, _fake_torchrun, load_recording_chunk_reads, metric, verify_jobs, verify_results

from ckptool import api
from ckptool.config import Layout
from ckptool.formats.megatron.checkpoint import read_megatron

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_moe_helper.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

# name -> helper job arguments (all at 4 processes: megatron-core carves EP out of DP)
SAVES = {"tp2ep2": "--tp 2 --ep 2 --arch mixtral", "pp2ep2": "--pp 2 --ep 2",
         "qwen_tp2ep2": "--tp 2 --ep 2 --arch qwen2moe", "etp1": "--tp 2 --ep 2 --etp 1",
         "grouped": "--tp 2 --ep 2 --arch grouped"}
# the helper's jobs (run once per session: test_moe_megatron / test_moe_dist save some of the same)
JOBS = declare_runs(HELPER, 4, {**{n: f"save {{out}} {a} --out {{out}}.pt" for n, a in SAVES.items()},
                                # torch_dist: experts stacked
                                "dist": "save-dist {out} --tp 2 --ep 2 --arch mixtral --out {out}.pt"})


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def moe(tmp_path_factory, framework_runs):
    """The megatron-core saves (run once per session: test_moe_megatron / test_moe_dist save the same),
    ckptool's TP1 EP4 and Qwen PP2 EP2 reshards, and the to-hf of the TP2 EP2 source (the reference with
    weights, for locating a corrupted expert). Built once: the checks' steps below start from the same."""
    return once(_build_moe, lambda: tmp_path_factory.mktemp("verify_moe"), framework_runs)


def _build_moe(root: Path, framework_runs) -> Path:
    for name, stem in framework_runs(HELPER, 4, JOBS, timeout=400).items():
        copy_run(stem, root / name)
    api.reshard(root / "tp2ep2", root / "tp1ep4", tp=1, ep=4, warn=lambda m: None)
    api.reshard(root / "qwen_tp2ep2", root / "qwen_pp2ep2", tp=1, pp=2, ep=2, warn=lambda m: None)
    api.to_hf(root / "tp2ep2", root / "hf", warn=lambda m: None)
    api.to_hf(root / "pp2ep2", root / "hf_pp2ep2", warn=lambda m: None)
    # one expert corrupted in one EP rank's file: layer 1's local expert 1 of mp_rank_01_001 (TP rank 1,
    # EP rank 1: global expert 3) takes local expert 0's fc2 columns (a swapped expert)
    shutil.copytree(root / "tp2ep2", root / "corrupt")
    f = root / "corrupt" / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    p = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc2.weight"
    state["model"][p.format(1)] = state["model"][p.format(0)].clone()
    torch.save(state, f)
    # not an MoE piece: layer 1's attention output projection changed in one file
    shutil.copytree(root / "tp2ep2", root / "attn")
    f = root / "attn" / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.layers.1.self_attention.linear_proj.weight"] *= 1.5
    torch.save(state, f)
    # the Qwen-like model's shared expert (replicated over EP) changed in one file: TP rank 1, EP rank 0
    api.to_hf(root / "qwen_tp2ep2", root / "hf_qwen", warn=lambda m: None)
    shutil.copytree(root / "qwen_tp2ep2", root / "qwen_shared")
    f = root / "qwen_shared" / "iter_0000007" / "mp_rank_01_000" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"] *= 1.5
    torch.save(state, f)
    # expert TP 1 below TP 2: ckptool's own outputs, at EP4 (4 files), PP2 EP2 and EP1 (two expert-data-
    # parallel replicas of every expert, which split its tokens)
    api.reshard(root / "tp2ep2", root / "etp1ep4", tp=2, ep=4, etp=1, warn=lambda m: None)
    api.reshard(root / "tp2ep2", root / "pp2etp1", tp=2, pp=2, ep=2, etp=1, warn=lambda m: None)
    api.reshard(root / "tp2ep2", root / "etp1ep1", tp=2, ep=1, etp=1, warn=lambda m: None)
    api.to_hf(root / "etp1", root / "hf_etp1", warn=lambda m: None)
    # a swapped expert in an expert-TP-1 file: layer 1's local experts 0 and 1 of mp_rank_01_001 (EP rank 1:
    # global experts 2 and 3, whole at ETP 1) trade places
    shutil.copytree(root / "etp1", root / "etp1_swapped")
    f = root / "etp1_swapped" / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    for fc in ("linear_fc1", "linear_fc2"):
        p = "decoder.layers.1.mlp.experts.local_experts.{}." + fc + ".weight"
        m = state["model"]
        m[p.format(0)], m[p.format(1)] = m[p.format(1)], m[p.format(0)]
    torch.save(state, f)
    # an expert-data-parallel replica changed: at TP2 ETP1 EP1 both files hold every expert whole; layer 1's
    # expert 1 of mp_rank_01 (the replica that computes every other token routed to it) scaled
    shutil.copytree(root / "etp1ep1", root / "etp1ep1_replica")
    f = root / "etp1ep1_replica" / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"] *= 1.5
    torch.save(state, f)
    # a virtual pipeline with EP: a Qwen2-MoE of 4 layers (dense layer 0, gated shared expert) built by
    # transformers, written by from-hf at TP1 PP2 VPP2 EP2 (stage 0 holds layers 0 and 2)
    from test_moe import _build, randomise
    randomise(_build("qwen2_moe")).save_pretrained(root / "hf_qwen4")
    api.from_hf(root / "hf_qwen4", root / "qwen_vpp_ep", tp=1, pp=2, vpp=2, ep=2, warn=lambda m: None)
    # TEGroupedMLP experts (mlp.experts.linear_fc1.weight{j}), as a --moe-grouped-gemm run with Transformer
    # Engine saves them
    api.reshard(root / "tp2ep2", root / "te_grouped", tp=2, ep=2, dialect="mcore-te", moe_grouped_gemm=True,
                warn=lambda m: None)
    return root


@shared_followups
def runs(framework_runs, d):
    """Every 4-process parallel verify of this module, in the session's shared launch of 4-process checks."""
    moe = once(_build_moe, lambda: d / "moe", framework_runs)
    m = lambda name, key="logits": f"{moe / name}.pt:{key}"  # noqa: E731
    cases = {
        "tp2ep2_mcore": [moe / "tp2ep2", "--reference-logits", m("tp2ep2")],
        "pp2ep2_mcore": [moe / "pp2ep2", "--reference-logits", m("pp2ep2")],
        "qwen_mcore": [moe / "qwen_tp2ep2", "--reference-logits", m("qwen_tp2ep2")],
        "ep4_mcore": [moe / "tp1ep4", "--reference-logits", m("tp2ep2")],  # batch 2 over 4 EP ranks: two idle
        "tp2ep2_merged": [moe / "tp2ep2"],  # against the single-process forward of the same files
        "tp2ep2_hf": [moe / "tp2ep2", "--reference", moe / "hf"],
        "pp2ep2_hf": [moe / "pp2ep2", "--reference", moe / "hf_pp2ep2"],
        "qwen_pp2ep2_uneven": [moe / "qwen_pp2ep2", "--batch", 3, "--seq-len", 8],  # rows 2 + 1
        "corrupt_mcore": [moe / "corrupt", "--reference-logits", m("tp2ep2")],
        "qwen_shared": [moe / "qwen_shared", "--reference", moe / "hf_qwen"],
        "attn": [moe / "attn", "--reference", moe / "hf"],
        "grouped_mcore": [moe / "grouped", "--reference-logits", m("grouped")],
        "etp1ep4_mcore": [moe / "etp1ep4", "--reference-logits", m("tp2ep2")],
        "pp2etp1_mcore": [moe / "pp2etp1", "--reference-logits", m("tp2ep2")],
        "qwen_vpp_ep_hf": [moe / "qwen_vpp_ep", "--reference", moe / "hf_qwen4", "--batch", 3],
        "te_grouped_mcore": [moe / "te_grouped", "--reference-logits", m("tp2ep2")],
        "dist_mcore": [moe / "dist", "--reference-logits", m("dist")],  # at its args' TP2 EP2
    }
    yield [(VERIFY_BATCH, 4, verify_jobs(cases, d / "runs"))]
    return verify_results(cases, d / "runs")


@shared_followups
def runs2(framework_runs, d):
    """The layouts of two ranks (expert TP 1 at TP2 EP2 and EP1), in the session's shared launch of 2-process
    checks."""
    moe = once(_build_moe, lambda: d / "moe", framework_runs)
    m = lambda name, key="logits": f"{moe / name}.pt:{key}"  # noqa: E731
    cases = {
        "etp1_mcore": [moe / "etp1", "--reference-logits", m("etp1")],
        "etp1_hf": [moe / "etp1", "--reference", moe / "hf_etp1"],
        "etp1ep1_mcore": [moe / "etp1ep1", "--reference-logits", m("tp2ep2")],
        "etp1_swapped": [moe / "etp1_swapped", "--reference", moe / "hf_etp1"],
        "dist_tp2_mcore": [moe / "dist", "--tp", 2, "--reference-logits", m("dist")],  # EP1: every expert, TP share
        "etp1ep1_replica": [moe / "etp1ep1_replica", "--reference", moe / "hf"],
    }
    yield [(VERIFY_BATCH, 2, verify_jobs(cases, d / "runs2"))]
    return verify_results(cases, d / "runs2")


def _failed_divergence(out: str, rc: int) -> str:
    """The first_divergence line of a verify run that must have failed."""
    assert rc == 1 and "result=FAIL" in out, out
    return next(l for l in out.splitlines() if l.startswith("first_divergence="))


def _named_pieces(line: str) -> str:
    """What the MoE probe names in a first_divergence line: the pieces that differ and their files."""
    return line.split("MoE pieces that differ", 1)[1]


@pytest.mark.parametrize("case, layout, save", [
    ("tp2ep2_mcore", "TP2 PP1 EP2", "tp2ep2"), ("pp2ep2_mcore", "TP1 PP2 EP2", "pp2ep2"),
    ("qwen_mcore", "TP2 PP1 EP2", "qwen_tp2ep2"), ("ep4_mcore", "TP1 PP1 EP4", "tp2ep2")])
def test_expert_parallel_forward_reproduces_megatron_cores_logits(runs, moe, case, layout, save):
    out, rc = runs[case]
    assert rc == 0 and "result=PASS" in out, out
    assert f"parallel forward: {layout}, 4 processes" in out, out
    ref = torch.load(f"{moe / save}.pt")["logits"][..., :100]
    assert metric(out, "max_abs_error") <= 1e-5 * ref.abs().max().item(), out  # fp32: relative 1e-5


@pytest.mark.parametrize("case", ["tp2ep2_merged", "tp2ep2_hf", "pp2ep2_hf", "qwen_pp2ep2_uneven"])
def test_expert_parallel_forward_matches_the_one_process_and_transformers_forwards(runs, case):
    out, rc = runs[case]
    assert rc == 0 and "result=PASS" in out, out
    assert metric(out, "max_abs_error") <= 1e-5, out
    assert "  layer 0 " in out, out  # hidden states compared layer by layer (transformers: not the last)


def test_a_corrupted_expert_is_caught_and_its_file_named(runs, moe):
    """Under plain `torchrun -m ckptool verify` (the entry point itself): the divergence names the layer
    and the one rank file holding the corrupted expert; every rank exits 1 and, stderr being a pipe,
    ckptool's result line comes after torchrun's report."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    r = subprocess.run(["torchrun", "--nproc-per-node", "4", "--standalone", "-m", "ckptool",
                        "verify", str(moe / "corrupt"), "--reference", str(moe / "hf")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 1 and "result=FAIL" in r.stdout, r.stdout + r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("first_divergence="))
    assert line.startswith("first_divergence=layer 1 "), line  # transformers has no hidden state of the last layer
    named = _named_pieces(line)
    assert "expert 3 in mp_rank_01_001, local expert 1" in named and named.count(" in mp_rank_") == 1, line
    assert r.stderr.strip().splitlines()[-1] == "result=FAIL (see the report above)", r.stderr[-3000:]
    assert r.stderr.count("exitcode  : 1 ") == 4, r.stderr[-3000:]  # every rank: ckptool's "mismatch"
    out, rc = runs["corrupt_mcore"]  # recorded logits alone: caught, located no further than the output
    assert rc == 1 and "result=FAIL" in out, out


def test_a_changed_shared_expert_copy_is_named_with_its_file(runs):
    out, rc = runs["qwen_shared"]
    line = _failed_divergence(out, rc)
    named = _named_pieces(line)
    assert "shared expert in mp_rank_01_000" in named and named.count(" in mp_rank_") == 1, line


def test_a_divergence_outside_the_moe_pieces_says_so(runs):
    out, rc = runs["attn"]
    line = _failed_divergence(out, rc)
    assert "layer 1: its router and experts compute what the reference's do" in line, line  # (no shared expert)
    assert "attention or norms" in line, line


def test_a_rank_reads_only_its_own_file_and_holds_only_its_experts(moe, monkeypatch):
    from ckptool.formats.megatron.ranks import read_layout, read_rank_shards
    from ckptool.io import torchfile
    meta = read_layout(moe / "tp2ep2")
    read_from = set()
    real = torchfile.TorchArchive.read_record
    monkeypatch.setattr(torchfile.TorchArchive, "read_record",
                        lambda self, *a, **k: read_from.add(Path(self.path).parent.name) or real(self, *a, **k))
    real_into = torchfile.TorchArchive.read_record_into
    monkeypatch.setattr(torchfile.TorchArchive, "read_record_into",
                        lambda self, *a, **k: read_from.add(Path(self.path).parent.name) or real_into(self, *a, **k))
    shards = read_rank_shards(moe / "tp2ep2", 1, 0, meta=meta, ep_rank=1)
    loaded = {k: v.load() for k, v in shards.tensors.items()}
    assert read_from == {"mp_rank_01_001"}, read_from
    assert shards.experts == range(2, 4)
    held = {int(k.split(".")[3]) for k in loaded if ".experts." in k}
    assert held == {2, 3}
    # global expert 3 is TP rank 1's [gate_r; up_r] rows and down columns of the merged expert
    merged = read_megatron(moe / "tp2ep2").tensors
    gate, up = (merged[f"layers.1.mlp.experts.3.{x}.weight"].load().chunk(2)[1] for x in ("gate", "up"))
    assert torch.equal(loaded["layers.1.experts.3.fc1.weight"], torch.cat([gate, up]))
    assert torch.equal(loaded["layers.1.experts.3.fc2.weight"], merged["layers.1.mlp.experts.3.down.weight"].load().chunk(2, 1)[1])


def test_torch_dist_style_slices_hold_the_ranks_experts(moe):
    """slice_rank_shards (the torch_dist path: global tensors cut per rank) gives an EP rank its experts
    only, the same tensors as the torch-format file of that rank."""
    from ckptool.formats.megatron.ranks import read_rank_shards, slice_rank_shards
    ck = read_megatron(moe / "tp2ep2")
    cut = slice_rank_shards(ck, Layout(tp=2, pp=1, ep=2), 1, 0, 1)
    own = read_rank_shards(moe / "tp2ep2", 1, 0, ep_rank=1)
    assert set(cut.tensors) == set(own.tensors)
    for name, t in own.tensors.items():
        assert torch.equal(cut.tensors[name].load(), t.load()), name


def test_the_process_count_must_be_tp_x_pp_x_ep(moe):
    r = _fake_torchrun(2, moe / "tp2ep2")
    assert r.returncode == 2, r.output
    assert "torchrun started 2 processes but" in r.output and "is TP2 PP1 EP2: it needs 4" in r.output, r.output


# --- expert TP other than TP, the legacy GroupedMLP, a virtual pipeline with EP ------------------------

@pytest.mark.parametrize("case, layout, nproc, save", [
    ("etp1_mcore", "TP2 PP1 EP2 ETP1", 2, "etp1"),  # megatron-core's own expert-TP-1 save: two files
    ("etp1ep1_mcore", "TP2 PP1 ETP1", 2, "tp2ep2"),  # ckptool's: both files hold every expert whole
    ("etp1ep4_mcore", "TP2 PP1 EP4 ETP1", 4, "tp2ep2"),
    ("pp2etp1_mcore", "TP2 PP2 EP2 ETP1", 4, "tp2ep2"),
    ("grouped_mcore", "TP2 PP1 EP2", 4, "grouped"),  # megatron-core's legacy GroupedMLP save
    ("te_grouped_mcore", "TP2 PP1 EP2", 4, "tp2ep2"),  # TEGroupedMLP files (ckptool's)
    ("dist_mcore", "TP2 PP1 EP2", 4, "dist"),  # megatron-core's torch_dist save: slices of the stacked experts
    ("dist_tp2_mcore", "TP2 PP1", 2, "dist")])
def test_expert_tp_grouped_and_torch_dist_forwards_reproduce_megatron_cores_logits(runs, runs2, moe, case, layout,
                                                                                  nproc, save):
    out, rc = (runs2 if nproc == 2 else runs)[case]
    assert rc == 0 and "result=PASS" in out, out
    assert f"parallel forward: {layout}, {nproc} processes" in out, out
    ref = torch.load(f"{moe / save}.pt")["logits"][..., :100]
    assert metric(out, "max_abs_error") <= 1e-5 * ref.abs().max().item(), out  # fp32: relative 1e-5


@pytest.mark.parametrize("case", ["etp1_hf", "qwen_vpp_ep_hf"])
def test_expert_tp_and_virtual_pipeline_forwards_match_transformers(runs, runs2, case):
    out, rc = (runs2 if case == "etp1_hf" else runs)[case]
    assert rc == 0 and "result=PASS" in out, out
    assert metric(out, "max_abs_error") <= 1e-5, out
    assert "  layer 0 " in out, out  # hidden states compared layer by layer (transformers: not the last)
    if case == "qwen_vpp_ep_hf":  # stage 0 runs layers 0 and 2 (chunks 0 and 1), stage 1 layers 1 and 3
        assert "parallel forward: TP1 PP2 VPP2 EP2, 4 processes" in out and "  layer 2 " in out, out


def test_a_swapped_expert_in_an_expert_tp_file_is_caught_and_named(runs2):
    out, rc = runs2["etp1_swapped"]
    line = _failed_divergence(out, rc)
    assert line.startswith("first_divergence=layer 1 "), line
    assert "mp_rank_00_000, mp_rank_01_001" in line, line  # the stage's two files, in rank order
    named = _named_pieces(line)
    assert "expert 2 in mp_rank_01_001, local expert 0" in named, line
    assert "expert 3 in mp_rank_01_001, local expert 1" in named and named.count(" in mp_rank_") == 2, line


def test_a_changed_expert_replica_is_caught_and_named(runs2):
    """TP2 ETP1 EP1: the two files are expert-data-parallel replicas; the one whose copy differs is named."""
    out, rc = runs2["etp1ep1_replica"]
    line = _failed_divergence(out, rc)
    named = _named_pieces(line)
    assert "expert 1 in mp_rank_01, local expert 1" in named and named.count(" in mp_rank_") == 1, line


def test_a_grouped_mlp_rank_reads_its_experts_from_its_own_tensors(moe):
    """The legacy GroupedMLP's weight1 / weight2 are cut per local expert (the reader's cut) within the
    rank's own file: the same tensors as the merged read gives, at that rank's TP share."""
    from ckptool.formats.megatron.ranks import read_rank_shards
    shards = read_rank_shards(moe / "grouped", 1, 0, ep_rank=1)
    assert shards.experts == range(2, 4)
    merged = read_megatron(moe / "grouped").tensors
    for e in (2, 3):
        gate, up = (merged[f"layers.1.mlp.experts.{e}.{x}.weight"].load().chunk(2)[1] for x in ("gate", "up"))
        assert torch.equal(shards.tensors[f"layers.1.experts.{e}.fc1.weight"].load(), torch.cat([gate, up]))
        down = merged[f"layers.1.mlp.experts.{e}.down.weight"].load().chunk(2, 1)[1]
        assert torch.equal(shards.tensors[f"layers.1.experts.{e}.fc2.weight"].load(), down)


def test_the_process_count_at_expert_tp_is_the_files_grid(moe):
    """At TP2 ETP1 EP2 Megatron-LM's ranks write two files; the parallel verify runs one rank per file."""
    r = _fake_torchrun(4, moe / "etp1")
    assert r.returncode == 2, r.output
    assert "torchrun started 4 processes but" in r.output and "is TP2 PP1 EP2 ETP1: it needs 2" in r.output, r.output


def test_a_torch_dist_rank_reads_only_its_slices_of_the_stacked_experts(moe):
    """megatron-core's torch_dist stacks a layer kind's experts ([layers, experts, out, in]); rank (TP 1,
    EP 1) of TP2 EP2 reads only the chunks of global experts 2 and 3 at TP rank 1 (fc1 rows from 12 of
    each of gate and up, fc2 columns from 12), and gets the tensors of the torch-format file of that rank
    (the same model, saved both ways from one seed)."""
    from ckptool.formats.dcp import torch_dist as dist_format
    from ckptool.formats.megatron.ranks import read_rank_shards, slice_rank_shards
    shards = slice_rank_shards(dist_format.read(moe / "dist"), Layout(tp=2, pp=1, ep=2), 1, 0, 1)
    loaded, reads = load_recording_chunk_reads(shards)
    experts = {(fqn.rsplit(".", 2)[1], off) for fqn, off in reads if ".experts." in fqn}
    assert experts == {(fc, (layer, e) + rest) for layer in (0, 1) for e in (2, 3)
                       for fc, rest in (("linear_fc1", (12, 0)), ("linear_fc1", (36, 0)), ("linear_fc2", (0, 12)))}
    own = read_rank_shards(moe / "tp2ep2", 1, 0, ep_rank=1)
    assert set(loaded) == set(own.tensors)
    for name, t in own.tensors.items():
        assert torch.equal(loaded[name], t.load()), name


@pytest.mark.parametrize("tp, ep, etp", [(2, 2, 2), (1, 4, 1), (2, 2, 1), (2, 4, 1), (2, 1, 1), (4, 2, 1), (4, 2, 2)])
def test_a_stages_ranks_are_the_files_megatron_lm_writes(tp, ep, etp):
    """One rank per file: the (TP rank, EP rank) pairs of a stage's ranks are exactly the files of
    Megatron-LM's expert grid, each once; every expert shard (EP rank, expert-TP rank) is held by the
    stage's expert-data-parallel replicas, each once; every TP rank of each data-parallel rank is there."""
    from ckptool.formats.megatron.checkpoint import expert_grid
    from ckptool.verify.parallel import ranks_per_stage, stage_coordinates
    n = ranks_per_stage(tp, ep, etp)
    ranks = [stage_coordinates(x, tp, ep, etp) for x in range(n)]
    grid = expert_grid(tp, ep, etp)
    files = [(t, e) for t, _, _, e, _ in ranks]
    assert sorted(files) == sorted(grid) and len(set(files)) == n
    assert all(grid[(t, e)] == et for t, _, et, e, _ in ranks)  # the file holds that expert-TP shard
    edp = n // (etp * ep)
    assert sorted((e, et, ed) for _, _, et, e, ed in ranks) == [
        (e, et, ed) for e in range(ep) for et in range(etp) for ed in range(edp)]
    assert sorted((d, t) for t, d, _, _, _ in ranks) == [(d, t) for d in range(n // tp) for t in range(tp)]
