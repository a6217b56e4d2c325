"""Synthetic GPT-2-style Megatron checkpoints of a chosen size, for benchmarks and memory tests.

The model exists only as lazy tensors whose bytes are generated when the writer asks for them (one
layer at a time), so a checkpoint larger than memory can be written. Values are uniform random in
bf16 from a generator seeded per tensor name: deterministic, incompressible, never NaN. Written with
ckptool's own Megatron writer, so the files carry args the way Megatron writes them.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

from ckptool.config import GPTConfig, Layout
from ckptool.formats.megatron import write_megatron
from ckptool.lazy import Derived
from ckptool.state import Checkpoint, SourceInfo, expected_names

VOCAB = 50257  # GPT-2's tokenizer; padded to 50304 for TP <= 2 with divisor 128
MAX_POS = 2048


def _random(name: str, shape, dtype) -> Derived:
    seed = zlib.crc32(name.encode())

    def make():
        # A random 1 Mi-element block tiled over the tensor: as incompressible as random data
        # for file I/O, and ~10x cheaper than drawing every element (30 GB must not take an hour).
        g = torch.Generator().manual_seed(seed)
        numel = 1
        for s in shape:
            numel *= s
        block = torch.empty(min(numel, 1 << 20), dtype=dtype).uniform_(-0.05, 0.05, generator=g)
        out = torch.empty(numel, dtype=dtype)
        out.view(-1)[: numel - numel % block.numel()].view(-1, block.numel()).copy_(block)
        out[numel - numel % block.numel():] = block[: numel % block.numel()]
        return out.view(shape)

    return Derived(make, [], memo=True, shape=shape, dtype=dtype)  # TP shards share one draw


def config_for_size(size_gb: float) -> GPTConfig:
    """A GPT-2-style config whose bf16 weights total about size_gb (1e9 bytes)."""
    hidden = 1024 if size_gb < 1 else 2048 if size_gb <= 8 else 4096
    per_layer = 2 * (12 * hidden * hidden + 13 * hidden)
    fixed = 2 * (50304 + MAX_POS) * hidden
    layers = max(2, 2 * round((size_gb * 1e9 - fixed) / per_layer / 2))  # even: PP2 splits it
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                     ffn_hidden_size=4 * hidden, padded_vocab_size=50304, vocab_size=VOCAB,
                     vocab_size_source="synthetic", max_position_embeddings=MAX_POS,
                     activation="gelu")


def synthetic_checkpoint(cfg: GPTConfig, dtype=torch.bfloat16) -> Checkpoint:
    shapes = {
        "embed.word": (cfg.padded_vocab_size, cfg.hidden_size),
        "embed.pos": (cfg.max_position_embeddings, cfg.hidden_size),
        "final_norm.weight": (cfg.hidden_size,), "final_norm.bias": (cfg.hidden_size,),
    }
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    per_layer = {
        "attn_norm.weight": (h,), "attn_norm.bias": (h,), "mlp_norm.weight": (h,), "mlp_norm.bias": (h,),
        "attn.q.weight": (h, h), "attn.k.weight": (h, h), "attn.v.weight": (h, h),
        "attn.q.bias": (h,), "attn.k.bias": (h,), "attn.v.bias": (h,),
        "attn.out.weight": (h, h), "attn.out.bias": (h,),
        "mlp.up.weight": (f, h), "mlp.up.bias": (f,), "mlp.down.weight": (h, f), "mlp.down.bias": (h,),
    }
    for i in range(cfg.num_layers):
        for k, s in per_layer.items():
            shapes[f"layers.{i}.{k}"] = s
    names = expected_names(cfg)
    missing = set(names) - set(shapes)
    assert not missing, f"synthetic model lacks {sorted(missing)[:4]}"
    tensors = {n: _random(n, shapes[n], dtype) for n in names}
    return Checkpoint(cfg, tensors, SourceInfo(path="<synthetic>", format="synthetic", dialect="mcore"))


def write_synthetic(out: Path, size_gb: float = 0.0, tp: int = 2, pp: int = 2, dialect: str = "mcore",
                    cfg: GPTConfig = None) -> GPTConfig:
    """Write a Megatron torch-format checkpoint of about size_gb (or of cfg) into out (a new directory)."""
    cfg = cfg or config_for_size(size_gb)
    Path(out).mkdir(parents=True, exist_ok=False)
    write_megatron(synthetic_checkpoint(cfg), Path(out), Layout(tp=tp, pp=pp), dialect=dialect,
                   iteration=1000, warn=lambda m: None)
    return cfg


if __name__ == "__main__":  # python scripts/synthetic.py OUT SIZE_GB
    import sys
    c = write_synthetic(Path(sys.argv[1]), float(sys.argv[2]))
    print(f"{c.num_layers} layers, hidden {c.hidden_size}")
