"""MoE under megatron-core's distributed optimizer (torch format, distrib_optim.pt), with the real package
(CPU, gloo; tests/mcore_moe_helper.py train --distributed-optimizer, 2 ranks).

EP 1: the experts are ordinary data-parallel parameters, one DistributedOptimizer, one grad buffer.
EP 2 (DP 2, expert DP 1; and DP 4, expert DP 2): megatron-core chains a dense DistributedOptimizer and an expert one over the
expert_parallel_buffers; distrib_optim.pt is the list [dense, expert], the dense part only in EP rank 0's
file (None in EP rank 1's). ckptool reads every master and moment bit for bit equal to the live
optimizer's, assembled from the DP shards by megatron-core's own range maps."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.megatron import optim as megatron_optim
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.lazy import Const
from ckptool.roles import is_parameter, unfuse_qkv
from conftest import copy_run, declare_runs, shared_followups

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

SLOTS = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# megatron-core's parameter name (layer-local part) -> the canonical name, for the unfused ones
DIRECT = {"input_layernorm.weight": "attn_norm.weight", "pre_mlp_layernorm.weight": "mlp_norm.weight",
          "self_attention.linear_proj.weight": "attn.out.weight", "mlp.router.weight": "mlp.router.weight"}
GLOBAL = {"embedding.word_embeddings.weight": "embed.word", "output_layer.weight": "output.weight",
          "decoder.final_layernorm.weight": "final_norm.weight"}


HELPER = Path(__file__).resolve().parent / "mcore_moe_helper.py"
FLAGS = "--tp 1 --dtype bf16 --distributed-optimizer"
# the trainings (in one launch with the other files' megatron-core MoE trainings at 2 processes)
TRAINS = declare_runs(HELPER, 2, {"ep1": f"train {{out}} --ep 1 {FLAGS} --out {{out}}.pt",
                                  "ep2": f"train {{out}} --ep 2 {FLAGS} --out {{out}}.pt",
                                  "qwen": f"train {{out}} --ep 2 --arch qwen2moe {FLAGS} --out {{out}}.pt",
                                  # sigmoid routing with an expert bias: a buffer among the weights, in no grad buffer
                                  "bias": f"train {{out}} --ep 2 --arch biased {FLAGS} --out {{out}}.pt"})
# DP 4 x EP 2 (expert DP 2: ranks 2 and 3 hold halves of their experts' state and write no file), in one launch with
# the other files' megatron-core MoE runs at 4 processes
TRAINS_DP4 = declare_runs(HELPER, 4, {"dp4": f"train {{out}} --ep 2 {FLAGS} --out {{out}}.pt"})


@shared_followups
def runs(framework_runs, d):
    """bf16 with fp32 masters (megatron-core's fp32 DistributedOptimizer cannot load_parameter_state on CPU:
    its masters are views of the weights). ckptool writes EP 2 -> EP 1 and EP 1 -> EP 2, each at DP 2, and
    EP 1 -> EP 2 at DP 4, and megatron-core resumes them, its own EP 2 save (control) and a weights-only one
    (in one launch per process count with the other files' MoE follow-ups)."""
    flags = FLAGS
    for name, stem in {**framework_runs(HELPER, 2, TRAINS), **framework_runs(HELPER, 4, TRAINS_DP4)}.items():
        copy_run(stem, d / name)
    said = []
    api.reshard(d / "ep2", d / "to_ep1", tp=1, ep=1, distributed_optimizer=True, dp=2, warn=said.append)
    api.reshard(d / "ep1", d / "to_ep2", tp=1, ep=2, distributed_optimizer=True, dp=2, warn=said.append)
    api.reshard(d / "qwen", d / "qwen_to_ep1", tp=1, ep=1, distributed_optimizer=True, dp=2, warn=said.append)
    api.reshard(d / "bias", d / "bias_to_ep1", tp=1, ep=1, distributed_optimizer=True, dp=2, warn=said.append)
    api.reshard(d / "ep1", d / "to_dp4", tp=1, ep=2, distributed_optimizer=True, dp=4, warn=said.append)
    assert not said, said
    yield [(HELPER, 2, [f"resume {d / 'to_ep1'} --ep 1 {flags} --out {d / 'to_ep1.pt'}",
                        f"resume {d / 'to_ep2'} --ep 2 {flags} --out {d / 'to_ep2.pt'}",
                        f"resume {d / 'ep2'} --ep 2 {flags} --out {d / 'control.pt'}",
                        f"resume {d / 'to_ep1'} --ep 1 {flags} --weights-only --out {d / 'fresh.pt'}",
                        f"resume {d / 'qwen_to_ep1'} --ep 1 --arch qwen2moe {flags} --out {d / 'qwen_to_ep1.pt'}",
                        f"resume {d / 'bias_to_ep1'} --ep 1 --arch biased {flags} --out {d / 'bias_to_ep1.pt'}"]),
           (HELPER, 4, [f"resume {d / 'to_dp4'} --ep 2 {flags} --out {d / 'to_dp4.pt'}"])]
    return d


def canonical_pieces(name: str, value: torch.Tensor, cfg) -> dict:
    """{canonical name: the part of this megatron-core parameter's tensor it is} (global expert names)."""
    if name in GLOBAL:
        return {GLOBAL[name]: value}
    _, _, layer, rest = name.split(".", 3)
    pre = f"layers.{layer}."
    if rest in DIRECT:
        return {pre + DIRECT[rest]: value}
    if rest == "self_attention.linear_qkv.weight":
        return dict(zip((pre + "attn.q.weight", pre + "attn.k.weight", pre + "attn.v.weight"), unfuse_qkv(value, cfg)))
    e, tail = rest.removeprefix("mlp.experts.local_experts.").split(".", 1)
    expert = f"{pre}mlp.experts.{e}."
    if tail == "linear_fc1.weight":
        gate, up = value.chunk(2, dim=0)
        return {expert + "gate.weight": gate, expert + "up.weight": up}
    assert tail == "linear_fc2.weight", name
    return {expert + "down.weight": value}


@pytest.mark.parametrize("src", ["ep1", "ep2", "dp4", "bias"])
def test_every_master_and_moment_equals_the_live_optimizers(runs, src):
    ck = read_megatron(runs / src)
    assert not ck.warnings and ck.optimizer is not None and ck.optimizer.kind == "megatron-distributed"
    assert ck.optimizer.step == 1 and all(m.load().dtype == torch.float32 for m in ck.optimizer.slots["master"].values())
    live = torch.load(runs / f"{src}.pt.live")["live"]
    seen = set()
    for (_, name), tensors in live.items():
        for key, slot in SLOTS.items():
            for canon, want in canonical_pieces(name, tensors[key], ck.config).items():
                got = ck.optimizer.slots[slot][canon].load()
                want = want[:got.shape[0]] if canon in ("embed.word", "output.weight") else want  # vocab padding
                assert torch.equal(got, want), (src, canon, slot)
                seen.add(canon)
    # every parameter; a module buffer (the router's expert bias) is a weight with no slot
    assert seen == {n for n in ck.tensors if is_parameter(n)} == set(ck.optimizer.slots["exp_avg"])
    assert any(".mlp.experts.3." in n for n in seen)
    # the dense groups (weight decay, none) carry the experts in the weight-decay one, whatever the EP
    groups = {g.hyper["wd_mult"]: g.names for g in ck.optimizer.param_groups}
    assert len(groups) == 2 and "layers.1.mlp.experts.3.down.weight" in groups[1.0]
    assert "layers.0.attn_norm.weight" in groups[0.0]


def _next(path):
    return torch.load(str(path) + ".losses")["next"]


@pytest.mark.parametrize("out,src", [("to_ep1", "ep2"), ("to_ep2", "ep1"), ("to_dp4", "ep1"),
                                     ("qwen_to_ep1", "qwen"), ("bias_to_ep1", "bias")])
def test_written_distrib_optim_resumes_at_another_expert_layout(runs, out, src):
    """megatron-core loads ckptool's distrib_optim.pt (load_state_dict + load_parameter_state) and takes
    the next two steps with the very losses the source run took; the second is the first that the
    loaded moments move. A fresh optimizer (weights only) is off by far more. qwen: the Qwen2-MoE-like
    model (a dense layer 0, a shared expert with its gate, QKV biases: all in the dense buffer)."""
    went_on, resumed = _next(runs / f"{src}.pt"), _next(runs / f"{out}.pt")
    fresh = abs(_next(runs / "fresh.pt")[1] - _next(runs / "ep2.pt")[1])
    print(f"MoE distributed {src} -> {out}: losses {resumed} vs {went_on}; weights-only gap {fresh:.2e}")
    assert resumed == went_on and fresh > 1e-3
    assert _next(runs / "control.pt") == _next(runs / "ep2.pt")


def test_written_chain_matches_megatron_cores_form(runs):
    """ckptool's EP 2 files: the rank file lists the [dense, expert] groups (is_expert_parallel set by the
    target), distrib_optim.pt [dense, expert] with the dense part in EP rank 0's file only, as the run's
    own; read back, every slot equals the source's."""
    d = runs / "to_ep2" / "iter_0000007"
    own = runs / "ep2" / "iter_0000007"
    for e in range(2):
        ours = torch.load(d / f"mp_rank_00_{e:03d}" / "distrib_optim.pt", weights_only=False)
        theirs = torch.load(own / f"mp_rank_00_{e:03d}" / "distrib_optim.pt", weights_only=False)
        assert [x is None for x in ours] == [x is None for x in theirs] == [e > 0, False]
        assert [x and {k: v for k, v in x.items() if k != 0} for x in ours] == \
            [x and {k: v for k, v in x.items() if k != 0} for x in theirs]
        for x, y in zip(ours, theirs):
            if x is not None:
                (kx, vx), = x[0].items()
                (ky, vy), = y[0].items()
                assert kx == ky and vx["numel_unpadded"] == vy["numel_unpadded"]
        groups = [[{k: v for k, v in g.items() if k != "step"} for g in o["optimizer"]["param_groups"]]
                  for o in torch.load(d / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt", weights_only=False)["optimizer"]]
        assert [[g["is_expert_parallel"] for g in part] for part in groups] == [[False, False], [True]]
    src = read_megatron(runs / "ep1").optimizer
    back = read_megatron(runs / "to_ep2").optimizer
    for slot, tensors in src.slots.items():
        assert all(torch.equal(t.load(), back.slots[slot][n].load()) for n, t in tensors.items()), slot


def test_ep2_files_are_megatron_cores_chain(runs):
    """What the test above reads: the dense state only in EP rank 0's file, each file its own experts."""
    d = runs / "ep2" / "iter_0000007"
    first = torch.load(d / "mp_rank_00_000" / "distrib_optim.pt", weights_only=False)
    second = torch.load(d / "mp_rank_00_001" / "distrib_optim.pt", weights_only=False)
    assert isinstance(first, list) and len(first) == 2 and first[0] is not None and first[1] is not None
    assert isinstance(second, list) and second[0] is None and second[1] is not None


def test_missing_dense_state_is_refused_naming_ep_rank_0s_file(runs, tmp_path):
    bad = tmp_path / "ep2"
    shutil.copytree(runs / "ep2", bad)
    f = bad / "iter_0000007" / "mp_rank_00_000" / "distrib_optim.pt"
    state = torch.load(f, weights_only=False)
    torch.save([None, state[1]], f)
    with pytest.raises(CkptError, match=r"mp_rank_00_000/distrib_optim\.pt: no dense optimizer state here \(the file of "
                                        r"the dense optimizer's DP rank 0"):
        read_megatron(bad)
    # EP rank 1's file points at EP rank 0's for the dense part
    from ckptool.formats.megatron import distopt as megatron_distopt
    rank1 = bad / "iter_0000007" / "mp_rank_00_001"
    tree = torch.load(rank1 / "model_optim_rng.pt", weights_only=False)
    with pytest.raises(CkptError, match=r"mp_rank_00_001/distrib_optim\.pt: no dense optimizer state here nor in "
                                        r".*mp_rank_00_000/distrib_optim\.pt"):
        megatron_distopt.read_rank(tree, rank1, [megatron_optim.RankParam("w", "attn_norm.weight", 0, Const(torch.zeros(2)))],
                                   megatron_distopt.RankRun(tree["args"], False, 1, 0), "x", 2,
                                   bad / "iter_0000007" / "mp_rank_00_000")
    # a chain's file beside a single optimizer's groups (or the reverse) is refused, never mis-tied
    torch.save(state[1], f)
    with pytest.raises(CkptError, match=r"mp_rank_00_000.*distrib_optim\.pt: one optimizer state"):
        read_megatron(bad)
