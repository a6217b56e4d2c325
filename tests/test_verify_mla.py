"""`torchrun -m ckptool verify` on Multi-Latent Attention checkpoints (gloo, CPU, 2 processes).

The tiny DeepSeek-V3 models of test_mla_megatron (built by transformers, weights off their init) are written by
from-hf at TP2 (YaRN; YaRN with RoPE on halves), PP2, EP2 and TP2 in the mcore-te dialect (the MoE one); every
rank computes with its own file's slices of the column-parallel MLA linears (cut from the file's whole down
projections in the mcore-te dialect) and its copies of the latent norms (verify/parallel.py), and
the logits must equal transformers' (fp32, relative 1e-5). A corrupted MLA tensor is caught: the first
divergence names its layer and the files that hold it, and at TP the probe (verify/mla_probe.py) the one
tensor and file.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import test_mla_megatron
from conftest import once, shared_followups
from test_moe import hf_logits
from test_verify import VERIFY_BATCH, metric, verify_jobs, verify_results

from ckptool import api
from ckptool.verify import inputs


def _scale(path, key: str, by: float = 1.5) -> None:
    obj = torch.load(path, weights_only=False)
    obj["model"][key] = obj["model"][key] * by
    torch.save(obj, path)


@shared_followups
def runs(framework_runs, root):
    """The checks below under torchrun (2 processes), in the session's shared launch of 2-process checks:
    ({name: (output, exit status)}, {name: the reference's folder})."""
    deepseek_dense = once(test_mla_megatron._dense_models, lambda: root / "dense")
    moe_src, _ = once(test_mla_megatron._deepseek, lambda: root / "moe")
    quiet = dict(warn=lambda m: None)
    refs = {"tp2_yarn": deepseek_dense("yarn")[0], "tp2_yarn_halves": deepseek_dense("yarn_halves")[0],
            "pp2_moe": moe_src, "ep2_moe": moe_src, "tp2_te_moe": moe_src}
    api.from_hf(refs["tp2_yarn"], root / "tp2_yarn", tp=2, **quiet)
    api.from_hf(refs["tp2_yarn_halves"], root / "tp2_yarn_halves", tp=2, **quiet)
    api.from_hf(moe_src, root / "pp2_moe", pp=2, **quiet)
    api.from_hf(moe_src, root / "ep2_moe", ep=2, **quiet)
    # Transformer Engine's MLA layer: the down projections whole in every TP rank's file (TELinear duplicated)
    api.from_hf(moe_src, root / "tp2_te_moe", tp=2, dialect="mcore-te", **quiet)
    # planted: layer 0's kv up projection in TP rank 1's file; layer 2's q up projection on pipeline stage 1
    # (transformers gives no hidden state of the last layer to compare, so the last layer is not the one)
    shutil.copytree(root / "tp2_yarn", root / "tp2_corrupt")
    _scale(next(root.glob("tp2_corrupt/*/mp_rank_01/model_optim_rng.pt")),
           "decoder.layers.0.self_attention.linear_kv_up_proj.weight")
    shutil.copytree(root / "pp2_moe", root / "pp2_corrupt")
    _scale(next(root.glob("pp2_corrupt/*/mp_rank_00_001/model_optim_rng.pt")),
           "decoder.layers.0.self_attention.linear_q_up_proj.weight")  # stage 1's first layer: global layer 2
    refs.update(tp2_corrupt=refs["tp2_yarn"], pp2_corrupt=moe_src)
    cases = {name: [root / name, "--reference", ref] for name, ref in refs.items()}
    yield [(VERIFY_BATCH, 2, verify_jobs(cases, root / "runs"))]
    return verify_results(cases, root / "runs"), refs


@pytest.mark.parametrize("case, layout", [("tp2_yarn", "TP2 PP1"), ("tp2_yarn_halves", "TP2 PP1"),
                                          ("pp2_moe", "TP1 PP2"), ("ep2_moe", "TP1 PP1 EP2"),
                                          ("tp2_te_moe", "TP2 PP1")])
def test_parallel_verify_runs_mla_and_equals_transformers(runs, case, layout):
    out, rc = runs[0][case]
    assert rc == 0 and "result=PASS" in out, out
    assert f"parallel forward: {layout}, 2 processes" in out, out
    want = hf_logits(runs[1][case], inputs.make_tokens(None, None, 2, 16, 0, vocab=100))  # verify's default tokens
    assert metric(out, "max_abs_error") <= 1e-5 * want.abs().max().item(), out
    assert "  layer 0 " in out, out  # hidden states compared layer by layer


@pytest.mark.parametrize("case, says", [
    ("tp2_corrupt", ["first_divergence=layer 0 ", "pipeline stage 0: mp_rank_00, mp_rank_01",  # then the probe:
                     "layer 0: attention tensors that differ from the reference's on the reference's values: "
                     "linear_kv_up_proj in mp_rank_01 (relative diff"]),
    ("pp2_corrupt", ["first_divergence=layer 2 ", "pipeline stage 1: mp_rank_00_001", "attention or norms"])])
def test_a_corrupted_mla_tensor_is_caught_and_named(runs, case, says):
    out, rc = runs[0][case]
    assert rc == 1 and "result=FAIL" in out, out
    line = next(l for l in out.splitlines() if l.startswith("first_divergence="))
    assert all(s in line for s in says), line
    assert line.count("relative diff") == (case == "tp2_corrupt"), line  # the one planted tensor, nothing else
