"""Optimizer state through merge / reshard, on the two Megatron-LM checkpoints in shared/real-checkpoints
(bf16 training: fp32 masters + Adam moments, written by Megatron-LM itself, TP2 PP2).

Checks: every parameter's master and moments in the output equal the source's at (1,1), (4,1), (1,2)
and (2,2) VPP 2; A -> B -> A gives back the source's rank files' optimizer state entry by entry
(group order, indices, hyperparameters, masters, moments); new vocabulary rows get zero moments and a
master equal to their weight; bad optimizer state is refused in one line.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import real_checkpoint
from ckptool.config import Layout
from ckptool.convert import fix_vocab, write_layout
from ckptool.errors import CkptError
from ckptool.formats.registry import open_checkpoint
from ckptool.io.torchfile import load_torch_file
from ckptool.write_options import WriteOptions

CASES = ["mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"]
LAYOUTS = [Layout(1, 1), Layout(4, 1), Layout(1, 2), Layout(2, 2, vpp=2)]
REPO = Path(__file__).resolve().parents[1]


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    rows = min(a.shape[0], b.shape[0]) if a.dim() else None
    return torch.equal(a[:rows], b[:rows]) if rows is not None else torch.equal(a, b)


def assert_same_training_state(src, out, vocab_rows=None):
    assert out.optimizer is not None and out.optimizer.step == src.optimizer.step
    assert out.optimizer.slot_names() == ["master", "exp_avg", "exp_avg_sq"]
    for slot in src.optimizer.slots:
        assert set(out.optimizer.slots[slot]) == set(src.optimizer.slots[slot])
        for name, t in src.optimizer.slots[slot].items():
            a, b = t.load(), out.optimizer.slots[slot][name].load()
            assert a.dtype == b.dtype == torch.float32, (slot, name)
            assert same_rows(a, b), (slot, name)
    assert [g.hyper for g in out.optimizer.param_groups] == [g.hyper for g in src.optimizer.param_groups]
    assert out.optimizer.scheduler == src.optimizer.scheduler


@pytest.mark.parametrize("case", CASES)
def test_reader_ties_every_slot_to_its_weight(case):
    ckpt = open_checkpoint(real_checkpoint(case) / "checkpoint")
    opt = ckpt.optimizer
    assert opt.kind == "megatron" and opt.step == 3 and opt.consumed_samples == 12
    assert [len(g.names) for g in opt.param_groups] == [26, 42]  # weights | biases and norms
    assert opt.param_groups[1].hyper["weight_decay"] == 0.0 and opt.param_groups[0].hyper["weight_decay"] > 0
    for slot in opt.slot_names():
        assert set(opt.slots[slot]) == set(ckpt.tensors)
    for name, master in opt.slots["master"].items():
        assert torch.equal(master.load().to(torch.bfloat16), ckpt.tensors[name].load()), name
        assert opt.slots["exp_avg_sq"][name].load().min() >= 0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe().replace(" ", ""))
def test_reshard_carries_masters_and_moments(tmp_path, case, layout):
    src = open_checkpoint(real_checkpoint(case) / "checkpoint")
    summary = write_layout(src, tmp_path / "out", layout, warn=lambda m: None)
    assert summary["optimizer"]["step"] == 3
    out = open_checkpoint(tmp_path / "out")
    assert out.source.layout.tp == layout.tp and out.source.layout.pp == layout.pp
    assert_same_training_state(src, out)
    back = tmp_path / "back"
    write_layout(out, back, src.source.layout, warn=lambda m: None)
    _assert_rank_files_equal(real_checkpoint(case) / "checkpoint" / "iter_0000003", back / "iter_0000003")


def _assert_rank_files_equal(a_dir: Path, b_dir: Path):
    """The optimizer entries of two checkpoints' rank files are the same, index by index."""
    for rank in sorted(p.name for p in a_dir.iterdir()):
        a, b = load_torch_file(a_dir / rank / "model_optim_rng.pt"), load_torch_file(b_dir / rank / "model_optim_rng.pt")
        oa, ob = a["optimizer"], b["optimizer"]
        ga, gb = oa["optimizer"]["param_groups"], ob["optimizer"]["param_groups"]
        assert ga == gb, rank
        for i, entry in oa["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(entry[k].load(), ob["optimizer"]["state"][i][k].load()), (rank, i, k)
        for group_a, group_b in zip(oa["fp32_from_fp16_params"], ob["fp32_from_fp16_params"]):
            assert [torch.equal(x.load(), y.load()) for x, y in zip(group_a, group_b)] == [True] * len(group_a)
        assert a["opt_param_scheduler"] == b["opt_param_scheduler"]


def test_new_vocabulary_rows_get_zero_moments_and_master_equal_weight(tmp_path):
    src = open_checkpoint(real_checkpoint(CASES[0]) / "checkpoint")
    # 1001 true rows; divisible by 160 at TP1 pads to 1120: 96 rows beyond the source's 1024.
    write_layout(src, tmp_path / "out", Layout(1, 1),
                 WriteOptions(divisible_by=160, pad_fill="mean"), warn=lambda m: None)
    out = open_checkpoint(tmp_path / "out")
    word, opt = out.tensors["embed.word"].load(), out.optimizer
    assert word.shape[0] == 1120
    master = opt.slots["master"]["embed.word"].load()
    assert torch.equal(master[1024:], word[1024:].float())
    assert word[1024:].abs().sum() > 0  # mean fill: not trivially zero
    for moment in ("exp_avg", "exp_avg_sq"):
        assert torch.count_nonzero(opt.slots[moment]["embed.word"].load()[1024:]) == 0
    assert_same_training_state(src, out)


def test_fix_vocab_resizes_every_slot(tmp_path):
    src = open_checkpoint(real_checkpoint(CASES[0]) / "checkpoint")
    trimmed = fix_vocab(src, size=1008)
    for slot, ts in trimmed.optimizer.slots.items():
        assert ts["embed.word"].shape[0] == 1008, slot
    assert_same_training_state(src, trimmed)


def test_no_optimizer_writes_weights_only(tmp_path):
    src = real_checkpoint(CASES[0]) / "checkpoint"
    r = subprocess.run([sys.executable, "-m", "ckptool", "merge", str(src), str(tmp_path / "out"), "--no-optimizer"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "optimizer state" not in r.stderr  # asked for: no warning
    out = open_checkpoint(tmp_path / "out")
    assert out.optimizer is None
    assert "optimizer" not in load_torch_file(tmp_path / "out" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")


# torch_dist targets carry the optimizer too: tests/test_dist_optim.py.


def _copy_case(tmp_path, case=CASES[0]) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(real_checkpoint(case) / "checkpoint", dst)
    return dst


def _rewrite(path: Path, edit, monkeypatch) -> None:
    """Edit a real rank file with torch itself. Its args may hold enums of a newer Megatron than the
    installed one: those load as placeholders registered on their module, so torch.save finds them."""
    import importlib
    import pickle

    class Placeholder:
        def __init__(self, *a, **k):
            self.a = a

        def __reduce__(self):
            return (type(self), self.a)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            try:
                return super().find_class(module, name)
            except AttributeError:
                cls = type(name, (Placeholder,), {"__module__": module, "__qualname__": name})
                monkeypatch.setattr(importlib.import_module(module), name, cls, raising=False)
                return cls

    shim = type(pickle)("placeholder_pickle")
    shim.__dict__.update(pickle.__dict__)
    shim.Unpickler = Unpickler
    obj = torch.load(path, weights_only=False, pickle_module=shim, map_location="cpu")
    edit(obj)
    torch.save(obj, path)


def test_mismatched_master_is_refused_naming_the_parameter(tmp_path, monkeypatch):
    src = _copy_case(tmp_path)
    f = src / "iter_0000003" / "mp_rank_01_000" / "model_optim_rng.pt"

    def shift(obj):  # a master that no longer rounds to its weight: e.g. state from another step
        obj["optimizer"]["fp32_from_fp16_params"][0][2].add_(0.5)
    _rewrite(f, shift, monkeypatch)
    ckpt = open_checkpoint(src)
    with pytest.raises(CkptError, match=r"mp_rank_01_000.*fp32 master of .*linear_proj.weight.*--no-optimizer"):
        write_layout(ckpt, tmp_path / "out", Layout(1, 1), warn=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_wrong_group_sizes_are_refused(tmp_path, monkeypatch):
    src = _copy_case(tmp_path)
    f = src / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"

    def move(obj):  # one parameter moved between the groups: no tie would be trustworthy
        g0, g1 = obj["optimizer"]["optimizer"]["param_groups"]
        g1["params"].insert(0, g0["params"].pop())
    _rewrite(f, move, monkeypatch)
    with pytest.raises(CkptError, match=r"mp_rank_00_000.*groups hold \[9, 17\].*--no-optimizer"):
        open_checkpoint(src)


def test_unreadable_distrib_optim_is_refused_and_no_optimizer_reads_the_weights(tmp_path):
    """distrib_optim.pt beside the rank files means the distributed optimizer (tests/test_distopt.py
    reads real ones); one that does not load is refused, and --no-optimizer leaves it unread."""
    from ckptool.options import ReadOptions
    src = _copy_case(tmp_path)
    for rank in (src / "iter_0000003").iterdir():
        (rank / "distrib_optim.pt").write_bytes(b"")
    with pytest.raises(CkptError, match=r"distrib_optim.pt cannot be read.*--no-optimizer"):
        open_checkpoint(src)
    ckpt = open_checkpoint(src, ReadOptions(optimizer=False))
    assert ckpt.optimizer is None and not ckpt.warnings


def test_per_dp_rank_optim_pt_form_is_dropped_with_a_warning(tmp_path):
    """The 2022-23 distributed optimizer (one mp_rank_XX_YYY_DDD/optim.pt per DP rank) is named."""
    src = _copy_case(tmp_path)
    extra = src / "iter_0000003" / "mp_rank_00_000_001"
    extra.mkdir()
    (extra / "optim.pt").write_bytes(b"")
    ckpt = open_checkpoint(src)
    assert ckpt.optimizer is None
    assert any("optim.pt per data-parallel rank" in w and "weights only" in w for w in ckpt.warnings)


@pytest.mark.parametrize("weights", ["master", "model"])
def test_megatron_deepspeed_zero_run_into_megatron_lm_with_its_optimizer(tmp_path, weights):
    """Across frameworks: the real Megatron-DeepSpeed bf16 ZeRO-1 TP2 PP2 run -> Megatron-LM torch format
    at TP1 with masters and moments from the ZeRO partitions; bf16 weights (--weights model) come with
    fp32 masters that round to them, so the output is mixed precision as Megatron trains it."""
    case = real_checkpoint("mds_gpt2_pipe_tp2pp2_bf16_zero1") / "checkpoint"
    src = open_checkpoint(case, _opts(weights))
    write_layout(src, tmp_path / "out", Layout(1, 1), warn=lambda m: None)
    out = open_checkpoint(tmp_path / "out")
    assert out.optimizer.step == src.optimizer.step == 3
    # fp32 weights (the masters) make an fp32 run: the weights are its masters, no separate copy
    assert out.optimizer.kind == ("megatron" if weights == "model" else "megatron-fp32")
    assert_same_training_state_values(src, out)
    rank = load_torch_file(tmp_path / "out" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    assert ("fp32_from_fp16_params" in rank["optimizer"]) == (weights == "model")
    assert "grad_scaler" not in rank["optimizer"]  # DeepSpeed's loss scaler is not Megatron's


def _opts(weights):
    from ckptool.options import ReadOptions
    return ReadOptions(weights=weights)


def assert_same_training_state_values(src, out):
    for slot in ("master", "exp_avg", "exp_avg_sq"):
        written = out.optimizer.slots.get(slot, out.tensors)  # fp32 runs: the weights are the masters
        for name, t in src.optimizer.slots[slot].items():
            assert same_rows(t.load(), written[name].load()), (slot, name)
