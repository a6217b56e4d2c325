"""Write a randomly initialised GPT-2 style model as Megatron mcore checkpoints (for timing verify).

  python scripts/make_random_gpt.py OUT_DIR --size 1b|llama-1b|llama-8b|tiny|llama-tiny --layouts 2x2,2x1 [--dtype bf16]

Writes OUT_DIR/tp{T}pp{P} for each layout with ckptool's own writer. Random init (std 0.02, output
projections scaled by 1/sqrt(2 * layers) as GPT-2 does) so the logits are not degenerate.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from ckptool.config import GPTConfig, Layout
from ckptool.formats.megatron.checkpoint import write_megatron
from ckptool.lazy import Const
from ckptool.state import Checkpoint, SourceInfo, expected_names
from ckptool.write_options import WriteOptions

# name -> GPTConfig keyword arguments. gpt2-1b: GPT-2 style (LayerNorm, tanh GeLU, learned positions,
# biases, tied embeddings), 1.1B parameters. llama-1b: Llama style (RMSNorm, SwiGLU, RoPE, GQA 16 heads
# in 4 query groups, no biases, untied output), 1.0B parameters. tiny: the GPT-2 style at smoke-test size.
LLAMA_STYLE = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                   add_bias_linear=False, add_qkv_bias=False, tied_embeddings=False)
SIZES = {
    "1b": dict(num_layers=20, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
               padded_vocab_size=50304, vocab_size=50257, max_position_embeddings=2048, activation="gelu_tanh"),
    "llama-1b": dict(num_layers=20, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                     ffn_hidden_size=5632, padded_vocab_size=32000, vocab_size=32000, max_position_embeddings=4096,
                     **LLAMA_STYLE),
    # llama-8b: a Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads in 8 query groups, SwiGLU FFN
    # 14336, vocab 128256, RoPE base 500000, untied): 8,030,261,248 parameters, 16 GB in bf16
    "llama-8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                     ffn_hidden_size=14336, padded_vocab_size=128256, vocab_size=128256,
                     max_position_embeddings=8192, rotary_base=500000.0, **LLAMA_STYLE),
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                 padded_vocab_size=1024, vocab_size=1001, max_position_embeddings=64, activation="gelu_tanh"),
    "llama-tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                       ffn_hidden_size=96, padded_vocab_size=1024, vocab_size=1000, max_position_embeddings=64,
                       **LLAMA_STYLE),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def canonical_shape(cfg: GPTConfig, name: str) -> tuple:
    """The full (unsharded) shape of one canonical tensor, from the name's last two parts."""
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    rows = {"q": cfg.num_attention_heads * hd, "k": cfg.num_query_groups * hd, "v": cfg.num_query_groups * hd,
            "out": h, "gate": f, "up": f, "down": h}
    cols = {"out": cfg.num_attention_heads * hd, "down": f}
    if name in ("embed.word", "output.weight"):
        return (cfg.padded_vocab_size, h)
    if name == "embed.pos":
        return (cfg.max_position_embeddings, h)
    part, kind = name.split(".")[-2:]
    if part.endswith("norm"):
        return (h,)
    if kind == "bias":
        return (rows[part],)
    return (rows[part], cols.get(part, h))


def random_gpt(size: str, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> Checkpoint:
    """device: where the random numbers are drawn (cuda: an 8B model's 8e9 normal draws take a minute
    on one CPU thread, a fraction of a second on a GPU; the values differ from the CPU's for one seed)."""
    cfg = GPTConfig(**SIZES[size])
    g = torch.Generator(device=device).manual_seed(seed)
    scaled = ("attn.out.weight", "mlp.down.weight")  # residual-branch outputs, scaled as GPT-2 does
    tensors = {}
    for name in expected_names(cfg):
        shape = canonical_shape(cfg, name)
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            std = 0.02 / (math.sqrt(2 * cfg.num_layers) if name.endswith(scaled) else 1)
            t = torch.randn(shape, generator=g, device=device) * std
        tensors[name] = Const(t.to(dtype).cpu())
    return Checkpoint(cfg, tensors, SourceInfo(path="random", format="random"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--layouts", default="2x2,2x1", help="TPxPP, comma separated")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cpu", help="where to draw the random weights (cpu, cuda)")
    a = ap.parse_args()
    start = time.perf_counter()
    ckpt = random_gpt(a.size, DTYPES[a.dtype], device=a.device)
    params = sum(t.numel for t in ckpt.tensors.values())
    print(f"params={params} init_seconds={time.perf_counter() - start:.1f}", flush=True)
    for spec in a.layouts.split(","):
        tp, pp = (int(x) for x in spec.split("x"))
        start = time.perf_counter()
        out = a.out / f"tp{tp}pp{pp}"
        info = write_megatron(ckpt, out, Layout(tp=tp, pp=pp), WriteOptions(dialect="mcore"), warn=lambda m: None)
        print(f"wrote={out} files={info['files']} bytes={info['bytes']} "
              f"write_seconds={time.perf_counter() - start:.1f}", flush=True)


if __name__ == "__main__":
    main()
