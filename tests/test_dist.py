"""torch_dist / DCP checkpoints: read without Megatron, write what megatron-core loads.

Checkpoints marked "mcore" are written by the real megatron-core package (PyPI `megatron-core`,
local layer spec, CPU, gloo) under torchrun with 2 processes, through tests/mcore_dist_helper.py;
those tests skip with a reason when megatron-core is not installed. The bad-input and plain-DCP
tests that need no framework build their checkpoints with ckptool's writer or torch's own DCP.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, once, shared_followups
from ckptool.config import GPTConfig, Layout
from ckptool.convert import write_layout
from ckptool.errors import CkptError
from ckptool.formats.dcp import torch_dist as dist
from ckptool.formats.registry import detect_format, open_checkpoint
from ckptool.io import dcp_io
from ckptool.lazy import Const
from ckptool.options import ReadOptions
from ckptool.state import Checkpoint, SourceInfo, expected_names
from ckptool.verify.reference import forward
from ckptool.write_options import WriteOptions

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_dist_helper.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed "
                                 "(pip install megatron-core: test-only extra)")


def run_cli(*args):
    """The CLI in-process (click's runner): returncode, stdout, stderr like a subprocess."""
    from click.testing import CliRunner
    from ckptool.cli import main
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart already
    r = runner.invoke(main, [str(a) for a in args])
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def assert_same_tensors(a: Checkpoint, b: Checkpoint):
    assert list(a.tensors) == list(b.tensors)
    for k in a.tensors:
        x, y = a.tensors[k].load(), b.tensors[k].load()
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k


# --- checkpoints written by megatron-core ---------------------------------------------------

# megatron-core's own torch_dist saves (name -> helper job; test_quick_inspect reads some of them too)
MCORE_SAVES = declare_runs(HELPER, 2, {
    "gpt2": "save {out} --tp 1 --arch gpt2 --with-args --out {out}.logits.pt",
    "llama": "save {out} --tp 2 --arch llama --with-args --out {out}.logits.pt",
    "bare": "save {out} --tp 2 --arch llama --out {out}.logits.pt",  # simple training loop: no args
    # pipeline stages: 1+1 layers (tied embeddings: the last stage holds a copy), 2+1 layers
    "gpt2_pp2": "save {out} --tp 1 --pp 2 --arch gpt2 --with-args --out {out}.logits.pt",
    "llama_pp2": "save {out} --tp 1 --pp 2 --arch llama --with-args --out {out}.logits.pt",
})


def _copied_saves(root: Path, framework_runs) -> Path:
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    for name, stem in framework_runs(HELPER, 2, MCORE_SAVES, timeout=240).items():
        copy_run(stem, root / name)
    return root


@pytest.fixture(scope="module")
def mcore(tmp_path_factory, framework_runs):
    """This file's copy of MCORE_SAVES (the load steps below start from the same)."""
    return once(_copied_saves, lambda: tmp_path_factory.mktemp("mcore"), framework_runs)


@pytest.fixture(scope="module")
def ours(mcore, tmp_path_factory):
    """mcore torch_dist -> torch (TP2 x PP2) -> torch_dist, written by ckptool."""
    return once(_write_ours, lambda: tmp_path_factory.mktemp("ours"), mcore)


def _write_ours(root: Path, mcore: Path) -> Path:
    for arch, stages in (("gpt2", None), ("llama", [2, 1])):
        src = open_checkpoint(mcore / arch)
        write_layout(src, root / f"{arch}_torch", Layout(tp=2, pp=2, stage_layers=stages),
                     WriteOptions(format="torch"), warn=print)
        mid = open_checkpoint(root / f"{arch}_torch")
        write_layout(mid, root / f"{arch}_dist", Layout(tp=2 if arch == "llama" else 1),
                     WriteOptions(format="torch_dist"),
                     warn=print)
    return root


@needs_mcore
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reads_mcore_torch_dist_like_megatron_computes(mcore, arch):
    path = mcore / arch
    assert detect_format(path) == "torch_dist"
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.padded_vocab_size, cfg.vocab_size, ckpt.source.iteration) == (128, 100, 7)
    if arch == "llama":
        assert (cfg.num_layers, cfg.num_query_groups, cfg.activation, cfg.normalization, cfg.tied_embeddings) == \
            (3, 2, "swiglu", "rmsnorm", False)
    else:
        assert (cfg.num_layers, cfg.position_embedding, cfg.add_bias_linear, cfg.tied_embeddings) == \
            (2, "learned", True, True)
    assert set(ckpt.tensors) == set(expected_names(cfg))
    ref = torch.load(mcore / f"{arch}.logits.pt")
    logits = forward(ckpt, ref["tokens"])
    torch.testing.assert_close(logits, ref["logits"], atol=1e-6, rtol=0)


@needs_mcore
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_to_hf_of_mcore_torch_dist_gives_megatron_core_logits(mcore, arch, tmp_path):
    """`ckptool to-hf` on a megatron-core torch_dist save: transformers computes megatron-core's logits."""
    from transformers import AutoModelForCausalLM
    r = run_cli("to-hf", mcore / arch, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.vocab_size == 100  # padding rows (128) trimmed to the true vocabulary
    ref = torch.load(mcore / f"{arch}.logits.pt")
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"][..., :100], atol=1e-5, rtol=0)


@needs_mcore
def test_layer_reads_only_its_own_chunks(mcore, monkeypatch):
    ckpt = open_checkpoint(mcore / "llama")
    seen = []
    real = dcp_io.DcpDir.read_chunk
    monkeypatch.setattr(dcp_io.DcpDir, "read_chunk",
                        lambda self, fqn, chunk: seen.append((fqn, tuple(chunk.offsets))) or real(self, fqn, chunk))
    ckpt.tensors["layers.1.mlp.gate.weight"].load()
    # fc1 of layer 1 only: the two TP ranks' [gate_r; up_r] chunks of the stacked [3, 96, 32] tensor
    assert seen and all(f == "decoder.layers.mlp.linear_fc1.weight" and o[0] == 1 for f, o in seen), seen
    assert len(seen) == 2


@needs_mcore
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_round_trip_through_torch_tp2_pp2_is_bit_exact(mcore, ours, arch):
    src = open_checkpoint(mcore / arch)
    mid = open_checkpoint(ours / f"{arch}_torch")
    back = open_checkpoint(ours / f"{arch}_dist")
    assert mid.source.format == "megatron" and (mid.source.layout.tp, mid.source.layout.pp) == (2, 2)
    assert back.source.format == "torch_dist"
    assert_same_tensors(src, mid)
    assert_same_tensors(src, back)
    assert back.config == src.config
    ref = torch.load(mcore / f"{arch}.logits.pt")
    assert torch.equal(forward(back, ref["tokens"]), forward(src, ref["tokens"]))
    files = sorted(p.name for p in (ours / f"{arch}_dist" / "iter_0000007").iterdir())
    assert files == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]


def _saves_and_ours(framework_runs, d: Path) -> tuple:
    """The inputs of the load steps: (mcore, ours) as those fixtures give them (built once, by the first asking)."""
    mcore = once(_copied_saves, lambda: d / "mcore", framework_runs)
    return mcore, once(_write_ours, lambda: d / "ours", mcore)


@shared_followups
def mcore_two_process_loads(framework_runs, d):
    """Every 2-process load of ckptool's outputs by megatron-core, in the session's shared 2-process launch
    (importing megatron-core is the slow part): {"dist": mcore_loads' folder, "torch": mcore_torch_loads'}."""
    mcore, ours = _saves_and_ours(framework_runs, d)
    out = d / "mcore_loads"
    out.mkdir()
    jobs = [f"load {ours}/llama_dist --tp 1 --arch llama --out {out}/llama.pt",
            f"load {ours}/gpt2_dist --tp 2 --arch gpt2 --out {out}/gpt2.pt",
            f"load {ours}/llama_dist --tp 1 --pp 2 --arch llama --out {out}/llama_pp2.pt",
            f"load {ours}/gpt2_dist --tp 1 --pp 2 --arch gpt2 --out {out}/gpt2_pp2.pt"]
    root = d / "mcore_torch"
    jobs += _torch_format_load_jobs(mcore, root)
    yield [(HELPER, 2, jobs)]
    return {"dist": out, "torch": root}


@pytest.fixture(scope="module")
def mcore_loads(mcore_two_process_loads):
    """megatron-core's dist_checkpointing.load of ckptool's torch_dist output (written for TP2 llama /
    TP1 gpt2) at another TP, and at TP1 PP2."""
    return mcore_two_process_loads["dist"]


@needs_mcore
def test_megatron_core_loads_our_torch_dist_at_another_tp(mcore, mcore_loads):
    # written for TP2 (llama) / TP1 (gpt2); megatron-core loads them at TP1 / TP2
    for arch, written_tp in (("llama", 2), ("gpt2", 1)):
        got = torch.load(mcore_loads / f"{arch}.pt", weights_only=False)
        ref = torch.load(mcore / f"{arch}.logits.pt")
        torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-6, rtol=0)
        assert got["common"] == {"iteration": 7, "checkpoint_version": 3.0}
        assert got["args_tp"] == written_tp


# megatron-core saves with Transformer-Engine norm names even for local layers; its local modules
# name the same tensors this way
TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def _stored_tensor_for(raw, name):
    """The tensor in a torch_dist save (stacked layers, TE norm names) that a loaded parameter's
    global name (decoder.layers.{i}.<local name>) should equal, and the stored key it came from."""
    if name.startswith("decoder.layers."):
        i, local = name[len("decoder.layers."):].split(".", 1)
        te = {v: k for k, v in TE_TO_LOCAL.items()}.get(local, local)
        return raw["decoder.layers." + te][int(i)], "decoder.layers." + te
    if name == "output_layer.weight" and name not in raw:  # tied: the last stage's copy of the embedding
        name = "embedding.word_embeddings.weight"
    return raw[name], name


@needs_mcore
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_megatron_core_loads_our_torch_dist_at_pp2(mcore, ours, mcore_loads, arch):
    """megatron-core at TP1 PP2 (each rank one stage, global layer offsets; llama split 2+1) loads
    ckptool's torch_dist: every parameter equals what ckptool wrote, and the pipelined forward gives
    the logits megatron-core computed unpipelined when it saved the source."""
    got = torch.load(mcore_loads / f"{arch}_pp2.pt", weights_only=False)
    raw = _raw_tensors(ours / f"{arch}_dist" / "iter_0000007")
    used = set()
    for name, value in got["params"].items():
        want, key = _stored_tensor_for(raw, name)
        assert value.shape == want.shape and torch.equal(value, want), name
        used.add(key)
    assert used == set(raw), set(raw) ^ used  # every stored tensor reached some stage's parameter
    n = 3 if arch == "llama" else 2
    assert {k.split(".")[2] for k in got["params"] if k.startswith("decoder.layers.")} == {str(i) for i in range(n)}
    ref = torch.load(mcore / f"{arch}.logits.pt")
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-6, rtol=0)
    assert got["common"] == {"iteration": 7, "checkpoint_version": 3.0}


# --- torch format written by ckptool, loaded the way Megatron-LM loads --ckpt-format torch ---------

TORCH_FORMAT_LOADS = (("llama", 2, 1), ("gpt2", 2, 1), ("llama", 1, 2), ("gpt2", 1, 2))


def _torch_format_load_jobs(mcore, root):
    """The helper's load-torch jobs of mcore_torch_loads, their inputs written into root first."""
    jobs = []
    for arch, tp, pp in TORCH_FORMAT_LOADS:
        out = root / f"{arch}_tp{tp}pp{pp}"
        split = ["--pp-layers", "2,1"] if (arch, pp) == ("llama", 2) else []
        r = run_cli("reshard", mcore / arch, out, "--tp", tp, "--pp", pp, "--format", "torch", *split)
        assert r.returncode == 0, r.stderr
        jobs.append(f"load-torch {out} --tp {tp} --pp {pp} --arch {arch} --out {root}/{out.name}.pt")
    return jobs


@pytest.fixture(scope="module")
def mcore_torch_loads(mcore_two_process_loads):
    """`ckptool reshard --format torch` of megatron-core's own torch_dist saves (llama saved at TP2,
    gpt2 at TP1), at TP2 and at TP1 PP2 (llama split 2+1, as megatron-core splits 3 layers), each
    loaded by megatron-core under torchrun through the helper's load-torch mode: Megatron-LM's
    load_checkpoint steps for the torch format (tracker, this rank's file, check_checkpoint_args,
    load_state_dict strict). Run in mcore_two_process_loads' launch."""
    return mcore_two_process_loads["torch"]


@needs_mcore
@pytest.mark.parametrize("arch, tp, pp", TORCH_FORMAT_LOADS)
def test_megatron_core_loads_our_torch_format(mcore, mcore_torch_loads, arch, tp, pp):
    """Every key of each rank's file fits megatron-core's GPTModel at that layout (strict load), the
    args pass Megatron-LM's checks, and the model computes the logits megatron-core saved with."""
    got = torch.load(mcore_torch_loads / f"{arch}_tp{tp}pp{pp}.pt", weights_only=False)
    assert got["args_layout"] == (tp, pp)
    assert got["common"] == {"iteration": 7, "checkpoint_version": 3.0}
    ref = torch.load(mcore / f"{arch}.logits.pt")
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-6, rtol=0)


@shared_followups
def mcore_tp2pp2_loads(framework_runs, out):
    """4 processes: megatron-core at TP2 PP2 loads ckptool's TP2 PP2 torch-format files (llama
    split 2+1) and its torch_dist output, in the session's shared 4-process launch."""
    ours = _saves_and_ours(framework_runs, out)[1]
    jobs = []
    for arch in ("gpt2", "llama"):
        jobs.append(f"load-torch {ours}/{arch}_torch --tp 2 --pp 2 --arch {arch} --out {out}/{arch}_torch.pt")
        jobs.append(f"load {ours}/{arch}_dist --tp 2 --pp 2 --arch {arch} --out {out}/{arch}_dist.pt")
    yield [(HELPER, 4, jobs)]
    return out


@needs_mcore
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_megatron_core_loads_our_tp2_pp2_files(mcore, mcore_tp2pp2_loads, arch):
    """TP and PP together, the common training layout: each of the 4 ranks loads its own
    torch-format file strictly (args checked as Megatron-LM does), or its slices of the torch_dist
    output, and the pipelined tensor-parallel forward gives megatron-core's saved logits."""
    ref = torch.load(mcore / f"{arch}.logits.pt")
    got = torch.load(mcore_tp2pp2_loads / f"{arch}_torch.pt", weights_only=False)
    assert got["args_layout"] == (2, 2)
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-6, rtol=0)
    got = torch.load(mcore_tp2pp2_loads / f"{arch}_dist.pt", weights_only=False)
    assert got["common"] == {"iteration": 7, "checkpoint_version": 3.0}
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-6, rtol=0)


@needs_mcore
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reads_mcore_pp2_save_like_megatron_computes(mcore, arch, tmp_path):
    """A torch_dist checkpoint megatron-core saved at TP1 PP2 (each stage wrote its own layers at their
    global offsets): ckptool reads the whole model, and its reference forward gives the logits
    megatron-core computed through the two stages."""
    ckpt = open_checkpoint(mcore / f"{arch}_pp2")
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.padded_vocab_size, cfg.vocab_size, ckpt.source.iteration) == \
        (3 if arch == "llama" else 2, 128, 100, 7)
    assert (ckpt.source.layout.tp, ckpt.source.layout.pp) == (1, 2)
    assert set(ckpt.tensors) == set(expected_names(cfg))
    ref = torch.load(mcore / f"{arch}_pp2.logits.pt")
    torch.testing.assert_close(forward(ckpt, ref["tokens"]), ref["logits"], atol=1e-6, rtol=0)
    # and on to the torch format at TP2 PP2 and back: the same tensors
    write_layout(ckpt, tmp_path / "torch", Layout(tp=2, pp=2, stage_layers=[2, 1] if arch == "llama" else None),
                 WriteOptions(format="torch"), warn=print)
    assert_same_tensors(ckpt, open_checkpoint(tmp_path / "torch"))


@needs_mcore
def test_vpp_save_reports_the_runs_layout_and_stays_layout_free(framework_runs, tmp_path):
    """megatron-core's torch_dist save of a PP2 x VPP2 run (test_dist_optim's dpr_vpp, shared): inspect, full
    and torch-free, reports TP1 PP2 VPP2, the layout the run's args say (torch_dist itself stores global
    tensors). Nothing then takes the save for VPP-cut files: a merge reads it whole into plain one-rank files,
    and fix-vocab, which keeps the source's layout, writes the run's model0 / model1 chunks."""
    import ckptool
    from ckptool import quick_inspect
    from test_dist_optim import HELPER as OPTIM_HELPER, SAVES
    src = framework_runs(OPTIM_HELPER, 2, {"dpr_vpp": SAVES["dpr_vpp"]})["dpr_vpp"]
    ckpt = open_checkpoint(src)
    assert ckpt.source.args.virtual_pipeline_model_parallel_size == 2
    assert ckpt.source.layout == Layout(tp=1, pp=2, vpp=2)
    assert quick_inspect.quick_open(src, {}).source.layout == ckpt.source.layout
    r = run_cli("inspect", src, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["layout"]["vpp"] == 2, r.stderr
    assert "layout      TP1 PP2 VPP2\n" in run_cli("inspect", src).stdout

    ckptool.merge(src, tmp_path / "merged", format="torch", optimizer=False)
    merged = open_checkpoint(tmp_path / "merged")
    assert merged.source.layout == Layout(tp=1, pp=1)
    assert_same_tensors(ckpt, merged)

    ckptool.fix_vocab(src, tmp_path / "fixed", size=256, format="torch", optimizer=False)
    fixed = open_checkpoint(tmp_path / "fixed")
    assert fixed.source.layout == Layout(tp=1, pp=2, vpp=2)
    stage0 = torch.load(next((tmp_path / "fixed").glob("iter_*/mp_rank_00_000/model_optim_rng.pt")), weights_only=False)
    assert {"model0", "model1"} <= set(stage0) and "model" not in stage0
    assert fixed.config.padded_vocab_size == 256
    for name in ckpt.tensors:
        a, b = ckpt.tensors[name].load(), fixed.tensors[name].load()
        assert torch.equal(a, b[:a.shape[0]]), name


@pytest.mark.parametrize("args, vpp", [
    (dict(virtual_pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2), 2),  # validated
    (dict(virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None), None),
    (dict(num_layers_per_virtual_pipeline_stage=2), 2),  # flags only: (8 layers / PP2) / 2
    (dict(num_layers_per_virtual_pipeline_stage=1, account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True), 5),  # (8 + 2) / PP2 / 1
    (dict(num_virtual_stages_per_pipeline_rank=4), 4),
    (dict(virtual_pipeline_model_parallel_size=1), None),  # validate_args keeps 1 as None
    # validated args hold the size the run ran with, whatever flags they also keep
    (dict(virtual_pipeline_model_parallel_size=None, num_virtual_stages_per_pipeline_rank=2), None),
])
def test_virtual_pipeline_size_from_args_of_each_era(args, vpp):
    """megatron_args.virtual_pipeline_size: the size validate_args stored, else derived from the flags."""
    import argparse
    from ckptool.formats.megatron.args import virtual_pipeline_size
    assert virtual_pipeline_size(argparse.Namespace(pipeline_model_parallel_size=2, **args), 8) == vpp


@needs_mcore
def test_bare_save_needs_flags_and_then_reads(mcore, tmp_path):
    bare = mcore / "bare"
    r = run_cli("inspect", bare)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "--num-attention-heads" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    ckpt = open_checkpoint(bare, ReadOptions(overrides={"num_attention_heads": 4, "vocab_size": 100,
                                                        "max_position_embeddings": 16}))
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups, cfg.activation,
            cfg.normalization, cfg.position_embedding, cfg.tied_embeddings, cfg.vocab_size) == \
        (3, 32, 48, 2, "swiglu", "rmsnorm", "rope", False, 100)
    ref = torch.load(mcore / "bare.logits.pt")
    torch.testing.assert_close(forward(ckpt, ref["tokens"]), ref["logits"], atol=1e-6, rtol=0)
    # --args-from another checkpoint of the same architecture
    other = open_checkpoint(bare, ReadOptions(args_from=str(mcore / "llama")))
    assert other.config.num_attention_heads == 4 and other.config.vocab_size == 100
    r = run_cli("inspect", bare, "--args-from", mcore / "llama")
    assert r.returncode == 0 and "3 layers" in r.stdout, r.stderr


def _raw_tensors(d: Path):
    dd = dcp_io.DcpDir(d)
    return {k: dd.lazy(k).load() for k in dd.tensor_keys()}


@needs_mcore
@pytest.mark.parametrize("variant", ["stacked-model.module.", "per-layer-local-names-model."])
def test_plain_dcp_with_model_prefix(mcore, tmp_path, variant):
    """A torch.distributed.checkpoint save (no metadata.json, no common state) of the same keys."""
    import torch.distributed.checkpoint as dcp
    raw = _raw_tensors(mcore / "llama" / "iter_0000007")
    if variant.startswith("stacked"):
        sd = {"model.module." + k: v for k, v in raw.items()}
    else:
        local = TE_TO_LOCAL
        sd = {}
        for k, v in raw.items():
            if k.startswith("decoder.layers."):
                name = k[len("decoder.layers."):]
                for i in range(v.shape[0]):
                    sd[f"model.decoder.layers.{i}.{local.get(name, name)}"] = v[i].clone()
            else:
                sd["model." + k] = v
    sd["optimizer.state.step"] = torch.tensor(3)  # non-model entries are skipped
    out = tmp_path / "dcp"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    assert not (out / "metadata.json").exists()
    assert detect_format(out) == "torch_dist"
    got = open_checkpoint(out, ReadOptions(overrides={"num_attention_heads": 4, "vocab_size": 100}))
    want = open_checkpoint(mcore / "llama")
    assert_same_tensors(want, got)


# --- no framework needed --------------------------------------------------------------------

def tiny_checkpoint(**kw) -> Checkpoint:
    """A canonical GPT with random tensors (shapes from the config)."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                    padded_vocab_size=128, vocab_size=100, max_position_embeddings=16, activation="swiglu",
                    normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                    add_qkv_bias=False, tied_embeddings=False, make_vocab_size_divisible_by=64, **kw)
    h = cfg.hidden_size
    g = torch.Generator().manual_seed(0)

    def shape(name):
        leaf = name.split(".")[-2] if name.startswith("layers.") else name
        return {"embed.word": (128, h), "output.weight": (128, h), "q": (cfg.q_size, h), "k": (cfg.kv_size, h),
                "v": (cfg.kv_size, h), "out": (h, cfg.q_size), "gate": (48, h), "up": (48, h),
                "down": (h, 48)}.get(leaf, (h,))

    tensors = {n: Const(torch.randn(shape(n), generator=g)) for n in expected_names(cfg)}
    return Checkpoint(cfg, tensors, SourceInfo(path="memory", format="test", iteration=3))


@pytest.fixture
def written(tmp_path):
    src = tiny_checkpoint()
    out = tmp_path / "dist"
    write_layout(src, out, Layout(tp=2), WriteOptions(format="torch_dist"), warn=print)
    return src, out


def test_writer_round_trip_without_megatron(written, tmp_path):
    src, out = written
    back = open_checkpoint(out)
    assert_same_tensors(src, back)
    assert back.config == src.config.replace(vocab_size_source="args.vocab_size")
    it = out / "iter_0000003"
    assert json.loads((it / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    # torch's own reader opens our index; the common state is in common.pt and in the DCP
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(it)).read_metadata()
    assert md.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"].size == torch.Size([2, 96, 32])
    assert dist.COMMON_KEY in md.state_dict_metadata
    dd = dcp_io.DcpDir(it)
    assert dist.read_common_state(it, dd)["checkpoint_version"] == 3.0
    (it / "common.pt").unlink()  # newer layout: common state only inside the DCP
    state = dist.read_common_state(it, dcp_io.DcpDir(it))
    assert state["iteration"] == 3 and state["args"].num_query_groups == 2
    assert_same_tensors(src, open_checkpoint(out))


def _cli_error(path, *needles):
    r = run_cli("inspect", path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_missing_metadata_is_a_clear_error(written):
    _, out = written
    (out / "iter_0000003" / ".metadata").unlink()
    _cli_error(out, "no .metadata")


def test_missing_chunk_file_is_a_clear_error(written):
    _, out = written
    (out / "iter_0000003" / "__0_0.distcp").unlink()
    _cli_error(out, "__0_0.distcp", "missing")


def test_zarr_backend_is_named(tmp_path):
    d = tmp_path / "iter_0000001"
    (d / "embedding.word_embeddings.weight").mkdir(parents=True)
    (d / "embedding.word_embeddings.weight" / ".zarray").write_text("{}")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    _cli_error(tmp_path, "zarr")


def test_stream_transforms_are_refused(written):
    _, out = written
    it = out / "iter_0000003"
    md = pickle.loads((it / ".metadata").read_bytes())  # our own file, written by this test
    for info in md.storage_data.values():
        info.transform_descriptors = ["zstandard"]
    (it / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CkptError, match="zstandard"):
        open_checkpoint(out).tensors["embed.word"].load()


def test_code_in_metadata_pickle_is_refused(written):
    _, out = written

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (out / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(Evil()))
    _cli_error(out, "refusing")


def test_megatron_reader_does_not_claim_torch_dist(written):
    from ckptool.formats.megatron.checkpoint import looks_like_megatron
    _, out = written
    assert not looks_like_megatron(out)
    assert dist.looks_like(out) and dist.looks_like(out / "iter_0000003")
