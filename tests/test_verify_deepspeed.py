"""`ckptool verify` under real torchrun (gloo, CPU) on DeepSpeed saves: every rank runs its own files.

Real: the Megatron-DeepSpeed TP2 PP2 bf16 ZeRO-1 checkpoint (shared/real-checkpoints, copied to
fixtures/real) against the logits Megatron-DeepSpeed computed, with its 16-bit layer files and with
its fp32 masters; copies of it whose TP rank 1 replica of a layer norm drifted (as with dropout on).
Real: tests/ds_mcore_tp_case.py trains a megatron-core GPT at TP 2, DP 2 with the real deepspeed
package (ZeRO-1 and ZeRO-3, bf16, hidden dropout seeded per TP rank, so the TP replicas drift apart) and records
the logits the framework's own model computes with each rank's copies; the parallel verify must
reproduce them, and the merged one-process view (rank 0's copies) must not.
Synthetic (named as such, deepspeed.md 1.3 via tests/test_deepspeed.py's writers): a ZeRO-1 run of
a Megatron model with TP 4 and DP 2 under Megatron names, one rank's replicas drifted.
The checks of one process count share a launch (tests/verify_batch.py runs each as the real command), the 4-process
ones with the other files' (conftest.shared_followups).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import real_checkpoint, run_torchrun, shared_followups
from test_deepspeed import HAVE_DS, _args, _legacy_module_tp, _rand_gpt, _write_zero12
from test_verify import VERIFY_BATCH, metric, verify_batch, verify_here, verify_jobs, verify_results

REPO = Path(__file__).resolve().parents[1]
MDS_CASE = "mds_gpt2_pipe_tp2pp2_bf16_zero1"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
DRIFT = 0.0625  # added to TP rank 1's copy of transformer layer 1's input layer norm


def mds_drift_model(mds: Path, dst: Path, tp_ranks=(1,)) -> Path:
    """The TP ranks' 16-bit layer files of transformer layer 1 (spec index 3, stage 0) drifted."""
    shutil.copytree(mds / "checkpoint", dst)
    for t in tp_ranks:
        f = dst / "global_step3" / f"layer_03-model_{t:02d}-model_states.pt"
        sd = torch.load(f)
        sd["input_layernorm.weight"] = sd["input_layernorm.weight"] + DRIFT
        torch.save(sd, f)
    return dst


# the keys of Megatron-DeepSpeed layer files that every TP rank holds whole (universal_checkpoint_info's
# TP_REPLICATED_PARAMETER_PATTERNS): norms, row-parallel biases, positions; `weight`/`bias` are the final norm's
TP_REPLICATED = ("input_layernorm.weight", "input_layernorm.bias", "post_attention_layernorm.weight",
                 "post_attention_layernorm.bias", "self_attention.dense.bias", "mlp.dense_4h_to_h.bias",
                 "position_embeddings.weight", "weight", "bias")


def mds_drift_everywhere(mds: Path, dst: Path) -> Path:
    """Every TP-replicated tensor of every 16-bit layer file drifted, differently on each TP rank (seeded
    noise of 0.05): positions on the first stage, every layer's norms and row-parallel biases, the final norm."""
    shutil.copytree(mds / "checkpoint", dst)
    for f in sorted((dst / "global_step3").glob("layer_*-model_*-model_states.pt")):
        idx, t = int(f.name[6:8]), int(f.name[15:17])
        sd = torch.load(f)
        g = torch.Generator().manual_seed(100 * idx + t)
        for key in TP_REPLICATED:
            if key in sd:
                sd[key] = (sd[key].float() + 0.05 * torch.randn(sd[key].shape, generator=g)).to(sd[key].dtype)
        torch.save(sd, f)
    return dst


def mds_drift_master(mds: Path, dst: Path) -> Path:
    """The same drift in TP rank 1's fp32 master partition (mp rank 1 = stage 0, TP rank 1)."""
    shutil.copytree(mds / "checkpoint", dst)
    f = dst / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"
    sd = torch.load(f, weights_only=False)  # our own copy of a trusted real file
    osd = sd["optimizer_state_dict"]
    frag = osd["param_slice_mappings"][1]["3.input_layernorm.weight"]
    with torch.no_grad():
        osd["single_partition_of_fp32_groups"][1].narrow(0, frag.start, frag.numel).add_(DRIFT)
    torch.save(sd, f)
    return dst


def synthetic_zero_tp4(dst: Path, drift: bool = False) -> Path:
    """Synthetic: ZeRO-1 bf16 files of a Megatron model (MDS --no-pipeline-parallel names) at TP 4,
    DP 2; with drift, mp rank 2's copy of layer 1's input layer norm is 0.5 off (written that way,
    as a run whose replicas drifted would have saved it)."""
    t = _rand_gpt(h=8, heads=4, vocab=16, seed=11)
    tag = dst / "global_step4"
    tag.mkdir(parents=True)
    (dst / "latest").write_text("global_step4")
    for mp in range(4):
        mine = dict(t)
        if drift and mp == 2:
            mine["1.ln1.w"] = t["1.ln1.w"] + 0.5
        _write_zero12(tag, _legacy_module_tp(mine, mp, 4, heads=4), mp, 2, "bf16_", 1, False,
                      {"args": _args(heads=4, tp=4), "iteration": 4, "checkpoint_version": 3.0})
    return dst


@pytest.fixture(scope="module")
def mds():
    return real_checkpoint(MDS_CASE)


MDS_FORWARD = REPO / "tests" / "mds_mcore_forward.py"


@shared_followups
def mds_runs(framework_runs, d):
    """First megatron-core's TP2 PP2 forward (tests/mds_mcore_forward.py, in the shared megatron-core launch of 4
    processes) of the real checkpoint and of its copy drifted everywhere, each rank on its own copies (d/real.pt,
    d/drift.pt); then every 4-process verify below (one launch). {"forward": (d, the drifted copy) or None without
    megatron-core, "batch": {name: (output, exit status)}}."""
    mds = real_checkpoint(MDS_CASE)
    recorded = f"{mds / 'reference_logits.pt'}"
    drift_all, forward = {}, None
    if HAVE_MCORE:  # the framework's forward of the copy drifted everywhere, from megatron-core
        drifted = mds_drift_everywhere(mds, d / "drift_all")
        yield [(MDS_FORWARD, 4, [f"{recorded} {mds / 'checkpoint' / 'global_step3'} {d / 'real.pt'}",
                                 f"{recorded} {drifted / 'global_step3'} {d / 'drift.pt'}"])]
        forward = d, drifted
        drift_all["mds_drift_all"] = [drifted, "--weights", "model", "--reference-logits", f"{d / 'drift.pt'}:logits"]
    cases = {
        "mds_model": [mds / "checkpoint", "--weights", "model", "--reference-logits", recorded + ":logits_fp32"],
        "mds_model_bf16": [mds / "checkpoint", "--weights", "model", "--dtype", "bf16",
                           "--reference-logits", recorded + ":logits_bf16"],
        "mds_master": [mds / "checkpoint" / "global_step3", "--weights", "master"],
        "mds_master_recorded": [mds / "checkpoint", "--reference-logits", recorded + ":logits_fp32"],
        "mds_drift_model": [mds_drift_model(mds, d / "drift_model"), "--weights", "model"],
        "mds_drift_master": [mds_drift_master(mds, d / "drift_master")],
        "zero_tp4_master": [synthetic_zero_tp4(d / "zero_tp4"), "--seq-len", 8],
        "zero_tp4_model": [d / "zero_tp4", "--weights", "model", "--seq-len", 8],
        "zero_tp4_drift": [synthetic_zero_tp4(d / "zero_tp4_drift", drift=True), "--seq-len", 8],
        **drift_all,
    }
    yield [(VERIFY_BATCH, 4, verify_jobs(cases, d / "out"))]
    return {"forward": forward, "batch": verify_results(cases, d / "out")}


@pytest.fixture(scope="module")
def mcore_forward(mds_runs):
    """megatron-core's TP2 PP2 forward of the real checkpoint and of its copy drifted everywhere (mds_runs):
    (folder with real.pt and drift.pt, the copy)."""
    if mds_runs["forward"] is None:
        pytest.skip("needs the megatron-core package")
    return mds_runs["forward"]


@pytest.fixture(scope="module")
def batch(mds_runs):
    return mds_runs["batch"]


def _passes(r, max_err=1e-5):
    text, rc = r
    assert rc == 0, text
    assert "TP2 PP2, 4 processes" in text and "deepspeed (mds-pipeline" in text
    assert metric(text, "max_abs_error") < max_err
    assert "result=PASS" in text
    return text


def test_mds_model_weights_reproduce_framework_logits_in_parallel(batch):
    # the save dir holds `latest` (global_step3) and Megatron's latest_checkpointed_iteration.txt
    text = _passes(batch["mds_model"])
    assert "model weights (bfloat16)" in text and "compared 1001 vocabulary columns" in text


def test_mds_model_weights_in_bf16_compute(batch):
    text, rc = batch["mds_model_bf16"]
    assert rc == 0 and "torch.bfloat16" in text, text
    assert 0 < metric(text, "max_abs_error") < metric(text, "tolerance")


def test_mds_master_weights_match_the_merged_masters(batch):
    # global_step3/ given directly; every rank computes with its own fp32 masters, the last stage
    # with its own master of the tied embedding (the word rows agree; only the position rows, unused
    # there, went stale, which the merged read reports)
    text = _passes(batch["mds_master"], 1e-5)
    assert "master weights (float32)" in text
    assert "tied position_embeddings.weight" in text
    for i in range(4):
        assert f"layer {i} " in text


def test_mds_master_weights_are_one_bf16_rounding_from_the_framework_logits(batch):
    text, rc = batch["mds_master_recorded"]
    assert rc == 1 and "result=FAIL" in text, text  # the framework computed with the 16-bit weights
    assert 1e-4 < metric(text, "max_abs_error") < 1e-2
    # the FAIL says which check failed and points at the weights the framework ran (mds_model passes)
    assert "failed_check=logits max_abs_error" in text and "> tolerance 0.0001" in text, text
    assert _hint(text).count("\n") == 0 and "rerun with --weights model" in _hint(text), text


def _hint(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("hint:"))


def test_a_fail_from_the_fp32_masters_hints_at_the_16bit_weights(mds):
    """One process: the masters are one bf16 rounding from the logits Megatron-DeepSpeed computed; the
    hint names --weights model and why, and with it the framework's logits are reproduced."""
    recorded = f"{mds / 'reference_logits.pt'}:logits_fp32"
    r = verify_here(mds / "checkpoint", "--reference-logits", recorded)
    assert r.exit_code == 1 and "result=FAIL" in r.output, r.output
    hint = _hint(r.output)
    assert hint.count("\n") == 0 and "fp32 master weights" in hint and "16-bit module weights" in hint, r.output
    assert "rerun with --weights model" in hint
    r = verify_here(mds / "checkpoint", "--weights", "model", "--reference-logits", recorded)
    assert r.exit_code == 0 and metric(r.stdout, "max_abs_error") < 1e-6 and "hint:" not in r.output, r.output


def test_a_fail_within_the_logits_tolerance_names_the_check_that_failed(mds, tmp_path):
    """Both TP copies of layer 1's input norm drifted: at --tolerance 0.01 the logits pass (3.3e-3) but
    layer 1's hidden state parts from the original's by 1.3e-2 relative; the report says that check
    failed, with its value and bound. No weights hint: the 16-bit weights are the ones compared."""
    drifted = mds_drift_model(mds, tmp_path / "drift", tp_ranks=(0, 1))
    r = verify_here(drifted, "--weights", "model", "--reference", mds / "checkpoint", "--tolerance", "0.01")
    assert r.exit_code == 1 and "result=FAIL" in r.output, r.output
    assert metric(r.stdout, "max_abs_error") < metric(r.stdout, "tolerance")
    checks = [line for line in r.stdout.splitlines() if line.startswith("failed_check=")]
    assert len(checks) == 1, r.output
    assert checks[0].startswith("failed_check=per-layer check: layer 1 hidden state relative diff 0.013"), checks
    assert "> 0.01 (the logits are within the tolerance: max_abs_error 0.0033" in checks[0], checks
    assert "hint:" not in r.output


@pytest.mark.parametrize("case,files", [
    ("mds_drift_model", "layer_02..03-model_00, layer_02..03-model_01"),
    ("mds_drift_master", "mp_rank_00 ZeRO partitions, mp_rank_01 ZeRO partitions")])
def test_mds_drifted_replica_is_computed_with_as_the_framework_did(batch, case, files):
    # the merged reference takes TP rank 0's copy; the parallel forward uses each rank's own, so
    # the drift shows at transformer layer 1, on the stage and files that hold it
    text, rc = batch[case]
    assert rc == 1, text
    assert f"first_divergence=layer 1 [pipeline stage 0: {files}]" in text, text
    assert "replicas differ" in text  # the merged read says so too


def test_megatron_core_computes_what_megatron_deepspeed_computed(mds, mcore_forward):
    # the oracle of the next test, checked against the framework: on the unmodified checkpoint megatron-core's
    # TP2 PP2 forward (each rank on its own layer files) gives Megatron-DeepSpeed's recorded fp32 logits
    got = torch.load(mcore_forward[0] / "real.pt")["logits"][..., :1001]
    want = torch.load(mds / "reference_logits.pt")["logits_fp32"][..., :1001]
    assert (got - want).abs().max().item() < 1e-6


def test_mds_drifted_everywhere_is_computed_as_the_framework_did(batch, mcore_forward):
    """Every replicated tensor differs per TP rank (positions on the first stage, norms and row-parallel biases
    of every layer, the final norm; the last stage's tied output is the first stage's word rows, as DeepSpeed
    broadcasts them on load): the parallel verify on the source's own TP2 PP2 layout reproduces the framework's
    forward with each rank's own copies; the merged one-process view (rank 0's copies) does not."""
    text, rc = batch["mds_drift_all"]
    assert rc == 0 and "result=PASS" in text, text
    assert "TP2 PP2, 4 processes" in text and metric(text, "max_abs_error") <= 1e-4
    forward_dir, drifted = mcore_forward
    single = verify_here(drifted, "--weights", "model", "--reference-logits", f"{forward_dir / 'drift.pt'}:logits")
    assert single.exit_code == 1 and metric(single.stdout, "max_abs_error") > 1e-2, single.output
    assert "tensor-parallel replicas differ" in single.output


def test_zero_run_of_a_megatron_model_with_tp(batch):
    for case, weights in (("zero_tp4_master", "master weights (float32)"),
                          ("zero_tp4_model", "model weights (bfloat16)")):
        text, rc = batch[case]
        assert rc == 0, text
        assert "TP4 PP1, 4 processes" in text and "megatron module" in text and weights in text
        assert metric(text, "max_abs_error") < 1e-5 and "layer 1 " in text


def test_zero_run_with_tp_drifted_replica(batch):
    text, rc = batch["zero_tp4_drift"]
    assert rc == 1, text
    assert ("first_divergence=layer 1 [pipeline stage 0: mp_rank_00 ZeRO partitions, mp_rank_01 ZeRO "
            "partitions, mp_rank_02 ZeRO partitions, mp_rank_03 ZeRO partitions]") in text, text


# --- a real DeepSpeed ZeRO run of a megatron-core model at TP 2 whose replicas drifted ---------------

@pytest.fixture(scope="module")
def mcore_tp_run(tmp_path_factory):
    if not (HAVE_DS and HAVE_MCORE):
        pytest.skip("needs the deepspeed and megatron-core packages")
    out = tmp_path_factory.mktemp("ds_mcore_tp")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    res = run_torchrun(4, REPO / "tests" / "ds_mcore_tp_case.py", out, "1", "3", env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cases = {f"zero{stage}_{w}": [out / f"zero{stage}" / "ckpt", "--weights", w, "--reference-logits",
                                  f"{out / f'zero{stage}' / 'reference.pt'}:logits_{w}"]
             for stage, w in (("1", "model"), ("1", "master"), ("3", "master"))}
    return out, verify_batch(2, cases, out / "verify")


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage,weights,dtype", [(1, "model", "bfloat16"), (1, "master", "float32"),
                                                 (3, "master", "float32")])
def test_real_zero_tp_run_with_drifted_replicas(mcore_tp_run, stage, weights, dtype):
    out, results = mcore_tp_run
    text, rc = results[f"zero{stage}_{weights}"]
    assert rc == 0, text
    assert "TP2 PP1, 2 processes" in text
    assert f"megatron module (mcore), zero-{stage}, {weights} weights ({dtype})" in text
    assert metric(text, "max_abs_error") < 1e-5 and "result=PASS" in text
    # the merged view computes with rank 0's copies everywhere: not what the framework ran
    run = out / f"zero{stage}"
    single = verify_here(run / "ckpt", "--weights", weights, "--reference-logits",
                         f"{run / 'reference.pt'}:logits_{weights}")
    assert single.exit_code == 1 and "result=FAIL" in single.output, single.output
    assert metric(single.stdout, "max_abs_error") > 1e-3
    assert "layers.1.attn_norm.weight: tensor-parallel replicas differ" in single.output


# --- no launch needed ------------------------------------------------------------------------------

def _fake_torchrun(world: int, *args):
    # the layout checks run before any process group is joined, so torchrun's environment is enough
    return verify_here(*args, env={"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})


def test_wrong_world_size_is_one_line(mds):
    r = _fake_torchrun(2, mds / "checkpoint", "--weights", "model")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "torchrun started 2 processes" in r.output and "is TP2 PP2: it needs 4" in r.output
    r = _fake_torchrun(4, mds / "checkpoint" / "global_step3", "--tp", "4", "--pp", "1")
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "runs at the layout of its files" in r.output


@pytest.mark.parametrize("weights,rank,files", [
    ("model", (0, 0), {"layer_01-model_00", "layer_02-model_00", "layer_03-model_00"}),
    # the last stage multiplies by the tied embedding: DeepSpeed saved it once (stage 0's layer_01)
    # and broadcasts it to the last stage on load
    ("model", (1, 1), {"layer_01-model_01", "layer_04-model_01", "layer_05-model_01", "layer_06-model_01"}),
    ("master", (1, 1), {"bf16_zero_pp_rank_0_mp_rank_03_optim"}),
    ("master", (0, 0), {"bf16_zero_pp_rank_0_mp_rank_00_optim"})])
def test_a_rank_reads_only_its_own_files(mds, monkeypatch, weights, rank, files):
    from ckptool.formats.deepspeed import checkpoint as ds
    from ckptool.formats.deepspeed.ranks import DeepSpeedRanks
    from ckptool.io import torchfile
    from ckptool.options import ReadOptions
    opts = ReadOptions(weights=weights)
    ranks = DeepSpeedRanks(mds / "checkpoint", opts, ds.read(mds / "checkpoint", opts))
    opened, reads = set(), set()  # files unpickled; files whose tensor bytes are read
    short = lambda path: path.name.replace("-model_states.pt", "").replace("_states.pt", "")  # noqa: E731
    real_tree, real, real_into = (torchfile.TorchArchive.load_tree, torchfile.TorchArchive.read_record,
                                  torchfile.TorchArchive.read_record_into)
    monkeypatch.setattr(torchfile.TorchArchive, "load_tree",
                        lambda self: opened.add(short(self.path)) or real_tree(self))
    monkeypatch.setattr(torchfile.TorchArchive, "read_record",
                        lambda self, *a, **k: reads.add(short(self.path)) or real(self, *a, **k))
    monkeypatch.setattr(torchfile.TorchArchive, "read_record_into",
                        lambda self, *a, **k: reads.add(short(self.path)) or real_into(self, *a, **k))
    shards = ranks.shards(*rank)
    loaded = {k: v.load() for k, v in shards.tensors.items()}
    assert reads == files
    mp = rank[1] * 2 + rank[0]
    # unpickled: the same files, and for the masters the rank's own model states (param_shapes)
    assert opened == (files if weights == "model" else files | {f"mp_rank_{mp:02d}_model"}), opened
    last = rank[1] == 1
    assert ("output.weight" in loaded) == last and ("embed.word" in loaded) == (not last)
    assert shards.chunks == [(2 * rank[1], 2)]
    assert sorted({int(k.split(".")[1]) for k in loaded if k.startswith("layers.")}) == [2 * rank[1], 2 * rank[1] + 1]


def _rank_views_equal_merged_slices(path, opts):
    """Where the replicas agree, each rank's own tensors are exactly its slices of the merged view."""
    from ckptool.formats.deepspeed import checkpoint as ds
    from ckptool.formats.deepspeed.ranks import DeepSpeedRanks
    from ckptool.formats.megatron.ranks import slice_rank_shards
    ckpt = ds.read(path, opts)
    layout = ckpt.source.layout
    ranks = DeepSpeedRanks(path, opts, ckpt)
    for p in range(layout.pp):
        for t in range(layout.tp):
            own = ranks.shards(t, p).tensors
            cut = slice_rank_shards(ckpt, layout, t, p).tensors
            # a tied one-stage model multiplies by embed.word itself; the slices add an output copy
            tied_one_stage = layout.pp == 1 and ckpt.config.tied_embeddings
            assert set(own) == set(cut) - ({"output.weight"} if tied_one_stage else set()), (t, p)
            for name, v in own.items():
                assert torch.equal(v.load(), cut[name].load()), (t, p, name)
    return ckpt


@pytest.mark.parametrize("weights", ["model", "master"])
def test_rank_views_of_the_real_mds_checkpoint(mds, weights):
    from ckptool.options import ReadOptions
    _rank_views_equal_merged_slices(mds / "checkpoint", ReadOptions(weights=weights))


@pytest.mark.parametrize("era,untied,qkv", [("old", False, "grouped"), ("new", True, "split")])
def test_rank_views_of_synthetic_pipeline_files(tmp_path, era, untied, qkv):
    """Synthetic MDS layer files at TP2 (tests/test_deepspeed.py's writer): both numbering eras, the
    untied lm_head file, and the [q | k | v] packing regrouped per rank (4 heads: 2 per rank, so the
    two packings differ)."""
    from ckptool.options import ReadOptions
    from test_deepspeed import _write_pipeline
    t = _rand_gpt(h=8, heads=4, vocab=16, seed=7)
    t["head"] = torch.randn(16, 8)
    _write_pipeline(tmp_path, t, era, untied, qkv, heads=4)
    for f in (tmp_path / "global_step5").glob("mp_rank_*_model_states.pt"):  # the writer's args say 2 heads
        meta = torch.load(f, weights_only=False)
        meta["args"].num_attention_heads = 4
        torch.save(meta, f)
    ckpt = _rank_views_equal_merged_slices(tmp_path, ReadOptions(qkv_layout=qkv))
    assert ckpt.config.tied_embeddings == (not untied)


@pytest.mark.parametrize("weights", ["model", "master"])
def test_rank_views_of_a_synthetic_zero_tp_run(tmp_path, weights):
    from ckptool.options import ReadOptions
    _rank_views_equal_merged_slices(synthetic_zero_tp4(tmp_path / "z"), ReadOptions(weights=weights))


def test_hf_names_run_as_one_rank(tmp_path):
    """Synthetic ZeRO-1 files (deepspeed.md 1.3) of a Hugging Face GPT-2: TP1 PP1, so the parallel
    verify is one rank computing with the merged tensors; a world of one process joins a real gloo
    group in this process, and transformers' own forward is the reference."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_head=2, n_layer=2, vocab_size=40,
                                                                 n_positions=16)).eval()
    model.save_pretrained(tmp_path / "hf")
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    (tmp_path / "ds" / "config.json").write_text(model.config.to_json_string())
    params = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" and not k.endswith(".attn.bias")}
    _write_zero12(tag, params, 0, 1, "bf16_", 1, False,
                  {"shared_params": {"lm_head.weight": "transformer.wte.weight"}})
    # port 0: the world of one binds its store on a port the kernel picks while binding it
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    r = verify_here(tmp_path / "ds", "--reference", tmp_path / "hf", "--seq-len", 8, env=env)
    assert r.exit_code == 0, r.output
    assert "TP1 PP1, 1 processes" in r.output and "deepspeed (hf gpt2" in r.output
    assert metric(r.stdout, "max_abs_error") < 1e-5
