"""Megatron torch format: every dialect read correctly (logits equal transformers' on the ground
truth), every layout written, round trips bit-exact. Fixtures come from scripts/make_fixtures.py,
which builds the files from the documented layouts without using ckptool."""
import json

import pytest
import torch

from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.formats.megatron.checkpoint import read_megatron
from ckptool.formats.registry import open_checkpoint
from ckptool.options import ReadOptions
from ckptool.verify.reference import forward
from ckptool.write_options import WriteOptions

ALL_FIXTURES = [
    "gpt2_flat2019_tp1", "gpt2_flat2019_tp2", "gpt2_legacy_v0_tp1pp1", "gpt2_legacy_v0_tp2pp1",
    "gpt2_legacy_v1_tp1pp1", "gpt2_legacy_v1_tp2pp1", "gpt2_legacy_v2_tp1pp1", "gpt2_legacy_v2_tp2pp1",
    "gpt2_legacy_v3_tp1pp1", "gpt2_legacy_v3_tp2pp2", "gpt2_legacy_v3_tp2pp2_vpp2", "gpt2_legacy_v3_tp4pp1",
    "gpt2_legacy_norm_tp1pp1", "gpt2_legacy_norm_tp2pp2", "gpt2_mcore_tp1pp1", "gpt2_mcore_tp2pp1",
    "gpt2_mcore_tp1pp2", "gpt2_mcore_tp2pp2", "gpt2_mcore_tp4pp1", "gpt2_mcore_tp2pp2_vpp2",
    "gpt2_mcore_te_tp1pp1", "gpt2_mcore_te_tp2pp2", "gpt2_mcore_tp2pp2_bf16",
    "llama_legacy_norm_tp1pp1", "llama_legacy_norm_tp2pp1", "llama_legacy_norm_tp2pp2",
    "llama_legacy_norm_tp4pp1", "llama_mcore_tp1pp1", "llama_mcore_tp2pp2", "llama_mcore_tp4pp1",
    "llama_mcore_tp2pp2_vpp2", "llama_mcore_te_tp1pp1", "llama_mcore_te_tp2pp2",
    "llama_legacy_norm_tp2pp1_bf16",
]
DIALECT_OF = {"flat2019": "flat2019", "legacy_v0": "legacy-2020", "legacy_v1": "legacy-2020",
              "legacy_v2": "legacy-2020", "legacy_v3": "legacy", "legacy_norm": "legacy-norm",
              "mcore": "mcore", "mcore_te": "mcore-te"}


def _opts(case):
    # 2019 files store no args: the user gives the head count (the error says so, see below)
    return ReadOptions(overrides={"num_attention_heads": case["num_attention_heads"]}) \
        if case["dialect"] == "flat2019" else ReadOptions()


def _read(fixture_dir, name):
    d = fixture_dir(name)
    case = json.loads((d / "case.json").read_text())
    return d, case, read_megatron(d / "checkpoint", _opts(case))


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_reader_matches_ground_truth_logits(fixture_dir, name):
    d, case, ckpt = _read(fixture_dir, name)
    assert ckpt.source.dialect == DIALECT_OF[case["dialect"]]
    lay = ckpt.source.layout
    assert (lay.tp, lay.pp, lay.vpp or None) == (case["tp"], case["pp"], case.get("vpp") or None)
    exp = torch.load(d / "expected.pt")
    logits = forward(ckpt, exp["tokens"])
    v = exp["logits"].shape[-1]
    assert ckpt.config.padded_vocab_size == case["padded_vocab_size"]
    err = (logits[..., :v] - exp["logits"]).abs().max().item()
    scale = exp["logits"].abs().max().item()
    tol = 2e-2 if case["dtype"] == "bfloat16" else 1e-5
    assert err <= tol * max(1.0, scale), f"{name}: max abs diff {err}"


LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (4, 1, None), (1, 4, None), (2, 2, 2)]


def _tensors_equal(a, b):
    assert list(a.tensors) == list(b.tensors)
    for n in a.tensors:
        x, y = a.tensors[n].load(), b.tensors[n].load()
        assert x.dtype == y.dtype and torch.equal(x, y), n


# One source per dialect (and per QKV ordering), GPT-2 and Llama style (8 heads in 2 query
# groups, SwiGLU: TP4 puts half a group on each rank). Layouts a dialect cannot hold are refused
# by the writer (next test), not skipped.
ROUND_TRIP_SOURCES = [
    "gpt2_flat2019_tp2", "gpt2_legacy_v0_tp2pp1", "gpt2_legacy_v1_tp2pp1", "gpt2_legacy_v2_tp2pp1",
    "gpt2_legacy_v3_tp2pp2_vpp2", "gpt2_legacy_norm_tp2pp2", "gpt2_mcore_tp2pp2_vpp2", "gpt2_mcore_te_tp2pp2",
    "llama_legacy_norm_tp2pp2", "llama_mcore_tp2pp2_vpp2", "llama_mcore_te_tp2pp2",
]
NO_PIPELINE_DIALECTS = {"flat2019"}


def _round_trip_cases():
    for name in ROUND_TRIP_SOURCES:
        for layout in LAYOUTS:
            no_pp = any(name.startswith(f"gpt2_{d}") for d in NO_PIPELINE_DIALECTS)
            if not (no_pp and (layout[1] > 1 or layout[2])):
                yield name, layout


@pytest.mark.parametrize("name, layout", list(_round_trip_cases()),
                         ids=lambda x: x if isinstance(x, str) else f"tp{x[0]}pp{x[1]}vpp{x[2]}")
def test_reshard_roundtrip_bit_exact(fixture_dir, tmp_path, name, layout):
    """source -> any layout -> source layout, in the source's dialect: every tensor bit-exact, and
    the reference forward gives identical logits for the source and the resharded version."""
    d, case, src = _read(fixture_dir, name)
    tp, pp, vpp = layout
    write_layout(src, tmp_path / "mid", Layout(tp, pp, vpp), warn=lambda m: None)
    back_src = read_megatron(tmp_path / "mid", _opts(case))
    assert back_src.source.dialect == src.source.dialect
    assert back_src.source.checkpoint_version == src.source.checkpoint_version
    assert (back_src.source.layout.tp, back_src.source.layout.pp, back_src.source.layout.vpp) == (tp, pp, vpp)
    _tensors_equal(src, back_src)
    lay = src.source.layout
    write_layout(back_src, tmp_path / "back", Layout(lay.tp, lay.pp, lay.vpp), warn=lambda m: None)
    again = read_megatron(tmp_path / "back", _opts(case))
    _tensors_equal(src, again)
    exp = torch.load(d / "expected.pt")
    assert torch.equal(forward(src, exp["tokens"]), forward(back_src, exp["tokens"]))


@pytest.mark.parametrize("layout", [(1, 2, None), (2, 2, 2)])
def test_2019_flat_dialect_refuses_pipeline_layouts(fixture_dir, tmp_path, layout):
    from ckptool.errors import CkptError
    d, case, src = _read(fixture_dir, "gpt2_flat2019_tp2")
    with pytest.raises(CkptError, match="no pipeline parallelism"):
        write_layout(src, tmp_path / "o", Layout(*layout), warn=lambda m: None)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["gpt2_legacy_v0_tp2pp1", "gpt2_legacy_v1_tp2pp1", "gpt2_flat2019_tp2",
                                  "gpt2_mcore_te_tp2pp2", "llama_legacy_norm_tp4pp1", "llama_mcore_te_tp2pp2"])
def test_dialect_is_kept_and_files_match_source(fixture_dir, tmp_path, name):
    """Writing in the source's dialect and layout reproduces every model tensor of every rank file."""
    d, case, src = _read(fixture_dir, name)
    lay = src.source.layout
    write_layout(src, tmp_path / "out", Layout(lay.tp, lay.pp, lay.vpp),
                 WriteOptions(release=False), warn=lambda m: None)
    out = read_megatron(tmp_path / "out", _opts(case))
    assert out.source.dialect == src.source.dialect
    assert out.source.checkpoint_version == src.source.checkpoint_version
    from ckptool.io.torchfile import load_torch_file
    from ckptool.formats.megatron.checkpoint import flatten
    src_files = sorted((d / "checkpoint").rglob("model_optim_rng.pt"))
    out_files = sorted((tmp_path / "out").rglob("model_optim_rng.pt"))
    assert [f.parent.name for f in src_files] == [f.parent.name for f in out_files]
    for a, b in zip(src_files, out_files):
        ta, tb = load_torch_file(a), load_torch_file(b)
        for key in [k for k in ta if str(k).startswith("model")]:
            fa, fb = flatten(ta[key]), flatten(tb[key])
            tensors_a = {k: v for k, v in fa.items() if hasattr(v, "load") and not k.endswith("_extra_state")}
            tensors_b = {k: v for k, v in fb.items() if hasattr(v, "load") and not k.endswith("_extra_state")}
            assert set(tensors_a) == set(tensors_b), a
            for k in tensors_a:
                assert torch.equal(tensors_a[k].load(), tensors_b[k].load()), (a, k)


@pytest.mark.parametrize("target", ["mcore", "mcore-te", "legacy-norm"])
def test_dialect_conversion_keeps_logits(fixture_dir, tmp_path, target):
    d, case, src = _read(fixture_dir, "llama_legacy_norm_tp2pp1")
    write_layout(src, tmp_path / "out", Layout(2, 2), WriteOptions(dialect=target), warn=lambda m: None)
    out = read_megatron(tmp_path / "out")
    assert out.source.dialect == target
    _tensors_equal(src, out)


def test_written_args_describe_the_new_layout(fixture_dir, tmp_path):
    d, case, src = _read(fixture_dir, "llama_mcore_tp2pp2")
    write_layout(src, tmp_path / "out", Layout(4, 1), warn=lambda m: None)
    from ckptool.io.torchfile import load_torch_file
    f = load_torch_file(tmp_path / "out" / "iter_0000010" / "mp_rank_03" / "model_optim_rng.pt")
    a = f["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (4, 1)
    assert a.padded_vocab_size == 1024 and f["checkpoint_version"] == 3.0 and f["iteration"] == 10
    assert a.num_query_groups == 2 and a.swiglu and a.normalization == "RMSNorm"
    # the Megatron enum in args survives as a reference to the real class
    assert type(a.model_type).__module__ == "megatron.core.enums"
    # the file loads with plain torch (as Megatron would) given the enum class
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "10"


@pytest.mark.parametrize("layout, vpp, first", [(Layout(1, 2), None, None), (Layout(1, 2, vpp=2), 2, None),
                                                (Layout(1, 2, stage_layers=[3, 1]), None, 3)], ids=str)
def test_written_args_say_the_pipeline_split_one_way(fixture_dir, tmp_path, layout, vpp, first):
    """A source run's args may say its pipeline split in ways the target layout does not have (Megatron-LM's
    --num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout, first / last stage sizes): the
    written args say the target's split only (validate_args refuses two ways of saying the virtual pipeline;
    stale stage sizes describe other files), and the run's VPP read from them is the target's."""
    from ckptool.formats.megatron.args import virtual_pipeline_size
    from ckptool.io.torchfile import load_torch_file
    d, case, src = _read(fixture_dir, "llama_mcore_tp2pp2")
    assert src.config.num_layers == 4
    a = src.source.args
    a.num_virtual_stages_per_pipeline_rank, a.virtual_pipeline_model_parallel_size = 2, 2
    a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers = 1, 1
    a.pipeline_model_parallel_layout = "Et|t|t|tL"
    write_layout(src, tmp_path / "out", layout, warn=lambda m: None)
    w = load_torch_file(next((tmp_path / "out").glob("iter_*/mp_rank_00_000/model_optim_rng.pt")))["args"]
    said = [k for k in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                        "pipeline_model_parallel_layout") if getattr(w, k, None) is not None]
    assert said == (["num_layers_per_virtual_pipeline_stage"] if vpp else [])
    assert w.virtual_pipeline_model_parallel_size == virtual_pipeline_size(w, 4) == vpp
    assert (w.decoder_first_pipeline_num_layers, w.decoder_last_pipeline_num_layers) == \
        ((first, layout.stage_layers[-1]) if first else (None, None))
    assert read_megatron(tmp_path / "out").source.layout == layout


@pytest.mark.parametrize("arg, value, flag", [
    ("rotary_seq_len_interpolation_factor", 4, "--rotary-seq-len-interpolation-factor"),
    ("no_rope_freq", 2, "--no-rope-freq"), ("qk_l2_norm", True, "--qk-l2-norm")])
def test_maths_ckptool_does_not_compute_goes_along_but_is_not_exported(fixture_dir, tmp_path, arg, value, flag):
    """Megatron-LM 0.16 args that change a layer's maths ckptool does not compute (RoPE position interpolation,
    layers without RoPE, L2-normalised q/k): a Megatron layout carries them in its args (sliding windows are
    computed since issue 32: tests/test_gemma.py, tests/test_gpt_oss.py),
    to-hf refuses by the flag's name and leaves nothing behind, where it would have written another model."""
    from ckptool import api
    from ckptool.errors import CkptError
    d, case, src = _read(fixture_dir, "llama_mcore_tp2pp2")
    setattr(src.source.args, arg, value)
    write_layout(src, tmp_path / "out", Layout(1, 1), warn=lambda m: None)
    assert getattr(read_megatron(tmp_path / "out").source.args, arg) == value
    with pytest.raises(CkptError, match=f"cannot export to Hugging Face: the model uses {flag}"):
        api.to_hf(tmp_path / "out", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_open_checkpoint_detects_iteration_and_tracker(fixture_dir, tmp_path):
    d = fixture_dir("gpt2_mcore_tp2pp1")
    ck = open_checkpoint(d / "checkpoint")
    assert ck.source.iteration == 10 and ck.source.format == "megatron"
    ck2 = open_checkpoint(d / "checkpoint" / "iter_0000010")
    assert ck2.source.iteration == 10
    ck3 = open_checkpoint(d / "checkpoint", ReadOptions(iteration=10))
    assert ck3.source.iteration == 10


def test_2019_files_without_head_count_name_the_flag(fixture_dir):
    from ckptool.errors import CkptError
    d = fixture_dir("gpt2_flat2019_tp1")
    with pytest.raises(CkptError, match="--num-attention-heads"):
        read_megatron(d / "checkpoint")


def test_uneven_pipeline_needs_a_split(fixture_dir, tmp_path):
    from ckptool.errors import CkptError
    d, case, src = _read(fixture_dir, "gpt2_mcore_tp1pp1")
    with pytest.raises(CkptError, match="--pp-layers"):
        write_layout(src, tmp_path / "o", Layout(1, 3), warn=lambda m: None)
    assert not (tmp_path / "o").exists()
    write_layout(src, tmp_path / "o", Layout(1, 2, stage_layers=[1, 3]), warn=lambda m: None)
    out = read_megatron(tmp_path / "o")
    assert out.source.layout.stage_layers == [1, 3]
    _tensors_equal(src, out)
