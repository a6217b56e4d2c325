"""scripts/mlm_gpu_resume.py, the issue-19 driver (Megatron-LM on 4 GPUs resuming ckptool's reshards),
checked where it runs without GPUs: how it reads Megatron-LM's loss lines and which ckptool and
Megatron-LM commands it plans. Its GPU figures are in docs/megatron-lm-gpu.md."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import mlm_gpu_resume as drv  # noqa: E402

# Megatron-LM's own log lines (d98e8a64), as a resumed run printed them on the device.
LINE = (" [2026-11-27 09:41:47.359895] iteration        {it}/       5 | consumed samples:           {n} |"
        " elapsed time per iteration (ms): 4279.5 | learning rate: 3.000000E-03 | global batch size:     8 |"
        " lm loss: {loss} | loss scale: 1.0 | grad norm: 4.973 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |")


def write_log(tmp_path, printed):
    log = tmp_path / "run.log"
    log.write_text("\n".join(["noise", *[LINE.format(it=i, n=8 * i, loss=v) for i, v in printed], "done"]))
    return log


def test_a_runs_second_logged_step_is_recovered_from_megatrons_running_mean(tmp_path):
    # Megatron-LM does not reset its loss accumulators after a run's first logged iteration, so the
    # next line prints the mean of both steps: 6.861133 = (6.830383 + 6.891883) / 2.
    losses = drv.parse_losses(write_log(tmp_path, [(4, "6.830383E+00"), (5, "6.861133E+00")]))
    assert losses[4] == pytest.approx(6.830383)
    assert losses[5] == pytest.approx(6.891883, abs=1e-6)


def test_only_the_second_line_of_a_run_is_corrected(tmp_path):
    printed = [(1, "6.995761E+00"), (2, "6.929517E+00"), (3, "7.003228E+00"), (4, "6.842361E+00")]
    losses = drv.parse_losses(write_log(tmp_path, printed))
    assert losses[2] == pytest.approx(2 * 6.929517 - 6.995761)
    assert [losses[i] for i in (1, 3, 4)] == [6.995761, 7.003228, 6.842361]


def plan(tmp_path, optims, models=("gpt2", "mixtral")):
    d = drv.Driver(tmp_path / "mlm", tmp_path / "w", tmp_path / "out", 8, 16, 0)
    return d, d.sources(list(models), True, optims)


def test_sources_cover_both_optimizers_formats_and_a_repeat(tmp_path):
    _, sources = plan(tmp_path, ["adam", "distopt"], models=("gpt2",))
    assert sorted(sources) == sorted(f"gpt2-{o}-{f}" for o in ("adam", "distopt")
                                     for f in ("torch-a", "torch-b", "torch_dist-a"))
    _, sources = plan(tmp_path, ["adamfp32"])
    assert sorted(sources) == ["gpt2-adamfp32-torch-a", "mixtral-adam-torch-a", "mixtral-distopt-torch_dist-a"]


def test_convert_plans_the_issues_layouts_with_the_optimizer(tmp_path, monkeypatch):
    d, sources = plan(tmp_path, ["adam", "distopt"])
    ran = []
    monkeypatch.setattr(d, "trained", lambda name: True)
    monkeypatch.setattr(d, "run", lambda jobs: ran.extend(jobs))
    d.convert(sources)
    args = {j.name: j.argv[j.argv.index("ckptool") + 1:] for j in ran}
    # copy b is a noise run: never converted
    assert not any("-torch-b-" in name for name in args)
    distopt = args["reshard-gpt2-distopt-torch-a-tp2pp1dp2-optim"]
    assert distopt[distopt.index("--tp") + 1] == "2" and distopt[distopt.index("--pp") + 1] == "1"
    assert distopt[distopt.index("--dp") + 1] == "2" and "--distributed-optimizer" in distopt
    assert distopt[distopt.index("--iteration") + 1] == str(drv.SAVE_STEP)  # the run saved step 5 too
    # torch_dist's fully_reshardable form needs no DP; weights-only beside the Adam torch jobs only
    assert "--dp" not in args["reshard-gpt2-distopt-torch_dist-a-tp1pp4-optim"]
    assert "--no-optimizer" in args["reshard-gpt2-adam-torch-a-tp4pp1-weights"]
    assert not any(name.endswith("-weights") and "distopt" in name for name in args)
    moe = args["reshard-mixtral-adam-torch-a-tp1ep4-optim"]
    assert moe[moe.index("--ep") + 1] == "4" and moe[moe.index("--tp") + 1] == "1"
    assert args["to-hf-mixtral-adam-torch-a"][:1] == ["to-hf"]


def test_resumes_load_without_rng_and_weights_only_without_optimizer(tmp_path, monkeypatch):
    d, sources = plan(tmp_path, ["adam"], models=("gpt2",))
    ran = []
    monkeypatch.setattr(d, "trained", lambda name: True)
    monkeypatch.setattr(d, "run", lambda jobs: ran.extend(jobs))
    outputs = [dict(sources["gpt2-adam-torch-a"], source="gpt2-adam-torch-a", target=t, mode=m,
                    dst=str(tmp_path / t), layout=dict(tp=tp, pp=pp, ep=1), dp=dp)
               for (t, (tp, pp, _, dp)) in drv.TARGETS["dense"].items() for m in ("optim", "weights")]
    d.resume(sources, outputs)
    by = {j.name: j.argv for j in ran}
    tp4 = by["resume-gpt2-adam-torch-a-tp4pp1-optim"]
    assert tp4[tp4.index("--tensor-model-parallel-size") + 1] == "4"
    assert "--no-load-rng" in tp4 and "--no-load-optim" not in tp4 and "--bf16" in tp4
    assert "--no-load-optim" in by["resume-gpt2-adam-torch-a-tp4pp1-weights"]
    control = by["resume-gpt2-adam-torch-a-same-control"]
    assert control[control.index("--ckpt-step") + 1] == str(drv.SAVE_STEP)
    # every Megatron-LM run goes through the torch-Adam patches
    assert all(Path(argv[argv.index("--nproc-per-node") + 2]).name == "mlm_torch_adam.py" for argv in by.values())


def test_verify_runs_each_output_on_tp_x_pp_x_ep_ranks(tmp_path, monkeypatch):
    """`ckptool verify` under torchrun wants TP x PP x EP processes, for torch_dist MoE outputs too."""
    d, sources = plan(tmp_path, ["adam"])
    ran = []
    monkeypatch.setattr(d, "run", lambda jobs: ran.extend(jobs))
    outputs = [dict(sources["mixtral-distopt-torch_dist-a"], source="mixtral-distopt-torch_dist-a", target="tp1ep4",
                    mode="optim", dst=str(tmp_path / "moe"), layout=dict(tp=1, pp=1, ep=4), dp=4),
               dict(sources["gpt2-adam-torch_dist-a"], source="gpt2-adam-torch_dist-a", target="tp2pp1dp2",
                    mode="optim", dst=str(tmp_path / "dense"), layout=dict(tp=2, pp=1, ep=1), dp=2)]
    d.verify(outputs)
    nproc = {j.name: int(j.argv[j.argv.index("--nproc-per-node") + 1]) for j in ran}
    assert nproc == {"verify-mixtral-torch_dist-tp1ep4": 4, "verify-gpt2-torch_dist-tp2pp1dp2": 2}
