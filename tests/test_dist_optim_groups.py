"""torch_dist optimizer state with param groups beyond weight decay (--decoupled-lr, lr_mult), real megatron-core.

megatron-core 0.16 (CPU, gloo; tests/mcore_optim_dist_helper.py --decoupled-lr --lr-mult) trains a tiny
llama with three groups: the default one, the no-weight-decay one with lr_mult 0.5, and the embedding +
output at the decoupled learning rate (its own max_lr / min_lr). torch_dist stores the groups without
parameter lists; ckptool ties every parameter by megatron_optim's group traits (the table the torch
format uses) and carries the groups under canonical names. Shown here for each form the helper saves
(non-distributed, fully_reshardable, dp_reshardable, fully_sharded_model_space): every slot equals the
live optimizer's; resharded TP2 -> TP1 (torch_dist, and the torch format) and TP2 -> TP1 PP2, megatron-core
loads the output and takes the next steps with the losses of the run that went on (measured gap
~1.5e-4, TP reduction order in bf16), while a weights-only resume is off by ~1e-2 at the second step.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.formats.registry import open_checkpoint
from ckptool.write_options import WriteOptions
from conftest import copy_run, declare_runs, shared_followups
from test_dist_optim import HELPER, assert_slots_equal, live, losses

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed (test-only extra)")

DECOUPLED, LR_MULT = 3e-3, 0.5
FLAGS = f"--arch llama --decoupled-lr {DECOUPLED} --lr-mult {LR_MULT}"
LOSS_TOL = 2e-3  # test_dist_optim.py's: TP reduction order in bf16 (measured here <= 2e-4)
# name -> (helper save options, the reader's kind)
FORMS = {"plain": ("--tp 2 --form plain", "non-distributed"),
         "fr": ("--tp 2 --form fully_reshardable", "fully_reshardable"),
         "dpr": ("--tp 2 --form dp_reshardable", "dp_reshardable"),
         "fs": ("--tp 1 --form fully_sharded_model_space", "fully_sharded_model_space")}


# the saves (in one launch with test_dist_optim.py's)
SAVES = declare_runs(HELPER, 2, {name: f"save {{out}} {how} {FLAGS} --live {{out}}_live --out {{out}}.pt"
                                 for name, (how, _) in FORMS.items()})


def copy_saves(framework_runs, d: Path) -> Path:
    """The session's SAVES, copied into d."""
    for name, stem in framework_runs(HELPER, 2, SAVES, timeout=600).items():
        copy_run(stem, d / name)
    return d


@pytest.fixture(scope="module")
def saved(tmp_path_factory, framework_runs):
    return copy_saves(framework_runs, tmp_path_factory.mktemp("dist_groups"))


@shared_followups
def resumed(framework_runs, d):
    """The saves (a copy of their own), ckptool's outputs at other layouts and megatron-core's resumes of them (in one
    launch per helper and process count with the other files' follow-ups)."""
    import test_resume
    copy_saves(framework_runs, d)
    write_layout(open_checkpoint(d / "fr"), d / "fr_tp1", Layout(1), WriteOptions(format="torch_dist"), warn=print)
    write_layout(open_checkpoint(d / "dpr"), d / "dpr_pp2", Layout(1, 2, stage_layers=[2, 1]),
                 WriteOptions(format="torch_dist"),
                 warn=print)
    write_layout(open_checkpoint(d / "plain"), d / "plain_tp1", Layout(1),
                 WriteOptions(format="torch_dist"), warn=print)
    write_layout(open_checkpoint(d / "fr"), d / "fr_torch", Layout(1), WriteOptions(format="torch"), warn=print)
    yield [(HELPER, 2, [
             f"resume {d}/fr_tp1 --tp 1 --form fully_reshardable {FLAGS} --out {d}/r_fr.pt",
             f"resume {d}/fr_tp1 --tp 1 --form plain {FLAGS} --out {d}/r_fr_plain.pt",
             f"resume {d}/fr_tp1 --tp 1 --form plain --weights-only {FLAGS} --out {d}/r_weights_only.pt",
             f"resume {d}/dpr_pp2 --tp 1 --pp 2 --form fully_reshardable {FLAGS} --out {d}/r_dpr_pp2.pt",
             f"resume {d}/plain_tp1 --tp 1 --form plain {FLAGS} --out {d}/r_plain.pt",
             f"resume {d}/fr --tp 2 --form fully_reshardable {FLAGS} --out {d}/r_control.pt"]),
           # the torch-format output, resumed as Megatron-LM's torch format loads (mcore_train_helper.py)
           (test_resume.HELPER, 1, [f"resume {d}/fr_torch --tp 1 --more 2 {FLAGS} --out {d}/r_fr_torch.pt"])]
    return d


@pytest.mark.parametrize("name", list(FORMS))
def test_groups_are_tied_by_their_traits_and_slots_equal_the_live_optimizer(saved, name):
    ckpt = open_checkpoint(saved / name)
    opt = ckpt.optimizer
    assert opt is not None and not ckpt.warnings, ckpt.warnings
    assert opt.kind == f"megatron-core-dist ({FORMS[name][1]})" and opt.step == 3
    by_key = {(g.hyper["wd_mult"], g.hyper["lr_mult"], g.hyper["max_lr"]): g.names for g in opt.param_groups}
    assert set(by_key) == {(1.0, 1.0, 1e-2), (0.0, LR_MULT, 1e-2), (1.0, 1.0, DECOUPLED)}
    assert sorted(by_key[(1.0, 1.0, DECOUPLED)]) == ["embed.word", "output.weight"]
    assert all(n.endswith("norm.weight") for n in by_key[(0.0, LR_MULT, 1e-2)])
    assert sorted(n for g in opt.param_groups for n in g.names) == sorted(ckpt.tensors)
    assert_slots_equal(ckpt, live(saved / f"{name}_live"))


def test_written_groups_are_the_sources(resumed, tmp_path):
    """The torch_dist output lists the same three groups (identifier keys included) and reads back
    with the same names and slots, bit for bit."""
    src, out = open_checkpoint(resumed / "fr"), open_checkpoint(resumed / "fr_tp1")
    assert [(g.names, g.hyper) for g in out.optimizer.param_groups] == \
        [(g.names, g.hyper) for g in src.optimizer.param_groups]
    assert_slots_equal(src, lambda slot: out.optimizer.slots[slot])
    back = open_checkpoint(resumed / "fr_torch").optimizer  # and the torch-format output
    assert sorted(sorted(g.names) for g in back.param_groups) == sorted(sorted(g.names) for g in src.optimizer.param_groups)
    assert_slots_equal(src, lambda slot: back.slots[slot])
    # torch format (its rank files' groups tied by the torch reader) -> torch_dist: the same again
    write_layout(open_checkpoint(resumed / "fr_torch"), tmp_path / "again", Layout(2),
                 WriteOptions(format="torch_dist"), warn=print)
    again = open_checkpoint(tmp_path / "again").optimizer
    assert sorted((sorted(g.names), g.hyper["max_lr"]) for g in again.param_groups) == \
        sorted((sorted(g.names), g.hyper["max_lr"]) for g in src.optimizer.param_groups)
    assert_slots_equal(src, lambda slot: again.slots[slot])


@pytest.mark.parametrize("run", ["r_fr", "r_fr_plain", "r_dpr_pp2", "r_plain", "r_fr_torch"])
def test_resharded_groups_resume_like_the_run_that_went_on(resumed, run):
    """TP2 -> TP1 (torch_dist, loaded by the distributed and the non-distributed optimizer; and the
    torch format) and dp_reshardable TP2 -> TP1 PP2: the next two losses match the source run's."""
    source = {"r_dpr_pp2": "dpr", "r_plain": "plain"}.get(run, "fr")
    went_on = losses(resumed / f"{source}.pt")[3:]
    gap = (losses(resumed / f"{run}.pt") - went_on).abs().max().item()
    weights_only = (losses(resumed / "r_weights_only.pt") - losses(resumed / "fr.pt")[3:]).abs().max().item()
    print(f"{run}: loss gap {gap:.2e}; weights-only {weights_only:.2e}")
    assert gap < LOSS_TOL and weights_only > 10 * max(gap, 1e-5)
    assert torch.equal(losses(resumed / "r_control.pt"), losses(resumed / "fr.pt")[3:])
