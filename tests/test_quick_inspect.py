"""`ckptool inspect` without torch (ckptool/quick_inspect.py) and the lazily imported CLI: the quick
path prints exactly what the full reader's path prints, and never imports torch."""
import io
import json
import subprocess
import sys

import click
import pytest
import torch
from click.testing import CliRunner

from conftest import ROOT, copy_run, declare_runs, real_checkpoint
from ckptool import quick_inspect
from ckptool.cli import main
from ckptool.commands import inspect_cmd
from ckptool.write_options import WriteOptions

# Runs `ckptool ARGS...` in a fresh interpreter and fails unless torch stayed unimported.
NO_TORCH = ("import sys\nfrom ckptool.cli import main\n"
            "try:\n    main(sys.argv[1:], prog_name='ckptool')\n"
            "finally:\n    sys.stdout.flush()\n"
            "    assert 'torch' not in sys.modules, 'torch was imported'\n")


def torch_free(*args) -> str:
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def full_path(monkeypatch, *args) -> str:
    """The same command through the full reader (api.open), in this process."""
    monkeypatch.setattr(inspect_cmd, "quick_open", lambda path, kw: None)
    r = CliRunner().invoke(main, list(map(str, args)))
    monkeypatch.undo()
    assert r.exit_code == 0, r.output
    return r.output


def quick_equals_full(monkeypatch, d, note=None) -> str:
    """inspect of d without torch and through the full reader: the same --json and the same text; the JSON."""
    quick_json = torch_free("inspect", d, "--json")
    assert quick_json == full_path(monkeypatch, "inspect", d, "--json"), note
    assert torch_free("inspect", d) == full_path(monkeypatch, "inspect", d), note
    return quick_json


def test_quick_inspect_of_gpt_oss_as_released_without_torch(monkeypatch):
    """fixtures/gpt_oss_mxfp4 (transformers' own MXFP4 quantizer): stacked experts, MXFP4 blocks, sinks, windows."""
    doc = json.loads(quick_equals_full(monkeypatch, ROOT / "fixtures/gpt_oss_mxfp4"))
    assert doc["quantization"]["method"] == "mxfp4" and doc["config"]["attn_sinks"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """The committed HF fixtures (GPT-2 tied, Llama GQA) and tiny transformers MoE/MLA models."""
    from test_moe import _build, randomise
    root = tmp_path_factory.mktemp("quick")
    dirs = {"gpt2": ROOT / "fixtures/gpt2_mcore_tp2pp2/hf", "llama": ROOT / "fixtures/llama_legacy_norm_tp2pp1/hf"}
    for kind in ("qwen2_moe", "deepseek_v3"):
        torch.manual_seed(3)
        randomise(_build(kind)).save_pretrained(root / kind)
        dirs[kind] = root / kind
    return dirs


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2_moe", "deepseek_v3"])
def test_quick_inspect_equals_the_full_path_without_torch(hf_dirs, monkeypatch, kind):
    d = hf_dirs[kind]
    quick_json = torch_free("inspect", d, "--json")
    assert json.loads(quick_json) == json.loads(full_path(monkeypatch, "inspect", d, "--json"))
    assert quick_json == full_path(monkeypatch, "inspect", d, "--json")
    assert torch_free("inspect", d) == full_path(monkeypatch, "inspect", d)
    assert quick_inspect.quick_open(d, {}) is not None


def test_full_path_when_the_quick_one_cannot_say(hf_dirs, tmp_path, monkeypatch):
    """Options, other formats and damaged files take the full reader, which behaves as before."""
    gpt2 = hf_dirs["gpt2"]
    assert quick_inspect.quick_open(gpt2, {"true_vocab_size": 1000}) is None
    assert quick_inspect.quick_open(ROOT / "fixtures/real/mds_gpt2_pipe_tp2pp2_bf16_zero1/checkpoint",
                                    {"weights": "model"}) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((gpt2 / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((gpt2 / "model.safetensors").read_bytes()[:1000])
    assert quick_inspect.quick_open(broken, {}) is None
    claimed = tmp_path / "claimed"  # a DeepSpeed `latest` file: the format table asks DeepSpeed first
    claimed.mkdir()
    for f in gpt2.iterdir():
        (claimed / f.name).write_bytes(f.read_bytes())
    assert quick_inspect.quick_open(claimed, {}) is not None
    (claimed / "latest").write_text("global_step5")  # names no step: DeepSpeed does not claim it, HF does
    assert torch_free("inspect", claimed, "--json") == full_path(monkeypatch, "inspect", claimed, "--json")
    (claimed / "global_step5").mkdir()
    (claimed / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"")  # now DeepSpeed's
    assert quick_inspect.quick_open(claimed, {}) is None
    r = CliRunner().invoke(main, ["inspect", str(broken)])
    assert r.exit_code != 0 and "truncated or corrupt" in r.output
    r = CliRunner().invoke(main, ["inspect", str(gpt2), "--true-vocab-size", "1000", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["vocab_size_source"] == "--true-vocab-size"


@pytest.fixture(scope="module")
def megatron_dirs(tmp_path_factory):
    """Megatron torch-format checkpoints the quick path reads: the committed fixtures, and weights-only
    copies of the real Megatron-LM saves (their args as Megatron wrote them, enums and all)."""
    import ckptool
    root = tmp_path_factory.mktemp("quick_megatron")
    dirs = {"gpt2_mcore": ROOT / "fixtures/gpt2_mcore_tp2pp2/checkpoint",
            "llama_legacy_norm": ROOT / "fixtures/llama_legacy_norm_tp2pp1/checkpoint"}
    for case in ("mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"):
        src = real_checkpoint(case) / "checkpoint"
        dirs[case] = src  # the real training save, with the (non-distributed) optimizer's state
        ckptool.reshard(src, root / case, tp=2, pp=2, optimizer=False)
        dirs[case + "_weights"] = root / case
    ckptool.reshard(dirs["gpt2_mcore"], root / "vpp", tp=1, pp=2, vpp=2, optimizer=False)
    dirs["gpt2_mcore_vpp"] = root / "vpp"
    # torch_dist: ckptool's writer (stacked layers, args carried from the real run)
    ckptool.merge(dirs["mlm_mcore_gpt2_torch_tp2pp2_weights"], root / "dist_gpt2", format="torch_dist")
    ckptool.merge(dirs["llama_legacy_norm"], root / "dist_llama", format="torch_dist")
    dirs["dist_gpt2"], dirs["dist_llama"] = root / "dist_gpt2", root / "dist_llama"
    # torch_dist of a run with an uneven pipeline split (the args' first / last stage layer counts)
    ckptool.reshard(dirs["gpt2_mcore"], root / "dist_uneven", tp=1, pp=2, pp_layers="3,1", format="torch_dist",
                    optimizer=False)
    dirs["dist_uneven"] = root / "dist_uneven"
    return dirs


QUICK_MEGATRON = ["gpt2_mcore", "llama_legacy_norm", "mlm_mcore_gpt2_torch_tp2pp2_weights",
                  "mlm_legacy_gpt2_torch_tp2pp2_weights", "gpt2_mcore_vpp", "dist_gpt2", "dist_llama", "dist_uneven",
                  "mlm_mcore_gpt2_torch_tp2pp2", "mlm_legacy_gpt2_torch_tp2pp2"]


def test_torch_dist_inspect_reports_the_runs_uneven_pipeline_split(megatron_dirs, monkeypatch):
    """torch_dist files hold global tensors: the split a run trained with is only in its args
    (decoder_first/last_pipeline_num_layers), and inspect reports it, with and without torch."""
    got = json.loads(quick_equals_full(monkeypatch, megatron_dirs["dist_uneven"]))
    assert got["layout"]["stage_layers"] == [3, 1] and got["layout"]["pp"] == 2
    assert "layers/stage 3,1" in torch_free("inspect", megatron_dirs["dist_uneven"])


@pytest.mark.parametrize("kind", QUICK_MEGATRON)
def test_quick_megatron_inspect_equals_the_full_path_without_torch(megatron_dirs, monkeypatch, kind):
    d = megatron_dirs[kind]
    quick_equals_full(monkeypatch, d)
    quick = quick_inspect.quick_open(d, {})
    assert type(next(iter(quick.tensors.values()))).__name__ == "TensorMeta"
    if kind.startswith("mlm_") and not kind.endswith("_weights"):  # the real runs' Adam state, read as shapes
        assert quick.optimizer.step == 3 and quick.optimizer.slot_names() == ["master", "exp_avg", "exp_avg_sq"]


def test_damaged_megatron_and_torch_dist_files_take_the_full_path(megatron_dirs, tmp_path):
    """What the full reader refuses on opening (a missing chunk file, a truncated rank file, a tensor
    whose storage record is gone, code in a pickle) the quick path leaves to it."""
    import shutil
    import zipfile
    dist = tmp_path / "dist"
    shutil.copytree(megatron_dirs["dist_llama"], dist)
    (next(dist.glob("iter_*")) / "__0_0.distcp").unlink()
    assert quick_inspect.quick_open(dist, {}) is None
    meg = tmp_path / "meg"
    shutil.copytree(megatron_dirs["llama_legacy_norm"], meg)
    rank_file = next(meg.glob("*/mp_rank_01/model_optim_rng.pt"))
    whole = rank_file.read_bytes()
    rank_file.write_bytes(whole[: len(whole) // 2])
    assert quick_inspect.quick_open(meg, {}) is None
    with zipfile.ZipFile(rank_file.with_name("x.pt"), "w") as out, zipfile.ZipFile(io.BytesIO(whole)) as src:
        for info in src.infolist():  # every record but one tensor's storage
            if "/data/" not in info.filename or not info.filename.endswith("/0"):
                out.writestr(info, src.read(info))
    rank_file.with_name("x.pt").replace(rank_file)
    assert quick_inspect.quick_open(meg, {}) is None
    # one TP rank's fc1 cut in half (the full reader: "inconsistent across tensor-parallel ranks")
    from ckptool.io.torchfile import load_torch_file, save_streaming
    from ckptool.lazy import Const
    shutil.copytree(megatron_dirs["gpt2_mcore"], tmp_path / "shape")
    rank_file = next((tmp_path / "shape").glob("*/mp_rank_01_000/model_optim_rng.pt"))
    tree = load_torch_file(rank_file)
    w = tree["model"]["decoder.layers.0.mlp.linear_fc1.weight"]
    tree["model"]["decoder.layers.0.mlp.linear_fc1.weight"] = Const(torch.zeros(w.shape[0] // 2, w.shape[1]))
    save_streaming(tree, rank_file.with_suffix(".tmp"))
    rank_file.with_suffix(".tmp").replace(rank_file)
    assert quick_inspect.quick_open(tmp_path / "shape", {}) is None
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "shape")])
    assert r.exit_code == 2 and "inconsistent across tensor-parallel ranks" in r.output
    code = tmp_path / "code"
    shutil.copytree(megatron_dirs["dist_llama"], code)
    (next(code.glob("iter_*")) / ".metadata").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    assert quick_inspect.quick_open(code, {}) is None
    r = CliRunner().invoke(main, ["inspect", str(code)])
    assert r.exit_code == 2 and "refusing" in r.output and "pwned" not in r.output


def test_quick_inspect_of_megatron_cores_own_torch_dist_save(framework_runs, monkeypatch):
    """A torch_dist checkpoint saved by megatron-core itself (dist_checkpointing under torchrun, args
    stored in the common state) reads the same both ways; a bare save without args is the full
    reader's (its config needs flags). (test_dist.py's saves, run once per session: read only here.)"""
    from test_dist import HAVE_MCORE, HELPER, MCORE_SAVES
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    saves = framework_runs(HELPER, 2, {n: MCORE_SAVES[n] for n in ("gpt2_pp2", "bare")}, timeout=240)
    d = saves["gpt2_pp2"]
    quick_equals_full(monkeypatch, d)
    assert quick_inspect.quick_open(saves["bare"], {}) is None


def test_help_imports_no_command_module_and_lists_their_own_lines():
    out = torch_free("--help")
    assert "inspect    Show a checkpoint's format" in out
    ctx = click.Context(main, info_name="ckptool")
    table, real = ctx.make_formatter(), ctx.make_formatter()
    main.format_commands(ctx, table)  # the one-line helps kept in cli.COMMANDS
    click.Group.format_commands(main, ctx, real)  # each command's own, from its docstring
    assert table.getvalue() == real.getvalue()


def test_torchrun_launcher_finds_the_command_in_the_table():
    from ckptool.torchrun import split_argv
    assert split_argv(["--nproc-per-node", "2", "verify", "out", "--reference", "src"]) == (
        ["--nproc-per-node", "2"], ["verify", "out", "--reference", "src"])


def test_quick_inspect_of_torch_dist_with_optimizer_state(megatron_dirs, framework_runs, tmp_path, monkeypatch):
    """torch_dist saves with optimizer state: megatron-core's own (non-distributed optimizer in bf16 and
    fp32, the distributed optimizer's fully_reshardable form, and its flat per-bucket dp_reshardable form
    at TP 2, PP 2, PP 2 x VPP 2 and with --overlap-grad-reduce buckets, every rank's layout checked
    against its stored bucket sizes) and ckptool's output of a real Megatron-LM
    training save read quick, equal to the full path."""
    import ckptool
    from test_dist_optim import HAVE_MCORE, HELPER, SAVES
    ckptool.merge(megatron_dirs["mlm_mcore_gpt2_torch_tp2pp2"], tmp_path / "ours", format="torch_dist")
    dirs = {"ours": (tmp_path / "ours", "megatron-core-dist (fully_reshardable)")}
    if HAVE_MCORE:  # test_dist_optim.py's saves, run once per session: read only here
        names = ("plain", "f32", "fr", "dpr", "dpr_pp2", "dpr_buckets", "dpr_vpp")
        saves = framework_runs(HELPER, 2, {n: SAVES[n] for n in names})
        dirs.update(plain=(saves["plain"], "megatron-core-dist (non-distributed)"),
                    f32=(saves["f32"], "megatron-core-dist (non-distributed)"),
                    fr=(saves["fr"], "megatron-core-dist (fully_reshardable)"),
                    **{n: (saves[n], "megatron-core-dist (dp_reshardable)")
                       for n in ("dpr", "dpr_pp2", "dpr_buckets", "dpr_vpp")})
    for name, (d, kind) in dirs.items():
        quick = quick_inspect.quick_open(d, {})
        full_json = full_path(monkeypatch, "inspect", d, "--json")
        assert json.loads(full_json)["optimizer"]["step"] > 0
        assert quick.optimizer.kind == kind, name
        assert torch_free("inspect", d, "--json") == full_json, name
        assert torch_free("inspect", d) == full_path(monkeypatch, "inspect", d), name
    if HAVE_MCORE:  # fp32 training: the weights are the masters, no slot of their own
        assert quick_inspect.quick_open(saves["f32"], {}).optimizer.slot_names() == ["exp_avg", "exp_avg_sq"]
        # a rank's stored bucket sizes that no layout of the model reproduces: no quick answer
        from ckptool.formats.dcp import quick as quick_dist, quick_buckets as dist_buckets
        read_objects = dist_buckets.object_reader

        def off_by_64(keys, read_bytes):
            objects = read_objects(keys, read_bytes)

            def edited(prefix):
                obj = objects(prefix)
                if prefix == "optimizer.distributed.dp_group_idx_1.per_bucket_numel_unpadded/":
                    sizes = obj[0][0]
                    sizes.update({k: [n + 64 for n in v] for k, v in sizes.items()})
                return obj
            return edited
        monkeypatch.setattr(quick_dist, "object_reader", off_by_64)
        assert quick_inspect.quick_open(saves["dpr_pp2"], {}) is None


# an fp32 megatron-core training (run with the other files' mcore_train_helper trainings, in one launch)
F32_TRAIN = declare_runs(ROOT / "tests" / "mcore_train_helper.py", 2,
                         {"f32": "train {out} --tp 2 --steps 2 --more 0 --dtype fp32 --out {out}.pt"})


def test_quick_inspect_of_megatron_core_training_saves_with_three_groups_and_fp32(framework_runs, tmp_path,
                                                                                  monkeypatch):
    """megatron-core training saves in the torch format: --decoupled-lr with an lr_mult override (three
    groups, tied by their traits), its PP 3 reshard by ckptool (a middle stage lists the decoupled group
    empty), and fp32 training (no masters apart: kind megatron-fp32) read quick, equal to the full path."""
    from test_dist import HAVE_MCORE
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    import ckptool
    from test_optimizer_groups import TRAINS  # its TP2 training with --decoupled-lr 3e-3 --lr-mult 0.5
    runs = framework_runs(ROOT / "tests" / "mcore_train_helper.py", 2, {"groups": TRAINS["a2"], **F32_TRAIN})
    for name, stem in runs.items():
        copy_run(stem, tmp_path / name)
    ckptool.reshard(tmp_path / "groups", tmp_path / "pp3", tp=1, pp=3)
    for name, kind, groups in (("groups", "megatron", 3), ("pp3", "megatron", 3), ("f32", "megatron-fp32", 2)):
        d = tmp_path / name
        quick = quick_inspect.quick_open(d, {})
        assert quick.optimizer.kind == kind and len(quick.optimizer.param_groups) == groups, name
        quick_equals_full(monkeypatch, d, name)
    three = quick_inspect.quick_open(tmp_path / "groups", {}).optimizer.param_groups
    assert 0.5 in [g.hyper.get("lr_mult") for g in three]


def test_optimizer_state_the_quick_tie_cannot_decide_takes_the_full_path(megatron_dirs, tmp_path, monkeypatch):
    """Rank files whose optimizer the full reader refuses or ties by other means (a group size off, a
    moment of another shape, one rank never stepped, groups told apart by sizes alone) give no quick
    answer; the full reader's message or description stands."""
    import shutil
    from ckptool.io.torchfile import load_torch_file, save_streaming
    src = megatron_dirs["mlm_mcore_gpt2_torch_tp2pp2"]

    def edited(name, edit):
        d = tmp_path / name
        shutil.copytree(src, d)
        f = next(d.glob("*/mp_rank_01_001/model_optim_rng.pt"))
        tree = load_torch_file(f)
        edit(tree["optimizer"])
        save_streaming(tree, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
        assert quick_inspect.quick_open(d, {}) is None, name
        return d

    def moved_param(opt):  # the first decay parameter listed in the no-decay group
        groups = opt["optimizer"]["param_groups"]
        groups[1]["params"].insert(0, groups[0]["params"].pop(0))
        opt["fp32_from_fp16_params"][1].insert(0, opt["fp32_from_fp16_params"][0].pop(0))

    def other_shape(opt):
        state = opt["optimizer"]["state"]
        state[0]["exp_avg"] = state[1]["exp_avg"]

    def never_stepped(opt):
        opt["optimizer"]["state"] = {}

    def sizes_alone(opt):  # an older era: no wd_mult, weight decay 0 in both groups
        for g in opt["optimizer"]["param_groups"]:
            g.pop("wd_mult")
            g["weight_decay"] = 0.0

    for name, edit in (("moved", moved_param), ("shape", other_shape), ("never", never_stepped)):
        r = CliRunner().invoke(main, ["inspect", str(edited(name, edit))])
        assert r.exit_code == 2 and "pass --no-optimizer" in r.output, (name, r.output)
    d = edited("sizes", sizes_alone)
    full_path(monkeypatch, "inspect", d)  # whatever the full reader makes of it, the quick path did not guess


@pytest.mark.parametrize("era,untied", [("old", False), ("new", True)])
def test_quick_inspect_of_megatron_deepspeed_pipeline_saves(tmp_path, monkeypatch, era, untied):
    """Megatron-DeepSpeed pipeline saves: the real TP2 PP2 bf16 ZeRO-1 run (fp32 master weights from the
    optimizer partitions, Adam state, groups) and synthetic layer files of both spec-index eras without
    optimizer shards (16-bit model weights, untied head) read quick, equal to the full path; a save with
    one model-parallel rank's optimizer shard gone is the full reader's to judge."""
    import shutil
    from test_deepspeed import _rand_gpt, _write_pipeline
    real = real_checkpoint("mds_gpt2_pipe_tp2pp2_bf16_zero1") / "checkpoint"
    t = _rand_gpt(h=8, heads=2, vocab=16, seed=7)
    t["head"] = torch.randn(16, 8)
    (tmp_path / "synthetic").mkdir()
    _write_pipeline(tmp_path / "synthetic", t, era, untied, "grouped")
    for d in (real, tmp_path / "synthetic"):
        quick = quick_inspect.quick_open(d, {})
        assert quick is not None, d
        quick_equals_full(monkeypatch, d, d)
    quick = quick_inspect.quick_open(real, {})
    assert quick.optimizer.kind == "deepspeed-zero1" and quick.optimizer.step == 3
    assert "master weights (float32)" in quick.source.storage
    assert "model weights" in quick_inspect.quick_open(tmp_path / "synthetic", {}).source.storage
    shutil.copytree(real, tmp_path / "missing")
    next((tmp_path / "missing").glob("*/bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt")).unlink()
    assert quick_inspect.quick_open(tmp_path / "missing", {}) is None
    assert "model weights" in json.loads(full_path(monkeypatch, "inspect", tmp_path / "missing", "--json"))["storage"]


@pytest.mark.parametrize("case", ["bf16_tp2_dp3", "zero2_fp16_dp4", "weights_only", "zero3_tp2_dp3"])
def test_quick_inspect_of_megatron_names_under_deepspeed_module(tmp_path, monkeypatch, case):
    """Megatron-DeepSpeed --no-pipeline-parallel saves (Megatron names under `module`, documented layouts
    written as tests/test_deepspeed.py does): BF16_Optimizer at TP 2 x DP 3 with the padding kept, ZeRO-2
    at DP 4 with it stripped, model states without shards (16-bit module weights), and ZeRO-3 at TP 2 x
    DP 3 (padded slices, a model-states file per DP rank) read quick, equal to the full path."""
    from test_deepspeed import _args, _legacy_module_tp, _rand_gpt, _write_zero12, _write_zero3
    t = _rand_gpt(h=8, heads=2, vocab=16)
    tag = tmp_path / "global_step7"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step7")
    if case == "zero3_tp2_dp3":
        for mp in range(2):
            _write_zero3(tag, _legacy_module_tp(t, mp, 2, heads=2), mp, 3,
                         {"args": _args(tp=2), "iteration": 7, "checkpoint_version": 3.0})
        assert quick_inspect.quick_open(tmp_path, {}).optimizer.kind == "deepspeed-zero3"
        quick_equals_full(monkeypatch, tmp_path)
        return
    tp, dp, prefix, stage, keep = {"bf16_tp2_dp3": (2, 3, "bf16_", None, True), "zero2_fp16_dp4": (1, 4, "", 2, False),
                                   "weights_only": (2, 1, "", 1, False)}[case]
    for mp in range(tp):
        _write_zero12(tag, _legacy_module_tp(t, mp, tp, heads=2), mp, dp, prefix, stage, keep,
                      {"args": _args(tp=tp), "iteration": 7, "checkpoint_version": 3.0})
    if case == "weights_only":
        for f in tag.glob("*optim_states.pt"):
            f.unlink()
    quick = quick_inspect.quick_open(tmp_path, {})
    assert quick is not None and quick.source.dialect.startswith("megatron module")
    quick_equals_full(monkeypatch, tmp_path)
    assert (quick.optimizer is None) == (case == "weights_only")


def test_quick_inspect_of_the_distributed_optimizer(megatron_dirs, framework_runs, tmp_path, monkeypatch):
    """distrib_optim.pt beside the rank files: megatron-core's own save (TP 1 x DP 2) and ckptool's outputs
    of the real training save (coalesced at TP2 PP2 DP 2; DP 4 with --overlap-grad-reduce buckets; the
    2024-02 bucket-list form with virtual pipeline chunks) read quick, every buffer's sizes checked
    against megatron-core's layout, equal to the full path; a buffer whose stated size is off is the full
    reader's to refuse."""
    import shutil
    import ckptool
    from test_dist import HAVE_MCORE
    src = megatron_dirs["mlm_mcore_gpt2_torch_tp2pp2"]
    ckptool.reshard(src, tmp_path / "coalesced", tp=2, pp=2, distributed_optimizer=True, dp=2)
    ckptool.reshard(src, tmp_path / "buckets", tp=1, pp=1, distributed_optimizer=True, dp=4, overlap_grad_reduce=True,
                    ddp_bucket_size=20000)
    ckptool.reshard(src, tmp_path / "bucket_list", tp=1, pp=2, vpp=2, distributed_optimizer=True,
                    distrib_optim_era="2024-02")
    dirs = ["coalesced", "buckets", "bucket_list"]
    if HAVE_MCORE:  # test_distopt.py's training, run once per session
        from test_distopt import TRAIN
        from test_resume import HELPER
        copy_run(framework_runs(HELPER, 2, {"mcore": TRAIN}, timeout=300)["mcore"], tmp_path / "mcore")
        dirs.append("mcore")
    for name in dirs:
        d = tmp_path / name
        assert quick_inspect.quick_open(d, {}).optimizer.kind == "megatron-distributed", name
        quick_equals_full(monkeypatch, d, name)
    # one rank's buffer stated at another size than it holds and than the layout gives
    from ckptool.io.torchfile import load_torch_file, save_streaming
    shutil.copytree(tmp_path / "coalesced", tmp_path / "off")
    f = next((tmp_path / "off").glob("*/mp_rank_01_001/distrib_optim.pt"))
    state = load_torch_file(f)
    entry = next(iter(state[0].values()))
    entry["numel_unpadded"] += 64
    save_streaming(state, f.with_suffix(".tmp"))
    f.with_suffix(".tmp").replace(f)
    assert quick_inspect.quick_open(tmp_path / "off", {}) is None
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "off")])
    assert r.exit_code == 2 and "numel_unpadded" in r.output and "pass --no-optimizer" in r.output


# Hugging Face models trained under the real DeepSpeed engine (one frozen parameter each, GPT-2 tied with its
# alias in shared_params): the session's saves of tests/ds_train_cases.py (conftest ds_cases: bf16 / fp16)
# and tests/ds_universal_cases.py (ds_universal_saves: fp32, BF16_Optimizer, ZeRO-3 sub-groups), read only.
QUICK_DS_HF = {"gpt2-1-bf16": "ds_cases", "gpt2-2-fp16": "ds_cases", "gpt2-3-bf16": "ds_cases",
               "gpt2-3-fp16": "ds_cases", "llama-3-bf16": "ds_cases",
               "gpt2-1-fp32": "ds_universal_saves", "gpt2-2-fp32": "ds_universal_saves",
               "gpt2-3-fp32": "ds_universal_saves", "gpt2-1-bf16opt": "ds_universal_saves",
               "gpt2-3s-bf16": "ds_universal_saves", "llama-2-bf16": "ds_universal_saves"}
DS_KINDS = {"1": "deepspeed-zero1", "2": "deepspeed-zero2", "3": "deepspeed-zero3", "3s": "deepspeed-zero3"}


@pytest.mark.parametrize("case", list(QUICK_DS_HF))
def test_quick_inspect_of_hf_models_under_deepspeed(request, monkeypatch, case):
    """ZeRO-1/2/3 and BF16_Optimizer runs of GPT-2 (tied) and Llama (GQA, SwiGLU, untied) in bf16, fp16 and
    fp32: the config from config.json, the fp32 masters placed from param_shapes in the partitions (ZeRO-3:
    each rank's slice of every parameter in its sub-group flats), the frozen parameter from its fragments
    or `module` in 16 bits, the Adam state and groups read quick, equal to the full path."""
    d = request.getfixturevalue(QUICK_DS_HF[case]) / case / "ckpt"
    quick = quick_inspect.quick_open(d, {})
    assert quick is not None and type(next(iter(quick.tensors.values()))).__name__ == "TensorMeta"
    quick_equals_full(monkeypatch, d)
    model, stage, dtype = case.split("-")
    frozen = {"gpt2": "embed.pos", "llama": "layers.0.attn_norm.weight"}[model]  # ds_train_cases.FROZEN
    assert quick.tensors[frozen].dtype == {"bf16": "bfloat16", "bf16opt": "bfloat16", "fp16": "float16"}.get(dtype, "float32")
    assert quick.tensors["embed.word"].dtype == "float32"  # a master
    opt = quick.optimizer
    assert opt.kind == ("deepspeed-bf16" if dtype == "bf16opt" else DS_KINDS[stage]) and opt.step == 2
    trainable = [n for n in quick.tensors if n != frozen]
    assert [n for g in opt.param_groups for n in g.names] == trainable  # the frozen one in no group


def test_hf_models_under_deepspeed_the_quick_path_does_not_cover(ds_cases, tmp_path, monkeypatch):
    """What the full reader refuses or reads by other means gives no quick answer, and the full reader's
    answer or error stands: a BERT run (not a GPT), a save without its config.json, a ZeRO-3 save whose
    frozen parameter's fragments no longer hold it, --hf-config given."""
    import shutil
    from ckptool.io.torchfile import load_torch_file, save_streaming
    from ckptool.lazy import Const
    bert = ds_cases / "bert-3-bf16" / "ckpt"
    assert quick_inspect.quick_open(bert, {}) is None
    r = CliRunner().invoke(main, ["inspect", str(bert)])
    assert r.exit_code == 2 and "not a GPT" in r.output
    shutil.copytree(ds_cases / "gpt2-3-bf16" / "ckpt", tmp_path / "noconf")
    (tmp_path / "noconf" / "config.json").unlink()
    assert quick_inspect.quick_open(tmp_path / "noconf", {}) is None
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "noconf")])
    assert r.exit_code == 2 and "--hf-config" in r.output
    assert quick_inspect.quick_open(tmp_path / "noconf", {"hf_config": str(ds_cases / "gpt2-3-bf16" / "ckpt")}) is None
    assert "dialect hf gpt2" in full_path(monkeypatch, "inspect", tmp_path / "noconf", "--hf-config",
                                          ds_cases / "gpt2-3-bf16" / "ckpt")
    shutil.copytree(ds_cases / "gpt2-3-bf16" / "ckpt", tmp_path / "short")
    for f in (tmp_path / "short").glob("*/zero_pp_rank_*_model_states.pt"):
        tree = load_torch_file(f)
        tree["frozen_param_fragments"]["transformer.wpe.weight"] = Const(torch.zeros(100, dtype=torch.bfloat16))
        save_streaming(tree, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
    assert quick_inspect.quick_open(tmp_path / "short", {}) is None
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "short")])
    assert r.exit_code == 2 and "frozen_param_fragments hold" in r.output, r.output


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """MoE checkpoints ckptool writes from tiny transformers Mixtral (every layer MoE) and Qwen2-MoE (a dense
    first layer, a gated shared expert) models: the Megatron torch format at EP 2 in each expert module form
    (SequentialMLP, TEGroupedMLP, the legacy GroupedMLP: its weight1 / weight2 as test_moe_megatron stacks
    them), expert TP 1 below TP 2 (only mp_rank_00_000 and mp_rank_01_001 exist), PP 2 x EP 2 (rank dirs
    mp_rank_TT_PPP_EEE), and torch_dist (experts stacked per layer) at EP 1 and EP 2."""
    import ckptool
    from test_moe import _build, randomise
    from test_moe_megatron import _as_legacy_grouped
    root = tmp_path_factory.mktemp("quick_moe")
    dirs = {}
    for kind in ("mixtral", "qwen2_moe"):
        torch.manual_seed(3)
        randomise(_build(kind)).save_pretrained(root / kind)
    dirs["mixtral_sequential"] = root / "mixtral_sequential"
    ckptool.from_hf(root / "mixtral", dirs["mixtral_sequential"], tp=2, ep=2)
    dirs["qwen2_moe_te_grouped"] = root / "qwen2_moe_te_grouped"
    ckptool.from_hf(root / "qwen2_moe", dirs["qwen2_moe_te_grouped"], tp=2, ep=2, dialect="mcore-te",
                    moe_grouped_gemm=True)
    dirs["qwen2_moe_etp1"] = root / "qwen2_moe_etp1"
    ckptool.from_hf(root / "qwen2_moe", dirs["qwen2_moe_etp1"], tp=2, ep=2, etp=1)
    dirs["mixtral_pp2ep2"] = root / "mixtral_pp2ep2"
    ckptool.from_hf(root / "mixtral", dirs["mixtral_pp2ep2"], tp=1, pp=2, ep=2)
    dirs["mixtral_legacy_grouped"] = _as_legacy_grouped(dirs["mixtral_sequential"], root / "mixtral_legacy_grouped")
    dirs["qwen2_moe_legacy_grouped_etp1"] = _as_legacy_grouped(dirs["qwen2_moe_etp1"], root / "qwen2_legacy_etp1")
    dirs["mixtral_dist"] = root / "mixtral_dist"
    ckptool.merge(dirs["mixtral_sequential"], dirs["mixtral_dist"], format="torch_dist")
    dirs["qwen2_moe_dist_ep2"] = root / "qwen2_moe_dist_ep2"
    ckptool.reshard(dirs["qwen2_moe_te_grouped"], dirs["qwen2_moe_dist_ep2"], tp=1, ep=2, format="torch_dist")
    # the non-distributed optimizer's chained [dense, expert] entries (Adam moments, two weight-decay groups:
    # test_optimizer_etp's Mixtral, its expert-TP layouts checked against megatron-core there)
    from ckptool.config import Layout
    from ckptool.formats.megatron.checkpoint import write_megatron
    from test_optimizer_etp import mixtral_with_moments
    ck, _ = mixtral_with_moments(root)
    for name, layout, dialect in (("optim_sequential_tp2ep2", Layout(tp=2, ep=2), "mcore"),
                                  ("optim_te_grouped_tp4ep2etp2", Layout(tp=4, ep=2, etp=2), "mcore-te")):
        write_megatron(ck, root / name, layout, WriteOptions(dialect=dialect, moe_grouped_gemm=dialect == "mcore-te"),
                       warn=lambda m: None)
        dirs[name] = root / name
    dirs["optim_dist_ep2"] = root / "optim_dist_ep2"  # torch_dist fully_reshardable, ChainedOptimizer {0: dense, 1: expert}
    ckptool.reshard(dirs["optim_sequential_tp2ep2"], dirs["optim_dist_ep2"], tp=1, ep=2, format="torch_dist")
    return dirs


QUICK_MOE = ["mixtral_sequential", "qwen2_moe_te_grouped", "qwen2_moe_etp1", "mixtral_pp2ep2",
             "mixtral_legacy_grouped", "qwen2_moe_legacy_grouped_etp1", "mixtral_dist", "qwen2_moe_dist_ep2",
             "optim_sequential_tp2ep2", "optim_te_grouped_tp4ep2etp2", "optim_dist_ep2"]


@pytest.mark.parametrize("kind", QUICK_MOE)
def test_quick_moe_inspect_equals_the_full_path_without_torch(moe_dirs, monkeypatch, kind):
    """Experts, top-k, EP and expert TP as the full reader shows them, read without torch."""
    d = moe_dirs[kind]
    quick_json = quick_equals_full(monkeypatch, d)
    doc = json.loads(quick_json)
    assert doc["config"]["moe"]["num_experts"] in (4, 6) and doc["config"]["moe"]["top_k"] == 2
    assert doc["layout"]["ep"] == (1 if kind == "mixtral_dist" else 2)
    assert any(".mlp.experts.3.down.weight" in t["name"] for t in doc["tensors"])
    if "etp" in kind:
        assert f"ETP{kind[-1]}" in torch_free("inspect", d, "--no-tensors")
    if kind.startswith("optim_"):  # the dense and expert optimizers' groups merged as the full reader merges them
        assert doc["optimizer"]["step"] == 3 and [g["tensors"] for g in doc["optimizer"]["param_groups"]] == [19, 3]
    quick = quick_inspect.quick_open(d, {})
    assert type(next(iter(quick.tensors.values()))).__name__ == "TensorMeta"


def test_moe_files_the_quick_path_cannot_vouch_for_take_the_full_reader(moe_dirs, tmp_path, monkeypatch):
    """A missing EP rank directory, args that claim other experts, or an expert's fc1 cut short: the quick
    path says nothing (None) and the full reader gives its error; never a different answer."""
    import shutil
    from ckptool.io.torchfile import load_torch_file, save_streaming
    from ckptool.lazy import Const
    missing = tmp_path / "missing"
    shutil.copytree(moe_dirs["mixtral_sequential"], missing)
    shutil.rmtree(next(missing.glob("*/mp_rank_01_001")))
    assert quick_inspect.quick_open(missing, {}) is None
    r = CliRunner().invoke(main, ["inspect", str(missing)])
    assert r.exit_code == 2 and "mp_rank_01_001" in r.output
    for name, edit in (("experts", lambda t: setattr(t["args"], "num_experts", 8)),
                       ("short", lambda t: t["model"].__setitem__(
                           "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
                           Const(torch.zeros(8, t["model"]["decoder.layers.1.mlp.experts.local_experts.0"
                                                            ".linear_fc1.weight"].shape[1]))))):
        d = tmp_path / name
        shutil.copytree(moe_dirs["mixtral_sequential"], d)
        for f in d.glob("*/mp_rank_*/model_optim_rng.pt"):
            tree = load_torch_file(f)
            edit(tree)
            save_streaming(tree, f.with_suffix(".tmp"))
            f.with_suffix(".tmp").replace(f)
        assert quick_inspect.quick_open(d, {}) is None, name
        r = CliRunner().invoke(main, ["inspect", str(d)])
        assert r.exit_code == 2, (name, r.output)


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory):
    """Multi-Latent Attention checkpoints ckptool writes from test_mla_megatron's tiny DeepSeek-V3 (MLA with a q
    latent, a dense layer 0, MoE layers with a shared expert and an expert bias, routing Megatron computes) and its
    direct-q variant: the Megatron torch format with the local spec's names (TP 2 x PP 2 (layers 1 + 3) x EP 2:
    the latent projections column-parallel) and the TE spec's (mcore-te: the down projections whole on every
    rank, the latent norms inside the up projections), and torch_dist with either names, in bf16 (the router's
    expert bias kept in fp32 there, as megatron-core keeps it)."""
    import ckptool
    from test_mla_megatron import _moe_deepseek
    root = tmp_path_factory.mktemp("quick_mla")
    latent, _ = _moe_deepseek(tmp_path_factory, 23, 20, 4, "deepseek_v3")
    direct, _ = _moe_deepseek(tmp_path_factory, 37, None, 2, "deepseek_v3_direct_q")
    dirs = {k: root / k for k in ("mla_tp2pp2ep2", "mla_te_tp2ep2", "mla_direct_q_te", "mla_dist_ep2",
                                  "mla_dist_te_bf16")}
    ckptool.from_hf(latent, dirs["mla_tp2pp2ep2"], tp=2, pp=2, ep=2, pp_layers=[1, 3])
    ckptool.from_hf(latent, dirs["mla_te_tp2ep2"], tp=2, ep=2, dialect="mcore-te")
    ckptool.from_hf(direct, dirs["mla_direct_q_te"], tp=2, dialect="mcore-te")
    ckptool.reshard(dirs["mla_tp2pp2ep2"], dirs["mla_dist_ep2"], tp=1, pp=1, ep=2, format="torch_dist")
    ckptool.reshard(dirs["mla_te_tp2ep2"], dirs["mla_dist_te_bf16"], tp=1, ep=1, format="torch_dist", dialect="mcore-te",
                    dtype=torch.bfloat16)
    return dirs


QUICK_MLA = ["mla_tp2pp2ep2", "mla_te_tp2ep2", "mla_direct_q_te", "mla_dist_ep2", "mla_dist_te_bf16"]


@pytest.mark.parametrize("kind", QUICK_MLA)
def test_quick_mla_inspect_equals_the_full_path_without_torch(mla_dirs, monkeypatch, kind):
    """MLA shapes from the args (q / kv latents, the rotary key part, the value head dim), in each dialect and in
    torch_dist, MoE layers and all, read without torch as the full reader reads them."""
    d = mla_dirs[kind]
    quick_json = quick_equals_full(monkeypatch, d)
    doc = json.loads(quick_json)
    assert doc["config"]["mla"]["kv_lora_rank"] == 12
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["layers.0.attn.kv_down.weight"]["shape"] == [12 + 8, 32]
    assert ("layers.0.attn.q.weight" in tensors) == ("direct_q" in kind)
    if kind.endswith("bf16"):  # the expert bias stays fp32 beside bf16 weights
        assert tensors["layers.1.mlp.router.expert_bias"]["dtype"] == "float32"
        assert tensors["layers.1.mlp.router.weight"]["dtype"] == "bfloat16"
    assert type(next(iter(quick_inspect.quick_open(d, {}).tensors.values()))).__name__ == "TensorMeta"


def test_mla_files_that_disagree_with_their_args_take_the_full_reader(mla_dirs, tmp_path):
    """Args claiming another kv latent rank than the files hold: the shapes the quick path would compute from the
    args are not the stored ones, so it says nothing and the full reader answers."""
    import shutil
    from ckptool.io.torchfile import load_torch_file, save_streaming
    d = tmp_path / "kv_lora"
    shutil.copytree(mla_dirs["mla_te_tp2ep2"], d)
    for f in d.glob("*/mp_rank_*/model_optim_rng.pt"):
        tree = load_torch_file(f)
        tree["args"].kv_lora_rank = 10
        save_streaming(tree, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
    assert quick_inspect.quick_open(mla_dirs["mla_te_tp2ep2"], {}) is not None
    assert quick_inspect.quick_open(d, {}) is None


# megatron-core's own MoE torch_dist saves (tests/mcore_optim_dist_helper.py moe-save, bf16, EP 2: the optimizer a
# ChainedOptimizer [dense, expert]); "biased": sigmoid routing with the router's expert bias, a buffer kept in fp32
# megatron-core's MoE saves as test_dist_optim_moe.py makes them (its SAVES, the same job lines): "bias": sigmoid
# routing with the router's expert bias; dpr: dp_reshardable, the chain's flat buffers under chained_0. / chained_1.;
# dpr_tp2: expert TP 2 x EP 2 (the expert buffers on their own grid); dpr_pp2: PP 2 with a dense stage 0 (its expert
# optimizer has no buffers and no step), Qwen2-MoE-like (shared expert and its gate)
from test_dist_optim_moe import BF16, SAVES as MOE_SAVES  # noqa: E402
MCORE_MOE_DIST = {name: f"moe-save {{out}} {MOE_SAVES[name][0]} {BF16} --out {{out}}.pt"
                  for name in ("bias_fr", "bias_dpr", "dpr_tp2", "dpr_pp2")}
NPROC = {name: MOE_SAVES[name][1] for name in MCORE_MOE_DIST}
for _n in (2, 4):
    declare_runs(ROOT / "tests" / "mcore_optim_dist_helper.py", _n, {k: v for k, v in MCORE_MOE_DIST.items() if NPROC[k] == _n})


@pytest.mark.parametrize("name", list(MCORE_MOE_DIST))
def test_quick_inspect_of_megatron_cores_moe_torch_dist_saves(framework_runs, monkeypatch, tmp_path, name):
    """megatron-core's MoE saves read quick, equal to the full path: the expert bias in fp32 beside bf16 weights,
    with no optimizer slot and in no group (a module buffer); the [dense, expert] chain's flat dp_reshardable
    buffers, every rank's layout of both optimizers checked against its stored bucket sizes."""
    from test_dist import HAVE_MCORE
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    d = framework_runs(ROOT / "tests" / "mcore_optim_dist_helper.py", NPROC[name], {name: MCORE_MOE_DIST[name]})[name]
    quick_equals_full(monkeypatch, d)
    quick = quick_inspect.quick_open(d, {})
    assert quick.optimizer.step > 0
    assert quick.optimizer.kind == "megatron-core-dist (%s)" % ("dp_reshardable" if "dpr" in name else "fully_reshardable")
    if "bias" in name:
        bias = "layers.0.mlp.router.expert_bias"
        assert quick.tensors[bias].dtype == "float32" and quick.tensors["layers.0.mlp.router.weight"].dtype == "bfloat16"
        assert all(bias not in slots for slots in quick.optimizer.slots.values())
        assert all(bias not in g.names for g in quick.optimizer.param_groups)
    if name == "dpr_tp2":  # args claiming whole experts (expert TP 1): no layout gives the expert buckets stored
        from test_dist_optim import _copy_with_args
        assert quick_inspect.quick_open(_copy_with_args(d, tmp_path, expert_tensor_parallel_size=1), {}) is None


def test_quick_inspect_of_the_moe_distributed_optimizer(framework_runs, tmp_path, monkeypatch):
    """distrib_optim.pt of MoE models at EP 2: megatron-core's [dense, expert] chain (each part in the file of its
    optimizer's DP rank 0, the experts' buffers sharded over the expert-data-parallel size). megatron-core's own
    trainings (test_distopt_moe.py's: Mixtral-like, with the router's fp32 expert bias, Qwen2-MoE-like) and
    ckptool's outputs (EP 1 -> EP 2; expert TP 1 below TP 2, where a part sits in another file of the stage; the
    Qwen2-MoE one at TP 2 x PP 2) read quick, every buffer checked against megatron-core's layout, equal to the
    full path; an expert buffer stated at another size is the full reader's to refuse."""
    import shutil
    import ckptool
    from test_dist import HAVE_MCORE
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    from test_distopt_moe import HELPER, TRAINS
    runs = framework_runs(HELPER, 2, {n: TRAINS[n] for n in ("ep1", "ep2", "bias", "qwen")})
    for name, stem in runs.items():
        copy_run(stem, tmp_path / name)
    ckptool.reshard(tmp_path / "ep1", tmp_path / "to_ep2", tp=1, ep=2, distributed_optimizer=True, dp=2)
    ckptool.reshard(tmp_path / "ep2", tmp_path / "etp1", tp=2, ep=2, etp=1, distributed_optimizer=True, dp=2)
    ckptool.reshard(tmp_path / "qwen", tmp_path / "qwen_tp2pp2", tp=2, pp=2, ep=2, distributed_optimizer=True, dp=2)
    for name in ("ep2", "bias", "qwen", "to_ep2", "etp1", "qwen_tp2pp2"):
        d = tmp_path / name
        quick = quick_inspect.quick_open(d, {})
        assert quick.optimizer.kind == "megatron-distributed" and quick.source.layout.ep == 2, name
        quick_equals_full(monkeypatch, d, name)
    assert quick_inspect.quick_open(tmp_path / "bias", {}).tensors["layers.0.mlp.router.expert_bias"].dtype == "float32"
    # EP rank 1's expert buffer stated 64 elements longer than it holds and than the layout gives
    from ckptool.io.torchfile import load_torch_file, save_streaming
    shutil.copytree(tmp_path / "ep2", tmp_path / "off")
    f = next((tmp_path / "off").glob("*/mp_rank_00_001/distrib_optim.pt"))
    state = load_torch_file(f)
    entry = next(iter(state[1][0].values()))
    entry["numel_unpadded"] += 64
    save_streaming(state, f.with_suffix(".tmp"))
    f.with_suffix(".tmp").replace(f)
    assert quick_inspect.quick_open(tmp_path / "off", {}) is None
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "off")])
    assert r.exit_code == 2 and "numel_unpadded" in r.output, r.output
