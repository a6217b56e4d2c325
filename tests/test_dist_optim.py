"""torch_dist checkpoints with optimizer state: read as slots, written in the fully_reshardable form.

Sources come from the real megatron-core (0.16, CPU, gloo, two torchrun processes) training a tiny GPT
with its own DDP, bf16 Adam with fp32 masters and LR scheduler, saving as Megatron-LM does for
--ckpt-format torch_dist (tests/mcore_optim_dist_helper.py): the non-distributed optimizer at TP2, the
distributed optimizer at TP1 x DP2 in its fully_reshardable form, and in its dp_reshardable (the 0.15/0.16
default) and fully_sharded_model_space (the default up to 0.14) forms at TP2, PP2, TP1 x DP2, bucketed
and (dp_reshardable) PP2 x VPP2. At the save the helper also writes the live optimizer's values (DP-gathered), which the reader must reproduce bit for bit.

ckptool then writes torch_dist with the optimizer at another TP; megatron-core loads it with
optimizer.sharded_state_dict + dist_checkpointing.load (both optimizer kinds, TP 1 and 2, and PP 2)
and trains on. Measured on CPU (torch 2.13): the resumed losses differ from the run that went on by
<= 2e-4 (TP reduction order in bf16), a weights-only resume by ~6e-2; megatron-core resuming its own
save at the same layout (the control) is exact.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, real_checkpoint, shared_followups
from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.errors import CkptError
from ckptool.formats.dcp import optim as dist_optim
from ckptool.formats.registry import open_checkpoint
from ckptool.io.dcp_io import DcpDir
from ckptool.lazy import Const
from ckptool.state import Checkpoint, OptimizerState
from ckptool.write_options import WriteOptions

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_optim_dist_helper.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed "
                                 "(pip install megatron-core: test-only extra)")
LOSS_TOL = 2e-3
SLOTS = ["master", "exp_avg", "exp_avg_sq"]
TORCH_CASES = ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"]


def losses(path: Path) -> torch.Tensor:
    return torch.tensor(torch.load(path)["losses"], dtype=torch.float64)


def assert_slots_equal(ckpt, slot_of, names=None):
    """ckpt's optimizer slots equal slot_of(slot) (canonical name -> lazy), bit for bit."""
    for slot in SLOTS:
        other = slot_of(slot)
        for name in names or ckpt.tensors:
            a, b = ckpt.optimizer.slots[slot][name].load(), other[name].load()
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (slot, name)


def live(root: Path):
    """The live optimizer values the helper wrote (torch-format weights per slot), by canonical name."""
    return lambda slot: open_checkpoint(root / slot).tensors


# name -> (helper save options, the reader's kind): the distributed optimizer's other torch_dist forms.
# fully_sharded_model_space as megatron-core < 0.15 stored it (N-D flattened, MCoreMetadata), at TP1 x DP2
# (DP slices inside parameters; llama: inside a SwiGLU half), TP2 (llama: GQA, SwiGLU factories) and PP2
# (tied embeddings); dp_reshardable
# (Megatron-LM 0.16's default) at PP2 (gpt2: tied, the embedding and its head copy in buckets of their
# own; llama: untied, uneven 2 + 1 layers, grads in fp32 as Megatron-LM reduces them with bf16) and bucketed
# by --overlap-grad-reduce at TP1 x DP2.
FSMS, DPR = "megatron-core-dist (fully_sharded_model_space)", "megatron-core-dist (dp_reshardable)"
DZ = "megatron-core-dist (dp_zero_gather_scatter)"
MORE_FORMS = {
    "fs": ("save --tp 1 --form fully_sharded_model_space", FSMS),
    "fs_tp2": ("save --tp 2 --arch llama --form fully_sharded_model_space", FSMS),
    "fs_llama": ("save --tp 1 --arch llama --form fully_sharded_model_space", FSMS),  # a DP cut inside SwiGLU's up half
    "fs_pp2": ("save --pp 2 --form fully_sharded_model_space", FSMS),
    "dpr_pp2": ("save --pp 2 --form dp_reshardable", DPR),
    "dpr_pp2_llama": ("save --pp 2 --arch llama --grad-fp32 --form dp_reshardable", DPR),
    "dpr_buckets": ("save --tp 1 --arch llama --bucket-size 1000 --form dp_reshardable", DPR),
    # virtual pipeline: 4 llama layers on PP2 x VPP2, one grad buffer per model chunk, chunk 0 of stage 0
    # bucketed (synthetic gradients, real optimizer steps: the helper has no interleaved schedule)
    "dpr_vpp": ("save-vpp --pp 2 --vpp 2 --bucket-size 1000 --form dp_reshardable", DPR),
    # the deprecated dp_zero_gather_scatter (up to 0.14 without --ckpt-fully-parallel-save): bucketed
    # buffers gathered over DP2, and PP2 with the tied embedding's own buckets
    "dz_buckets": ("save --tp 1 --arch llama --bucket-size 1000 --form dp_zero_gather_scatter", DZ),
    "dz_pp2": ("save --pp 2 --form dp_zero_gather_scatter", DZ),
}


# the other forms resharded to torch_dist at another layout and resumed there by megatron-core's
# distributed optimizer (the next 2 steps compared with the source run's): name -> (arch option, target TP)
RESUMED_FORMS = {"fs": ("", 2), "fs_tp2": ("--arch llama", 1), "fs_pp2": ("", 1), "dpr_pp2": ("", 2),
                 "dpr_pp2_llama": ("--arch llama", 2), "dpr_buckets": ("--arch llama", 2), "dz_pp2": ("", 2)}


# every save of `trained`: name -> helper job (test_quick_inspect reads some of them too)
SAVES = declare_runs(HELPER, 2, {"plain": "save {out} --tp 2 --form plain --live {out}_live --out {out}.pt",
         "fr": "save {out} --tp 1 --form fully_reshardable --live {out}_live --out {out}.pt",
         "dpr": "save {out} --tp 2 --arch llama --form dp_reshardable --live {out}_live --out {out}.pt",
         "f32": "save {out} --tp 2 --form plain --dtype fp32 --live {out}_live --out {out}.pt",
         **{name: f"{how.split(' ', 1)[0]} {{out}} {how.split(' ', 1)[1]} --live {{out}}_live --out {{out}}.pt"
            for name, (how, _) in MORE_FORMS.items()}})


def copy_saves(framework_runs, root: Path) -> Path:
    """The session's SAVES, copied into root."""
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    for name, stem in framework_runs(HELPER, 2, SAVES, timeout=600).items():
        copy_run(stem, root / name)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, framework_runs):
    return copy_saves(framework_runs, tmp_path_factory.mktemp("dist_optim"))


@shared_followups
def resumed(framework_runs, r):
    """The saves (a copy of their own), ckptool's torch_dist outputs at another TP, loaded and trained on by
    megatron-core (in one launch with the other files' 2-process follow-ups of the helper)."""
    copy_saves(framework_runs, r)
    write_layout(open_checkpoint(r / "plain"), r / "plain_to_tp1", Layout(1),
                 WriteOptions(format="torch_dist"), warn=print)
    write_layout(open_checkpoint(r / "fr"), r / "fr_to_tp2", Layout(2), WriteOptions(format="torch_dist"), warn=print)
    write_layout(open_checkpoint(r / "f32"), r / "f32_to_tp1", Layout(1), WriteOptions(format="torch_dist"), warn=print)
    write_layout(open_checkpoint(r / "dpr"), r / "dpr_to_tp1", Layout(1), WriteOptions(format="torch_dist"), warn=print)
    write_layout(open_checkpoint(r / "dpr_vpp"), r / "dpr_vpp_to_tp2", Layout(2),
                 WriteOptions(format="torch_dist"), warn=print)
    for name, (_, tp) in RESUMED_FORMS.items():
        write_layout(open_checkpoint(r / name), r / f"{name}_to_tp{tp}", Layout(tp),
                     WriteOptions(format="torch_dist"), warn=print)
    yield [(HELPER, 2, [
             f"resume {r}/plain_to_tp1 --tp 1 --form plain --out {r}/r_plain_tp1.pt",
             f"resume {r}/plain_to_tp1 --tp 1 --form fully_reshardable --out {r}/r_plain_tp1_distopt.pt",
             f"resume {r}/plain_to_tp1 --tp 1 --form plain --weights-only --out {r}/r_weights_only.pt",
             f"resume {r}/fr_to_tp2 --tp 2 --form fully_reshardable --out {r}/r_fr_tp2.pt",
             f"resume {r}/fr_to_tp2 --tp 2 --form plain --out {r}/r_fr_tp2_plain.pt",
             f"resume {r}/fr --tp 1 --form fully_reshardable --out {r}/r_control.pt",
             f"resume {r}/f32_to_tp1 --tp 1 --form plain --dtype fp32 --out {r}/r_f32.pt",
             f"resume {r}/dpr_to_tp1 --tp 1 --arch llama --form fully_reshardable --out {r}/r_dpr.pt",
             f"resume {r}/f32_to_tp1 --tp 1 --form fully_reshardable --dtype fp32 --out {r}/r_f32_distopt.pt",
             *(f"resume {r}/{name}_to_tp{tp} --tp {tp} {arch} --form fully_reshardable --out {r}/r_{name}.pt"
               for name, (arch, tp) in RESUMED_FORMS.items()),
             f"load {r}/plain_to_tp1 --tp 1 --pp 2 --form plain --live {r}/l_pp2_plain --out {r}/l1.pt",
             f"load {r}/dpr_vpp_to_tp2 --tp 2 --arch llama --layers 4 --form fully_reshardable --live {r}/l_vpp "
             f"--out {r}/l3.pt",
             f"load {r}/fr_to_tp2 --tp 1 --pp 2 --form fully_reshardable --live {r}/l_pp2_fr --out {r}/l2.pt"])]
    return r


@needs_mcore
@pytest.mark.parametrize("form", ["plain", "fr"])
def test_reader_equals_the_live_optimizer(trained, form):
    ckpt = open_checkpoint(trained / form)
    opt = ckpt.optimizer
    assert opt.kind == ("megatron-core-dist (non-distributed)" if form == "plain"
                        else "megatron-core-dist (fully_reshardable)")
    assert opt.step == 3 and opt.consumed_samples == 6 and opt.scheduler["num_steps"] == 3
    # Megatron's groups: weights with weight decay; biases and norms without
    assert [len(g.names) for g in opt.param_groups] == [14, 22]
    assert [g.hyper["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
    assert_slots_equal(ckpt, live(trained / f"{form}_live"))
    for name, master in opt.slots["master"].items():
        assert torch.equal(master.load().to(torch.bfloat16), ckpt.tensors[name].load()), name


@needs_mcore
def test_dp_reshardable_flat_buckets_are_tied_by_the_buffer_layout(trained):
    """Megatron-LM's default form: flat per-bucket buffers per TP rank (llama: GQA, SwiGLU, untied, TP2)."""
    ckpt = open_checkpoint(trained / "dpr")
    assert ckpt.optimizer.kind == "megatron-core-dist (dp_reshardable)" and ckpt.optimizer.step == 3
    assert_slots_equal(ckpt, live(trained / "dpr_live"))


@needs_mcore
@pytest.mark.parametrize("name", list(MORE_FORMS))
def test_other_distributed_forms_equal_the_live_optimizer(trained, name):
    """Every slot of every parameter equals the live optimizer's at the save, bit for bit; the scalars
    come from the common state (fully_sharded_model_space) or the per-rank objects (dp_reshardable)."""
    ckpt = open_checkpoint(trained / name)
    opt = ckpt.optimizer
    assert opt is not None and opt.kind == MORE_FORMS[name][1] and not ckpt.warnings, ckpt.warnings
    assert opt.step == 3 and opt.consumed_samples == 6 and opt.scheduler["num_steps"] == 3
    assert [g.hyper["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
    assert_slots_equal(ckpt, live(trained / f"{name}_live"))
    if "--grad-fp32" in MORE_FORMS[name][0]:
        keys = DcpDir(next((trained / name).glob("iter_*"))).entries
        assert any("dtype_(torch.bfloat16, torch.float32)" in k for k in keys)


@needs_mcore
def test_fully_sharded_model_space_storage_is_n_d_flattened(trained):
    """What the reader undoes: [layers, rows/x, cols/y, x*y] with DP slices inside a chunk, and the
    original shapes in megatron-core's MCoreMetadata."""
    dcp = DcpDir(next((trained / "fs").glob("iter_*")))
    key = "decoder.layers.mlp.linear_fc1.weight"
    assert tuple(dcp.entries[f"optimizer.state.exp_avg.{key}"].size) == (2, 1, 1, 64 * 32)
    assert tuple(dcp.entries[key].size) == (2, 64, 32)
    assert dcp.mcore_data[f"optimizer.state.fp32_param.{key}"]["nd_reformulated_orig_global_shape"] == (2, 64, 32)
    assert any(c.offsets[-1] > 0 for c in dcp.entries[f"optimizer.state.exp_avg.{key}"].chunks)  # a DP cut inside
    up = DcpDir(next((trained / "fs_llama").glob("iter_*"))).entries[f"optimizer.state.exp_avg.{key}"]
    assert tuple(up.size) == (3, 2, 1, 48 * 32)  # [layers, gate / up, 1, half of fc1]
    assert any(c.offsets[1] == 1 and c.offsets[-1] > 0 for c in up.chunks)


@needs_mcore
def test_fully_sharded_model_space_with_a_dp_slice_missing_is_refused(trained, tmp_path):
    """A DP rank's slice of a parameter absent from the index: the region is not covered, refused."""
    import pickle
    import shutil
    src = tmp_path / "src"
    shutil.copytree(trained / "fs", src)
    d = next(src.glob("iter_*"))
    md = pickle.loads((d / ".metadata").read_bytes())
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    entry = md.state_dict_metadata[key]
    entry.chunks = [c for c in entry.chunks if c.offsets[-1] == 0]
    (d / ".metadata").write_bytes(pickle.dumps(md))
    ckpt = open_checkpoint(src)
    with pytest.raises(CkptError, match="the stored chunks cover"):
        ckpt.optimizer.slots["exp_avg"]["layers.0.mlp.up.weight"].load()


@needs_mcore
@pytest.mark.parametrize("name,layout,distributed", [
    ("fs", Layout(2), False), ("fs_pp2", Layout(1, 1), True), ("dpr_pp2", Layout(1, 2), True),
    ("dpr_buckets", Layout(2), False),
])
def test_other_distributed_forms_reshard_into_the_torch_format(trained, tmp_path, name, layout, distributed):
    """Into Megatron-LM's torch format, with the non-distributed optimizer or distrib_optim.pt (DP 2):
    what ckptool reads back equals the source's optimizer state bit for bit."""
    src = open_checkpoint(trained / name)
    kw = dict(distributed_optimizer=True, dp=2) if distributed else {}
    write_layout(src, tmp_path / "out", layout, WriteOptions(format="torch", **kw), warn=print)
    out = open_checkpoint(tmp_path / "out")
    assert out.optimizer.step == 3 and not out.warnings, out.warnings
    assert (tmp_path / "out" / "iter_0000003" / ("mp_rank_00" + ("_000" if layout.pp > 1 else "")) /
            "distrib_optim.pt").is_file() == distributed
    assert_slots_equal(src, lambda slot: out.optimizer.slots[slot])


@needs_mcore
def test_dp_reshardable_bucket_size_not_in_the_args_is_found_from_the_stored_buckets(trained, tmp_path):
    """args with --overlap-grad-reduce but no --ddp-bucket-size (megatron-core's default would be
    40M): the bucket size is found among the stored bucket sizes; every slot still equals the live one."""
    ckpt = open_checkpoint(_copy_with_args(trained / "dpr_buckets", tmp_path, ddp_bucket_size=None))
    assert ckpt.optimizer is not None and not ckpt.warnings
    assert_slots_equal(ckpt, live(trained / "dpr_buckets_live"))


@needs_mcore
@pytest.mark.parametrize("edit,problem", [
    (dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2),
     r"dp_group_idx_0\.gbuf_idx_0 holds buckets of \[\d+\] elements"),
    (dict(pipeline_model_parallel_size=2), r"pipeline split .* does not fit 3 layers on 2 stages"),
])
def test_dp_reshardable_args_that_do_not_fit_the_buffers_are_refused(trained, tmp_path, edit, problem):
    """args claiming pipeline stages the save did not have: the recomputed buckets differ from the
    stored per_bucket_numel_unpadded (or the split does not fit), refused in one line suggesting
    --no-optimizer."""
    src = _copy_with_args(trained / "dpr", tmp_path, **edit)
    with pytest.raises(CkptError, match=problem + ".*--no-optimizer"):
        open_checkpoint(src)


@needs_mcore
def test_dp_reshardable_with_the_wrong_layout_is_refused(trained, tmp_path):
    """args claiming Transformer Engine (another registration order): the sizes still add up, but the
    masters no longer round to their weights: refused, never a silently mis-tied moment."""
    src = _copy_with_args(trained / "dpr", tmp_path, transformer_impl="transformer_engine")
    with pytest.raises(CkptError, match=r"fp32 master of \S+ does not round to its stored weight.*--no-optimizer"):
        ckpt = open_checkpoint(src)
        for slot in ckpt.optimizer.slots.values():
            for t in slot.values():
                t.load()


def _copy_with_args(save: Path, tmp_path: Path, **changes) -> Path:
    import shutil
    from ckptool.io.torchfile import load_torch_file, save_streaming
    dst = tmp_path / "src"
    shutil.copytree(save, dst)
    d = next(dst.glob("iter_*"))
    common = load_torch_file(d / "common.pt")
    for k, v in changes.items():
        setattr(common["args"], k, v)
    save_streaming(common, tmp_path / "common.pt")
    os.replace(tmp_path / "common.pt", d / "common.pt")
    return dst


@needs_mcore
def test_megatron_core_loads_our_output_at_another_tp_and_pp(resumed):
    """What megatron-core's optimizer holds after loading ckptool's output (TP1 PP2, both optimizer
    kinds; the PP2 x VPP2 dp_reshardable source at TP2) equals the source's optimizer state, bit for bit;
    so does ckptool reading its own output."""
    for src, out, loaded in (("plain", "plain_to_tp1", "l_pp2_plain"), ("fr", "fr_to_tp2", "l_pp2_fr"),
                             ("dpr_vpp", "dpr_vpp_to_tp2", "l_vpp")):
        ckpt = open_checkpoint(resumed / src)
        assert_slots_equal(ckpt, live(resumed / loaded))
        ours = open_checkpoint(resumed / out)
        assert_slots_equal(ckpt, lambda slot: ours.optimizer.slots[slot])
        assert ours.optimizer.step == 3 and ours.optimizer.scheduler == ckpt.optimizer.scheduler
        assert [g.hyper for g in ours.optimizer.param_groups] == [g.hyper for g in ckpt.optimizer.param_groups]


@needs_mcore
def test_training_resumes_on_the_new_layout(resumed):
    r = resumed
    went_on = {"plain": losses(r / "plain.pt")[3:], "fr": losses(r / "fr.pt")[3:], "dpr": losses(r / "dpr.pt")[3:]}
    went_on.update({name: losses(r / f"{name}.pt")[3:] for name in RESUMED_FORMS})
    gaps = {name: (losses(r / f"{name}.pt") - went_on[src]).abs().max().item()
            for name, src in (("r_plain_tp1", "plain"), ("r_plain_tp1_distopt", "plain"),
                              ("r_fr_tp2", "fr"), ("r_fr_tp2_plain", "fr"), ("r_dpr", "dpr"),
                              *((f"r_{name}", name) for name in RESUMED_FORMS))}
    weights_only = (losses(r / "r_weights_only.pt") - went_on["plain"]).abs().max().item()
    print("loss gaps:", gaps, "weights only:", weights_only)
    assert max(gaps.values()) < LOSS_TOL, gaps
    assert weights_only > 10 * max(gaps.values()) and weights_only > 1e-2, (weights_only, gaps)
    assert torch.equal(losses(r / "r_control.pt"), went_on["fr"])  # megatron-core's own save, same layout
    # fp32 training (no separate masters): TP2 -> TP1 resumes exactly here, with either optimizer kind
    for name in ("r_f32", "r_f32_distopt"):
        assert (losses(r / f"{name}.pt") - losses(r / "f32.pt")[3:]).abs().max().item() < LOSS_TOL, name


@needs_mcore
def test_fp32_training_state_has_moments_and_no_separate_masters(trained):
    ckpt = open_checkpoint(trained / "f32")
    assert ckpt.optimizer.slot_names() == ["exp_avg", "exp_avg_sq"] and ckpt.optimizer.step == 3
    for slot in ckpt.optimizer.slot_names():
        other = open_checkpoint(trained / "f32_live" / slot).tensors
        for name, t in ckpt.optimizer.slots[slot].items():
            assert torch.equal(t.load(), other[name].load()), (slot, name)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_torch_to_torch_dist_and_back_is_bit_exact(tmp_path, case):
    """Megatron-LM torch format with optimizer -> torch_dist (TP1) -> torch at the source layout: the rank
    files' optimizer entries come back index by index (tests/test_optimizer.py's comparison)."""
    from test_optimizer import _assert_rank_files_equal, assert_same_training_state
    src_dir = real_checkpoint(case) / "checkpoint"
    src = open_checkpoint(src_dir)
    summary = write_layout(src, tmp_path / "dist", Layout(1), WriteOptions(format="torch_dist"), warn=lambda m: None)
    assert summary["optimizer"]["kind"] == "fully_reshardable" and summary["optimizer"]["step"] == 3
    mid = open_checkpoint(tmp_path / "dist")
    assert_same_training_state(src, mid)
    assert [set(g.names) for g in mid.optimizer.param_groups] == [set(g.names) for g in src.optimizer.param_groups]
    write_layout(mid, tmp_path / "back", src.source.layout, WriteOptions(format="torch", dialect=src.source.dialect),
                 warn=lambda m: None)
    _assert_rank_files_equal(src_dir / "iter_0000003", tmp_path / "back" / "iter_0000003")


def test_master_aliases_share_bytes_and_megatron_core_keys_are_written(tmp_path):
    src = open_checkpoint(real_checkpoint(TORCH_CASES[0]) / "checkpoint")
    write_layout(src, tmp_path / "dist", Layout(2), WriteOptions(format="torch_dist"), warn=lambda m: None)
    dcp = DcpDir(tmp_path / "dist" / "iter_0000003")
    key = "decoder.layers.self_attention.linear_qkv.weight"
    for stored in ("param", "fp32_param", "exp_avg", "exp_avg_sq"):
        assert f"optimizer.state.{stored}.{key}" in dcp.entries
    assert dcp.storage[f"optimizer.state.param.{key}"] == dcp.storage[f"optimizer.state.fp32_param.{key}"]
    size = (tmp_path / "dist" / "iter_0000003" / "__0_0.distcp").stat().st_size
    listed = sum(info.length for chunks in dcp.storage.values() for info in chunks.values())
    master = sum(info.length for k, chunks in dcp.storage.items() if k.startswith("optimizer.state.param.")
                 for info in chunks.values())
    assert size == listed - master  # every master byte is on disk once


def test_fp32_target_takes_its_weights_from_the_masters(tmp_path):
    src = open_checkpoint(real_checkpoint(TORCH_CASES[0]) / "checkpoint")
    write_layout(src, tmp_path / "dist", Layout(1),
                 WriteOptions(format="torch_dist", dtype=torch.float32), warn=lambda m: None)
    out = open_checkpoint(tmp_path / "dist")
    for name, master in src.optimizer.slots["master"].items():
        assert torch.equal(out.tensors[name].load(), master.load()), name


def _with_optimizer(ckpt, slots):
    return Checkpoint(ckpt.config, ckpt.tensors, ckpt.source, [], ckpt.optimizer.with_slots(slots))


def test_a_master_that_does_not_match_its_weight_is_refused(tmp_path):
    src = open_checkpoint(real_checkpoint(TORCH_CASES[0]) / "checkpoint")
    slots = {s: dict(ts) for s, ts in src.optimizer.slots.items()}
    bad = slots["master"]["layers.1.mlp.up.weight"].load().clone()
    bad[0, 0] += 1.0
    slots["master"]["layers.1.mlp.up.weight"] = Const(bad)
    write_layout(_with_optimizer(src, slots), tmp_path / "dist", Layout(1),
                 WriteOptions(format="torch_dist"), warn=lambda m: None)
    ckpt = open_checkpoint(tmp_path / "dist")
    with pytest.raises(CkptError, match=r"fp32 master of layers\.1\.mlp\.up\.weight does not round.*--no-optimizer"):
        ckpt.optimizer.slots["master"]["layers.1.mlp.up.weight"].load()


def test_unexpected_param_groups_are_refused():
    """A group no trait singles out (lr_mult 2 on weights, by a run's own condition) is refused, never
    guessed; the groups the traits tell apart are tied (tests/test_dist_optim_groups.py: real runs)."""
    from ckptool.formats.megatron.optim import GroupRule
    weights = {"a.weight": Const(torch.zeros(2, 2)), "a.bias": Const(torch.zeros(2))}
    hypers = [{"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0, "lr_mult": 1.0}, {"wd_mult": 1.0, "lr_mult": 2.0}]
    with pytest.raises(CkptError, match="here: 3 optimizer groups that megatron-core's group traits.*--no-optimizer"):
        dist_optim.tie_groups([hypers], weights, GroupRule(), 1, "here")
    groups = dist_optim.tie_groups([hypers[:2]], weights, GroupRule(), 1, "here")
    assert [g.names for g in groups] == [["a.weight"], ["a.bias"]]


def test_a_chain_is_tied_per_optimizer_and_a_swapped_one_is_refused():
    """megatron-core's [dense, expert] chain at EP 2: the experts tie to the second optimizer's group,
    which is one canonical group with its dense twin; written back at EP 2 the chain is re-formed, at EP 1
    one optimizer. Swapped, the is_expert_parallel flags disagree with the chain's order: refused."""
    from ckptool.formats.megatron.optim import GroupRule
    weights = {"layers.0.attn.q.weight": Const(torch.zeros(2, 2)), "layers.0.attn_norm.weight": Const(torch.zeros(2)),
               "layers.0.mlp.experts.1.down.weight": Const(torch.zeros(2, 2))}
    dense = [{"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False},
             {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False}]
    expert = [{"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": True}]
    groups = dist_optim.tie_groups([dense, expert], weights, GroupRule(), 2, "here")
    assert [g.names for g in groups] == [["layers.0.attn.q.weight", "layers.0.mlp.experts.1.down.weight"],
                                         ["layers.0.attn_norm.weight"]]
    opt = OptimizerState("x", {}, step=2, param_groups=groups)
    chain = dist_optim.common_entries(opt, mixed=True, ep=2)["optimizer"]
    assert [[g["is_expert_parallel"] for g in chain[k]["optimizer"]["param_groups"]] for k in (0, 1)] == [[False, False], [True]]
    assert "param_groups" in dist_optim.common_entries(opt, mixed=True, ep=1)["optimizer"]["optimizer"]
    with pytest.raises(CkptError, match=r"here \(chained optimizer 0\): its groups say is_expert_parallel \[True\].*--no-optimizer"):
        dist_optim.tie_groups([expert, dense], weights, GroupRule(), 2, "here")


def test_groups_without_megatron_core_identifier_keys_get_a_default_runs_values():
    from ckptool.state import ParamGroup
    opt = OptimizerState("x", {}, step=5, param_groups=[ParamGroup(["w"], {"lr": 0.1, "weight_decay": 0.1}),
                                                        ParamGroup(["b"], {"lr": 0.1, "weight_decay": 0.0})])
    groups = dist_optim.common_entries(opt, mixed=True)["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["lr_mult"], g["is_expert_parallel"], g["is_decoupled_lr"], g["step"]) for g in groups] == \
        [(1.0, 1.0, False, False, 5.0), (0.0, 1.0, False, False, 5.0)]


def test_a_chained_optimizer_is_dropped_by_name(tmp_path):
    """Two optimizers (megatron-core's ChainedOptimizer: one entry per optimizer, tensor keys prefixed
    chained_N. in the non-reshardable forms) in a dense model, not megatron-core's [dense, expert] pair:
    dropped with a warning, the weights still read (MoE chains: tests/test_dist_optim_moe.py)."""
    import pickle
    from ckptool.io.torchfile import load_torch_file, save_streaming
    src = open_checkpoint(real_checkpoint(TORCH_CASES[0]) / "checkpoint")
    write_layout(src, tmp_path / "dist", Layout(1), WriteOptions(format="torch_dist"), warn=lambda m: None)
    d = tmp_path / "dist" / "iter_0000003"
    common = load_torch_file(d / "common.pt")
    common["optimizer"] = {0: common["optimizer"], 1: common["optimizer"]}
    save_streaming(common, tmp_path / "common.pt")  # not over the file its lazy tensors read from
    os.replace(tmp_path / "common.pt", d / "common.pt")
    md = pickle.loads((d / ".metadata").read_bytes())
    md.state_dict_metadata = {("chained_0." + k if k.startswith("optimizer.") else k): v
                              for k, v in md.state_dict_metadata.items()}
    md.storage_data = {type(i)(("chained_0." + i.fqn) if i.fqn.startswith("optimizer.") else i.fqn, i.offset, i.index): v
                       for i, v in md.storage_data.items()}
    (d / ".metadata").write_bytes(pickle.dumps(md))
    ckpt = open_checkpoint(tmp_path / "dist")
    assert ckpt.optimizer is None
    assert any("chained optimizer of 2 optimizers at EP 1" in w for w in ckpt.warnings), ckpt.warnings
    assert torch.equal(ckpt.tensors["embed.word"].load()[:1001], src.tensors["embed.word"].load()[:1001])


def test_no_optimizer_leaves_a_broken_optimizer_unread(tmp_path):
    """--no-optimizer (ReadOptions.optimizer False): a torch_dist optimizer state that would be refused
    is not read at all, and the weights convert."""
    from ckptool.options import ReadOptions
    src = open_checkpoint(real_checkpoint(TORCH_CASES[0]) / "checkpoint")
    write_layout(src, tmp_path / "dist", Layout(1), WriteOptions(format="torch_dist"), warn=lambda m: None)
    d = tmp_path / "dist" / "iter_0000003"
    from ckptool.io.torchfile import load_torch_file, save_streaming
    common = load_torch_file(d / "common.pt")
    common["optimizer"]["optimizer"]["param_groups"] *= 2  # 4 groups: refused
    save_streaming(common, tmp_path / "common.pt")
    os.replace(tmp_path / "common.pt", d / "common.pt")
    with pytest.raises(CkptError, match="4 optimizer groups.*--no-optimizer"):
        open_checkpoint(tmp_path / "dist")
    ckpt = open_checkpoint(tmp_path / "dist", ReadOptions(optimizer=False))
    assert ckpt.optimizer is None and not ckpt.warnings
