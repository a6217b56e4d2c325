"""The distributed optimizer (distrib_optim.pt) at expert TP != TP, with the real megatron-core (CPU, gloo, 4
processes; tests/mcore_moe_helper.py train --distributed-optimizer).

At TP2 ETP1 EP2 DP2 the dense grid (TP x DP) and the expert grid (expert TP x EP x expert DP) differ: rank x
is dense TP rank x % 2, EP rank x % 2. ChainedOptimizer.save_parameter_state saves each part from that
optimizer's DP rank 0 into the saving rank's own file, so mp_rank_00_000 (rank 0) and mp_rank_01_001 (rank 1)
each hold [dense state of their TP rank, their EP rank's experts]; at TP2 ETP1 EP4 the files of EP ranks 2
and 3 hold [None, experts] and TP rank t's dense state is in file (t, t % 4) (megatron_distopt.chain_sources).
ckptool reads every master and moment equal to the live optimizer's, writes the source's files back
identically, and megatron-core resumes its output at TP1 EP2, TP2 ETP1 EP1 and TP2 ETP1 EP4.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.formats.megatron.distopt import chain_sources
from ckptool.write_options import WriteOptions

from conftest import copy_run, declare_runs, shared_followups
from test_optimizer_etp import HELPER, mixtral_with_moments

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

FLAGS = "--dtype bf16 --distributed-optimizer"  # bf16 with fp32 masters (see tests/test_distopt_moe.py)
GRID = "--tp 2 --ep 2 --etp 1"
# target name -> (tp, ep, etp, dp) on the helper's 4 processes
TARGETS = {"tp2ep2etp1": (2, 2, 1, 2), "tp1ep2": (1, 2, 1, 4), "tp2ep1etp1": (2, 1, 1, 2), "tp2ep4etp1": (2, 4, 1, 2)}
TP_AXIS = {"self_attention.linear_proj.weight": 1, "self_attention.linear_qkv.weight": 0,
           "embedding.word_embeddings.weight": 0, "output_layer.weight": 0}  # the others: replicated or whole


# the trainings (in one launch with the other files' megatron-core MoE saves at 4 processes)
TRAINS = declare_runs(HELPER, 4, {"src": f"train {{out}} {GRID} {FLAGS} --out {{out}}.pt",
                                  "ep1src": f"train {{out}} --tp 2 --ep 1 --etp 1 {FLAGS} --out {{out}}.pt"})


@shared_followups
def runs(framework_runs, d):
    """The trainings copied, ckptool's TARGETS of the TP2 ETP1 EP2 one, and megatron-core's resumes of each, of its
    own save (control) and a weights-only one (the resumes in one launch with the other files' 4-process MoE
    follow-ups)."""
    for name, stem in framework_runs(HELPER, 4, TRAINS).items():
        copy_run(stem, d / name)
    said = []
    for name, (tp, ep, etp, dp) in TARGETS.items():
        api.reshard(d / "src", d / name, tp=tp, ep=ep, etp=etp, distributed_optimizer=True, dp=dp, warn=said.append)
    assert not said, said
    yield [(HELPER, 4, [f"resume {d / name} --tp {tp} --ep {ep} --etp {etp} {FLAGS} --out {d / name}.pt"
                        for name, (tp, ep, etp, _) in TARGETS.items()]
            + [f"resume {d / 'src'} {GRID} {FLAGS} --out {d / 'control.pt'}",
               f"resume {d / 'tp1ep2'} --tp 1 --ep 2 --etp 1 {FLAGS} --weights-only --out {d / 'fresh.pt'}"])]
    return d


def _live_full(live: dict) -> dict:
    """{megatron-core name: {param, exp_avg, exp_avg_sq}} from the helper's per-TP-rank live values: TP-cut
    parameters joined along their axis, the rest (norms, router, experts whole at expert TP 1) equal on
    every TP rank that holds them."""
    by_name: dict = {}
    for (t, name), tensors in sorted(live.items()):
        by_name.setdefault(name, []).append(tensors)
    out = {}
    for name, parts in by_name.items():
        axis = next((a for suffix, a in TP_AXIS.items() if name.endswith(suffix)), None)
        if axis is None:
            assert all(torch.equal(p[k], parts[0][k]) for p in parts for k in p), name
            out[name] = parts[0]
        else:
            assert len(parts) == 2, name
            out[name] = {k: torch.cat([p[k] for p in parts], dim=axis) for k in parts[0]}
    return out


def test_chain_sources_follow_the_two_grids():
    # expert TP = TP: the dense state in EP rank 0's file, the experts in the file itself
    assert chain_sources(1, 3, 2, 4, 2) == ((1, 0), (1, 3))
    # TP2 ETP1 EP2: each file holds both parts of its own ranks
    assert [chain_sources(t, t, 2, 2, 1) for t in range(2)] == [((0, 0), (0, 0)), ((1, 1), (1, 1))]
    # TP2 ETP1 EP4: file (0, 2) [None, experts of EP 2]; its dense part in (0, 0)
    assert chain_sources(0, 2, 2, 4, 1) == ((0, 0), (0, 2))
    # TP4 ETP1 EP2: file (2, 0) has no expert part (its rank is expert DP rank 1): EP rank 0's experts in (0, 0)
    assert chain_sources(2, 0, 4, 2, 1) == ((2, 0), (0, 0))


@pytest.mark.parametrize("src", ["src", "ep1src"])
def test_every_master_and_moment_equals_the_live_optimizers(runs, src):
    """TP2 ETP1 EP2 (chained), and TP2 ETP1 EP1 (one optimizer: the experts, whole, in every TP rank's
    dense buffer)."""
    from test_distopt_moe import SLOTS, canonical_pieces
    ck = read_megatron(runs / src)
    assert not ck.warnings and ck.optimizer.kind == "megatron-distributed" and ck.source.layout.expert_tp == 1
    live = _live_full(torch.load(runs / f"{src}.pt.live")["live"])
    seen = set()
    for name, tensors in live.items():
        for key, slot in SLOTS.items():
            for canon, want in canonical_pieces(name, tensors[key], ck.config).items():
                got = ck.optimizer.slots[slot][canon].load()
                want = want[:got.shape[0]] if canon in ("embed.word", "output.weight") else want  # vocab padding
                assert torch.equal(got, want), (canon, slot)
                seen.add(canon)
    assert seen == set(ck.tensors) == set(ck.optimizer.slots["exp_avg"])


def test_written_files_are_megatron_cores_and_read_back(runs):
    """ckptool's TP2 ETP1 EP2 files equal the source's tensor for tensor; at EP4 the files of EP ranks 2 and 3
    hold only the expert part, as megatron-core saves them; every target reads back every slot bit for bit."""
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):
        ours, theirs = (torch.load(runs / n / "iter_0000007" / rank / "distrib_optim.pt", weights_only=False)
                        for n in ("tp2ep2etp1", "src"))
        for x, y in zip(ours, theirs):
            (kx, vx), = x[0].items()
            (ky, vy), = y[0].items()
            assert kx == ky and all(torch.equal(vx[k], vy[k]) for k in ("param", "exp_avg", "exp_avg_sq")), rank
    ep4 = runs / "tp2ep4etp1" / "iter_0000007"
    assert sorted(p.name for p in ep4.iterdir()) == ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001", "mp_rank_01_003"]
    for rank, dense in (("mp_rank_00_000", True), ("mp_rank_01_001", True), ("mp_rank_00_002", False), ("mp_rank_01_003", False)):
        state = torch.load(ep4 / rank / "distrib_optim.pt", weights_only=False)
        assert [x is not None for x in state] == [dense, True], rank
    src = read_megatron(runs / "src").optimizer
    for name in TARGETS:
        back = read_megatron(runs / name)
        assert not back.warnings, back.warnings
        for slot, tensors in src.slots.items():
            assert all(torch.equal(t.load(), back.optimizer.slots[slot][n].load()) for n, t in tensors.items()), (name, slot)


def _next(path):
    return torch.load(str(path) + ".losses")["next"]


@pytest.mark.parametrize("out", list(TARGETS))
def test_resumes_at_another_layout_with_the_source_runs_losses(runs, out):
    """megatron-core loads ckptool's output (load_state_dict + load_parameter_state) and takes the two steps
    the source run took after its save. Same layout and TP2 ETP1 EP4: exactly its losses (the control,
    megatron-core resuming its own save, too); TP1 EP2 and TP2 ETP1 EP1: within bf16 reduction-order noise
    (measured 2.4e-4 and 1.3e-4 at the second step), far below a weights-only resume's gap (1.4e-2)."""
    went_on = _next(runs / "src.pt")
    resumed = _next(runs / f"{out}.pt")
    gap = max(abs(a - b) for a, b in zip(resumed, went_on))
    fresh = abs(_next(runs / "fresh.pt")[1] - went_on[1])
    print(f"distributed TP2 ETP1 EP2 -> {out}: loss gap {gap:.2e}; weights-only {fresh:.2e}")
    assert _next(runs / "control.pt") == went_on
    if out in ("tp2ep2etp1", "tp2ep4etp1"):
        assert resumed == went_on
    assert gap < 1e-3 and fresh > 10 * gap


def test_expert_parts_in_other_files_are_written_and_read_back(tmp_path):
    """TP4 ETP1 EP2 (beyond the helper's model; a tiny Mixtral with 4 KV heads and distinct random moments):
    ranks 2 and 3 are expert-DP rank 1, so files (2, 0) and (3, 1) hold [dense, None] and their experts'
    state is in (0, 0) and (1, 1), where ckptool writes it and reads it back bit for bit."""
    from ckptool.config import Layout
    from ckptool.formats.megatron.checkpoint import write_megatron
    from ckptool.lazy import Const
    ck, slots = mixtral_with_moments(tmp_path)
    write_megatron(ck, tmp_path / "out", Layout(tp=4, ep=2, etp=1),
                   WriteOptions(distributed_optimizer=True, dp=1), warn=lambda m: None)
    it = tmp_path / "out" / "iter_0000000"
    held = {p.name: [x is not None for x in torch.load(p / "distrib_optim.pt", weights_only=False)] for p in it.iterdir()}
    assert held == {"mp_rank_00_000": [True, True], "mp_rank_01_001": [True, True],
                    "mp_rank_02_000": [True, False], "mp_rank_03_001": [True, False]}
    back = read_megatron(tmp_path / "out")
    assert back.optimizer.kind == "megatron-distributed" and not [w for w in back.warnings if "optimizer" in w]
    for slot in ("exp_avg", "exp_avg_sq"):
        for n, t in slots[slot].items():
            if n not in ("embed.word", "output.weight"):  # padded for TP4 on write
                assert torch.equal(back.optimizer.slots[slot][n].load(), t.load()), (slot, n)
    # a file that should hold the experts' state but does not is refused, naming it (and, for a file that
    # looks there, both)
    f = it / "mp_rank_00_000" / "distrib_optim.pt"
    state = torch.load(f, weights_only=False)
    torch.save([state[0], None], f)
    with pytest.raises(CkptError, match=r"mp_rank_00_000/distrib_optim\.pt: no expert optimizer state here \(the file "
                                        r"of the expert optimizer's DP rank 0"):
        read_megatron(tmp_path / "out")
    from ckptool.formats.megatron import distopt as megatron_distopt, optim as megatron_optim
    rank = it / "mp_rank_02_000"
    tree = torch.load(rank / "model_optim_rng.pt", weights_only=False)
    expert = megatron_optim.RankParam("w", "experts.0.fc2.weight", 0, Const(torch.zeros(2)))
    with pytest.raises(CkptError, match=r"mp_rank_02_000/distrib_optim\.pt: no expert optimizer state here nor in "
                                        r".*mp_rank_00_000/distrib_optim\.pt"):
        megatron_distopt.read_rank(tree, rank, [expert], megatron_distopt.RankRun(tree["args"], False, 1, 0), "x", 2, rank,
                                   it / "mp_rank_00_000")
