"""FSDP2 / torchtitan / accelerate torch.distributed.checkpoint saves (issue 31), against the real libraries.

tests/fsdp2_helper.py trains a tiny LlamaForCausalLM and a tiny Qwen3MoeForCausalLM (transformers) sharded with
torch's FSDP2 (`fully_shard`) on 2 CPU processes (gloo) for 2 AdamW steps and saves them with dcp.save in the
layouts trainers use: torchtitan's (model flattened to the top level, optimizer under "optimizer"), the same run
under torchtitan's own names (its RoPE row order), accelerate's pytorch_model_fsdp_0/ ("model." prefix) and a
{"model", "optimizer"} save with no config.json beside it. ckptool reads each without options (the config from
where trainers put it, or --hf-config), to-hf gives transformers' model bit-exact with the same logits,
megatron-core loads its torch_dist output strictly with the same logits (the AdamW state carried), and the DCP
folder ckptool writes (HF or torchtitan names) loads with torch's own dcp.load into FSDP2 at 2 and 4 ranks.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import declare_runs, shared_followups
from fsdp2_helper import TITAN, TITAN_LAYER

from ckptool import api
from ckptool.errors import CkptError
from ckptool.formats import registry
from ckptool.formats.dcp import titan
from ckptool.lazy import Const

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "fsdp2_helper.py"
MCORE = REPO / "tests" / "mcore_fsdp_helper.py"
RUNS = declare_runs(HELPER, 2, {"inputs": "save {out}"})
# source name -> (path under the helper's output, its reference model, needs --hf-config)
SOURCES = {"llama": ("llama", "llama", False), "titan": ("llama_titan", "llama", False),
           "accelerate": ("accelerate", "llama", False), "qwen3moe": ("qwen3moe/step-2", "qwen3moe", True)}
# DCP outputs ckptool writes: name -> (source, --dialect); each is loaded by FSDP2 at 2 and 4 ranks
DCP_OUTPUTS = {"llama_hf": ("titan", None), "llama_titan": ("accelerate", "torchtitan"), "qwen_hf": ("qwen3moe", None)}
HELPER_MODEL = {"llama_hf": "llama", "llama_titan": "llama --titan", "qwen_hf": "qwen3moe"}


def read_options(inputs: Path, name: str) -> dict:
    return {"hf_config": str(inputs / "qwen3moe_config")} if SOURCES[name][2] else {}


def source(inputs: Path, name: str) -> Path:
    return inputs / SOURCES[name][0]


@shared_followups
def converted(framework_runs, root):
    """The FSDP2 inputs, ckptool's torch_dist and dcp outputs of them, and the real libraries' loads of those."""
    inputs = framework_runs(HELPER, 2, RUNS)["inputs"]
    quiet = {"warn": lambda m: None}
    api.merge(source(inputs, "titan"), root / "llama_td", format="torch_dist", dialect="mcore", **quiet)
    api.merge(source(inputs, "qwen3moe"), root / "qwen_td", format="torch_dist", dialect="mcore", **quiet,
              **read_options(inputs, "qwen3moe"))
    for out, (name, dialect) in DCP_OUTPUTS.items():
        api.merge(source(inputs, name), root / out, format="dcp", dialect=dialect, **quiet, **read_options(inputs, name))
    mcore = [f"load-dist {root / 'llama_td'} --tp 2 --out {root / 'llama_td.pt'}",
             f"load-dist {root / 'qwen_td'} --ep 2 --out {root / 'qwen_td.pt'}"]
    loads = {n: [f"load {root / out} {root / f'{out}_{n}.pt'} --model {HELPER_MODEL[out]}" for out in DCP_OUTPUTS]
             for n in (2, 4)}
    # megatron-core's helper runs the 2-process FSDP2 loads too: one launch for both
    yield [(MCORE, 2, mcore + loads[2]), (HELPER, 4, loads[4])]
    return inputs, root


def reference(inputs: Path, model: str) -> dict:
    return torch.load(inputs / f"{model}.pt", weights_only=False)


def test_each_save_is_found_without_options(converted):
    inputs, root = converted
    for path in (inputs / "llama", inputs / "llama" / "step-2", inputs / "llama_titan", inputs / "accelerate",
                 inputs / "accelerate" / "pytorch_model_fsdp_0", inputs / "qwen3moe", root / "llama_titan"):
        assert registry.detect_format(path) == "dcp", path
    assert registry.detect_format(root / "llama_td") == "torch_dist"  # megatron-core's names stay torch_dist's
    info = api.inspect(inputs / "llama_titan")
    assert info["format"] == "dcp" and "torchtitan" in str(info["dialect"])


@pytest.mark.parametrize("name", list(SOURCES))
def test_to_hf_is_bit_exact_with_transformers_logits(converted, tmp_path, name):
    import transformers
    inputs, _ = converted
    ref = reference(inputs, SOURCES[name][1])
    api.to_hf(source(inputs, name), tmp_path / "hf", warn=lambda m: None, **read_options(inputs, name))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = model.state_dict()
    assert sorted(state) == sorted(ref["state"])
    assert all(torch.equal(state[k], v) for k, v in ref["state"].items())
    with torch.no_grad():
        assert torch.equal(model(ref["tokens"]).logits, ref["logits"])


def test_adamw_state_is_read_in_model_order_and_carried_to_torch_dist(converted):
    inputs, root = converted
    llama, qwen = reference(inputs, "llama")["exp_avg"], reference(inputs, "qwen3moe")["exp_avg"]
    # torchtitan's moments come back in HF's row order, as its weights do; accelerate's optimizer_0/ beside its model
    # folder holds get_optimizer_state_dict's nested form (param groups by index, listing their FQNs)
    for name in ("llama", "titan", "accelerate"):
        opt = api.open(source(inputs, name)).optimizer
        assert opt.kind == "fsdp-adamw" and opt.step == 2 and len(opt.param_groups) == 1
        assert opt.param_groups[0].hyper["weight_decay"] == 0.1 and opt.param_groups[0].hyper["lr"] == 1e-2
        for canonical, hf in (("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("mlp.down", "mlp.down_proj")):
            assert torch.equal(opt.slots["exp_avg"][f"layers.1.{canonical}.weight"].load(), llama[f"model.layers.1.{hf}.weight"])
    opt = api.open(source(inputs, "qwen3moe"), **read_options(inputs, "qwen3moe")).optimizer
    fused = qwen["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2 x ffn, hidden]: expert 2's up is its second half
    assert torch.equal(opt.slots["exp_avg"]["layers.1.mlp.experts.2.up.weight"].load(), fused[2, fused.shape[1] // 2:])
    written = api.open(root / "qwen_td").optimizer  # what megatron-core would resume from
    assert written.step == 2
    for n, t in opt.slots["exp_avg"].items():
        assert torch.equal(written.slots["exp_avg"][n].load(), t.load()), n


@pytest.mark.parametrize("out, model", [("llama_td", "llama"), ("qwen_td", "qwen3moe")])
def test_megatron_core_loads_the_torch_dist_output_strictly_with_the_same_logits(converted, out, model):
    inputs, root = converted
    got = torch.load(root / f"{out}.pt", weights_only=False)["logits"]
    want = reference(inputs, model)["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("out", list(DCP_OUTPUTS))
def test_the_written_dcp_loads_into_fsdp2_at_another_world_size(converted, out, world):
    inputs, root = converted
    got = torch.load(root / f"{out}_{world}.pt", weights_only=False)
    ref = reference(inputs, "qwen3moe" if out.startswith("qwen") else "llama")
    assert got["world"] == world
    assert all(torch.equal(got["state"][k], v) for k, v in ref["state"].items())
    assert torch.equal(got["logits"], ref["logits"])


def test_a_dcp_source_is_rewritten_as_megatron_torch_by_default(converted, tmp_path):
    inputs, _ = converted
    result = api.merge(source(inputs, "llama"), tmp_path / "out", warn=lambda m: None)
    assert result.summary.format == "torch" and result.summary.optimizer["step"] == 2


def test_a_save_without_its_config_is_a_clear_error(converted, tmp_path):
    inputs, _ = converted
    with pytest.raises(CkptError, match="without its config.json") as e:
        api.open(source(inputs, "qwen3moe"))
    assert "--hf-config" in e.value.hint
    r = subprocess.run([sys.executable, "-m", "ckptool", "to-hf", str(source(inputs, "qwen3moe")), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--hf-config" in r.stderr
    assert not (tmp_path / "o").exists()
    with pytest.raises(CkptError, match="--dialect legacy"):
        api.merge(source(inputs, "llama"), tmp_path / "d", format="dcp", dialect="legacy", warn=lambda m: None)


def test_torchtitan_names_of_a_model_it_has_no_adapter_for_are_refused(converted, tmp_path):
    inputs, _ = converted
    copy = tmp_path / "mistral"
    shutil.copytree(inputs / "llama_titan" / "step-2", copy)
    conf = (copy / "config.json").read_text().replace('"llama"', '"mistral"').replace("LlamaForCausalLM", "MistralForCausalLM")
    (copy / "config.json").write_text(conf)
    with pytest.raises(CkptError, match="torchtitan names for a mistral model"):
        api.open(copy)


@pytest.mark.parametrize("bias", ["moe.expert_bias_E", "moe.expert_bias", "moe.router.expert_bias"])  # newest first
def test_torchtitan_expert_bias_is_dropped_only_when_it_never_moved(bias):
    said = []
    named = {f"layers.0.{bias}": Const(torch.zeros(4))}
    assert titan.to_hf(named, {"num_attention_heads": 4}, "qwen3_moe", said.append, "x") == {}
    assert "all zeros" in said[0]
    named = {f"layers.0.{bias}": Const(torch.tensor([0.0, 0.1, 0.0, 0.0]))}
    with pytest.raises(CkptError, match="expert bias"):
        titan.to_hf(named, {"num_attention_heads": 4}, "qwen3_moe", said.append, "x")


def test_optimizer_state_other_than_adamw_is_dropped_with_a_warning(converted, tmp_path):
    import torch.distributed.checkpoint as dcp
    inputs, _ = converted
    state = dict(reference(inputs, "llama")["state"])
    momentum = {f"state.{k}.momentum_buffer": torch.zeros_like(v) for k, v in state.items()}
    dcp.save({**state, "optimizer": momentum}, checkpoint_id=str(tmp_path / "sgd"))  # one process, no group
    shutil.copy(inputs / "llama" / "huggingface" / "config.json", tmp_path / "sgd" / "config.json")
    ckpt = api.open(tmp_path / "sgd")
    assert ckpt.optimizer is None
    assert any("optimizer state dropped" in w and "momentum_buffer" in w for w in ckpt.warnings)


def test_torchtitan_names_written_are_the_ones_torchtitan_saved(converted, tmp_path):
    """--dialect torchtitan writes the names and RoPE row order of the helper's own torchtitan save (renamed and
    permuted by an implementation of torchtitan's adapter independent of ckptool's table); an MoE model's
    fused experts come back to the same model."""
    from ckptool.io.dcp_io import DcpDir
    inputs, root = converted
    saved, written = DcpDir(inputs / "llama_titan" / "step-2"), DcpDir(root / "llama_titan")
    model_keys = sorted(k for k in saved.tensor_keys() if not k.startswith("optimizer."))
    assert sorted(written.tensor_keys()) == model_keys
    for k in model_keys:
        assert torch.equal(written.lazy(k).load(), saved.lazy(k).load()), k
    qwen = api.open(source(inputs, "qwen3moe"), **read_options(inputs, "qwen3moe"))
    api.merge(source(inputs, "qwen3moe"), tmp_path / "t", format="dcp", dialect="torchtitan", warn=lambda m: None,
              **read_options(inputs, "qwen3moe"))
    assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in DcpDir(tmp_path / "t").tensor_keys()
    back = api.open(tmp_path / "t")
    assert back.source.dialect == "torchtitan qwen3_moe" and list(back.tensors) == list(qwen.tensors)
    for n, t in qwen.tensors.items():
        assert torch.equal(back.tensors[n].load(), t.load()), n


def test_data_files_without_their_index_are_named(converted, tmp_path):
    """accelerate's merge-weights fails on a missing .metadata with a traceback; ckptool says what is missing."""
    inputs, _ = converted
    copy = tmp_path / "out"
    shutil.copytree(inputs / "accelerate", copy)
    (copy / "pytorch_model_fsdp_0" / ".metadata").unlink()
    assert registry.detect_format(copy) == "dcp"
    with pytest.raises(CkptError, match=r"pytorch_model_fsdp_0: DCP data files \(__0_0.distcp.*but no .metadata"):
        api.open(copy)


def test_inspect_reads_an_hf_named_save_without_torch(converted):
    """The quick path (formats/dcp/fsdp_quick.py) gives the full reader's config and shapes, importing no torch;
    what it cannot say (optimizer state, torchtitan's names) it leaves to the full reader."""
    inputs, _ = converted
    fmt = registry.BY_NAME["dcp"]
    quick, full = fmt.quick_read(inputs / "accelerate"), api.open(inputs / "accelerate")
    assert quick.config == full.config
    assert {n: tuple(t.shape) for n, t in quick.tensors.items()} == {n: tuple(t.shape) for n, t in full.tensors.items()}
    assert fmt.quick_read(inputs / "llama") is None and fmt.quick_read(inputs / "llama_titan") is None
    code = ("import sys\nfrom ckptool.formats import registry\n"
            f"ckpt = registry.BY_NAME['dcp'].quick_read({str(inputs / 'accelerate')!r})\n"
            "assert ckpt is not None and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# torchtitan's Qwen3-MoE names (pytorch/torchtitan b5bcd76 torchtitan/models/qwen3/state_dict_adapter.py from_hf_map,
# models/common/moe.py GroupedExperts and MoE's persistent expert_bias_E buffer), written independently of ckptool's
# table: the helper's Llama3 names for attention and norms (the same in both adapters), Qwen3's q/k norms, the router
TITAN_QWEN3 = {**{hf: t for hf, t in TITAN_LAYER.items() if not hf.startswith("mlp.")},
               "self_attn.q_norm.weight": "attention.q_norm.weight", "self_attn.k_norm.weight": "attention.k_norm.weight",
               "mlp.gate.weight": "moe.router.gate.weight"}


def titan_qwen3_moe(state: dict) -> dict:
    """A transformers 5 Qwen3-MoE state dict (experts fused: gate_up_proj [E, 2F, D], down_proj [E, D, F]) under
    torchtitan's current names: w1_EFD / w3_EFD the gate / up halves, w2_EDF the down projection, and the
    expert_bias_E buffer torchtitan saves (all zeros: load balancing never moved it)."""
    out = {t: state[hf] for hf, t in TITAN.items()}
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})
    for i in layers:
        p = f"model.layers.{i}."
        for hf, name in TITAN_QWEN3.items():
            out[f"layers.{i}.{name}"] = state[p + hf]
        gate_up = state[p + "mlp.experts.gate_up_proj"]
        ffn = gate_up.shape[1] // 2
        experts = f"layers.{i}.moe.routed_experts.inner_experts."
        out[experts + "w1_EFD"], out[experts + "w3_EFD"] = gate_up[:, :ffn].clone(), gate_up[:, ffn:].clone()
        out[experts + "w2_EDF"] = state[p + "mlp.experts.down_proj"]
        out[f"layers.{i}.moe.expert_bias_E"] = torch.zeros(gate_up.shape[0])
    return out


def test_torchtitan_current_moe_names_read_as_the_hf_model_and_are_written_back(converted, tmp_path):
    """A DCP (torch's dcp.save) of the Qwen3-MoE run under torchtitan's current names reads as the same model, to-hf
    gives transformers' logits, and --dialect torchtitan writes exactly those names (the zero expert bias included)."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from ckptool.io.dcp_io import DcpDir
    inputs, _ = converted
    ref = reference(inputs, "qwen3moe")
    named = titan_qwen3_moe(ref["state"])
    dcp.save(named, checkpoint_id=str(tmp_path / "titan"))  # one process, no group
    shutil.copy(inputs / "qwen3moe_config" / "config.json", tmp_path / "titan" / "config.json")
    got = api.open(tmp_path / "titan")
    want = api.open(source(inputs, "qwen3moe"), **read_options(inputs, "qwen3moe"))
    assert got.source.dialect == "torchtitan qwen3_moe" and list(got.tensors) == list(want.tensors)
    assert all(torch.equal(got.tensors[n].load(), t.load()) for n, t in want.tensors.items())
    assert any("expert_bias_E" in w and "all zeros" in w for w in got.warnings)
    api.to_hf(tmp_path / "titan", tmp_path / "hf", warn=lambda m: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(ref["tokens"]).logits, ref["logits"])
    api.merge(tmp_path / "titan", tmp_path / "back", format="dcp", dialect="torchtitan", warn=lambda m: None)
    written = DcpDir(tmp_path / "back")
    assert sorted(written.tensor_keys()) == sorted(named)  # expert_bias_E too: torchtitan's dcp.load asks for it
    for k in written.tensor_keys():
        assert torch.equal(written.lazy(k).load(), named[k]), k
