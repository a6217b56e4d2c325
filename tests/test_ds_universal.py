"""DeepSpeed optimizer state in (ZeRO-1/2/3 and BF16_Optimizer moments) and `--format ds-universal` out.

Real: tests/ds_universal_cases.py trains tiny GPT-2 models (odd sizes, a frozen parameter) with the
real deepspeed package under torchrun (DP 2, gloo, CPU) at ZeRO-1/2/3 in bf16 and fp32, and keeps
the live engine's fp32 masters and Adam moments. ckptool reads them bit for bit, `ckptool merge
--format ds-universal` writes a universal checkpoint, and fresh engines at DP 1 and DP 3 load it
with `checkpoint.load_universal`: safe_get_full_fp32_param / safe_get_full_optimizer_state equal
the saved engine's values bit for bit, and one more training step on a shared batch gives the loss the
un-converted run's next step gave. Runs with no canonical GPT form (a module of its own saved without
config.json, a Hugging Face BERT) are written the same way under the engine's own parameter names
(every file equal to ds_to_universal.py --inject_missing_state's) and load the same. The real
Megatron-DeepSpeed TP2 PP2 run in shared/real-checkpoints is converted by ckptool and by DeepSpeed's
own ds_to_universal.py, and every tensor file must agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DS_UNIVERSAL_CASES, DS_UNIVERSAL_OWN_NAME_CASES, count_tensor_reads, run_torchrun
from ckptool.errors import CkptError
from ckptool.formats.deepspeed.universal import universal_params
from ckptool.formats.registry import open_checkpoint
from ckptool.lazy import load_scope
from ckptool.options import ReadOptions

REPO = Path(__file__).resolve().parents[1]
MDS = next((base / "mds_gpt2_pipe_tp2pp2_bf16_zero1" for base in (REPO.parent / "shared" / "real-checkpoints",
                                                                   REPO / "fixtures" / "real")
            if (base / "mds_gpt2_pipe_tp2pp2_bf16_zero1" / "checkpoint").is_dir()),
           REPO / "fixtures" / "real" / "mds_gpt2_pipe_tp2pp2_bf16_zero1")
# bf16opt: bf16 with fp32 gradient accumulation at stage 1, which DeepSpeed runs as BF16_Optimizer;
# llama: GQA, SwiGLU and an untied head (HF names through the Llama table)
# fp16: DeepSpeed's DynamicLossScaler travels in zero/optimizer_state.pt (a stand-in written back)
# 3s: ZeRO-3 with small optimizer sub-groups (several flat groups per rank; DeepSpeed's own converter
# mishandled these before 0.18)
CASES = DS_UNIVERSAL_CASES  # conftest's ds_universal_saves
# no canonical GPT form: plain (a module of its own, no config.json; a tied head, a buffer, a frozen
# parameter) at ZeRO-1 fp32 and ZeRO-3 bf16, a Hugging Face BertForMaskedLM at ZeRO-2 bf16
OWN = DS_UNIVERSAL_OWN_NAME_CASES
KINDS = {"1": "deepspeed-zero1", "2": "deepspeed-zero2", "3": "deepspeed-zero3", "3s": "deepspeed-zero3"}
FROZEN = {"gpt2": "embed.pos", "llama": "layers.0.attn_norm.weight"}  # ds_train_cases.FROZEN, canonical
LOAD_DP = (1, 3)
# one folder serves every stage (both model-states names are written): ZeRO-3 -> ZeRO-1 and back, at DP 3
CROSS_STAGE = ("gpt2-3-fp32:1", "gpt2-1-bf16:3", "gpt2-3s-bf16:1")
SLOT_FILES = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

try:
    import deepspeed  # noqa: F401
    HAVE_DS = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_DS = False


def _cli(*argv):
    from click.testing import CliRunner
    from ckptool.cli import main
    return CliRunner().invoke(main, list(argv))


def _torchrun(n, *argv):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    res = run_torchrun(n, REPO / "tests" / "ds_universal_cases.py", *argv, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="session")
def runs(ds_universal_saves):
    """Every case saved at DP 2 (the session's saves), converted by the CLI, then loaded at DP 1 and DP 3
    (one launch each)."""
    if not HAVE_DS:
        pytest.skip("the deepspeed package cannot be imported")
    out = ds_universal_saves
    for case in CASES + OWN:
        res = _cli("merge", str(out / case / "ckpt"), str(out / case / "universal"), "--format", "ds-universal")
        assert res.exit_code == 0, res.output
        (out / case / "merge.txt").write_text(res.output)
    for n in LOAD_DP:
        _torchrun(n, "load", str(out), *CASES, *OWN, *(CROSS_STAGE if n == 3 else ()))
    return out


@pytest.mark.parametrize("case", CASES)
def test_reader_slots_equal_the_live_engine_bit_for_bit(runs, case):
    ckpt = open_checkpoint(str(runs / case / "ckpt"))
    opt = ckpt.optimizer
    model, stage, dtype = case.split("-")
    assert opt.kind == ("deepspeed-bf16" if dtype == "bf16opt" else KINDS[stage])
    truth = torch.load(runs / case / "truth.pt", weights_only=False)
    assert opt.step == truth["step"] == 2
    for slot in SLOT_FILES:  # same canonical names and shapes as the weights
        assert list(opt.slots[slot]) == list(ckpt.tensors)
        assert all(opt.slots[slot][n].shape == ckpt.tensors[n].shape for n in ckpt.tensors)
        assert all(t.dtype == torch.float32 for t in opt.slots[slot].values())
    params, _ = universal_params(ckpt)
    compared = 0
    with load_scope():
        for p in params:
            for slot, key in SLOT_FILES.items():
                if p.name in truth["params"]:
                    assert torch.equal(p.slots[slot].load(), truth["params"][p.name][key]), (p.name, slot)
                    compared += 1
    assert compared == 3 * len(truth["params"]) > 0
    # the frozen parameter is in no group; its moments are zero and its master is the weight in fp32
    groups = opt.param_groups
    assert len(groups) == 1  # ZeRO-3's sub-groups (4 in 3s) belong to the one torch param group
    names = [n for g in groups for n in g.names]
    frozen = FROZEN[model]
    assert frozen not in names and len(names) == len(set(names)) == len(ckpt.tensors) - 1
    assert all(g.hyper["lr"] == 1e-2 and g.hyper["weight_decay"] == 0.01 for g in groups)
    assert not opt.slots["exp_avg"][frozen].load().any()
    assert torch.equal(opt.slots["master"][frozen].load(), ckpt.tensors[frozen].load().float())


# DeepSpeed 0.19.8's ZeRO-3 universal loader (stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3)
# hands one `step` tensor to every optimizer sub-group, and torch's Adam increments it once per sub-group,
# so with several sub-groups (3s) Adam's bias correction runs ahead from the first step after loading.
# Masters and moments load bit-equal; the output of DeepSpeed's own ds_to_universal.py resumes with the
# very same loss (checked by hand); the loss after that step is only close (1.5e-3 relative here).
SUBGROUPS_SHARE_ONE_STEP = {"gpt2-3s-bf16"}


def _continues_like_the_saved_run(got: dict, rel: float = 1e-4) -> None:
    """The resumed engine's next step on the batch every rank shares (ds_universal_cases.next_step) is
    the un-converted run's: the same loss (equal masters, the same forward) and, after the step, the
    same loss within rel (1e-4: a DP size of 3 averages the shared gradient with other roundings), a
    tolerance far below what the step itself changed (a twentieth of it at most)."""
    (loss, after), (want, want_after) = got["next_step"], got["truth_next_step"]
    assert loss == want
    assert abs(after - want_after) <= rel * abs(want_after) < abs(want - want_after) / 20


@pytest.mark.parametrize("dp", LOAD_DP)
@pytest.mark.parametrize("case", CASES + OWN)
def test_universal_output_loads_into_the_engine_at_another_dp(runs, case, dp):
    got = json.loads((runs / case / f"load_dp{dp}.json").read_text())
    assert got["equal_before_load"] < got["compared"] // 3  # the fresh engine differed before loading
    assert got["mismatch"] == []
    assert got["step"] == got["truth_step"] == 2.0
    assert got["moved"] and got["finite"] and got["global_steps"] == 3  # and it trains on
    _continues_like_the_saved_run(got, 2.5e-3 if case in SUBGROUPS_SHARE_ONE_STEP else 1e-4)


@pytest.mark.parametrize("spec", CROSS_STAGE)
def test_universal_output_loads_into_another_zero_stage(runs, spec):
    case, stage = spec.split(":")
    got = json.loads((runs / case / f"load_dp3_z{stage}.json").read_text())
    assert got["mismatch"] == [] and got["compared"] == 81 and got["equal_before_load"] == 0
    assert got["step"] == 2.0 and got["moved"] and got["finite"]
    _continues_like_the_saved_run(got)


def test_universal_folder_layout(runs):
    out = runs / "gpt2-1-bf16" / "universal"
    tag = (out / "latest_universal").read_text()
    assert tag == "global_step2_universal"
    zero = out / tag / "zero"
    assert sorted(p.name for p in (zero / "transformer.h.0.attn.c_attn.weight").iterdir()) == \
        ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    assert sorted(p.name for p in (zero / "transformer.wpe.weight").iterdir()) == ["fp32.pt"]  # frozen
    assert not (zero / "lm_head.weight").exists()  # tied to wte
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        ms = torch.load(out / tag / name, weights_only=False)
        assert ms["global_steps"] == 2 and ms["dp_world_size"] == 2
    assert not (out / "latest").exists()


def test_real_mds_optimizer_state():
    ckpt = open_checkpoint(str(MDS / "checkpoint"))
    opt = ckpt.optimizer
    assert opt.kind == "deepspeed-zero1" and opt.step == 3
    assert [g.hyper["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert [g.hyper["name"] for g in opt.param_groups] == ["wd_no_scale_lr", "no_wd_no_scale_lr"]
    names = [n for g in opt.param_groups for n in g.names]
    assert sorted(names) == sorted(ckpt.tensors)  # every tensor in exactly one group
    assert all("norm" not in n and not n.endswith("bias") for n in opt.param_groups[0].names)
    with load_scope():
        for n, w in ckpt.tensors.items():  # --weights master (the default) IS the master slot
            assert torch.equal(opt.slots["master"][n].load(), w.load()), n
            assert opt.slots["exp_avg_sq"][n].load().min() >= 0
    assert opt.total_bytes == 3 * ckpt.total_bytes


def test_weights_only_reading_builds_no_optimizer_slots():
    ckpt = open_checkpoint(str(MDS / "checkpoint"))
    assert ckpt.optimizer is not None and not ckpt.optimizer.slots._filled  # built on first use only


def test_real_mds_universal_equals_deepspeeds_own_converter(tmp_path):
    """ds_to_universal.py (installed deepspeed) and ckptool on the real TP2 PP2 run: same files, same bits."""
    if not HAVE_DS:
        pytest.skip("the deepspeed package cannot be imported")
    ref = tmp_path / "ref" / "global_step3_universal"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          str(MDS / "checkpoint" / "global_step3"), "--output_folder", str(ref),
                          "--num_extract_workers", "1", "--num_merge_workers", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    res = _cli("merge", str(MDS / "checkpoint"), str(tmp_path / "ours"), "--format", "ds-universal")
    assert res.exit_code == 0, res.output
    ours = tmp_path / "ours" / "global_step3_universal" / "zero"
    ref = ref / "zero"
    params = sorted(p.name for p in ref.iterdir() if p.is_dir())
    assert params == sorted(p.name for p in ours.iterdir() if p.is_dir()) and len(params) == 52
    for name in params:
        for f in sorted(p.name for p in (ref / name).iterdir()):
            a = torch.load(ref / name / f, weights_only=False)
            b = torch.load(ours / name / f, weights_only=False)
            if f == "step.pt":
                assert float(a) == float(b) == 3.0
                continue
            assert {k: v for k, v in a.items() if k != "param"} == {k: v for k, v in b.items() if k != "param"}, name
            assert torch.equal(a["param"].detach(), b["param"]), (name, f)
    a = torch.load(ref / "optimizer_state.pt", weights_only=False)
    b = torch.load(ours / "optimizer_state.pt", weights_only=False)
    assert a["param_groups"] == b["param_groups"] and a["clip_grad"] == b["clip_grad"]
    # the vocabulary is cut to the true 1001 rows, as DeepSpeed's converter does
    assert torch.load(ours / "tied_modules.embed.word_embeddings.weight" / "fp32.pt")["param"].shape[0] == 1001


def test_missing_shard_is_refused_naming_the_file(runs, tmp_path):
    import shutil
    src = tmp_path / "ckpt"
    shutil.copytree(runs / "gpt2-2-bf16" / "ckpt", src)
    gone = src / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    res = _cli("merge", str(src), str(tmp_path / "out"), "--format", "ds-universal")
    assert res.exit_code != 0 and str(gone) in res.output and "--weights model" in res.output
    # 16-bit weights still read; asking for the optimizer names the file and the way out
    ckpt = open_checkpoint(str(src), ReadOptions(weights="model"))
    with pytest.raises(CkptError, match="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing.*--no-optimizer"):
        ckpt.optimizer.slots["exp_avg"]
    assert not (tmp_path / "out").exists()


def test_ds_universal_refusals(tmp_path):
    res = _cli("reshard", str(MDS / "checkpoint"), str(tmp_path / "tp2"), "--tp", "2", "--format", "ds-universal")
    assert res.exit_code != 0 and "ckptool merge SRC DST --format ds-universal" in res.output
    res = _cli("merge", str(MDS / "checkpoint"), str(tmp_path / "megatron"))
    assert res.exit_code == 0, res.output
    res = _cli("merge", str(tmp_path / "megatron"), str(tmp_path / "u"), "--format", "ds-universal")
    assert res.exit_code != 0 and "no DeepSpeed names" in res.output  # carried, but Megatron's names
    res = _cli("merge", str(tmp_path / "megatron"), str(tmp_path / "u"), "--format", "ds-universal", "--no-optimizer")
    assert res.exit_code != 0 and "cannot be written --no-optimizer" in res.output
    assert not (tmp_path / "u").exists() and not (tmp_path / "tp2").exists()
    assert open_checkpoint(str(MDS / "checkpoint"), ReadOptions(optimizer=False)).optimizer is None


def test_moment_of_the_wrong_size_is_refused_naming_the_file(runs, tmp_path):
    import shutil
    src = tmp_path / "ckpt"
    shutil.copytree(runs / "gpt2-2-fp32" / "ckpt", src)
    shard = src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    tree = torch.load(shard, weights_only=False)
    state = tree["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["exp_avg_sq"] = state["exp_avg_sq"][:-7].clone()
    torch.save(tree, shard)
    ckpt = open_checkpoint(str(src))  # the weights do not need the moments
    assert ckpt.tensors["embed.word"].load().shape[0] == 1001
    with pytest.raises(CkptError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: group 0 exp_avg_sq holds "
                                        ".*--no-optimizer"):
        ckpt.optimizer.slots["master"]
    res = _cli("merge", str(src), str(tmp_path / "out"), "--format", "ds-universal")
    assert res.exit_code != 0 and "exp_avg_sq holds" in res.output and not (tmp_path / "out").exists()


def test_synthetic_megatron_module_names_tp2_dp3_bf16_optimizer(tmp_path):
    """Synthetic (test_deepspeed's deepspeed.md 1.3/1.4 writer): Megatron-DeepSpeed --no-pipeline-parallel
    names, TP 2, DP 3, BF16_Optimizer partitions with padding kept, moments x/4 and x*x of the masters.
    The moment slots must be exactly those functions of the master slot (any misplaced element shows),
    and the universal files the TP-merged tensors with DeepSpeed's merge facts."""
    from test_deepspeed import _args, _legacy_module_tp, _rand_gpt, _write_zero12
    t = _rand_gpt(h=8, heads=2, vocab=16)
    src = tmp_path / "src"
    tag = src / "global_step7"
    tag.mkdir(parents=True)
    (src / "latest").write_text("global_step7")
    ranks = [_legacy_module_tp(t, mp, 2, heads=2) for mp in range(2)]
    for mp in range(2):
        _write_zero12(tag, ranks[mp], mp, 3, "bf16_", None, True,
                      {"args": _args(tp=2), "iteration": 7, "checkpoint_version": 3.0, "global_steps": 7})
    ckpt = open_checkpoint(str(src))
    opt = ckpt.optimizer
    assert opt.kind == "deepspeed-bf16" and opt.step == 7
    assert opt.param_groups[0].hyper == {"lr": 1e-3, "weight_decay": 0.1}
    assert sorted(opt.param_groups[0].names) == sorted(ckpt.tensors)
    with load_scope():
        for n in ckpt.tensors:
            m = opt.slots["master"][n].load()
            assert torch.equal(opt.slots["exp_avg"][n].load(), m * 0.25), n
            assert torch.equal(opt.slots["exp_avg_sq"][n].load(), m * m), n
    res = _cli("merge", str(src), str(tmp_path / "u"), "--format", "ds-universal")
    assert res.exit_code == 0, res.output
    zero = tmp_path / "u" / "global_step7_universal" / "zero"
    p = "language_model.encoder.layers.1."
    expect = {  # engine name -> (TP-merged master, merge facts the loader reads)
        p + "self_attention.query_key_value.weight": (torch.cat([r[p + "self_attention.query_key_value.weight"]
                                                                 for r in ranks]), {"cat_dim": 0}),
        p + "self_attention.dense.weight": (t["1.o"], {"cat_dim": 1}),
        p + "mlp.dense_4h_to_h.weight": (t["1.down"], {"cat_dim": 1}),
        p + "mlp.dense_h_to_4h.bias": (t["1.upb"], {"cat_dim": 0}),
        p + "input_layernorm.weight": (t["1.ln1.w"], {}),
        "language_model.embedding.word_embeddings.weight": (t["word"], {"cat_dim": 0, "vocab_tensor": True}),
    }
    for name, (want, facts) in expect.items():
        for f, fn in (("fp32", lambda x: x), ("exp_avg", lambda x: x * 0.25), ("exp_avg_sq", lambda x: x * x)):
            got = torch.load(zero / name / f"{f}.pt", weights_only=False)
            assert {k: v for k, v in got.items() if k != "param"} == facts, name
            assert torch.equal(got["param"], fn(want.float())), (name, f)
    assert len([d for d in zero.iterdir() if d.is_dir()]) == len(ranks[0])


def test_framework_objects_pickled_without_init_are_written_back_loadable(tmp_path):
    """DeepSpeed's DynamicLossScaler is pickled as NEWOBJ (no __init__ call); its stand-in must be
    written back the same way, or torch.load calls DynamicLossScaler() without its arguments."""
    if not HAVE_DS:
        pytest.skip("the deepspeed package cannot be imported")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from ckptool.io.torchfile import StreamingTorchWriter, load_torch_file
    scaler = DynamicLossScaler(init_scale=512.0, scale_window=100, min_scale=1.0, delayed_shift=2,
                               consecutive_hysteresis=False)
    torch.save({"loss_scaler": scaler, "t": torch.arange(3.0)}, tmp_path / "a.pt")
    tree = load_torch_file(tmp_path / "a.pt")
    assert type(tree["loss_scaler"]).__name__ == "DynamicLossScaler"  # an inert stand-in
    w = StreamingTorchWriter(tmp_path / "b.pt", tree)
    for ps in w.pending:
        w.write(ps)
    w.finish()
    back = torch.load(tmp_path / "b.pt", weights_only=False)
    assert isinstance(back["loss_scaler"], DynamicLossScaler)
    assert back["loss_scaler"].cur_scale == 512.0 and back["loss_scaler"].scale_window == 100
    assert torch.equal(back["t"], torch.arange(3.0))


@pytest.mark.parametrize("case", ["gpt2-1-bf16", "gpt2-3-bf16"])
def test_universal_writer_reads_each_optimizer_byte_once_in_parameter_sized_reads(runs, case, tmp_path,
                                                                                 monkeypatch):
    """Streaming, measured: writing ds-universal reads every master and moment element once (plus
    ZeRO-3's per-rank padding), one parameter at a time, so memory stays near one parameter."""
    from ckptool.formats.deepspeed.universal import write_ds_universal
    from ckptool.config import Layout
    ckpt = open_checkpoint(str(runs / case / "ckpt"))
    opt = ckpt.optimizer
    sizes = [t.nbytes for slot in opt.slots.values() for t in slot.values()]
    reads = count_tensor_reads(monkeypatch)
    write_ds_universal(ckpt, tmp_path / "u", Layout(1, 1))
    frozen_moments = 2 * opt.slots["exp_avg"]["embed.pos"].nbytes  # zeros, never read
    frozen_bf16 = opt.slots["master"]["embed.pos"].nbytes // 2  # its master is the 16-bit weight
    assert sum(reads) <= sum(sizes) - frozen_moments - frozen_bf16 + 3 * 4 * 2 * len(ckpt.tensors)
    assert sum(reads) >= sum(sizes) - frozen_moments - frozen_bf16
    assert max(reads) <= max(t.nbytes for t in opt.slots["master"].values())


def _pipe_run_with_optimizer(root, qkv):
    """Synthetic Megatron-DeepSpeed pipeline run (TP 2, new era, untied head, true vocab 13 of 16 rows)
    with ZeRO-1 shards at DP 2 under pipe names; moments x/4 and x*x of the masters."""
    from test_deepspeed import _args, _rand_gpt, _write_pipeline, _write_zero12
    t = _rand_gpt(h=8, heads=2, vocab=16, seed=7)
    t["head"] = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    root.mkdir()
    _write_pipeline(root, t, "new", True, qkv)
    tag = root / "global_step5"
    for r in range(2):
        layers = {idx: torch.load(tag / f"layer_{idx:02d}-model_{r:02d}-model_states.pt") for idx in (1, 2, 3, 4, 5)}
        params = {f"{idx}.{k}": v for idx, sd in layers.items() for k, v in sd.items()}
        args = _args(tp=2)
        args.untie_embeddings_and_output_weights, args.vocab_size = True, 13
        _write_zero12(tag, params, r, 2, "bf16_", 1, False,
                      {"args": args, "iteration": 5, "checkpoint_version": 3.0, "mp_world_size": 2,
                       "global_steps": 5, "module": None})
    return t


def test_synthetic_pipeline_untied_head_vocab_cut_and_split_qkv_refused(tmp_path):
    t = _pipe_run_with_optimizer(tmp_path / "src", "grouped")
    ckpt = open_checkpoint(str(tmp_path / "src"))
    assert ckpt.optimizer.kind == "deepspeed-zero1" and ckpt.config.vocab_size == 13
    res = _cli("merge", str(tmp_path / "src"), str(tmp_path / "u"), "--format", "ds-universal")
    assert res.exit_code == 0, res.output
    zero = tmp_path / "u" / "global_step5_universal" / "zero"
    head = torch.load(zero / "5.lm_head.weight" / "exp_avg.pt", weights_only=False)
    assert {k: v for k, v in head.items() if k != "param"} == {"cat_dim": 0, "vocab_tensor": True}
    assert torch.equal(head["param"], t["head"][:13] * 0.25)  # cut to the true vocabulary
    word = torch.load(zero / "1.word_embeddings.weight" / "fp32.pt", weights_only=False)
    assert torch.equal(word["param"], t["word"][:13]) and word["vocab_tensor"]
    down = torch.load(zero / "2.mlp.dense_4h_to_h.weight" / "exp_avg_sq.pt", weights_only=False)
    assert down["cat_dim"] == 1 and torch.equal(down["param"], t["0.down"] * t["0.down"])
    # [Q|K|V]-packed ranks: the universal loader's chunking would mix heads, so ckptool refuses
    _pipe_run_with_optimizer(tmp_path / "split", "split")
    res = _cli("merge", str(tmp_path / "split"), str(tmp_path / "u2"), "--format", "ds-universal",
               "--qkv-layout", "split")
    assert res.exit_code != 0 and "not per query group" in res.output and not (tmp_path / "u2").exists()


# --- runs with no canonical GPT form: the engine's own parameter names --------------------------------

def _tensor_files(folder: Path) -> dict:
    """{param name: {file: loaded}} of a universal zero/ folder."""
    return {d.name: {f.name: torch.load(f, weights_only=False) for f in d.iterdir()}
            for d in folder.iterdir() if d.is_dir()}


@pytest.mark.parametrize("case", OWN)
def test_own_names_universal_files_hold_the_live_engines_values(runs, case):
    """Every trainable parameter's fp32 master and Adam moments under its engine name, equal bit for bit
    to what the saving engine held; the frozen parameter as fp32.pt only; no tied alias, no buffer."""
    truth = torch.load(runs / case / "truth.pt", weights_only=False)
    out = runs / case / "universal"
    tag = (out / "latest_universal").read_text()
    got = _tensor_files(out / tag / "zero")
    (frozen, value), = truth["frozen"].items()
    assert sorted(got) == sorted([*truth["params"], frozen])
    for name, states in truth["params"].items():
        assert sorted(got[name]) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        assert float(got[name]["step.pt"]) == 2.0
        for key, want in states.items():
            assert {k: v for k, v in got[name][f"{key}.pt"].items() if k != "param"} == {"cat_dim": 0}
            assert torch.equal(got[name][f"{key}.pt"]["param"], want), (name, key)
    assert list(got[frozen]) == ["fp32.pt"] and torch.equal(got[frozen]["fp32.pt"]["param"], value.float())
    ms = torch.load(out / tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert [list(g) for g in ms["param_shapes"]] == [list(truth["params"])]
    assert ms["global_steps"] == 2 and ms["dp_world_size"] == 2 and "universal_checkpoint_info" not in ms
    said = (runs / case / "merge.txt").read_text()
    assert ("1 buffers not written (scale)" in said) == case.startswith("plain")  # BERT's buffers are not saved


def test_own_names_equal_deepspeeds_own_converter(runs, tmp_path):
    """ds_to_universal.py --inject_missing_state (installed deepspeed) on the ZeRO-1 plain run: the same
    tensor files bit for bit. DeepSpeed also copies every `module` entry the engine saved as fp32.pt,
    the tied head and the buffer too, which a universal load never reads; ckptool leaves them out."""
    if not HAVE_DS:
        pytest.skip("the deepspeed package cannot be imported")
    ref = tmp_path / "ref" / "global_step2_universal"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          str(runs / "plain-1-fp32" / "ckpt" / "global_step2"), "--output_folder", str(ref),
                          "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    mine = runs / "plain-1-fp32" / "universal" / "global_step2_universal" / "zero"
    theirs, ours = _tensor_files(ref / "zero"), _tensor_files(mine)
    assert sorted(set(theirs) - set(ours)) == ["head.weight", "scale"] and set(ours) <= set(theirs)
    for name, files in ours.items():
        assert sorted(files) == sorted(theirs[name]), name
        for f, b in files.items():
            a = theirs[name][f]
            if f == "step.pt":
                assert float(a) == float(b) == 2.0
                continue
            assert {k: v for k, v in a.items() if k != "param"} == {k: v for k, v in b.items() if k != "param"}
            assert torch.equal(a["param"], b["param"]), (name, f)
    a = torch.load(ref / "zero" / "optimizer_state.pt", weights_only=False)
    b = torch.load(mine / "optimizer_state.pt", weights_only=False)
    assert a["param_groups"] == b["param_groups"] and a["clip_grad"] == b["clip_grad"]


def test_own_names_through_the_api_and_what_is_refused(runs, tmp_path):
    import shutil
    import ckptool
    src = runs / "plain-1-fp32" / "ckpt"
    result = ckptool.merge(src, tmp_path / "api", format="ds-universal")
    assert result.kind == "deepspeed-module" and result.checkpoint is None
    assert result.summary.optimizer["step"] == 2 and any("scale" in w for w in result.warnings)
    refused = {  # arguments -> what the one error line says
        ("merge",): "not Megatron's and no config.json sits beside the checkpoint (give --hf-config PATH "
                    "(the model's config.json), or use `ckptool merge SRC DST --format ds-universal`)",
        ("merge", "--format", "torch_dist"): "--format ds-universal",
        ("merge", "--format", "ds-universal", "--no-optimizer"): "cannot be written --no-optimizer",
        ("merge", "--format", "ds-universal", "--dtype", "bf16"): "stores fp32 masters and moments",
        ("reshard", "--tp", "2", "--format", "ds-universal"): "has no layout of its own",
        ("to-hf",): "--hf-config PATH",
    }
    for (command, *options), says in refused.items():
        res = _cli(command, str(src), str(tmp_path / "out"), *options)
        assert res.exit_code == 2 and says in res.output and "Traceback" not in res.output, (command, res.output)
    res = _cli("merge", str(runs / "bert-2-bf16" / "ckpt"), str(tmp_path / "out"))
    assert res.exit_code == 2 and ("use `ckptool to-hf SRC DST` or `ckptool merge SRC DST --format ds-universal`"
                                   in res.output)
    copy = tmp_path / "ckpt"
    shutil.copytree(runs / "plain-3-bf16" / "ckpt", copy)
    gone = copy / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    gone.unlink()
    res = _cli("merge", str(copy), str(tmp_path / "out"), "--format", "ds-universal")
    assert res.exit_code == 2 and f"{gone} is missing" in res.output
    assert not (tmp_path / "out").exists()


def test_own_names_writer_streams_one_parameter_at_a_time(runs, tmp_path, monkeypatch):
    """ZeRO-3: each master and moment is read once (plus the per-rank padding), in parameter-sized reads."""
    import ckptool
    truth = torch.load(runs / "plain-3-bf16" / "truth.pt", weights_only=False)
    slots = [t for states in truth["params"].values() for t in states.values()]
    frozen = sum(t.numel() * 2 for t in truth["frozen"].values())  # bf16 fragments
    reads = count_tensor_reads(monkeypatch)
    ckptool.merge(runs / "plain-3-bf16" / "ckpt", tmp_path / "u", format="ds-universal")
    exact = sum(t.nbytes for t in slots) + frozen
    assert exact <= sum(reads) <= exact + 3 * 4 * 2 * len(truth["params"]) + frozen
    assert max(reads) <= max(t.nbytes for t in slots)
