"""Optimizer state when expert TP differs from TP, with the real megatron-core (CPU, gloo, 4 processes).

megatron-core trains a Mixtral-like MoE model at TP2 ETP1 EP2 one Adam step (fp32) and saves it as
Megatron-LM does: only the (TP, EP) rank files mp_rank_00_000 and mp_rank_01_001 (megatron.expert_grid),
each with its rank's optimizer.state_dict(), a ChainedOptimizer's [dense, expert] list whose expert part
holds the rank's local experts whole (expert-TP rank 0 of 1). ckptool reads every moment equal to the live
optimizer's, writes it at TP2 ETP1 EP1 (expert TP != TP again, one optimizer) and at TP1 EP2, and
megatron-core resumes each with the next-step loss the source run took (a weights-only resume misses it).
A bf16 run (fp32 masters in each optimizer of the chain) written back at its own layout resumes exactly as
megatron-core resumes its own save.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.io.torchfile import load_torch_file
from ckptool.write_options import WriteOptions
from conftest import copy_run, declare_runs, shared_followups

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

MOE_TOL = 1e-4  # fp32: a layout change only reorders float sums
# target name -> (tp, ep, etp)
TARGETS = {"tp2ep1etp1": (2, 1, 1), "tp1ep2": (1, 2, 1), "tp2ep2etp1": (2, 2, 1)}


HELPER = Path(__file__).resolve().parent / "mcore_moe_helper.py"
GRID = "--tp 2 --ep 2 --etp 1"
# the trainings (in one launch with the other files' megatron-core MoE saves at 4 processes)
TRAINS = declare_runs(HELPER, 4, {"src": f"train {{out}} {GRID} --out {{out}}.pt",
                                  "bf16": f"train {{out}} {GRID} --dtype bf16 --out {{out}}.pt"})


def _next_loss(path) -> float:
    """The second step after the save: the first whose weights the loaded optimizer state moved."""
    return torch.load(str(path) + ".losses")["next"][1]


@shared_followups
def etp_run(framework_runs, d):
    """The trainings copied, ckptool's TARGETS of the fp32 one and a same-layout copy of the bf16 one, and
    megatron-core's resumes (in one launch with the other files' 4-process MoE follow-ups)."""
    grid = GRID
    for name, stem in framework_runs(HELPER, 4, TRAINS).items():
        copy_run(stem, d / name)
    said = []
    for name, (tp, ep, etp) in TARGETS.items():
        api.reshard(d / "src", d / name, tp=tp, ep=ep, etp=etp, warn=said.append)
    api.reshard(d / "bf16", d / "bf16_same", tp=2, ep=2, etp=1, warn=said.append)
    assert not [m for m in said if "optimizer" in m], said
    yield [(HELPER, 4, [f"resume {d / name} --tp {tp} --ep {ep} --etp {etp} --out {d / name}.pt"
                        for name, (tp, ep, etp) in TARGETS.items()]
            + [f"resume {d / 'tp2ep1etp1'} --tp 2 --ep 1 --etp 1 --out {d / 'fresh.pt'} --weights-only",
               f"resume {d / 'bf16_same'} {grid} --dtype bf16 --out {d / 'bf16_same.pt'}",
               f"resume {d / 'bf16'} {grid} --dtype bf16 --out {d / 'bf16_control.pt'}"])]
    return d


@pytest.mark.parametrize("src", ["src", "bf16"])
def test_expert_tp_moments_equal_the_live_optimizers(etp_run, src):
    ck = read_megatron(etp_run / src)
    assert ck.optimizer is not None and not ck.warnings and ck.source.layout.expert_tp == 1
    assert ck.optimizer.kind == {"src": "megatron-fp32", "bf16": "megatron"}[src]
    if src == "bf16":  # each master is checked against its stored weight as it loads
        assert all(m.load().dtype == torch.float32 for m in ck.optimizer.slots["master"].values())
    # every rank's live moments under global names; experts (ETP 1) and replicated tensors are whole
    live = {}
    for _, moments in torch.load(etp_run / f"{src}.pt.moments")["exp_avg"]:
        for name, m in moments.items():
            live.setdefault(name, []).append(m)
    ea = ck.optimizer.slots["exp_avg"]
    for i in range(2):
        assert torch.equal(ea[f"layers.{i}.mlp.router.weight"].load(), live[f"decoder.layers.{i}.mlp.router.weight"][0])
        for e in range(4):
            (fc1, *same1) = live[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            (fc2, *same2) = live[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"]
            assert fc1.shape[0] == 48 and all(torch.equal(fc1, x) for x in same1)  # whole on every rank holding it
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.gate.weight"].load(), fc1[:24])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.up.weight"].load(), fc1[24:])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.down.weight"].load(), fc2)
        # a dense TP-cut weight: the row-parallel output projection, TP rank 0's half then rank 1's
        proj = {t: m[f"decoder.layers.{i}.self_attention.linear_proj.weight"]
                for t, m in torch.load(etp_run / f"{src}.pt.moments")["exp_avg"]}
        assert torch.equal(ea[f"layers.{i}.attn.out.weight"].load(), torch.cat([proj[0], proj[1]], dim=1))
    assert set(ea) == set(ck.tensors)


def test_expert_tp_target_lays_out_each_ranks_shard(etp_run):
    """TP2 ETP1 EP1: one optimizer (no expert parallelism); TP2 ETP1 EP2: only the grid's files, each with
    the chained pair, the expert one holding its EP rank's experts whole; every target reads back the same."""
    src = read_megatron(etp_run / "src").optimizer
    for t in range(2):
        opt = load_torch_file(etp_run / "tp2ep1etp1" / "iter_0000007" / f"mp_rank_{t:02d}" / "model_optim_rng.pt")["optimizer"]
        assert isinstance(opt, dict) and len(opt["state"]) == len(opt["param_groups"][0]["params"]) + \
            len(opt["param_groups"][1]["params"])
    it = etp_run / "tp2ep2etp1" / "iter_0000007"
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    for t in range(2):
        dense, expert = load_torch_file(it / f"mp_rank_{t:02d}_{t:03d}" / "model_optim_rng.pt")["optimizer"]
        (group,) = expert["param_groups"]
        # layer 0's first local expert is global expert 2t: its whole fc2 moment (ETP 1)
        fc2 = expert["state"][group["params"][1]]["exp_avg"].load()
        assert torch.equal(fc2, src.slots["exp_avg"][f"layers.0.mlp.experts.{2 * t}.down.weight"].load())
    for name in TARGETS:
        back = read_megatron(etp_run / name).optimizer
        for slot in ("exp_avg", "exp_avg_sq"):
            assert all(torch.equal(x.load(), back.slots[slot][n].load()) for n, x in src.slots[slot].items()), (name, slot)


@pytest.mark.parametrize("out", list(TARGETS))
def test_expert_tp_run_resumes_at_another_layout(etp_run, out):
    went_on = _next_loss(etp_run / "src.pt")
    gap = abs(_next_loss(etp_run / f"{out}.pt") - went_on)
    fresh = abs(_next_loss(etp_run / "fresh.pt") - went_on)
    print(f"ETP1 TP2 EP2 -> {out}: next-step loss gap {gap:.2e}; weights-only {fresh:.2e}")
    assert gap < MOE_TOL and fresh > 10 * max(gap, 1e-6)


def test_expert_tp_bf16_round_trip_resumes_exactly_as_megatron_core_resumes_its_save(etp_run):
    ours, control = (torch.load(etp_run / f"{n}.pt.losses")["next"] for n in ("bf16_same", "bf16_control"))
    assert ours == control


def test_expert_tp_pipeline_target_reads_back_and_a_missing_distrib_optim_is_refused(etp_run, tmp_path, monkeypatch):
    """TP2 PP2 ETP1 EP2 (the grid per stage) reads back bit for bit; args claiming the distributed optimizer
    without its distrib_optim.pt are refused by name, never mis-read (the distributed optimizer at expert
    TP != TP itself: tests/test_distopt_etp.py)."""
    src = read_megatron(etp_run / "src").optimizer
    api.reshard(etp_run / "src", tmp_path / "pp2", tp=2, pp=2, ep=2, etp=1, warn=lambda m: None)
    back = read_megatron(tmp_path / "pp2").optimizer
    for slot in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(x.load(), back.slots[slot][n].load()) for n, x in src.slots[slot].items()), slot
    from ckptool.formats.megatron import distopt as megatron_distopt
    monkeypatch.setattr(megatron_distopt, "uses_distributed_optimizer", lambda *a: True)
    with pytest.raises(CkptError, match=r"mp_rank_00/model_optim_rng\.pt: the run used the distributed optimizer but "
                                        r".*mp_rank_00/distrib_optim\.pt is missing"):
        read_megatron(etp_run / "tp2ep1etp1")


def test_slot_shards_follow_the_expert_grid_at_expert_tp_above_one():
    """TP4 ETP2 EP2: Megatron-LM saves files (0, 0), (1, 0), (2, 1), (3, 1); EP rank 1's experts are cut at
    expert-TP ranks 0 and 1 in files (2, 1) and (3, 1), and each slot is gathered from there."""
    from ckptool.formats.megatron.checkpoint import expert_grid
    from ckptool.formats.megatron.optim import RankParam
    from ckptool.formats.megatron.training import slot_shards
    from ckptool.lazy import Const
    grid = expert_grid(4, 2, 2)
    assert sorted(grid) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    params, values = {}, {}
    for t, e in grid:
        roles = ["proj.weight", f"experts.{2 * e}.fc2.weight", f"experts.{2 * e + 1}.fc2.weight"]
        params[(t, 0, e)] = [RankParam(f"k{i}", r, 0, Const(torch.zeros(1))) for i, r in enumerate(roles)]
        values[(t, 0, e)] = [Const(torch.tensor([float(100 * t + 10 * e + i)])) for i in range(3)]
    shards, _ = slot_shards(values, params, 4, grid, 2)
    got = {k: [int(v.load().item()) for v in vs] for k, vs in shards.items()}
    assert got == {("proj.weight", 0): [0, 100, 210, 310],
                   ("experts.0.fc2.weight", 0): [1, 101], ("experts.1.fc2.weight", 0): [2, 102],
                   ("experts.2.fc2.weight", 0): [211, 311], ("experts.3.fc2.weight", 0): [212, 312]}


@pytest.mark.parametrize("dialect, grouped", [("mcore", False), ("mcore-te", True)])
def test_expert_tp_2_of_tp_4_is_written_on_its_grid_and_reads_back(tmp_path, dialect, grouped):
    """TP4 ETP2 EP2 (a tiny Mixtral with 4 KV heads, distinct random moments): the writer cuts each expert's
    slots at expert-TP rank t % 2 into the grid's files only, the reader gathers them back bit for bit;
    SequentialMLP experts and TEGroupedMLP (--moe-grouped-gemm: fc-major parameter order) alike."""
    from ckptool.config import Layout
    from ckptool.formats.megatron.checkpoint import write_megatron
    ck, slots = mixtral_with_moments(tmp_path)
    write_megatron(ck, tmp_path / "out", Layout(tp=4, ep=2, etp=2),
                   WriteOptions(dialect=dialect, moe_grouped_gemm=grouped),
                   warn=lambda m: None)
    it = tmp_path / "out" / "iter_0000000"
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001"]
    # file (2, 1): EP rank 1's first local expert (global 2), fc2 cut over expert TP along its input: half 0
    dense, expert = load_torch_file(it / "mp_rank_02_001" / "model_optim_rng.pt")["optimizer"]
    # (SequentialMLP: expert by expert, fc1 then fc2; TEGroupedMLP: every local expert's fc1, then every fc2)
    fc2 = expert["state"][expert["param_groups"][0]["params"][2 if grouped else 1]]["exp_avg"].load()
    assert torch.equal(fc2, slots["exp_avg"]["layers.0.mlp.experts.2.down.weight"].load()[:, :24])
    back = read_megatron(tmp_path / "out")
    assert back.source.layout.expert_tp == 2 and not [w for w in back.warnings if "optimizer" in w]
    for slot in ("exp_avg", "exp_avg_sq"):
        for n, t in slots[slot].items():
            if n not in ("embed.word", "output.weight"):  # padded for TP4 on write
                assert torch.equal(back.optimizer.slots[slot][n].load(), t.load()), (slot, n)


def mixtral_with_moments(tmp_path):
    """A tiny Mixtral (4 KV heads, 4 experts) built by transformers, with distinct random Adam moments and
    Megatron's two weight-decay groups: (checkpoint, slots) for writing expert layouts beyond the helper's model."""
    import transformers
    from ckptool.formats.registry import open_checkpoint
    from ckptool.lazy import Const
    from ckptool.state import OptimizerState, ParamGroup
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
        num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "hf")
    ck = open_checkpoint(tmp_path / "hf")
    gen = torch.Generator().manual_seed(0)
    slots = {s: {n: Const(torch.randn(t.shape, generator=gen)) for n, t in ck.tensors.items()} for s in ("exp_avg", "exp_avg_sq")}
    hyper = dict(lr=1e-3, lr_mult=1.0, is_expert_parallel=False)
    groups = [ParamGroup([n for n, t in ck.tensors.items() if len(t.shape) > 1], dict(hyper, wd_mult=1.0, weight_decay=0.01)),
              ParamGroup([n for n, t in ck.tensors.items() if len(t.shape) == 1], dict(hyper, wd_mult=0.0, weight_decay=0.0))]
    ck.optimizer = OptimizerState("megatron-fp32", slots, step=3, param_groups=groups)
    return ck, slots
