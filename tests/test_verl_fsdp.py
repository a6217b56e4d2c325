"""verl's FSDP checkpoints: model_world_size_N_rank_R.pt per rank (an FSDP2 model's state_dict(), DTensors placed
Shard(0)) beside huggingface/config.json (formats/verl/), read through the safe unpickler's DTensor records
(io/dtensor.py). The rank files are written by real torch (fully_shard + one AdamW step + torch.save of state_dict()
under torchrun, gloo, 2 ranks) through tests/verl_fsdp_helper.py, laid out as verl's FSDPCheckpointManager saves.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import copy_run, declare_runs
from test_dist import run_cli
from ckptool.errors import CkptError
from ckptool import api
from ckptool.formats.registry import detect_format, open_checkpoint
from ckptool.io import dtensor, safe_pickle
from ckptool.io.standin import standin_class
from ckptool.options import ReadOptions

HELPER = Path(__file__).resolve().parent / "verl_fsdp_helper.py"
# llama: untied, no biases; qwen2: tied embeddings, q/k/v biases
SAVES = declare_runs(HELPER, 2, {arch: f"save {{out}} --arch {arch} --out {{out}}.ref.pt" for arch in ("llama", "qwen2")})


@pytest.fixture(scope="module")
def saves(tmp_path_factory, framework_runs):
    root = tmp_path_factory.mktemp("verl_fsdp")
    for name, stem in framework_runs(HELPER, 2, SAVES, timeout=240).items():
        copy_run(stem, root / name)
    return root


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_to_hf_is_bit_exact_with_the_fsdp_models_weights_and_logits(saves, arch, tmp_path):
    from transformers import AutoModelForCausalLM
    assert detect_format(saves / arch) == "verl-fsdp"
    r = run_cli("to-hf", saves / arch, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "optimizer state dropped" not in r.stderr
    ref = torch.load(saves / f"{arch}.ref.pt")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    tied = arch == "qwen2"
    assert set(written) == {k for k in ref["weights"] if not (tied and k == "lm_head.weight")}
    for name, t in written.items():
        assert torch.equal(t, ref["weights"][name]), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"], atol=1e-6, rtol=0)


def test_the_global_step_folder_and_hf_config_elsewhere_read_the_same(saves, tmp_path):
    step = tmp_path / "global_step_1"
    shutil.copytree(saves / "llama", step / "actor")
    assert detect_format(step) == "verl-fsdp"
    shutil.move(step / "actor" / "huggingface", tmp_path / "hf_config")
    r = run_cli("inspect", step)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--hf-config" in r.stderr, r.stderr
    ckpt = open_checkpoint(step, ReadOptions(hf_config=str(tmp_path / "hf_config")))
    base = open_checkpoint(saves / "llama")
    assert list(ckpt.tensors) == list(base.tensors)
    assert all(torch.equal(ckpt.tensors[k].load(), base.tensors[k].load()) for k in base.tensors)


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "model_world_size_2_rank_1.pt").unlink(), "missing for ranks [1]"),
    (lambda d: _swap(d / "model_world_size_2_rank_0.pt", d / "model_world_size_2_rank_1.pt"), "sits at mesh coordinate"),
    (lambda d: (d / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}'), "FSDP1"),
])
def test_bad_rank_files_are_clear_errors(saves, tmp_path, damage, words):
    d = tmp_path / "actor"
    shutil.copytree(saves / "llama", d)
    damage(d)
    r = run_cli("to-hf", d, tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_only_a_dtensor_may_use_the_wrapper_subclass_rebuild():
    """_rebuild_wrapper_subclass builds no object: the unpickler hands its call to dtensor.from_pickle, which takes
    only torch's DTensor (as a StandIn record), never another class a pickle names."""
    for new_type in (torch.Tensor, standin_class("megatron.core", "DTensor")):
        with pytest.raises(CkptError):
            safe_pickle._safe_rebuild_from_type_v2(dtensor.wrapper_subclass_args, new_type, (new_type, None, (2,)), {})


# canonical name -> the Hugging Face parameter whose AdamW moment it must hold
MOMENT_NAMES = {"embed.word": "model.embed_tokens.weight", "layers.0.attn.q.weight": "model.layers.0.self_attn.q_proj.weight",
                "layers.1.mlp.down.weight": "model.layers.1.mlp.down_proj.weight",
                "final_norm.weight": "model.norm.weight"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_optimizer_files_are_read_and_carried_to_megatron(saves, arch, tmp_path):
    """optim_world_size_2_rank_R.pt (torch's optimizer.state_dict() of the FSDP2 model: parameters by index, moments
    as DTensor shards) tied to the parameters in named_parameters() order (qwen2: tied, one embedding parameter),
    equal to the live moments, carried into torch_dist."""
    ckpt = open_checkpoint(saves / arch)
    opt = ckpt.optimizer
    assert opt.kind == "verl-fsdp-adamw" and opt.step == 1 and not ckpt.warnings
    assert len(opt.param_groups) == 1 and opt.param_groups[0].hyper["weight_decay"] == 0.01
    assert sorted(opt.param_groups[0].names) == sorted(ckpt.tensors) == sorted(opt.slots["exp_avg"])
    ref = torch.load(saves / f"{arch}.ref.pt")["exp_avg"]
    for canonical, hf in MOMENT_NAMES.items():
        assert torch.equal(opt.slots["exp_avg"][canonical].load(), ref[hf]), canonical
    api.merge(saves / arch, tmp_path / "td", format="torch_dist", warn=lambda m: None)
    again = open_checkpoint(tmp_path / "td").optimizer
    assert again.step == 1
    for n, t in opt.slots["exp_avg"].items():
        assert torch.equal(again.slots["exp_avg"][n].load(), t.load()), n


def test_optimizer_files_of_another_model_are_dropped_with_the_reason(saves, tmp_path):
    d = tmp_path / "actor"
    shutil.copytree(saves / "qwen2", d)
    for rank in (0, 1):  # llama's optimizer (21 parameters) beside qwen2's model (26)
        shutil.copy(saves / "llama" / f"optim_world_size_2_rank_{rank}.pt", d)
    ckpt = open_checkpoint(d)
    assert ckpt.optimizer is None
    assert any("optimizer state dropped" in w and "21 parameters, the model has 26" in w for w in ckpt.warnings)
