"""Param groups beyond weight decay, and chained optimizers, with the real megatron-core (CPU, gloo).

1. --decoupled-lr and an lr_mult override: megatron-core 0.16 makes three groups (default, no weight
   decay with lr_mult, embedding + output at the decoupled learning rate); ckptool ties every parameter
   to its group, carries the groups with their canonical names, reshards TP2 -> TP1 and -> TP1 PP3, and a
   megatron-core run loads each (its optimizer checks each group's size and key) and trains on like the
   run that went on at TP2.
2. MoE: at EP 2 (here bf16 with fp32 masters; the EP 1 run is fp32) megatron-core saves a
   ChainedOptimizer's [dense, expert] list per rank; ckptool reads the experts' moments under their
   global names and writes them at EP 1, EP 2 and TP 2; megatron-core loads the EP 1 and EP 2 outputs
   and takes the next steps with the losses the source run took (MoE training at TP > 1 needs sequence
   parallelism, whose reduce-scatter gloo lacks: TP 2 is checked by reading back).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.megatron import groups as megatron_groups, optim as megatron_optim
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.formats.registry import open_checkpoint
from ckptool.io.torchfile import load_torch_file
from ckptool.lazy import Const
from conftest import copy_run, declare_runs, shared_followups

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

STEPS, MORE = 3, 2
DECOUPLED, LR_MULT = 3e-3, 0.5
# fp32 runs: changing EP / TP only reorders float sums (measured gaps below 1e-5); the weights-only
# resume (fresh Adam) is off by far more
MOE_TOL = 1e-4


def _test_resume():
    import test_resume
    return test_resume


# --- 1. decoupled learning rate and lr_mult -------------------------------------------------------

FLAGS = f"--arch llama --decoupled-lr {DECOUPLED} --lr-mult {LR_MULT}"
# the trainings at TP2 and at TP1 x DP2 with the distributed optimizer (in one launch with the other files'
# mcore_train_helper trainings at 2 processes; test_quick_inspect reads "a2" too)
TRAINS = declare_runs(Path(__file__).resolve().parent / "mcore_train_helper.py", 2, {
    "a2": f"train {{out}} --tp 2 --steps {STEPS} --more {MORE} {FLAGS} --out {{out}}.pt",
    "a": f"train {{out}} --tp 1 --dp 2 --distributed-optimizer --steps {STEPS} --more {MORE} {FLAGS} --out {{out}}.pt"})


@shared_followups
def grouped(framework_runs, d):
    """The TP2 training copied, ckptool's TP1 (carried, weights only) and PP3 outputs, megatron-core's resumes (in
    one launch per process count with the other files' follow-ups of the helper)."""
    R = _test_resume()
    flags = FLAGS
    copy_run(framework_runs(R.HELPER, 2, {"a2": TRAINS["a2"]})["a2"], d / "a2")
    R.ckptool("reshard", d / "a2", d / "b1", "--tp", "1")
    R.ckptool("reshard", d / "a2", d / "w1", "--tp", "1", "--no-optimizer")
    # PP 3 (one layer a stage): the middle stage holds neither embedding nor output, yet megatron-core
    # 0.16 lists the decoupled group there too, empty
    R.ckptool("reshard", d / "a2", d / "p3", "--tp", "1", "--pp", "3")
    yield [(R.HELPER, 1, [f"resume {d}/b1 --tp 1 --more {MORE} {flags} --out {d}/b1.pt",
                          f"resume {d}/w1 --tp 1 --more {MORE} {flags} --out {d}/w1.pt --weights-only"]),
           (R.HELPER, 3, [f"resume {d}/p3 --tp 1 --pp 3 --more {MORE} {flags} --out {d}/p3.pt"])]
    return d


def test_decoupled_lr_and_lr_mult_groups_are_tied_by_name(grouped):
    opt = open_checkpoint(grouped / "a2").optimizer
    by_key = {(g.hyper["wd_mult"], g.hyper["lr_mult"], g.hyper["max_lr"]): g for g in opt.param_groups}
    assert len(opt.param_groups) == 3 and set(by_key) == {(1.0, 1.0, 1e-2), (0.0, LR_MULT, 1e-2), (1.0, 1.0, DECOUPLED)}
    assert sorted(by_key[(1.0, 1.0, DECOUPLED)].names) == ["embed.word", "output.weight"]
    no_wd = by_key[(0.0, LR_MULT, 1e-2)].names
    assert no_wd and all(n.endswith(("norm.weight", ".bias")) for n in no_wd)
    default = by_key[(1.0, 1.0, 1e-2)].names
    assert "layers.0.attn.q.weight" in default and "embed.word" not in default
    # inspect --json shows each group's learning-rate bounds and multiplier
    from ckptool.describe import describe_optimizer
    shown = describe_optimizer(open_checkpoint(grouped / "a2"))["param_groups"]
    assert [(g["tensors"], g["lr_mult"], g["max_lr"]) for g in shown] == \
        [(len(g.names), g.hyper["lr_mult"], g.hyper["max_lr"]) for g in opt.param_groups]
    # the TP1 output lists the same groups in megatron-core's order, each with its hyperparameters
    out = load_torch_file(grouped / "b1" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]
    src = load_torch_file(grouped / "a2" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]
    strip = [{k: v for k, v in g.items() if k != "params"} for g in src["optimizer"]["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in out["optimizer"]["param_groups"]] == strip


@pytest.mark.parametrize("out", ["b1", "p3"])
def test_decoupled_lr_run_resumes_after_reshard(grouped, out):
    R = _test_resume()
    went_on = R.losses(grouped / "a2.pt")[STEPS:]
    gap = (R.losses(grouped / f"{out}.pt") - went_on).abs().max().item()
    gap_weights_only = (R.losses(grouped / "w1.pt") - went_on).abs().max().item()
    print(f"decoupled-lr TP2 -> {out}: loss gap carried {gap:.2e}, weights-only (TP1) {gap_weights_only:.2e}")
    assert gap < R.LOSS_TOL and gap_weights_only > 10 * max(gap, 1e-5)
    if out == "p3":
        middle = load_torch_file(grouped / "p3" / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt")
        assert [len(g["params"]) for g in middle["optimizer"]["optimizer"]["param_groups"]][2] == 0


@shared_followups
def grouped_distributed(framework_runs, d):
    """The same groups under megatron-core's DistributedOptimizer (TP1 x DP2, distrib_optim.pt): its
    saved groups list no parameters, so the traits alone place each parameter (the resumes in one launch with
    the other files' 2-process follow-ups of the helper)."""
    R = _test_resume()
    flags = FLAGS
    copy_run(framework_runs(R.HELPER, 2, {"a": TRAINS["a"]})["a"], d / "a")
    R.ckptool("reshard", d / "a", d / "b2", "--tp", "2")
    R.ckptool("reshard", d / "a", d / "c1", "--tp", "1", "--distributed-optimizer", "--dp", "2")
    yield [(R.HELPER, 2, [
        f"resume {d}/b2 --tp 2 --more {MORE} {flags} --out {d}/b2.pt",
        f"resume {d}/c1 --tp 1 --dp 2 --distributed-optimizer --more {MORE} {flags} --out {d}/c1.pt",
        f"resume {d}/a --tp 1 --dp 2 --distributed-optimizer --more {MORE} {flags} --out {d}/control.pt"])]
    return d


def test_distributed_optimizer_groups_are_placed_by_their_traits(grouped_distributed):
    """Read: three groups with their names. TP2 (non-distributed) resumes like the run that went on;
    ckptool's own distrib_optim.pt at TP1 x DP2 resumes exactly as megatron-core resumes its own save,
    and both exactly as the run that went on. (They drifted by 1.1e-3 at the second step while the
    helper's group-key fix reached megatron-core's optimizer.py only, not distrib_optimizer.py's own
    copy of the key tuple: its load merged the decoupled group into the default one.)"""
    R, d = _test_resume(), grouped_distributed
    opt = open_checkpoint(d / "a").optimizer
    assert opt.kind == "megatron-distributed"
    names = {g.hyper["max_lr"]: sorted(g.names) for g in opt.param_groups if g.hyper["lr_mult"] == 1.0}
    assert names[DECOUPLED] == ["embed.word", "output.weight"] and len(opt.param_groups) == 3
    went_on = R.losses(d / "a.pt")[STEPS:]
    gap = (R.losses(d / "b2.pt") - went_on).abs().max().item()
    print(f"distributed decoupled-lr TP1xDP2 -> TP2: loss gap {gap:.2e}")
    assert gap < R.LOSS_TOL
    assert torch.equal(R.losses(d / "c1.pt"), R.losses(d / "control.pt"))
    assert torch.equal(R.losses(d / "c1.pt"), went_on)


def _param(key, shape, role):
    return megatron_optim.RankParam(key, role, 0, Const(torch.zeros(shape)))


def test_groups_no_rule_can_tell_apart_are_refused_naming_lr_mult():
    """Two weight-decay groups differing only in lr_mult (a run's own scale-lr condition): which weight
    sits in which group is nowhere in the checkpoint, so nothing is tied."""
    params = [_param("a.weight", (2, 2), "proj.weight"), _param("b.weight", (2, 2), "fc2.weight"),
              _param("n.weight", (2,), "attn_norm.weight")]
    groups = [dict(wd_mult=1.0, lr_mult=1.0, params=[0]), dict(wd_mult=1.0, lr_mult=0.1, params=[1]),
              dict(wd_mult=0.0, lr_mult=1.0, params=[2])]
    with pytest.raises(CkptError, match=r"w\.pt: optimizer groups hold \[1, 1, 1\].*lr_mult \[0\.1\].*--no-optimizer"):
        megatron_optim._tie_groups(groups, params, "w.pt", megatron_optim.GroupRule())
    # the same groups with the lr_mult group holding the norms instead: the traits single each one out
    groups = [dict(wd_mult=1.0, lr_mult=1.0, params=[0, 1]), dict(wd_mult=0.0, lr_mult=0.1, params=[2])]
    assert megatron_optim._tie_groups(groups, params, "w.pt", megatron_optim.GroupRule()) == [[0, 1], [2]]


# --- 2. chained optimizers: MoE at EP > 1 ---------------------------------------------------------

MOE_HELPER = Path(__file__).resolve().parent / "mcore_moe_helper.py"
# the MoE trainings (in one launch with the other files' megatron-core MoE trainings at 2 processes)
MOE_TRAINS = declare_runs(MOE_HELPER, 2, {"ep1": "train {out} --tp 1 --ep 1 --out {out}.pt",
                                          "ep2": "train {out} --tp 1 --ep 2 --dtype bf16 --out {out}.pt",
                                          # sigmoid routing with an expert bias (--moe-router-enable-expert-bias):
                                          # a buffer, in no group
                                          "bias": "train {out} --tp 1 --ep 2 --arch biased --dtype bf16 --out {out}.pt"})


def _next_loss(path: Path) -> float:
    """The loss of the second step after the save: the first one whose weights the loaded optimizer
    state moved (the first step's loss depends on the weights alone)."""
    first, second = torch.load(str(path) + ".losses")["next"]
    return second


@shared_followups
def moe_runs(framework_runs, d):
    """The MoE trainings copied, ckptool's outputs at other EP / TP, megatron-core's resumes (in one launch with the
    other files' 2-process MoE follow-ups)."""
    for name, stem in framework_runs(MOE_HELPER, 2, MOE_TRAINS).items():
        copy_run(stem, d / name)
    said = []
    api.reshard(d / "ep2", d / "to_ep1", tp=1, ep=1, warn=said.append)
    api.reshard(d / "ep1", d / "to_ep2", tp=1, ep=2, warn=said.append)
    api.reshard(d / "ep2", d / "to_tp2", tp=2, ep=1, warn=said.append)
    api.reshard(d / "bias", d / "bias_to_ep1", tp=1, ep=1, warn=said.append)
    # the expert bias across tensor-parallel ranks: TP 2 (resumed below), TP 2 x EP 2 (4 ranks: files checked), and
    # the TP 2 output merged back to one rank
    api.reshard(d / "bias", d / "bias_to_tp2", tp=2, ep=1, warn=said.append)
    api.reshard(d / "bias", d / "bias_to_tp2ep2", tp=2, ep=2, warn=said.append)
    api.merge(d / "bias_to_tp2", d / "bias_merged", warn=said.append)
    assert not [m for m in said if "optimizer" in m], said
    yield [(MOE_HELPER, 2, [
        f"resume {d / 'to_ep1'} --tp 1 --ep 1 --dtype bf16 --out {d / 'to_ep1.pt'}",
        f"resume {d / 'to_ep2'} --tp 1 --ep 2 --out {d / 'to_ep2.pt'}",
        f"resume {d / 'to_ep1'} --tp 1 --ep 1 --dtype bf16 --out {d / 'fresh.pt'} --weights-only",
        f"resume {d / 'bias_to_ep1'} --tp 1 --ep 1 --arch biased --dtype bf16 --out {d / 'bias_to_ep1.pt'}",
        f"resume {d / 'bias_to_tp2'} --tp 2 --ep 1 --arch biased --dtype bf16 --out {d / 'bias_to_tp2.pt'}"])]
    return d


@pytest.mark.parametrize("src", ["ep1", "ep2"])
def test_expert_moments_are_read_under_global_names(moe_runs, src):
    """EP 1: one optimizer, experts in parameter order; EP 2: [dense, expert] per rank, each rank's
    expert optimizer holding its local experts. Every moment equals the live optimizer's."""
    ck = read_megatron(moe_runs / src)
    assert ck.optimizer is not None and not ck.warnings
    # EP 1 trained in fp32 (the weights are the masters), EP 2 in bf16 (fp32 masters in each optimizer
    # of the chain, each checked against its weight as it loads)
    assert ck.optimizer.kind == {"ep1": "megatron-fp32", "ep2": "megatron"}[src]
    if src == "ep2":
        assert all(m.load().dtype == torch.float32 for m in ck.optimizer.slots["master"].values())
    live = {}
    for _, moments in torch.load(moe_runs / f"{src}.pt.moments")["exp_avg"]:
        live.update(moments)
    ea = ck.optimizer.slots["exp_avg"]
    for i in range(2):
        assert torch.equal(ea[f"layers.{i}.mlp.router.weight"].load(), live[f"decoder.layers.{i}.mlp.router.weight"])
        for e in range(4):
            fc1 = live[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.gate.weight"].load(), fc1[:24])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.up.weight"].load(), fc1[24:])
            assert torch.equal(ea[f"layers.{i}.mlp.experts.{e}.down.weight"].load(),
                               live[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"])
    assert set(ea) == set(ck.tensors)
    # one canonical group per megatron-core key: experts join the weight-decay group whatever the EP
    groups = {g.hyper["wd_mult"]: g.names for g in ck.optimizer.param_groups}
    assert len(ck.optimizer.param_groups) == 2 and "layers.1.mlp.experts.3.down.weight" in groups[1.0]


def test_chained_optimizer_is_written_per_expert_parallel_rank(moe_runs):
    src = read_megatron(moe_runs / "ep1").optimizer
    for e in range(2):
        opt = load_torch_file(moe_runs / "to_ep2" / "iter_0000007" / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt")["optimizer"]
        assert isinstance(opt, list) and len(opt) == 2
        dense, expert = opt
        assert [g["is_expert_parallel"] for g in dense["param_groups"]] == [False, False]
        (group,) = expert["param_groups"]
        assert group["is_expert_parallel"] and group["wd_mult"] == 1.0 and len(group["params"]) == 2 * 2 * 2
        # this rank's first local expert of layer 0 is global expert 2e: its fc2 moment, by the tie
        fc2 = expert["state"][group["params"][1]]["exp_avg"].load()
        assert torch.equal(fc2, src.slots["exp_avg"][f"layers.0.mlp.experts.{2 * e}.down.weight"].load())
    # and back, from EP 2 and from TP 2 (megatron-core trains MoE at TP > 1 only with sequence
    # parallelism, which gloo cannot run: that layout is checked here, not resumed)
    for out in ("to_ep2", "to_tp2"):
        back = read_megatron(moe_runs / out).optimizer
        origin = src if out == "to_ep2" else read_megatron(moe_runs / "ep2").optimizer
        for slot in ("exp_avg", "exp_avg_sq"):
            assert all(torch.equal(t.load(), back.slots[slot][n].load()) for n, t in origin.slots[slot].items()), (out, slot)


def test_expert_bias_is_a_weight_in_no_optimizer_group(moe_runs):
    """megatron-core's TopKRouter.expert_bias is a buffer: in the rank files' model state, in no param group.
    The groups tie to the parameters alone (every moment equals the live optimizer's); the bias is a weight
    without slots, written at EP 1 as the same values and again in no group (megatron-core's
    load_state_dict matches group sizes: test_moe_optimizer_resumes_at_another_expert_layout)."""
    ck, out = read_megatron(moe_runs / "bias"), read_megatron(moe_runs / "bias_to_ep1")
    assert not ck.warnings and ck.optimizer.kind == "megatron"
    live = {}
    for _, moments in torch.load(moe_runs / "bias.pt.moments")["exp_avg"]:
        live.update(moments)
    ea = ck.optimizer.slots["exp_avg"]
    for i in range(2):
        assert torch.equal(ea[f"layers.{i}.mlp.router.weight"].load(), live[f"decoder.layers.{i}.mlp.router.weight"])
        assert torch.equal(ea[f"layers.{i}.mlp.experts.3.down.weight"].load(),
                           live[f"decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc2.weight"])
    biases = [n for n in ck.tensors if n.endswith("router.expert_bias")]
    assert len(biases) == 2 and set(ea) == set(ck.tensors) - set(biases)
    for n in biases:
        assert ck.tensors[n].load().dtype == torch.float32 and torch.equal(out.tensors[n].load(), ck.tensors[n].load())
        assert all(n not in g.names for o in (ck, out) for g in o.optimizer.param_groups)
        assert all(n not in slots for slots in out.optimizer.slots.values())
    rank = load_torch_file(moe_runs / "bias_to_ep1" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt")
    params = [k for k in rank["model"] if not k.endswith("_extra_state")]
    assert sum(k.endswith("router.expert_bias") for k in params) == 2
    assert sum(len(g["params"]) for g in rank["optimizer"]["optimizer"]["param_groups"]) == len(params) - 2


def test_expert_bias_is_whole_on_every_tensor_parallel_rank(moe_runs):
    """The expert bias is per expert, never cut over TP: resharded to TP 2 and TP 2 x EP 2, every rank file holds
    the whole bias of each MoE layer, bit for bit, in no param group (megatron-core resumes the TP 2 files:
    test_moe_optimizer_resumes_at_another_expert_layout); read back, and merged back to one rank, it is the
    same values, a weight no optimizer slot or group holds, while every parameter keeps its moments."""
    ck = read_megatron(moe_runs / "bias")
    biases = {n: t.load() for n, t in ck.tensors.items() if n.endswith("router.expert_bias")}
    assert len(biases) == 2 and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in biases.values())
    for out, ranks in (("bias_to_tp2", ["mp_rank_00", "mp_rank_01"]),
                       ("bias_to_tp2ep2", [f"mp_rank_0{t}_00{e}" for t in range(2) for e in range(2)])):
        for rank in ranks:
            sd = load_torch_file(moe_runs / out / "iter_0000007" / rank / "model_optim_rng.pt")
            params = [k for k in sd["model"] if not k.endswith("_extra_state")]
            for name, bias in biases.items():
                stored = sd["model"][f"decoder.{name}"].load()
                assert stored.dtype == torch.float32 and torch.equal(stored, bias), (out, rank, name)
            chain = sd["optimizer"] if isinstance(sd["optimizer"], list) else [sd["optimizer"]]
            grouped = sum(len(g["params"]) for part in chain for g in part["optimizer"]["param_groups"])
            assert grouped == len(params) - len(biases), (out, rank)
    ea = ck.optimizer.slots["exp_avg"]
    for out in ("bias_to_tp2", "bias_to_tp2ep2", "bias_merged"):
        back = read_megatron(moe_runs / out)
        assert back.source.layout.tp == (1 if out == "bias_merged" else 2)
        for name, bias in biases.items():
            assert torch.equal(back.tensors[name].load(), bias), (out, name)
            assert all(name not in slots for slots in back.optimizer.slots.values()), (out, name)
            assert all(name not in g.names for g in back.optimizer.param_groups), (out, name)
        assert set(back.optimizer.slots["exp_avg"]) == set(ea)
        assert all(torch.equal(back.optimizer.slots["exp_avg"][n].load(), t.load()) for n, t in ea.items()), out


@pytest.mark.parametrize("out,src", [("to_ep1", "ep2"), ("to_ep2", "ep1"), ("bias_to_ep1", "bias"),
                                     ("bias_to_tp2", "bias")])
def test_moe_optimizer_resumes_at_another_expert_layout(moe_runs, out, src):
    went_on = _next_loss(moe_runs / f"{src}.pt")
    gap = abs(_next_loss(moe_runs / f"{out}.pt") - went_on)
    fresh = abs(_next_loss(moe_runs / "fresh.pt") - _next_loss(moe_runs / "ep2.pt"))
    print(f"MoE {src} -> {out}: next-step loss gap {gap:.2e}; weights-only {fresh:.2e}")
    assert gap < MOE_TOL and fresh > 10 * max(gap, 1e-6)


def test_moe_distributed_optimizer_target_needs_a_whole_expert_dp(moe_runs, tmp_path):
    """(MoE targets of the distributed optimizer are written and resumed in test_distopt_moe.py.)"""
    with pytest.raises(CkptError, match=r"--dp 1: the expert-data-parallel size .* 1 x 1 / \(2 x 1\)\) is not whole"):
        api.reshard(moe_runs / "ep2", tmp_path / "d", tp=1, ep=2, distributed_optimizer=True, dp=1, warn=lambda m: None)
    assert not (tmp_path / "d").exists()


def test_expert_tp_below_tp_carries_the_optimizer(moe_runs, tmp_path):
    """Expert TP != TP: the optimizer is written at the target's expert grid and reads back the same
    (tests/test_optimizer_etp.py resumes it); so do the distributed optimizer's buffers (tests/test_distopt_etp.py)."""
    said = []
    api.reshard(moe_runs / "ep1", tmp_path / "etp1", tp=2, etp=1, warn=said.append)
    assert not [m for m in said if "optimizer" in m], said
    src, back = read_megatron(moe_runs / "ep1").optimizer, read_megatron(tmp_path / "etp1").optimizer
    assert all(torch.equal(t.load(), back.slots["exp_avg"][n].load()) for n, t in src.slots["exp_avg"].items())
    api.reshard(moe_runs / "ep1", tmp_path / "etp1d", tp=2, etp=1, distributed_optimizer=True, dp=2, warn=said.append)
    assert not [m for m in said if "optimizer" in m], said
    back = read_megatron(tmp_path / "etp1d").optimizer
    assert back.kind == "megatron-distributed"
    assert all(torch.equal(t.load(), back.slots["exp_avg"][n].load()) for n, t in src.slots["exp_avg"].items())


def test_target_groups_are_re_formed_by_megatron_cores_rule_at_the_target():
    """EP 1 -> EP 2: the experts' group gets an expert-parallel copy in a second optimizer; every rank
    lists every group of its optimizer, empty or not (megatron-core 0.16 aligns them over the ranks)."""
    from ckptool.state import ParamGroup
    groups = [ParamGroup(["layers.0.attn.q.weight", "layers.0.mlp.experts.3.down.weight"],
                         {"wd_mult": 1.0, "is_expert_parallel": False}),
              ParamGroup(["layers.0.attn_norm.weight"], {"wd_mult": 0.0, "is_expert_parallel": False}),
              ParamGroup(["embed.word", "output.weight"], {"wd_mult": 1.0, "max_lr": 3e-3, "is_expert_parallel": False})]
    assert megatron_optim.target_groups(groups, 1) == [[0, 1, 2]]
    assert megatron_optim.target_groups(groups, 2) == [[0, 1, 2], [0]]
    one = Const(torch.zeros(2))
    slots = {"exp_avg": one, "exp_avg_sq": one}
    # a middle pipeline stage at EP 2: a dense weight, a norm, one local expert; no embedding
    entries = [(0, False, slots), (1, False, slots), (0, True, slots)]
    dense, expert = megatron_optim.rank_state(entries, groups, megatron_optim.target_groups(groups, 2), 3,
                                              mixed=False, grad_scaler=None)
    assert [len(g["params"]) for g in dense["param_groups"]] == [1, 1, 0]
    assert [g["is_expert_parallel"] for g in dense["param_groups"]] == [False] * 3
    assert [(len(g["params"]), g["is_expert_parallel"]) for g in expert["param_groups"]] == [(1, True)]
    assert megatron_optim.rank_state(entries[:2], groups, [[0, 1, 2]], 3, mixed=False, grad_scaler=None)["param_groups"][2]["params"] == []


def test_look_alike_groups_of_older_eras_stay_apart():
    """--weight-decay 0 before wd_mult existed: two groups with the same hyperparameters, tied by size."""
    hypers = [{"lr": 1e-3, "weight_decay": 0.0}, {"lr": 1e-3, "weight_decay": 0.0}]
    canonical, local = megatron_groups.merge_groups({(0, 0, 0): hypers, (1, 0, 0): hypers}, "x")
    assert len(canonical) == 2 and local == {(0, 0, 0): [0, 1], (1, 0, 0): [0, 1]}
    # a dense group and its expert-parallel copy are one canonical group
    dense, expert = {"wd_mult": 1.0, "is_expert_parallel": False}, {"wd_mult": 1.0, "is_expert_parallel": True}
    canonical, local = megatron_groups.merge_groups({(0, 0, 1): [dense, expert]}, "x")
    assert canonical == [dense] and local == {(0, 0, 1): [0, 0]}


def test_a_swapped_or_foreign_chain_is_refused_never_mis_tied(moe_runs, tmp_path):
    """The chain's order is [dense, expert]: swapped, the dense parameters meet the expert optimizer's
    one group and the tie fails by name. A chain at EP 1 (not megatron-core's expert pair) is dropped
    with a warning naming it."""
    import shutil
    bad = tmp_path / "swapped"
    shutil.copytree(moe_runs / "ep2", bad)
    f = bad / "iter_0000007" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(f, map_location="cpu", weights_only=False)
    state["optimizer"] = state["optimizer"][::-1]
    torch.save(state, f)
    with pytest.raises(CkptError, match=r"mp_rank_00_001.*chained optimizer 0.*groups hold \[8\].*--no-optimizer"):
        read_megatron(bad)
    assert megatron_optim.unsupported_form({"optimizer": [{}, {}]}, 1) is not None
    assert megatron_optim.unsupported_form({"optimizer": [{}, {}]}, 2) is None
