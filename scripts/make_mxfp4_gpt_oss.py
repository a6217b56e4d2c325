"""Build the tiny MXFP4 GPT-OSS checkpoint of fixtures/gpt_oss_mxfp4 with transformers' own MXFP4 quantizer.

  python scripts/make_mxfp4_gpt_oss.py TRITON/python/triton_kernels OUT

transformers (5.24) quantizes GPT-OSS experts in integrations/mxfp4.py: Mxfp4Quantize calls quantize_to_mxfp4,
which calls `downcast_to_mxfp_torch` of the Hugging Face hub package kernels-community/gpt-oss-triton-kernels, then
swizzle_mxfp4; saving goes through Mxfp4HfQuantizer.get_state_dict_and_metadata (Mxfp4ReverseDeserialize: unswizzle,
then `*_blocks` [E, out, G, 16] and `*_scales` [E, out, G]). That hub package is a build of triton's
python/triton_kernels, which this script imports from the folder given (a triton checkout's python/triton_kernels;
the fixture's README names the commit). It needs the `triton` package (3.5 or later; importable on a CPU-only
machine, where triton_kernels' default weight layout is the plain StridedLayout, so nothing is swizzled). Nothing is
downloaded and no hub is reached: the module transformers would fetch is handed to it.

Steps: a tiny GptOssForCausalLM built by transformers, every parameter moved off its init, cast to bfloat16 (the
released checkpoints' dtype); each layer's experts replaced by transformers' Mxfp4GptOssExperts and quantized by
transformers' Mxfp4Quantize op; saved by transformers' save_pretrained with the quantizer attached. Then the script
loads the result back with transformers (Mxfp4Config(dequantize=True)) and checks the dequantized experts are the
bf16 weights to MXFP4 precision, and the other tensors equal: so the fixture is the model it claims to be.

One fact decides the call (transformers 5.24, integrations/mxfp4.py Mxfp4Quantize.convert): the op transposes what
it is handed and quantizes along axis 1 of that, the axis triton's matmul_ogs contracts (the input features) and the
axis the released gpt-oss checkpoints' blocks run along ([E, out, in / 32, 16]). GptOssExperts' own parameters are
[E, in, out], so the op is handed each one transposed ([E, out, in]); handed as stored, it quantizes along the
output axis and writes [E, in, out / 32, 16], which transformers' own dequantizing load reads as the transpose (a
shape mismatch unless in == out). This script checks the written shapes are the released layout.
"""
import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

SIZES = dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128, hidden_size=32,
             intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
# hidden 32 and intermediate 64 make every expert weight non-square ([E, 32, 128] and [E, 64, 32]): a transposed
# read cannot pass for a right one. Both are multiples of 32, MXFP4's block.
# as the released checkpoints' quantization_config says
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
PROJECTIONS = ("gate_up_proj", "down_proj")


def triton_kernels_package(folder: Path):
    """triton's triton_kernels package from a checkout, with the submodules transformers reaches for imported."""
    sys.path.insert(0, str(folder))
    try:
        package = importlib.import_module("triton_kernels")
        for sub in ("numerics_details.mxfp", "matmul_ogs", "tensor", "tensor_details.layout"):
            importlib.import_module(f"triton_kernels.{sub}")
    except ImportError as e:
        raise SystemExit(f"error: {e}: give a triton checkout's python/triton_kernels folder and install the `triton` "
                         "package (3.5 or later) beside it") from None
    return package


def build_model(seed: int):
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**SIZES)).eval()
    with torch.no_grad():  # off init: sinks, biases and norms too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.to(torch.bfloat16)


def quantize(model, triton_kernels) -> None:
    """Each layer's experts -> transformers' Mxfp4GptOssExperts, quantized by transformers' Mxfp4Quantize op."""
    import transformers.integrations.mxfp4 as mx
    from transformers import Mxfp4Config
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    mx.triton_kernels_hub = triton_kernels  # what replace_with_mxfp4_linear sets from the hub's get_kernel
    quantizer = Mxfp4HfQuantizer(Mxfp4Config(modules_to_not_convert=NOT_CONVERTED))
    op = mx.Mxfp4Quantize(quantizer)
    for i, layer in enumerate(model.model.layers):
        bf16, q = layer.mlp.experts, mx.Mxfp4GptOssExperts(model.config)
        for proj in PROJECTIONS:  # the biases stay bfloat16, as the model holds them
            setattr(q, f"{proj}_bias", torch.nn.Parameter(getattr(bf16, f"{proj}_bias").detach(), requires_grad=False))
        layer.mlp.experts = q
        for proj in PROJECTIONS:  # handed [E, out, in]: the op transposes it back and quantizes along `in`
            weight = getattr(bf16, proj).detach().transpose(-1, -2)
            op.convert({proj: weight}, model=model, full_layer_name=f"model.layers.{i}.mlp.experts.{proj}",
                       missing_keys=set())
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)  # config.quantization_config, as from_pretrained leaves it


def check(out: Path, want: dict) -> None:
    """transformers' own dequantizing load of `out` is the bf16 model: experts to MXFP4 precision, the rest equal."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Mxfp4Config
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for i in range(SIZES["num_hidden_layers"]):
            for proj in PROJECTIONS:
                e, fan_in, fan_out = want[f"model.layers.{i}.mlp.experts.{proj}"].shape
                blocks = f.get_slice(f"model.layers.{i}.mlp.experts.{proj}_blocks").get_shape()
                assert blocks == [e, fan_out, fan_in // 32, 16], (proj, blocks)  # the released layout
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16,
                                               quantization_config=Mxfp4Config(dequantize=True)).state_dict()
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k].float()
        if k.endswith(PROJECTIONS):  # e2m1 keeps 1 mantissa bit: within a quarter of each block's scale
            err = ((g - w.float()).abs().max() / w.float().abs().max()).item()
            assert 0 < err < 0.25, (k, err)
        else:
            assert torch.equal(got[k], w), k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("triton_kernels", type=Path, help="a triton checkout's python/triton_kernels folder")
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import transformers
    triton_kernels = triton_kernels_package(a.triton_kernels)
    model = build_model(a.seed)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quantize(model, triton_kernels)
    model.save_pretrained(a.out)
    check(a.out, want)
    made = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "triton": __import__("triton").__version__, "seed": a.seed}
    print(json.dumps(made))


if __name__ == "__main__":
    main()
