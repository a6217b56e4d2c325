"""Training resumes after a reshard: the proof with the real megatron-core optimizer (CPU, gloo).

A run trains a tiny GPT with megatron-core's own DDP, bf16 mixed-precision Adam (fp32 masters) and LR
scheduler at one TP size, saves Megatron-LM's torch format and trains on. ckptool reshards the saved
checkpoint to another TP size, with the optimizer (the default) and without it (--no-optimizer); a
second run loads each the way Megatron-LM's load_checkpoint does and trains the same further batches.

What is measured (docs/optimizer-state.md has the figures): the resumed run's losses and final
weights against the run that went on at the first layout. Changing TP changes the order of floating
point reductions, so "equal" means within that noise; the weights-only resume restarts Adam from zero
moments and is visibly off. A same-layout resume is the control: it must reproduce the run exactly.

The same for a model with megatron-core's multi-token-prediction block (issue 30: --mtp-num-layers 1, its MTP
loss scaled into the backward as megatron-core does): main and MTP losses both go on as the run's did.
"""
from __future__ import annotations

import importlib.util
import subprocess
import traceback
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, run_torchrun, shared_followups
from ckptool.formats.registry import open_checkpoint

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "mcore_train_helper.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
pytestmark = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed "
                                "(pip install megatron-core: test-only extra)")

STEPS, MORE = 3, 2
# Measured on CPU (torch 2.13, megatron-core 0.16): resumed-after-reshard losses differ from the
# run that went on by <= 2e-4 (TP reduction order in bf16); weights-only resumes by >= 5e-2.
LOSS_TOL = 2e-3


def torchrun(nproc: int, *jobs: str, timeout: int = 300) -> None:
    r = run_torchrun(nproc, HELPER, *jobs, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def ckptool(*args: str) -> subprocess.CompletedProcess:
    """`ckptool ARGS` in this process (click's runner: the CLI's own code and exit status, without a
    Python and torch start per call); returncode, stdout and stderr like a subprocess."""
    from click.testing import CliRunner
    from ckptool.cli import main
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart already
    res = runner.invoke(main, [str(a) for a in args])
    r = subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)
    assert r.returncode == 0, r.stdout + r.stderr + "".join(traceback.format_exception(*res.exc_info))
    return r


def losses(path: Path, which: str = "losses") -> torch.Tensor:
    """The run's main losses per step, or with which="mtp_losses" its MTP losses (a model with --mtp-num-layers)."""
    return torch.tensor(torch.load(path)[which], dtype=torch.float64)


def weight_gap(a: Path, b: Path, only=lambda name: True) -> float:
    """Largest |difference| between two checkpoints' weights over every canonical tensor (those `only` keeps)."""
    x, y = open_checkpoint(a), open_checkpoint(b)
    assert set(x.tensors) == set(y.tensors)
    return max((x.tensors[n].load().float() - y.tensors[n].load().float()).abs().max().item()
               for n in x.tensors if only(n))


# the TP2 training (in one launch with the other files' mcore_train_helper trainings at 2 processes)
TRAIN_TP2 = declare_runs(HELPER, 2, {"a2": f"train {{out}} --tp 2 --steps {STEPS} --more {MORE} --out {{out}}.pt",
                                     # MTP (issue 30): megatron-core's MTP block, its loss in the backward
                                     "m2": f"train {{out}} --tp 2 --arch llama_mtp --steps {STEPS} --more {MORE} "
                                           "--out {out}.pt",
                                     # and at PP 2: the MTP block and megatron-core's copy of the embedding last
                                     "q2": f"train {{out}} --pp 2 --arch llama_mtp --steps {STEPS} --more {MORE} "
                                           "--distributed-optimizer --out {out}.pt"})
# and the TP1 one (with the other files' one-process trainings of the helper, if any)
TRAIN_TP1 = declare_runs(HELPER, 1, {"a1": f"train {{out}} --tp 1 --steps {STEPS} --more {MORE} --out {{out}}.pt"})


@shared_followups
def runs(framework_runs, d):
    """TP2 -> TP1 and TP1 -> TP2, each carried and weights-only, plus the same-layout control (the resumes in one
    launch per process count with the other files' follow-ups of the helper)."""
    copy_run(framework_runs(HELPER, 2, TRAIN_TP2, timeout=300)["a2"], d / "a2")
    copy_run(framework_runs(HELPER, 1, TRAIN_TP1, timeout=300)["a1"], d / "a1")
    copy_run(framework_runs(HELPER, 2, TRAIN_TP2, timeout=300)["m2"], d / "m2")
    copy_run(framework_runs(HELPER, 2, TRAIN_TP2, timeout=300)["q2"], d / "q2")
    out = ckptool("reshard", d / "a2", d / "b1", "--tp", "1").stdout
    assert "optimizer state carried" in out
    ckptool("reshard", d / "a2", d / "w1", "--tp", "1", "--no-optimizer")
    ckptool("reshard", d / "a1", d / "b2", "--tp", "2")
    ckptool("reshard", d / "a1", d / "w2", "--tp", "2", "--no-optimizer")
    assert "optimizer state carried" in ckptool("reshard", d / "m2", d / "n1", "--tp", "1").stdout
    ckptool("reshard", d / "m2", d / "v1", "--tp", "1", "--no-optimizer")
    ckptool("reshard", d / "m2", d / "p2", "--tp", "1", "--pp", "2", "--pp-layers", "2,1")  # MTP at PP 2, written
    ckptool("reshard", d / "m2", d / "p2d", "--tp", "1", "--pp", "2", "--pp-layers", "2,1", "--distributed-optimizer")
    ckptool("reshard", d / "q2", d / "r1", "--pp", "1")  # and read (its embedding copy checked; distrib_optim.pt)
    mtp = "--arch llama_mtp"
    yield [(HELPER, 1, [f"resume {d}/b1 --tp 1 --more {MORE} --out {d}/b1.pt",
                        f"resume {d}/w1 --tp 1 --more {MORE} --out {d}/w1.pt --weights-only",
                        f"resume {d}/n1 --tp 1 {mtp} --more {MORE} --out {d}/n1.pt",
                        f"resume {d}/v1 --tp 1 {mtp} --more {MORE} --out {d}/v1.pt --weights-only",
                        f"resume {d}/r1 --tp 1 {mtp} --more {MORE} --out {d}/r1.pt"]),
           (HELPER, 2, [f"resume {d}/b2 --tp 2 --more {MORE} --out {d}/b2.pt",
                        f"resume {d}/w2 --tp 2 --more {MORE} --out {d}/w2.pt --weights-only",
                        f"resume {d}/a2 --tp 2 --more {MORE} --out {d}/a2_control.pt",
                        f"resume {d}/m2 --tp 2 {mtp} --more {MORE} --out {d}/m2_control.pt",
                        f"resume {d}/p2 --pp 2 {mtp} --more {MORE} --out {d}/p2.pt",
                        f"resume {d}/p2d --pp 2 {mtp} --more {MORE} --out {d}/p2d.pt --distributed-optimizer"])]
    return d


def test_same_layout_resume_reproduces_the_run_exactly(runs):
    went_on = losses(runs / "a2.pt")[STEPS:]
    assert torch.equal(losses(runs / "a2_control.pt"), went_on)
    assert weight_gap(runs / "a2_continued", runs / "a2_resumed_tp2") == 0.0


@pytest.mark.parametrize("src,carried,dropped,tp", [("a2", "b1", "w1", 1), ("a1", "b2", "w2", 2)])
def test_resharded_optimizer_resumes_like_the_run_that_went_on(runs, src, carried, dropped, tp):
    went_on = losses(runs / f"{src}.pt")[STEPS:]
    gap = (losses(runs / f"{carried}.pt") - went_on).abs().max().item()
    gap_weights_only = (losses(runs / f"{dropped}.pt") - went_on).abs().max().item()
    print(f"{src} -> TP{tp}: loss gap carried {gap:.2e}, weights-only {gap_weights_only:.2e}")
    assert gap < LOSS_TOL
    assert gap_weights_only > 10 * max(gap, 1e-5)
    w_gap = weight_gap(runs / f"{src}_continued", runs / f"{carried}_resumed_tp{tp}")
    w_gap_weights_only = weight_gap(runs / f"{src}_continued", runs / f"{dropped}_weights_only_tp{tp}")
    print(f"{src} -> TP{tp}: weight gap carried {w_gap:.2e}, weights-only {w_gap_weights_only:.2e}")
    assert w_gap < 0.25 * w_gap_weights_only


# --- multi-token prediction (issue 30) -------------------------------------------------------------------
# The llama model with megatron-core's MTP block (--mtp-num-layers 1, layer 3 canonically): its loss is in the
# backward (MTPLossAutoScaler), so its layer's Adam moments and masters are part of the state carried.
MTP_LAYER = "layers.3."


def test_mtp_same_layout_resume_reproduces_the_run_exactly(runs):
    for which in ("losses", "mtp_losses"):
        assert len(losses(runs / "m2.pt", which)) == STEPS + MORE
        assert torch.equal(losses(runs / "m2_control.pt", which), losses(runs / "m2.pt", which)[STEPS:])
    assert weight_gap(runs / "m2_continued", runs / "m2_resumed_tp2") == 0.0


def test_mtp_resharded_optimizer_resumes_like_the_run_that_went_on(runs):
    """TP2 -> TP1 with the optimizer: the main and the MTP loss go on as the run that went on at TP2, within the
    TP reduction noise; without the optimizer (Adam from zero moments) both are visibly off, and so are the MTP
    layer's own weights."""
    for which in ("losses", "mtp_losses"):
        went_on = losses(runs / "m2.pt", which)[STEPS:]
        gap = (losses(runs / "n1.pt", which) - went_on).abs().max().item()
        gap_weights_only = (losses(runs / "v1.pt", which) - went_on).abs().max().item()
        print(f"MTP model TP2 -> TP1 {which}: gap carried {gap:.2e}, weights-only {gap_weights_only:.2e}")
        assert gap < LOSS_TOL
        assert gap_weights_only > 10 * max(gap, 1e-5)
    mtp_layer = lambda name: name.startswith(MTP_LAYER)  # noqa: E731
    w_gap = weight_gap(runs / "m2_continued", runs / "n1_resumed_tp1", mtp_layer)
    w_gap_weights_only = weight_gap(runs / "m2_continued", runs / "v1_weights_only_tp1", mtp_layer)
    print(f"MTP layer's weights: gap carried {w_gap:.2e}, weights-only {w_gap_weights_only:.2e}")
    assert w_gap < 0.25 * w_gap_weights_only


@pytest.mark.parametrize("src,resumed", [("m2", "p2"), ("m2", "p2d"), ("q2", "r1")])
def test_mtp_resumes_across_pipeline_stages(runs, src, resumed):
    """MTP at PP 2 both ways: the TP 2 run resharded to PP 2 (ckptool writes the last stage's copy of the word
    embedding megatron-core keeps for MTP, and its optimizer state: in the rank files, p2, and in distrib_optim.pt,
    p2d) and megatron-core's own PP 2 run with its distributed optimizer resharded to PP 1 (ckptool reads that copy,
    checked equal to the first stage's): megatron-core resumes each with its optimizer and the main and MTP losses go
    on as the run's that went on."""
    for which in ("losses", "mtp_losses"):
        went_on = losses(runs / f"{src}.pt", which)[STEPS:]
        gap = (losses(runs / f"{resumed}.pt", which) - went_on).abs().max().item()
        print(f"MTP model {src} -> {resumed} {which}: gap {gap:.2e}")
        assert gap < LOSS_TOL
