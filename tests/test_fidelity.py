"""Issue 9: the Megatron arguments that change the maths, checked against megatron-core itself.

tests/mcore_flags_helper.py builds one tiny megatron-core GPTModel per argument (the real
`megatron-core` package, CPU) and saves it as Megatron-LM does in torch format, with the args its
parser would give. For each one: ckptool reads the flag from the args, its reference forward and
`verify --reference-logits` reproduce the logits megatron-core computed, and to-hf either gives a
transformers model with those logits or refuses with a message naming the flag. A control (the
same checkpoint read with the flag switched off) shows each flag really moves the logits.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptool.cli import main
from ckptool.formats.registry import open_checkpoint
from ckptool.verify.reference import forward

REPO = Path(__file__).resolve().parents[1]
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
VOCAB = 100

# variant -> (config field it sets, value read, the value that switches it off, to-hf: None = exports
#             with the same logits, else the flag the refusal must name)
FLAGS = {
    "gelu_exact": ("activation", "gelu", "gelu_tanh", None),
    "bias_gelu_fusion": ("activation", "gelu_tanh", "gelu", None),
    "openai_gelu": ("activation", "gelu_tanh", "gelu", None),
    "squared_relu": ("activation", "squared_relu", "gelu", None),
    "layernorm_eps": ("norm_eps", 0.5, 1e-5, None),
    "layernorm_1p": ("apply_layernorm_1p", True, False, None),
    "qk_layernorm": ("qk_layernorm", True, False, "--qk-layernorm"),
    "add_qkv_bias": ("add_qkv_bias", True, False, None),
    "rotary_base": ("rotary_base", 37.0, 10000.0, None),
    "rotary_percent": ("rotary_percent", 0.5, 1.0, "--rotary-percent"),
    "rotary_interleaved": ("rotary_interleaved", True, False, None),
    "rope_scaling": ("rope_scaling_factor", 8.0, None, None),
    # megatron-core's TransformerLayer never reads this flag (only legacy layers do): the run
    # computed the plain pre-norm residual, and ckptool must read it so
    "post_ln_residual": ("post_layernorm_residual", False, True, None),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not HAVE_MCORE:
        pytest.skip("megatron-core is not installed (pip install megatron-core: test-only extra)")
    root = tmp_path_factory.mktemp("mcore_flags")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_flags_helper.py"), f"{root}:{port}", *FLAGS],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return root


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("variant", list(FLAGS))
def test_flag_read_and_computed_like_megatron_core(built, variant):
    field, value, off, _ = FLAGS[variant]
    ckpt = open_checkpoint(built / variant / "checkpoint")
    assert getattr(ckpt.config, field) == value
    ref = torch.load(built / variant / "logits.pt")
    want = ref["logits"]
    assert (forward(ckpt, ref["tokens"]) - want).abs().max().item() <= 1e-5
    # the flag matters: read with it switched the other way, the logits move
    tensors = ckpt.tensors
    if variant == "add_qkv_bias":  # the forward adds whatever biases are present: drop them
        tensors = {k: v for k, v in tensors.items() if not (".attn." in k and k.endswith(".bias"))}
        assert len(tensors) == len(ckpt.tensors) - 6
    other = ckpt.with_tensors(tensors, **{field: off})
    assert (forward(other, ref["tokens"]) - want).abs().max().item() > 1e-4
    if variant == "post_ln_residual":
        assert any("apply_residual_connection_post_layernorm" in w for w in ckpt.warnings)


@pytest.mark.parametrize("variant", list(FLAGS))
def test_flag_through_verify(built, variant):
    r = cli("verify", built / variant / "checkpoint", "--reference-logits", f"{built / variant / 'logits.pt'}:logits")
    assert r.exit_code == 0 and "result=PASS" in r.output, r.output


@pytest.mark.parametrize("variant", list(FLAGS))
def test_flag_through_to_hf(built, variant, tmp_path):
    refusal = FLAGS[variant][3]
    out = tmp_path / "hf"
    r = cli("to-hf", built / variant / "checkpoint", out)
    if refusal:
        assert r.exit_code == 2 and refusal in r.output and not out.exists(), r.output
        return
    assert r.exit_code == 0, r.output
    from transformers import AutoModelForCausalLM
    ref = torch.load(built / variant / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(ref["tokens"]).logits.float()
    assert got.shape[-1] == VOCAB
    assert (got - ref["logits"][..., :VOCAB]).abs().max().item() <= 1e-5
    if variant in ("bias_gelu_fusion", "openai_gelu"):
        assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu_new"
