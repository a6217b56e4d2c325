"""Write a randomly initialised GPT-2 style model as Megatron mcore checkpoints (for timing verify).

  python scripts/make_random_gpt.py OUT_DIR --size 1b|tiny --layouts 2x2,2x1 [--dtype bf16]

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
from ckptool.formats.megatron import write_megatron
from ckptool.lazy import Const
from ckptool.state import Checkpoint, SourceInfo, expected_names

SIZES = {  # hidden, layers, heads, vocab, max positions
    "1b": (2048, 20, 16, 50257, 2048),
    "tiny": (64, 4, 4, 1001, 64),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def random_gpt(size: str, dtype: torch.dtype, seed: int = 0) -> Checkpoint:
    hidden, layers, heads, vocab, max_pos = SIZES[size]
    cfg = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                    padded_vocab_size=vocab, vocab_size=vocab, max_position_embeddings=max_pos,
                    activation="gelu_tanh")
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.word": (vocab, hidden), "embed.pos": (max_pos, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attn.q.weight": (hidden, hidden), p + "attn.k.weight": (hidden, hidden),
                       p + "attn.v.weight": (hidden, hidden), p + "attn.out.weight": (hidden, hidden),
                       p + "mlp.up.weight": (4 * hidden, hidden), p + "mlp.down.weight": (hidden, 4 * hidden)})
    tensors = {}
    for name in expected_names(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(hidden)
        elif name.endswith(".bias"):
            rows = 4 * hidden if "mlp.up" in name else hidden
            t = torch.zeros(rows)
        else:
            std = 0.02 / (math.sqrt(2 * layers) if name.endswith(("attn.out.weight", "mlp.down.weight")) else 1)
            t = torch.randn(shapes[name], generator=g) * std
        tensors[name] = Const(t.to(dtype))
    return Checkpoint(cfg, tensors, SourceInfo(path="random", format="random"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--layouts", default="2x2,2x1", help="TPxPP, comma separated")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    a = ap.parse_args()
    start = time.perf_counter()
    ckpt = random_gpt(a.size, DTYPES[a.dtype])
    params = sum(t.numel for t in ckpt.tensors.values())
    print(f"params={params} init_seconds={time.perf_counter() - start:.1f}", flush=True)
    for spec in a.layouts.split(","):
        tp, pp = (int(x) for x in spec.split("x"))
        start = time.perf_counter()
        out = a.out / f"tp{tp}pp{pp}"
        info = write_megatron(ckpt, out, Layout(tp=tp, pp=pp), dialect="mcore", warn=lambda m: None)
        print(f"wrote={out} files={info['files']} bytes={info['bytes']} "
              f"write_seconds={time.perf_counter() - start:.1f}", flush=True)


if __name__ == "__main__":
    main()
