"""DeepSpeed checkpoints as sources.

Real: tests/ds_train_cases.py trains tiny GPT-2 / BERT models with the real deepspeed package under
torchrun (2 ranks, gloo, CPU) for ZeRO 1/2/3 in bf16 and fp16 and dumps the engine's own fp32
masters; ckptool's reassembly must equal them bit for bit. The real Megatron-DeepSpeed TP2 PP2
checkpoint in shared/real-checkpoints must reproduce the logits the framework computed.
Synthetic (named as such): layouts the CPU engine cannot produce here, built from deepspeed.md 1.3/1.4.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import DS_TRAIN_CASES, count_tensor_reads, shared_followups
from ckptool.errors import CkptError
from ckptool.formats.deepspeed import checkpoint as ds
from ckptool.formats.registry import detect_format, open_checkpoint
from ckptool.lazy import load_scope
from ckptool.options import ReadOptions
from ckptool.verify.reference import forward

REPO = Path(__file__).resolve().parents[1]
# ../shared/real-checkpoints while developing; fixtures/real (a copy in the repo) on CI
MDS = next((base / "mds_gpt2_pipe_tp2pp2_bf16_zero1" for base in (REPO.parent / "shared" / "real-checkpoints",
                                                                   REPO / "fixtures" / "real")
            if (base / "mds_gpt2_pipe_tp2pp2_bf16_zero1" / "checkpoint").is_dir()),
           REPO / "fixtures" / "real" / "mds_gpt2_pipe_tp2pp2_bf16_zero1")

try:
    import deepspeed  # noqa: F401
    HAVE_DS = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_DS = False
needs_ds = pytest.mark.skipif(not HAVE_DS, reason="the deepspeed package cannot be imported")

GPT2_CASES = [c for c in DS_TRAIN_CASES if c.startswith("gpt2-")]  # the saves of conftest's ds_cases
BERT_CASES = [c for c in DS_TRAIN_CASES if c.startswith("bert-")]
LLAMA_CASES = [c for c in DS_TRAIN_CASES if c.startswith("llama-")]


def _cli(*argv):
    from click.testing import CliRunner
    from ckptool.cli import main
    return CliRunner().invoke(main, list(argv))


def _load_all(tensors):
    with load_scope():
        return {k: v.load().clone() for k, v in tensors.items()}


# --- real DeepSpeed checkpoints -----------------------------------------------------------------

@needs_ds
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", GPT2_CASES + BERT_CASES + LLAMA_CASES)
def test_master_weights_equal_engine_fp32_bit_for_bit(ds_cases, case):
    truth = torch.load(ds_cases / case / "truth.pt")
    hf_cfg, named = ds.consolidate_hf_state(ds_cases / case / "ckpt")
    got = _load_all(named)
    assert hf_cfg["model_type"] == case.split("-")[0]
    frozen = {"gpt2": "transformer.wpe.weight", "bert": "bert.embeddings.token_type_embeddings.weight",
              "llama": "model.layers.0.input_layernorm.weight"}[case.split("-")[0]]
    for name, want in truth.items():
        assert name in got, name
        assert got[name].dtype == want.dtype, name
        assert got[name].shape == want.shape, name
        assert torch.equal(got[name], want), f"{case} {name}"
    assert frozen in got
    if case.startswith("llama"):  # untied: the head is a parameter of its own
        assert "lm_head.weight" in truth and "lm_head.weight" in got
    else:  # the tied alias is left for HF to re-tie
        assert "lm_head.weight" not in got and "cls.predictions.decoder.weight" not in got


@needs_ds
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", ["gpt2-1-bf16", "gpt2-2-fp16"])
def test_model_weights_are_the_16bit_copies(ds_cases, case):
    truth = torch.load(ds_cases / case / "truth.pt")
    half = torch.bfloat16 if case.endswith("bf16") else torch.float16
    _, named = ds.consolidate_hf_state(ds_cases / case / "ckpt", ReadOptions(weights="model"))
    got = _load_all(named)
    for name, want in truth.items():
        assert got[name].dtype == half
        assert torch.equal(got[name], want.to(half)), name


@needs_ds
@pytest.mark.deepspeed
def test_zero3_has_no_model_weights(ds_cases):
    with pytest.raises(CkptError, match="ZeRO-3"):
        open_checkpoint(ds_cases / "gpt2-3-bf16" / "ckpt", ReadOptions(weights="model"))


@needs_ds
@pytest.mark.deepspeed
def test_zero3_without_its_optimizer_shards_is_refused_by_name(ds_cases, tmp_path):
    """Neither weights is there: the placeholders are not read as a model (once an internal error)."""
    shutil.copytree(ds_cases / "gpt2-3-bf16" / "ckpt", tmp_path / "ckpt")
    for f in (tmp_path / "ckpt").glob("*/*optim_states.pt"):
        f.unlink()
    with pytest.raises(CkptError, match="no ZeRO optimizer shards and keeps no 16-bit module weights"):
        open_checkpoint(tmp_path / "ckpt")
    r = _cli("inspect", str(tmp_path / "ckpt"))
    assert r.exit_code == 2 and "optim_states.pt files" in r.output


@needs_ds
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", ["gpt2-1-bf16", "gpt2-3-fp16"])
def test_gpt2_logits_through_transformers(ds_cases, case, tmp_path):
    import transformers
    from safetensors.torch import save_file
    ckpt_dir = ds_cases / case / "ckpt"
    assert detect_format(ckpt_dir) == "deepspeed" and detect_format(ckpt_dir / "global_step2") == "deepspeed"
    ckpt = open_checkpoint(ckpt_dir)
    assert ckpt.source.layout.dp == 2 and "master" in ckpt.source.storage
    tokens = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = forward(ckpt, tokens)
    hf_cfg, named = ds.consolidate_hf_state(ckpt_dir)
    save_file({k: v.load().float().contiguous() for k, v in named.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(tokens).logits
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    assert (hf - ref).abs().max().item() < 2e-5


@needs_ds
@pytest.mark.deepspeed
def test_llama_gqa_swiglu_logits_through_transformers(ds_cases, tmp_path):
    import transformers
    from safetensors.torch import save_file
    ckpt = open_checkpoint(ds_cases / "llama-3-bf16" / "ckpt")
    assert ckpt.config.gated and ckpt.config.num_query_groups == 2 and not ckpt.config.tied_embeddings
    tokens = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = forward(ckpt, tokens)
    hf_cfg, named = ds.consolidate_hf_state(ds_cases / "llama-3-bf16" / "ckpt")
    save_file({k: v.load().float().contiguous() for k, v in named.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(tokens).logits
    assert (hf - ref).abs().max().item() < 2e-5


@needs_ds
@pytest.mark.deepspeed
def test_bert_consolidates_to_a_loadable_hf_model(ds_cases, tmp_path):
    import transformers
    from safetensors.torch import save_file
    case = ds_cases / "bert-3-bf16"
    with pytest.raises(CkptError, match="to-hf"):
        open_checkpoint(case / "ckpt")
    hf_cfg, named = ds.consolidate_hf_state(case / "ckpt", ReadOptions(hf_config=str(case / "ckpt" / "config.json")))
    save_file({k: v.load().float().contiguous() for k, v in named.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    model = transformers.BertForMaskedLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    truth = torch.load(case / "truth.pt")
    sd = model.state_dict()
    for name, want in truth.items():
        assert torch.equal(sd[name], want.float()), name
    assert torch.equal(sd["cls.predictions.decoder.weight"], truth["bert.embeddings.word_embeddings.weight"])


@needs_ds
@pytest.mark.deepspeed
def test_cli_inspect_and_merge_of_a_zero3_run(ds_cases, tmp_path):
    src = ds_cases / "gpt2-3-bf16" / "ckpt"
    res = _cli("inspect", str(src), "--no-tensors")
    assert res.exit_code == 0, res.output
    assert "deepspeed" in res.output and "zero-3" in res.output and "master weights" in res.output
    res = _cli("merge", str(src), str(tmp_path / "m"))
    assert res.exit_code == 0, res.output
    res = _cli("inspect", str(src), "--weights", "model")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "error: " in res.output
    a, b = open_checkpoint(src), open_checkpoint(tmp_path / "m")
    tokens = torch.arange(12).reshape(1, 12)
    assert torch.allclose(forward(a, tokens), forward(b, tokens)[..., :1001], atol=1e-6, rtol=0)


# --- the real Megatron-DeepSpeed TP2 PP2 checkpoint ----------------------------------------------

needs_mds = pytest.mark.skipif(not MDS.is_dir(), reason=f"real checkpoint not found at {MDS}")


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@needs_mds
def test_real_mds_model_weights_reproduce_framework_logits():
    ref = torch.load(MDS / "reference_logits.pt")
    ckpt = open_checkpoint(MDS / "checkpoint", ReadOptions(weights="model"))
    assert ckpt.source.format == "deepspeed" and ckpt.source.layout.tp == 2 and ckpt.source.layout.pp == 2
    assert ckpt.config.vocab_size == 1001 and ckpt.config.padded_vocab_size == 1024
    assert ckpt.config.vocab_size_source == "universal_checkpoint_info.original_vocab_size"
    logits = forward(ckpt, ref["tokens"])
    assert _rel(logits, ref["logits_fp32"]) < 1e-4
    assert not ckpt.source.extra["replica_policy"].divergences  # this run had dropout off


@needs_mds
def test_real_mds_master_weights_differ_and_tied_copy_is_reported():
    ref = torch.load(MDS / "reference_logits.pt")
    ckpt = open_checkpoint(MDS / "checkpoint" / "global_step3")
    assert "master" in ckpt.source.storage
    logits = forward(ckpt, ref["tokens"])
    assert 1e-4 < _rel(logits, ref["logits_fp32"]) < 1e-1  # bf16 rounding apart (deepspeed.md 8)
    # The last stage's optimizer keeps a stale master of the (unused there) position embeddings.
    assert any("tied position_embeddings.weight" in w and "last pipeline stage" in w and "0.0909" in w
               for w in ckpt.warnings), ckpt.warnings
    assert not any("word_embeddings" in w for w in ckpt.warnings)


@needs_mds
def test_real_mds_merge_keeps_logits(tmp_path):
    ref = torch.load(MDS / "reference_logits.pt")
    res = _cli("merge", str(MDS / "checkpoint"), str(tmp_path / "m"), "--weights", "model")
    assert res.exit_code == 0, res.output
    merged = open_checkpoint(tmp_path / "m")
    assert merged.config.vocab_size == 1001
    logits = forward(merged, ref["tokens"])
    assert _rel(logits[..., :1001], ref["logits_fp32"][..., :1001]) < 1e-4


@needs_ds
def test_real_mds_merge_says_once_that_the_stale_tied_position_copy_is_unused(tmp_path):
    """The last stage's optimizer holds a stale copy of the position embeddings (master, exp_avg and
    exp_avg_sq, on both TP ranks): one warning line for all of them, saying which copy is kept and that
    the stale one takes no part in the forward (DeepSpeed ties only word_embeddings_weight)."""
    res = _cli("merge", str(MDS / "checkpoint"), str(tmp_path / "m"))
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if "tied position_embeddings.weight" in line]
    assert len(lines) == 1, res.output
    line = lines[0]
    assert "TP ranks 0, 1" in line and "using the first stage's" in line and "not used by the forward" in line
    assert all(part in line for part in ("master 0.0909,", "exp_avg 0.", "exp_avg_sq 1.")), line


@pytest.fixture
def mds_copy(tmp_path):
    if not MDS.is_dir():
        pytest.skip(f"real checkpoint not found at {MDS}")
    dst = tmp_path / "ckpt"
    shutil.copytree(MDS / "checkpoint", dst)
    return dst


@needs_mds
def test_real_mds_diverged_tp_replicas(mds_copy):
    """Like a run with dropout on: TP rank 1's layer norm drifts from rank 0's."""
    f = mds_copy / "global_step3" / "layer_03-model_01-model_states.pt"
    sd = torch.load(f)
    sd["input_layernorm.weight"] = sd["input_layernorm.weight"] + 0.0625
    torch.save(sd, f)
    tokens = torch.arange(8).reshape(1, 8)
    first = open_checkpoint(mds_copy, ReadOptions(weights="model", replicas="first"))
    forward(first, tokens)
    assert any(w.startswith("layers.1.attn_norm.weight: tensor-parallel replicas differ") for w in first.warnings)
    assert abs(first.source.extra["replica_policy"].divergences["layers.1.attn_norm.weight"] - 0.0625) < 0.01
    mean = open_checkpoint(mds_copy, ReadOptions(weights="model", replicas="mean"))
    w = mean.tensors["layers.1.attn_norm.weight"].load()
    w0 = first.tensors["layers.1.attn_norm.weight"].load()
    assert torch.allclose(w.float(), w0.float() + 0.03125, atol=4e-3)
    strict = open_checkpoint(mds_copy, ReadOptions(weights="model", replicas="strict"))
    with pytest.raises(CkptError, match="replicas differ"):
        forward(strict, tokens)


@needs_mds
def test_real_mds_split_qkv_layout_changes_the_model():
    ref = torch.load(MDS / "reference_logits.pt")
    ckpt = open_checkpoint(MDS / "checkpoint", ReadOptions(weights="model", qkv_layout="split"))
    assert "qkv split" in ckpt.source.dialect
    assert _rel(forward(ckpt, ref["tokens"]), ref["logits_fp32"]) > 1e-2


# --- synthetic fixtures (documented layouts the CPU engine cannot produce here) -------------------

def _rand_gpt(h=8, heads=2, layers=2, vocab=16, ffn=32, pos=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {"word": r(vocab, h), "pos": r(pos, h), "final_norm.weight": r(h), "final_norm.bias": r(h)}
    for i in range(layers):
        t.update({f"{i}.ln1.w": r(h), f"{i}.ln1.b": r(h), f"{i}.q": r(h, h), f"{i}.k": r(h, h), f"{i}.v": r(h, h),
                  f"{i}.qb": r(h), f"{i}.kb": r(h), f"{i}.vb": r(h), f"{i}.o": r(h, h), f"{i}.ob": r(h),
                  f"{i}.ln2.w": r(h), f"{i}.ln2.b": r(h), f"{i}.up": r(ffn, h), f"{i}.upb": r(ffn),
                  f"{i}.down": r(h, ffn), f"{i}.downb": r(h)})
    return t


def _args(h=8, heads=2, layers=2, ffn=32, pos=8, tp=1, vocab=16):
    return argparse.Namespace(num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn,
                              max_position_embeddings=pos, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=1, padded_vocab_size=vocab, vocab_size=vocab,
                              make_vocab_size_divisible_by=1)


def _per_head_qkv(q, k, v, heads):
    """Megatron's per-head [q, k, v] rows (what MDS stores for MHA), built by hand."""
    hd = q.shape[0] // heads
    rows = []
    for j in range(heads):
        rows += [q[j * hd:(j + 1) * hd], k[j * hd:(j + 1) * hd], v[j * hd:(j + 1) * hd]]
    return torch.cat(rows)


def _check_canonical(ckpt, t, layers=2):
    got = _load_all(ckpt.tensors)
    assert torch.equal(got["embed.word"], t["word"])
    assert torch.equal(got["embed.pos"], t["pos"])
    for i in range(layers):
        for a, b in [("attn.q.weight", "q"), ("attn.k.weight", "k"), ("attn.v.weight", "v"),
                     ("attn.q.bias", "qb"), ("attn.out.weight", "o"), ("mlp.up.weight", "up"),
                     ("mlp.down.weight", "down"), ("attn_norm.weight", "ln1.w"), ("mlp.down.bias", "downb")]:
            assert torch.equal(got[f"layers.{i}.{a}"], t[f"{i}.{b}"]), (i, a)


def _legacy_module_tp(t, rank, tp, heads, layers=2):
    """Megatron legacy state for one TP rank, dotted parameter names (MDS --no-pipeline-parallel)."""
    hl = heads // tp
    h = t["word"].shape[1]
    hd = h // heads
    sl = lambda x, n: x.chunk(tp, 0)[rank] if n == 0 else x.chunk(tp, 1)[rank]  # noqa: E731
    out = {"language_model.embedding.word_embeddings.weight": sl(t["word"], 0),
           "language_model.embedding.position_embeddings.weight": t["pos"]}
    for i in range(layers):
        p = f"language_model.encoder.layers.{i}."
        rows = slice(rank * hl * hd, (rank + 1) * hl * hd)
        out[p + "input_layernorm.weight"] = t[f"{i}.ln1.w"]
        out[p + "input_layernorm.bias"] = t[f"{i}.ln1.b"]
        out[p + "self_attention.query_key_value.weight"] = _per_head_qkv(t[f"{i}.q"][rows], t[f"{i}.k"][rows], t[f"{i}.v"][rows], hl)
        out[p + "self_attention.query_key_value.bias"] = _per_head_qkv(t[f"{i}.qb"][rows], t[f"{i}.kb"][rows], t[f"{i}.vb"][rows], hl)
        out[p + "self_attention.dense.weight"] = sl(t[f"{i}.o"], 1)
        out[p + "self_attention.dense.bias"] = t[f"{i}.ob"]
        out[p + "post_attention_layernorm.weight"] = t[f"{i}.ln2.w"]
        out[p + "post_attention_layernorm.bias"] = t[f"{i}.ln2.b"]
        out[p + "mlp.dense_h_to_4h.weight"] = sl(t[f"{i}.up"], 0)
        out[p + "mlp.dense_h_to_4h.bias"] = sl(t[f"{i}.upb"], 0)
        out[p + "mlp.dense_4h_to_h.weight"] = sl(t[f"{i}.down"], 1)
        out[p + "mlp.dense_4h_to_h.bias"] = t[f"{i}.downb"]
    out["language_model.encoder.final_layernorm.weight"] = t["final_norm.weight"]
    out["language_model.encoder.final_layernorm.bias"] = t["final_norm.bias"]
    return out


def _write_zero12(tag, params, mp, dp, prefix, zero_stage, keep_padding, extra_meta):
    """ZeRO-1/2 (or BF16_Optimizer when zero_stage is None) files for one MP rank, deepspeed.md 1.3/1.4:
    one group, params back to back, padded to a multiple of 2*dp, cut into dp equal partitions."""
    flat = torch.cat([p.float().reshape(-1) for p in params.values()])
    align = 2 * dp
    pad = (-flat.numel()) % align
    flat = torch.cat([flat, torch.zeros(pad)])
    n = flat.numel() // dp
    parts = list(flat.split(n))
    # Adam moments as exact elementwise functions of the masters (x/4, x*x), partitions kept whole
    moments = [{"step": torch.tensor(7.0), "exp_avg": x * 0.25, "exp_avg_sq": x * x} for x in parts]
    paddings = [0] * dp
    if not keep_padding:  # ZeRO-1/2 strip the trailing padding from the saved partition
        left = pad
        for r in reversed(range(dp)):
            cut = min(left, n)
            paddings[r] = cut
            parts[r] = parts[r][:n - cut]
            left -= cut
    elif dp > 0:
        paddings[-1] = pad
    for r in range(dp):
        osd = {"single_partition_of_fp32_groups": [parts[r].clone()], "group_paddings": [paddings[r]],
               "partition_count": [dp], "base_optimizer_state": {
                   "state": {0: moments[r]}, "param_groups": [{"lr": 1e-3, "weight_decay": 0.1, "params": [0]}]}}
        if zero_stage is not None:
            osd["zero_stage"] = zero_stage
        torch.save({"optimizer_state_dict": osd}, tag / f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt")
    meta = {"module": {k: v.to(torch.bfloat16) for k, v in params.items()}, "buffer_names": [],
            "param_shapes": [{k: v.shape for k, v in params.items()}], "shared_params": {},
            "frozen_param_shapes": None, "frozen_param_fragments": None, "dp_world_size": dp}
    meta.update(extra_meta)
    torch.save(meta, tag / f"mp_rank_{mp:02d}_model_states.pt")


def _write_zero3(tag, params, mp, ws, extra_meta):
    """ZeRO-3 files for one MP rank, deepspeed.md 1.2/1.3: every parameter cut into ws equal slices
    (the last zero-padded), rank r's slices back to back in its one flat; a model-states file per DP
    rank with 0-numel placeholders in `module`; Adam moments x/4 and x*x of the masters."""
    flats = [[] for _ in range(ws)]
    for v in params.values():
        x = v.float().reshape(-1)
        pn = -(-x.numel() // ws)
        x = torch.cat([x, torch.zeros(pn * ws - x.numel())])
        for r in range(ws):
            flats[r].append(x[r * pn:(r + 1) * pn])
    for r in range(ws):
        flat = torch.cat(flats[r])
        osd = {"zero_stage": 3, "partition_count": ws, "fp32_flat_groups": [flat], "optimizer_state_dict": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": flat * 0.25, "exp_avg_sq": flat * flat}},
            "param_groups": [{"lr": 1e-3, "weight_decay": 0.1, "params": [0]}]}}
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt")
        meta = {"module": {k: torch.empty(0, dtype=torch.bfloat16) for k in params}, "buffer_names": [],
                "param_shapes": [{k: v.shape for k, v in params.items()}], "shared_params": {},
                "frozen_param_shapes": {}, "frozen_param_fragments": {}, "dp_world_size": ws}
        meta.update(extra_meta)
        torch.save(meta, tag / f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt")


def test_synthetic_zero3_tp2_megatron_names(tmp_path):
    """Synthetic: ZeRO-3 at TP 2 x DP 3 of Megatron-DeepSpeed --no-pipeline-parallel names (odd sizes:
    padded slices): the fp32 masters and moments are the parameters, exactly."""
    t = _rand_gpt(h=8, heads=2, vocab=16)
    tag = tmp_path / "global_step7"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step7")
    for mp in range(2):
        _write_zero3(tag, _legacy_module_tp(t, mp, 2, heads=2), mp, 3,
                     {"args": _args(tp=2), "iteration": 7, "checkpoint_version": 3.0})
    ckpt = open_checkpoint(tmp_path)
    assert "zero-3, master weights" in ckpt.source.storage and ckpt.source.layout.dp == 3
    _check_canonical(ckpt, t)
    got = _load_all(ckpt.optimizer.slots["exp_avg"])
    assert torch.equal(got["embed.word"], t["word"] * 0.25) and ckpt.optimizer.step == 7


def test_synthetic_bf16_optimizer_tp2_megatron_names(tmp_path):
    """Synthetic: BF16_Optimizer shards (no zero_stage, padding kept), TP=2 (mp_rank_01), DP=3,
    Megatron-DeepSpeed --no-pipeline-parallel names, args in the model states."""
    t = _rand_gpt(h=8, heads=2, vocab=16)
    tag = tmp_path / "global_step7"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step7")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    for mp in range(2):
        params = _legacy_module_tp(t, mp, 2, heads=2)
        _write_zero12(tag, params, mp, 3, "bf16_", None, True,
                      {"args": _args(tp=2), "iteration": 7, "checkpoint_version": 3.0})
    assert detect_format(tmp_path) == "deepspeed"
    ckpt = open_checkpoint(tmp_path)
    assert "BF16_Optimizer" in ckpt.source.storage and ckpt.source.layout.tp == 2 and ckpt.source.layout.dp == 3
    _check_canonical(ckpt, t)
    model = open_checkpoint(tmp_path, ReadOptions(weights="model"))
    assert model.tensors["embed.word"].dtype == torch.bfloat16
    assert torch.equal(model.tensors["embed.word"].load(), t["word"].to(torch.bfloat16))


def test_synthetic_zero2_fp16_trailing_padding_stripped(tmp_path):
    """Synthetic: ZeRO-2 fp16 files (zero_stage 2, padding stripped over the last ranks), DP=4."""
    t = _rand_gpt(h=6, heads=2, vocab=11, ffn=10, pos=5, seed=3)
    tag = tmp_path / "global_step1"
    tag.mkdir()
    params = _legacy_module_tp(t, 0, 1, heads=2)
    _write_zero12(tag, params, 0, 4, "", 2, False,
                  {"args": _args(h=6, heads=2, ffn=10, pos=5, vocab=11)})
    ckpt = open_checkpoint(tag)
    assert "zero-2" in ckpt.source.storage
    _check_canonical(ckpt, t)


def test_synthetic_2019_deepspeed_examples_engine_format(tmp_path):
    """Synthetic: the 2019 DeepSpeedExamples Megatron-LM engine format, <save>/<iteration>/
    mp_rank_00_model_states.pt with flat 2019 keys under `module`, QKV in the v0 [3, np, hd] order,
    no args (heads from --num-attention-heads)."""
    t = _rand_gpt(h=8, heads=2, vocab=16, seed=5)
    it = tmp_path / "1000"
    it.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1000")
    m = {"word_embeddings.weight": t["word"], "position_embeddings.weight": t["pos"],
         "transformer.final_layernorm.weight": t["final_norm.weight"],
         "transformer.final_layernorm.bias": t["final_norm.bias"]}
    for i in range(2):
        p = f"transformer.layers.{i}."
        m.update({p + "input_layernorm.weight": t[f"{i}.ln1.w"], p + "input_layernorm.bias": t[f"{i}.ln1.b"],
                  p + "attention.query_key_value.weight": torch.cat([t[f"{i}.q"], t[f"{i}.k"], t[f"{i}.v"]]),
                  p + "attention.query_key_value.bias": torch.cat([t[f"{i}.qb"], t[f"{i}.kb"], t[f"{i}.vb"]]),
                  p + "attention.dense.weight": t[f"{i}.o"], p + "attention.dense.bias": t[f"{i}.ob"],
                  p + "post_attention_layernorm.weight": t[f"{i}.ln2.w"],
                  p + "post_attention_layernorm.bias": t[f"{i}.ln2.b"],
                  p + "mlp.dense_h_to_4h.weight": t[f"{i}.up"], p + "mlp.dense_h_to_4h.bias": t[f"{i}.upb"],
                  p + "mlp.dense_4h_to_h.weight": t[f"{i}.down"], p + "mlp.dense_4h_to_h.bias": t[f"{i}.downb"]})
    torch.save({"module": m, "optimizer": None, "iteration": 1000}, it / "mp_rank_00_model_states.pt")
    assert detect_format(tmp_path) == "deepspeed"
    ckpt = open_checkpoint(tmp_path, ReadOptions(overrides={"num_attention_heads": 2}))
    assert "flat2019" in ckpt.source.dialect and "model weights" in ckpt.source.storage
    _check_canonical(ckpt, t)


def test_synthetic_zero3_frozen_and_padding(tmp_path):
    """Synthetic: ZeRO-3 (deepspeed.md 1.4): each param padded to ceil(n/ws) per rank, two sub-groups,
    a frozen param in per-rank fragments, HF GPT-2 names; checked against the documented layout."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=10, n_head=2, n_layer=1, vocab_size=13,
                                                                 n_positions=7)).eval()
    with torch.no_grad():  # the frozen param lives in bf16 fragments: make the model agree
        model.transformer.wpe.weight.copy_(model.transformer.wpe.weight.to(torch.bfloat16).float())
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    frozen = "transformer.wpe.weight"
    train = {k: v for k, v in sd.items() if k != frozen}
    ws = 3
    names = list(train)
    groups = [names[:5], names[5:]]
    tag = tmp_path / "global_step2"
    tag.mkdir()
    (tmp_path / "config.json").write_text(model.config.to_json_string())
    for r in range(ws):
        flats = []
        for grp in groups:
            pieces = []
            for n in grp:
                v = train[n].reshape(-1).float()
                pn = -(-v.numel() // ws)
                v = torch.cat([v, torch.zeros(pn * ws - v.numel())])
                pieces.append(v[r * pn:(r + 1) * pn])
            flats.append(torch.cat(pieces))
        torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": ws, "fp32_flat_groups": flats,
                                             "optimizer_state_dict": {}}},
                   tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        fv = sd[frozen].reshape(-1).to(torch.bfloat16)
        pn = -(-fv.numel() // ws)
        fv = torch.cat([fv, torch.zeros(pn * ws - fv.numel(), dtype=torch.bfloat16)])
        torch.save({"module": {k: torch.empty(0) for k in sd}, "buffer_names": [],
                    "param_shapes": [{n: train[n].shape for n in grp} for grp in groups],
                    "frozen_param_shapes": {frozen: sd[frozen].shape},
                    "frozen_param_fragments": {frozen: fv[r * pn:(r + 1) * pn]},
                    "shared_params": {"lm_head.weight": "transformer.wte.weight"} if r == 0 else {}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    _, named = ds.consolidate_hf_state(tmp_path)
    got = _load_all(named)
    for n, v in train.items():
        assert torch.equal(got[n], v), n
    assert torch.equal(got[frozen], sd[frozen].to(torch.bfloat16))
    ckpt = open_checkpoint(tmp_path)
    tokens = torch.arange(6).reshape(1, 6)
    with torch.no_grad():
        want = model(tokens).logits
    assert (forward(ckpt, tokens) - want).abs().max() < 1e-5


def test_synthetic_errors(tmp_path):
    """Synthetic: a missing optimizer shard and a bad --weights choice are one-line CkptErrors."""
    t = _rand_gpt()
    tag = tmp_path / "global_step1"
    tag.mkdir()
    _write_zero12(tag, _legacy_module_tp(t, 0, 1, heads=2), 0, 2, "", 1, False, {"args": _args()})
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CkptError, match="DP ranks"):
        open_checkpoint(tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CkptError, match="no ZeRO optimizer shards"):
        open_checkpoint(tmp_path, ReadOptions(weights="master"))
    assert open_checkpoint(tmp_path).source.extra["weights"] == "model"


def _write_pipeline(tmp_path, t, era, untied, qkv, tp=2, heads=2, layers=2):
    """Synthetic: Megatron-DeepSpeed pipeline layer files (deepspeed.md 4.1) for PP=1, TP=tp, weights
    only (no optimizer shards). era 'old': layers from spec index 3, final norm L+4; 'new': from 2, L+2,
    untied LM head at L+3."""
    tag = tmp_path / "global_step5"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step5")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    first = 3 if era == "old" else 2
    h = t["word"].shape[1]
    hd = h // heads
    hl = heads // tp
    for r in range(tp):
        sl0 = lambda x: x.chunk(tp, 0)[r]  # noqa: E731
        sl1 = lambda x: x.chunk(tp, 1)[r]  # noqa: E731
        torch.save({"word_embeddings.weight": sl0(t["word"]), "position_embeddings.weight": t["pos"]},
                   tag / f"layer_01-model_{r:02d}-model_states.pt")
        for i in range(layers):
            rows = slice(r * hl * hd, (r + 1) * hl * hd)
            qs = [t[f"{i}.{x}"][rows] for x in "qkv"]
            bs = [t[f"{i}.{x}b"][rows] for x in "qkv"]
            fused = (_per_head_qkv(*qs, hl), _per_head_qkv(*bs, hl)) if qkv == "grouped" else (torch.cat(qs), torch.cat(bs))
            torch.save({"input_layernorm.weight": t[f"{i}.ln1.w"], "input_layernorm.bias": t[f"{i}.ln1.b"],
                        "self_attention.query_key_value.weight": fused[0],
                        "self_attention.query_key_value.bias": fused[1],
                        "self_attention.dense.weight": sl1(t[f"{i}.o"]), "self_attention.dense.bias": t[f"{i}.ob"],
                        "post_attention_layernorm.weight": t[f"{i}.ln2.w"],
                        "post_attention_layernorm.bias": t[f"{i}.ln2.b"],
                        "mlp.dense_h_to_4h.weight": sl0(t[f"{i}.up"]), "mlp.dense_h_to_4h.bias": sl0(t[f"{i}.upb"]),
                        "mlp.dense_4h_to_h.weight": sl1(t[f"{i}.down"]), "mlp.dense_4h_to_h.bias": t[f"{i}.downb"]},
                       tag / f"layer_{first + i:02d}-model_{r:02d}-model_states.pt")
        norm_idx = layers + (4 if era == "old" else 2)
        torch.save({"weight": t["final_norm.weight"], "bias": t["final_norm.bias"]},
                   tag / f"layer_{norm_idx:02d}-model_{r:02d}-model_states.pt")
        if untied:
            torch.save({"lm_head.weight": sl0(t["head"])}, tag / f"layer_{norm_idx + 1:02d}-model_{r:02d}-model_states.pt")
        args = _args(tp=tp)
        args.untie_embeddings_and_output_weights = untied
        torch.save({"module": None, "buffer_names": [], "optimizer": None, "param_shapes": None,
                    "args": args, "iteration": 5, "checkpoint_version": 3.0, "mp_world_size": tp},
                   tag / f"mp_rank_{r:02d}_model_states.pt")


@pytest.mark.parametrize("era,untied,qkv", [("old", False, "grouped"), ("new", True, "grouped"), ("new", False, "split")])
def test_synthetic_mds_pipeline_layer_files(tmp_path, era, untied, qkv):
    """Synthetic: both layer-numbering eras, the untied lm_head file, TP=2, both QKV packings."""
    t = _rand_gpt(h=8, heads=2, vocab=16, seed=7)
    t["head"] = torch.randn(16, 8)
    _write_pipeline(tmp_path, t, era, untied, qkv)
    assert detect_format(tmp_path) == "deepspeed"
    ckpt = open_checkpoint(tmp_path, ReadOptions(qkv_layout=qkv))
    assert "model weights" in ckpt.source.storage and ckpt.source.layout.tp == 2
    assert ckpt.config.tied_embeddings == (not untied) and ckpt.config.num_layers == 2
    _check_canonical(ckpt, t)
    if untied:
        assert torch.equal(ckpt.tensors["output.weight"].load(), t["head"])
    else:
        assert "output.weight" not in ckpt.tensors
    with pytest.raises(CkptError, match="no ZeRO optimizer shards"):
        open_checkpoint(tmp_path, ReadOptions(weights="master"))


@needs_ds
@pytest.mark.deepspeed
def test_zero3_reads_only_one_parameters_bytes(ds_cases, monkeypatch):
    """Streaming: gathering one ZeRO-3 parameter reads its slices, not the ranks' whole flat groups."""
    from ckptool.io import torchfile
    read = []
    orig = torchfile.StorageRef.read

    def counting(self, first, count):
        read.append(count * torch.empty((), dtype=self.dtype).element_size())
        return orig(self, first, count)
    monkeypatch.setattr(torchfile.StorageRef, "read", counting)
    _, named = ds.consolidate_hf_state(ds_cases / "gpt2-3-bf16" / "ckpt")
    read.clear()
    t = named["transformer.h.0.attn.c_proj.weight"]
    t.load()
    assert sum(read) <= 4 * (t.numel + 2)  # fp32, plus at most one padding element per rank
    total = sum(v.nbytes for v in named.values())
    assert sum(read) < total / 10


# --- every command on DeepSpeed input (in-process CLI) --------------------------------------------

TIED = ("lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")  # HF re-ties these


def _engine_model(case_dir, cls_name):
    """The engine's model in fp32: a fresh transformers model with the engine's own master weights."""
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(case_dir / "ckpt")
    model = getattr(transformers, cls_name)(cfg).eval()
    truth = {k: v.float() for k, v in torch.load(case_dir / "truth.pt").items()}
    missing, unexpected = model.load_state_dict(truth, strict=False)
    assert not unexpected and all(k in TIED for k in missing), missing
    model.tie_weights()
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(3))


@needs_ds
@pytest.mark.deepspeed
def test_cli_to_hf_of_a_zero_gpt2_run_gives_the_engine_logits(ds_cases, tmp_path):
    import transformers
    case = ds_cases / "gpt2-2-fp16"
    res = _cli("to-hf", str(case / "ckpt"), str(tmp_path / "hf"))
    assert res.exit_code == 0, res.output
    assert "GPT2LMHeadModel" in res.output and "zero-2" in res.output and "master weights" in res.output
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    want = _engine_model(case, "GPT2LMHeadModel")
    assert (_logits(got, TOKENS) - _logits(want, TOKENS)).abs().max().item() < 1e-5


@needs_ds
@pytest.mark.deepspeed
def test_cli_to_hf_of_a_zero3_bert_run(ds_cases, tmp_path):
    """A non-GPT HF model: consolidated with its own names, config.json given or found beside it."""
    import transformers
    from safetensors.torch import load_file
    case = ds_cases / "bert-3-bf16"
    bare = tmp_path / "bare"  # the checkpoint without its config.json
    shutil.copytree(case / "ckpt", bare, ignore=shutil.ignore_patterns("config.json", "*.py"))
    res = _cli("to-hf", str(bare), str(tmp_path / "x"))
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "--hf-config" in res.output, res.output
    (tmp_path / "conf").mkdir()
    shutil.copy(case / "ckpt" / "config.json", tmp_path / "conf" / "config.json")
    res = _cli("to-hf", str(bare), str(tmp_path / "given"), "--hf-config", str(tmp_path / "conf"))
    assert res.exit_code == 0, res.output
    assert "bert names" in res.output
    res = _cli("to-hf", str(case / "ckpt" / "global_step2"), str(tmp_path / "found"))
    assert res.exit_code == 0, res.output
    a, b = load_file(tmp_path / "given" / "model.safetensors"), load_file(tmp_path / "found" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "bert.encoder.layer.1.attention.self.query.weight" in a  # the model's own names
    want = _engine_model(case, "BertForMaskedLM")
    for d in ("given", "found"):
        got = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / d, dtype=torch.float32).eval()
        assert type(got).__name__ == "BertForMaskedLM"
        assert (_logits(got, TOKENS) - _logits(want, TOKENS)).abs().max().item() < 1e-5
    res = _cli("to-hf", str(case / "ckpt"), str(tmp_path / "half"), "--weights", "master", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    half = load_file(tmp_path / "half" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in half.values())
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == "bfloat16"


@needs_ds
@pytest.mark.deepspeed
def test_cli_reshard_and_verify_of_a_zero1_gpt2_run(ds_cases, tmp_path):
    src = ds_cases / "gpt2-1-bf16" / "ckpt"
    res = _cli("reshard", str(src), str(tmp_path / "pp2"), "--tp", "1", "--pp", "2")
    assert res.exit_code == 0, res.output
    out = open_checkpoint(tmp_path / "pp2")
    assert out.source.layout.pp == 2 and out.config.vocab_size == 1001
    ref = forward(open_checkpoint(src), TOKENS)
    assert torch.equal(forward(out, TOKENS)[..., :1001], ref[..., :1001])
    res = _cli("verify", str(tmp_path / "pp2"), "--reference", str(src), "--seq-len", "8")
    assert res.exit_code == 0, res.output
    assert "result=PASS" in res.output
    err = next(line for line in res.output.splitlines() if line.startswith("max_abs_error="))
    assert float(err.split("=")[1]) < 1e-5


@needs_mds
def test_cli_on_the_real_mds_checkpoint(tmp_path):
    """inspect (tag dir and save dir), reshard TP2 PP2 -> TP1 PP2 and TP2 PP1, verify, fix-vocab, to-hf."""
    import transformers
    ref = torch.load(MDS / "reference_logits.pt")
    src = MDS / "checkpoint"
    for path in (src, src / "global_step3"):
        res = _cli("inspect", str(path), "--no-tensors", "--weights", "model")
        assert res.exit_code == 0, res.output
        assert "deepspeed" in res.output and "mds-pipeline" in res.output and "model weights" in res.output
        assert "TP2 PP2" in res.output and "true 1001" in res.output and "iteration   3" in res.output
    res = _cli("inspect", str(src), "--json")
    assert res.exit_code == 0 and json.loads(res.output)["format"] == "deepspeed", res.output
    for tp, pp in ((1, 2), (2, 1)):
        dst = tmp_path / f"tp{tp}pp{pp}"
        res = _cli("reshard", str(src), str(dst), "--tp", str(tp), "--pp", str(pp), "--weights", "model")
        assert res.exit_code == 0, res.output
        got = forward(open_checkpoint(dst), ref["tokens"])[..., :1001]
        assert _rel(got, ref["logits_fp32"][..., :1001]) < 1e-4
    res = _cli("verify", str(tmp_path / "tp2pp1"), "--reference", str(src), "--weights", "model")
    assert res.exit_code == 0 and "result=PASS" in res.output, res.output
    # the DeepSpeed directory as verify's target, against the logits Megatron-DeepSpeed computed:
    # its 16-bit module weights reproduce them; the fp32 masters are one bf16 rounding away
    recorded = f"{MDS / 'reference_logits.pt'}:logits_fp32"
    res = _cli("verify", str(src), "--reference-logits", recorded, "--weights", "model")
    assert res.exit_code == 0 and "result=PASS" in res.output, res.output
    res = _cli("verify", str(src), "--reference-logits", recorded)
    assert res.exit_code == 1 and "result=FAIL" in res.output, res.output
    res = _cli("fix-vocab", str(src), str(tmp_path / "fv"), "--multiple", "96", "--weights", "model")
    assert res.exit_code == 0, res.output
    fixed = open_checkpoint(tmp_path / "fv")
    assert fixed.config.padded_vocab_size == 1056 and fixed.config.vocab_size == 1001
    assert _rel(forward(fixed, ref["tokens"])[..., :1001], ref["logits_fp32"][..., :1001]) < 1e-4
    res = _cli("to-hf", str(src), str(tmp_path / "hf"), "--weights", "model")
    assert res.exit_code == 0, res.output
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.vocab_size == 1001
    assert _rel(_logits(model, ref["tokens"]), ref["logits_fp32"][..., :1001]) < 1e-4


@shared_followups
def mds_tp2_verify(framework_runs, d):
    """The MDS checkpoint resharded to TP2 PP1 and verified tensor-parallel under real torchrun (gloo) against its
    source, in the session's shared launch of 2-process checks: (output, exit status)."""
    from test_verify import VERIFY_BATCH, verify_jobs, verify_results
    if not MDS.is_dir():
        pytest.skip(f"real checkpoint not found at {MDS}")
    src = MDS / "checkpoint"
    res = _cli("reshard", str(src), str(d / "tp2"), "--tp", "2", "--pp", "1", "--weights", "model")
    assert res.exit_code == 0, res.output
    cases = {"tp2": [d / "tp2", "--reference", src, "--weights", "model", "--seq-len", "8"]}
    yield [(VERIFY_BATCH, 2, verify_jobs(cases, d / "runs"))]
    return verify_results(cases, d / "runs")["tp2"]


@needs_mds
def test_parallel_verify_under_torchrun_against_the_mds_checkpoint(mds_tp2_verify):
    """Resharded to TP2 PP1, run tensor-parallel under real torchrun (gloo) against the MDS source."""
    out, rc = mds_tp2_verify
    assert rc == 0, out
    assert "TP2 PP1, 2 processes" in out and "result=PASS" in out


@needs_ds
@needs_mds
def test_cli_replicas_on_diverged_master_weights(mds_copy, tmp_path):
    """Like a run with dropout on, in the fp32 masters: TP rank 1's optimizer partition holds a layer
    norm 0.25 away from rank 0's. The warning names the tensor and the largest difference."""
    f = mds_copy / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"  # stage 0, TP rank 1
    sd = torch.load(f, weights_only=False)  # our own copy of a trusted real file
    osd = sd["optimizer_state_dict"]
    frag = osd["param_slice_mappings"][1]["3.input_layernorm.weight"]  # spec index 3 = transformer layer 1
    with torch.no_grad():
        osd["single_partition_of_fp32_groups"][1].narrow(0, frag.start, frag.numel).add_(0.25)
    torch.save(sd, f)
    name = "layers.1.attn_norm.weight"
    res = _cli("merge", str(mds_copy), str(tmp_path / "first"))
    assert res.exit_code == 0, res.output
    # the masters are the weights here, and travel as the output's optimizer masters too: the warning may
    # carry that slot's tag ("optimizer master: ...")
    assert f"{name}: tensor-parallel replicas differ (max abs diff 0.25); using rank 0's copy" in res.output
    res = _cli("merge", str(mds_copy), str(tmp_path / "strict"), "--replicas", "strict")
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert res.output.startswith(f"error: {name}: tensor-parallel replicas differ (max abs diff 0.25)")
    assert not (tmp_path / "strict").exists()
    res = _cli("merge", str(mds_copy), str(tmp_path / "mean"), "--replicas", "mean")
    assert res.exit_code == 0 and "using the mean of the copies" in res.output, res.output
    first = open_checkpoint(tmp_path / "first").tensors[name].load()
    mean = open_checkpoint(tmp_path / "mean").tensors[name].load()
    assert torch.allclose(mean, first + 0.125, atol=1e-6)
    # the 16-bit module weights of the same save are untouched, so they show no divergence ...
    res = _cli("merge", str(mds_copy), str(tmp_path / "model"), "--weights", "model", "--replicas", "strict",
               "--no-optimizer")
    assert res.exit_code == 0 and "replicas differ" not in res.output, res.output
    # ... but the optimizer state carried beside them holds the diverged masters: strict refuses it
    res = _cli("merge", str(mds_copy), str(tmp_path / "model_opt"), "--weights", "model", "--replicas", "strict")
    assert res.exit_code == 2 and f"{name}: tensor-parallel replicas differ (max abs diff 0.25)" in res.output


@needs_ds
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", ["bert-3-bf16", "gpt2-1-bf16"])
def test_export_reads_each_master_byte_once_in_parameter_sized_reads(ds_cases, case, tmp_path, monkeypatch):
    """Streaming, measured: consolidating a ZeRO-3 (parameters cut across ranks) or ZeRO-1 (flat
    groups) run reads every fp32 master once, never more than one parameter at a time, and never the
    Adam moments that make up most of each optimizer shard. So memory stays near one parameter."""
    from ckptool.formats.deepspeed import hf_export as deepspeed_hf_export
    reads = count_tensor_reads(monkeypatch)  # bytes of every tensor-data read
    src = ds_cases / case / "ckpt"
    _, named = ds.consolidate_hf_state(src)
    sizes = {k: v.nbytes for k, v in named.items()}
    reads.clear()
    (tmp_path / "hf").mkdir()
    deepspeed_hf_export.write_hf_state(*ds.consolidate_hf_state(src, ReadOptions()), tmp_path / "hf")
    shards = sum(p.stat().st_size for p in (src / "global_step2").glob("*optim_states.pt"))
    ws = 2
    assert sum(reads) <= sum(sizes.values()) + 4 * ws * len(sizes)  # at most one padding element per rank
    assert sum(reads) < shards / 2  # the moments (2x the masters) are never touched
    assert max(reads) <= max(sizes.values())
