"""megatron-core torch_dist checkpoints written by trainers other than Megatron-LM: no `args` in the common
state, the config in the trainer's sidecar (formats/dcp/sidecars.py): Megatron-Bridge's run_config.yaml,
NeMo 2's context/model.yaml, verl's huggingface/config.json, or --hf-config.

The checkpoints are saved by the real megatron-core (dist_checkpointing.save under torchrun, gloo, CPU) through
tests/mcore_dist_helper.py's trainer modes (tests/mcore_sidecar_helper.py), which write each sidecar from the TransformerConfig the model was built with.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import copy_run, declare_runs, shared_followups
from test_dist import HELPER as MCORE_HELPER, needs_mcore, run_cli
from test_dist_optim import HELPER as OPTIM_HELPER, SLOTS, assert_slots_equal, live
from ckptool import api
from ckptool.formats.dcp import torch_dist as dist
from ckptool.io.dcp_io import DcpDir
from ckptool.formats.registry import detect_format, open_checkpoint
from ckptool.options import ReadOptions
from ckptool.verify.reference import forward

HELPER = MCORE_HELPER  # its bridge / nemo / verl modes (tests/mcore_sidecar_helper.py): one launch with test_dist's saves
# trainer -> (arch, TP it saved at); Bridge and verl a Llama (GQA, SwiGLU, RMSNorm), NeMo a GPT-2 (tied, biases)
TRAINERS = {"bridge": ("llama", 2), "nemo": ("gpt2", 1), "verl": ("llama", 2)}
SAVES = declare_runs(HELPER, 2, {t: f"{t} {{out}} --tp {tp} --arch {arch} --out {{out}}.logits.pt"
                                 for t, (arch, tp) in TRAINERS.items()})
# Megatron-LM's --ckpt-format fsdp_dtensor as its source lays it out (no Megatron-FSDP here: see the helper)
FSDP_DTENSOR = declare_runs(HELPER, 2, {f"fsdp_dtensor_{arch}": f"fsdp_dtensor {{out}} --arch {arch} --out {{out}}.logits.pt"
                                        for arch in ("llama", "gpt2")})
# ... and an MoE model (Mixtral-like) after one step of megatron-core's optimizer, its Adam state saved per parameter as
# Megatron-FSDP's optimizer gives it, experts named as SequentialMLP's or Transformer Engine's grouped experts
FSDP_DTENSOR_MOE = declare_runs(HELPER, 2, {f"fsdp_dtensor_moe_{e}": f"fsdp_dtensor {{out}} --arch mixtral --experts {e} "
                                            "--optim --out {out}.logits.pt" for e in ("sequential", "grouped")})
# What each sidecar says about itself and its vocabulary (the reader names where the config came from).
SIDECAR_WORDS = {"bridge": "Megatron-Bridge run_config.yaml", "nemo": "NeMo 2 context/model.yaml",
                 "verl": "Hugging Face config huggingface/config.json"}


def _copied_runs(tmp_path_factory, framework_runs, helper: Path, runs: dict, folder: str) -> Path:
    """The session's runs of helper (2 ranks), copied into a folder of this file's own."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp(folder)
    for name, stem in framework_runs(helper, 2, runs, timeout=300).items():
        copy_run(stem, root / name)
    return root


@pytest.fixture(scope="module")
def saves(tmp_path_factory, framework_runs):
    return _copied_runs(tmp_path_factory, framework_runs, HELPER, SAVES, "sidecar_saves")


@needs_mcore
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_reads_each_trainers_checkpoint_like_megatron_core_computes(saves, trainer):
    path = saves / trainer
    assert detect_format(path) == "torch_dist"
    ckpt = open_checkpoint(path)
    assert ckpt.source.args is None or not hasattr(ckpt.source.args, "iteration")  # nothing from a Megatron-LM run
    assert ckpt.source.extra["config_sidecar"] == SIDECAR_WORDS[trainer]
    cfg = ckpt.config
    assert (cfg.padded_vocab_size, cfg.vocab_size) == (128, 100)
    if TRAINERS[trainer][0] == "llama":
        assert (cfg.num_layers, cfg.num_query_groups, cfg.activation, cfg.normalization, cfg.tied_embeddings,
                cfg.add_bias_linear) == (3, 2, "swiglu", "rmsnorm", False, False)
    else:
        assert (cfg.num_layers, cfg.position_embedding, cfg.activation, cfg.add_bias_linear, cfg.tied_embeddings) == \
            (2, "learned", "gelu", True, True)
    ref = torch.load(saves / f"{trainer}.logits.pt")
    torch.testing.assert_close(forward(ckpt, ref["tokens"]), ref["logits"], atol=1e-6, rtol=0)


@needs_mcore
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_quick_inspect_reads_the_sidecar_as_the_full_reader(saves, trainer, monkeypatch):
    from test_quick_inspect import quick_equals_full
    from ckptool import quick_inspect
    assert quick_inspect.quick_open(saves / trainer, {}) is not None
    quick_equals_full(monkeypatch, saves / trainer)


@needs_mcore
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_to_hf_is_bit_exact_and_transformers_computes_megatron_cores_logits(saves, trainer, tmp_path):
    from transformers import AutoModelForCausalLM
    r = run_cli("to-hf", saves / trainer, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    src, out = open_checkpoint(saves / trainer), open_checkpoint(tmp_path / "hf")
    assert list(out.tensors) == list(src.tensors)
    for name, t in src.tensors.items():
        want = t.load()[:100] if name in ("embed.word", "output.weight") else t.load()  # padding rows trimmed
        assert torch.equal(out.tensors[name].load(), want), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ref = torch.load(saves / f"{trainer}.logits.pt")
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"][..., :100], atol=1e-5, rtol=0)


# ckptool's reshards megatron-core loads: torch_dist at TP1 of every trainer's save (loaded at TP2), and the torch
# format of Bridge's (TP2) and NeMo's (TP1 PP2); verl's args (from config.json) name another vocab divisor than
# the run the load-torch mode compares them with.
TORCH_FORMAT_LOADS = {"bridge": (2, 1), "nemo": (1, 2)}


@shared_followups
def mcore_loads(framework_runs, root):
    """The reshards above (of the session's saves, read only), loaded by megatron-core strictly
    (tests/mcore_dist_helper.py load / load-torch) in the shared 2-process launch."""
    pytest.importorskip("megatron.core")
    saves = framework_runs(HELPER, 2, SAVES, timeout=300)
    jobs = []
    for trainer, (arch, _) in TRAINERS.items():
        out = root / f"{trainer}_dist"
        r = run_cli("reshard", saves[trainer], out, "--tp", 1, "--format", "torch_dist")
        assert r.returncode == 0, r.stderr
        jobs.append(f"load {out} --tp 2 --arch {arch} --out {root}/{trainer}_dist.pt")
        if trainer in TORCH_FORMAT_LOADS:
            tp, pp = TORCH_FORMAT_LOADS[trainer]
            out = root / f"{trainer}_torch"
            r = run_cli("reshard", saves[trainer], out, "--tp", tp, "--pp", pp, "--format", "torch")
            assert r.returncode == 0, r.stderr
            jobs.append(f"load-torch {out} --tp {tp} --pp {pp} --arch {arch} --out {root}/{trainer}_torch.pt")
    yield [(MCORE_HELPER, 2, jobs)]
    return root


@needs_mcore
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_megatron_core_loads_the_reshards_strictly(saves, mcore_loads, trainer):
    ref = torch.load(saves / f"{trainer}.logits.pt")
    for name in [f"{trainer}_dist"] + ([f"{trainer}_torch"] if trainer in TORCH_FORMAT_LOADS else []):
        got = torch.load(mcore_loads / f"{name}.pt", weights_only=False)
        torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-6, rtol=0, msg=name)


@pytest.fixture(scope="module")
def fsdp_dtensor_saves(tmp_path_factory, framework_runs):
    return _copied_runs(tmp_path_factory, framework_runs, HELPER, FSDP_DTENSOR, "fsdp_dtensor")


@needs_mcore
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_megatron_lm_fsdp_dtensor_layout_reads_and_exports(fsdp_dtensor_saves, arch, tmp_path, monkeypatch):
    """Per-layer keys under model.module., a SwiGLU fc1 as weight_w / weight_v, args and iteration as DCP byte
    entries: read with megatron-core's logits (quick inspect alike), to-hf with transformers computing them."""
    from transformers import AutoModelForCausalLM
    from test_quick_inspect import quick_equals_full
    path = fsdp_dtensor_saves / f"fsdp_dtensor_{arch}"
    ckpt = open_checkpoint(path)
    assert ckpt.source.iteration == 7 and ckpt.source.args.ckpt_format == "fsdp_dtensor"
    ref = torch.load(fsdp_dtensor_saves / f"fsdp_dtensor_{arch}.logits.pt")
    torch.testing.assert_close(forward(ckpt, ref["tokens"]), ref["logits"], atol=1e-6, rtol=0)
    quick_equals_full(monkeypatch, path)
    r = run_cli("to-hf", path, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"][..., :100], atol=1e-5, rtol=0)


@needs_mcore
def test_without_a_sidecar_the_error_names_hf_config_and_then_it_reads(saves, tmp_path):
    d = tmp_path / "verl"
    shutil.copytree(saves / "verl", d)
    shutil.move(d / "huggingface", tmp_path / "elsewhere")
    r = run_cli("inspect", d)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no config sidecar" in r.stderr and "--hf-config" in r.stderr
    r = run_cli("inspect", d, "--hf-config", tmp_path / "elsewhere", "--json")
    assert r.returncode == 0, r.stderr
    ckpt = open_checkpoint(d, ReadOptions(hf_config=str(tmp_path / "elsewhere")))
    assert ckpt.source.extra["config_sidecar"].startswith("--hf-config")
    ref = torch.load(saves / "verl.logits.pt")
    torch.testing.assert_close(forward(ckpt, ref["tokens"]), ref["logits"], atol=1e-6, rtol=0)


@needs_mcore
@pytest.mark.parametrize("damage, words", [
    (lambda f: f.write_text("model: [unclosed"), "not readable YAML"),
    (lambda f: f.write_text(f.read_text().replace("torch.nn.functional.silu", "torch.nn.functional.mish")),
     "activation_func mish with gated_linear_unit"),
    (lambda f: f.write_text("checkpoint: {}\n"), "holds no model config"),
])
def test_a_damaged_run_config_is_a_clear_error(saves, tmp_path, damage, words):
    d = tmp_path / "bridge"
    shutil.copytree(saves / "bridge", d)
    run_config = d / "iter_0000007" / "run_config.yaml"
    before = (d / "iter_0000007" / ".metadata").read_bytes()
    damage(run_config)
    r = run_cli("to-hf", d, tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    assert (d / "iter_0000007" / ".metadata").read_bytes() == before


# The distributed optimizer (tests/mcore_optim_dist_helper.py: trained 3 steps by the real megatron-core, saved without
# args) as each trainer lays it out: Megatron-Bridge (--bridge: run_config.yaml with the model / ddp / optimizer /
# checkpoint sections) fully_reshardable at TP1 x DP2 (GPT-2) and its default dp_reshardable at TP2 (Llama); NeMo 2
# (--trainer nemo: weights/ with the model keys under module., the optimizer's common entry a one-element list,
# context/model.yaml) and verl's Megatron backend (--trainer verl: dist_ckpt/, huggingface/config.json), fully_reshardable.
TRAINER_OPTIM = declare_runs(OPTIM_HELPER, 2, {
    "fr": "save {out} --tp 1 --form fully_reshardable --bridge --more 0 --live {out}_live --out {out}.pt",
    "dpr": "save {out} --tp 2 --arch llama --form dp_reshardable --bridge --more 0 --live {out}_live --out {out}.pt",
    "nemo": "save {out} --tp 1 --form fully_reshardable --trainer nemo --more 0 --live {out}_live --out {out}.pt",
    "verl": "save {out} --tp 2 --arch llama --form fully_reshardable --trainer verl --more 0 --live {out}_live "
            "--out {out}.pt"})


@pytest.fixture(scope="module")
def trainer_optim(tmp_path_factory, framework_runs):
    return _copied_runs(tmp_path_factory, framework_runs, OPTIM_HELPER, TRAINER_OPTIM, "trainer_optim")


@needs_mcore
@pytest.mark.parametrize("save, trainer, kind", [("fr", "bridge", "fully_reshardable"), ("dpr", "bridge", "dp_reshardable"),
                                                 ("nemo", "nemo", "fully_reshardable"), ("verl", "verl", "fully_reshardable")])
def test_each_trainers_distributed_optimizer_equals_the_live_one_and_carries_over(trainer_optim, save, trainer, kind,
                                                                                    tmp_path):
    from ckptool.formats.dcp.files import locate
    ckpt = open_checkpoint(trainer_optim / save)
    assert ckpt.source.extra["config_sidecar"] == SIDECAR_WORDS[trainer]
    d = locate(trainer_optim / save)[0]
    assert "args" not in dist.read_common_state(d, DcpDir(d))
    assert ckpt.optimizer is not None, ckpt.warnings
    assert ckpt.optimizer.kind == f"megatron-core-dist ({kind})" and ckpt.optimizer.step == 3
    assert_slots_equal(ckpt, live(trainer_optim / f"{save}_live"))
    out = tmp_path / "tp2"
    r = run_cli("reshard", trainer_optim / save, out, "--tp", 2, "--format", "torch_dist")
    assert r.returncode == 0 and "optimizer state dropped" not in r.stderr, r.stderr
    again = open_checkpoint(out)
    assert again.optimizer.step == 3
    vocab = ("embed.word", "output.weight")  # verl's config.json gives the true vocabulary: padding rows written anew
    assert_slots_equal(again, live(trainer_optim / f"{save}_live"), [n for n in again.tensors if n not in vocab])
    want = live(trainer_optim / f"{save}_live")
    for slot in SLOTS:
        for name in vocab:
            if name in again.tensors:
                assert torch.equal(again.optimizer.slots[slot][name].load()[:100], want(slot)[name].load()[:100])


@pytest.fixture(scope="module")
def fsdp_dtensor_moe(tmp_path_factory, framework_runs):
    return _copied_runs(tmp_path_factory, framework_runs, HELPER, FSDP_DTENSOR_MOE, "fsdp_dtensor_moe")


@needs_mcore
@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_megatron_fsdp_moe_and_its_optimizer_read_and_carry_to_megatron(fsdp_dtensor_moe, experts, tmp_path):
    """Experts by global index (mlp.experts.local_experts.{e}. / linear_fc1.weight{e}, GLU halves _w / _v) read with
    megatron-core's logits and to-hf with transformers'; the Adam state under optimizer.state.<param name>.<slot>
    equals the live optimizer's bit for bit (moments split like the weights, master = the weight), its groups are
    megatron-core's two (weight decay on / off), and it is carried into torch_dist at EP 2."""
    from transformers import AutoModelForCausalLM
    path = fsdp_dtensor_moe / f"fsdp_dtensor_moe_{experts}"
    ckpt = open_checkpoint(path)
    assert ckpt.config.moe.num_experts == 4 and ckpt.source.args.ckpt_format == "fsdp_dtensor"
    ref = torch.load(fsdp_dtensor_moe / f"fsdp_dtensor_moe_{experts}.logits.pt")
    torch.testing.assert_close(forward(ckpt, ref["tokens"]), ref["logits"], atol=1e-6, rtol=0)
    opt = ckpt.optimizer
    assert opt is not None and opt.kind == "megatron-fsdp-dtensor" and opt.step == 1, ckpt.warnings
    assert_slots_equal(ckpt, live(fsdp_dtensor_moe / f"fsdp_dtensor_moe_{experts}_live"))
    assert sorted(g.hyper["wd_mult"] for g in opt.param_groups) == [0.0, 1.0]
    assert sorted(n for g in opt.param_groups for n in g.names) == sorted(ckpt.tensors)
    r = run_cli("to-hf", path, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ref["tokens"]).logits, ref["logits"][..., :100], atol=1e-5, rtol=0)
    r = run_cli("reshard", path, tmp_path / "ep2", "--ep", 2, "--format", "torch_dist")
    assert r.returncode == 0 and "optimizer state dropped" not in r.stderr, r.stderr
    again = open_checkpoint(tmp_path / "ep2")
    assert again.optimizer.step == 1
    assert_slots_equal(again, live(fsdp_dtensor_moe / f"fsdp_dtensor_moe_{experts}_live"))


MOE_HELPER = Path(__file__).resolve().parent / "mcore_moe_helper.py"


@shared_followups
def fsdp_dtensor_moe_loaded(framework_runs, root):
    """Each fsdp_dtensor MoE save resharded by ckptool to torch_dist at EP 2 (the weights: the carried optimizer
    state is checked in test_megatron_fsdp_moe_and_its_optimizer_read_and_carry_to_megatron), then loaded by
    megatron-core's own GPTModel of that model at EP 2 (mcore_moe_helper load-dist: dist_checkpointing.load, every
    parameter found, nothing left over) with its logits, in the other files' shared 2-process launch."""
    jobs = []
    for name, stem in framework_runs(HELPER, 2, FSDP_DTENSOR_MOE, timeout=300).items():
        out = root / f"{name}_ep2"
        api.reshard(stem, out, ep=2, format="torch_dist", optimizer=False, warn=lambda m: None)
        jobs.append(f"load-dist {out} --tp 1 --ep 2 --arch mixtral --out {out}.pt")
    yield [(MOE_HELPER, 2, jobs)]
    return root


@needs_mcore
@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_megatron_core_loads_the_fsdp_dtensor_moe_at_ep2_with_its_logits(fsdp_dtensor_moe, fsdp_dtensor_moe_loaded,
                                                                         experts):
    ref = torch.load(fsdp_dtensor_moe / f"fsdp_dtensor_moe_{experts}.logits.pt")
    got = torch.load(fsdp_dtensor_moe_loaded / f"fsdp_dtensor_moe_{experts}_ep2.pt")
    assert torch.equal(got["tokens"], ref["tokens"])
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=0)


def _resaved(src: Path, dst: Path, edit) -> Path:
    """src's fsdp_dtensor save loaded whole by torch's own DCP reader, edited, saved again with dcp.save (one
    process) with its tracker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    it = next(src.glob("iter_*"))
    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(it)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    flat, _ = flatten_state_dict(state)  # the DCP keys again (the loader nests them)
    dcp.save(edit(flat), checkpoint_id=str(dst / it.name), no_dist=True)
    shutil.copy(src / "latest_checkpointed_iteration.txt", dst)
    return dst


@needs_mcore
def test_megatron_fsdp_optimizer_of_another_kind_is_dropped_and_a_missing_moment_is_an_error(fsdp_dtensor_moe, tmp_path):
    src = fsdp_dtensor_moe / "fsdp_dtensor_moe_sequential"
    sgd = _resaved(src, tmp_path / "sgd", lambda s: {k.replace(".exp_avg_sq", ".momentum_buffer"): v for k, v in s.items()})
    ckpt = open_checkpoint(sgd)
    assert ckpt.optimizer is None
    assert any("optimizer state dropped" in w and "momentum_buffer" in w for w in ckpt.warnings)
    router = "optimizer.state.module.module.module.decoder.layers.1.mlp.router.weight.exp_avg"
    lost = _resaved(src, tmp_path / "lost", lambda s: {k: v for k, v in s.items() if k != router})
    r = run_cli("reshard", lost, tmp_path / "out", "--format", "torch_dist")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no exp_avg optimizer state for layers.1.mlp.router.weight" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
