"""Block-FP8 weights (DeepSeek-V3 / R1 as released): dequantized lazily on read, quantized by to-hf --fp8.

The arithmetic is transformers' own (transformers 5.24 integrations/finegrained_fp8.py), so what
ckptool reads is bit-exact with what transformers dequantizes and what it writes is what transformers'
quantizer writes:
  dequantize (Fp8Dequantize._dequantize_one): weight.to(float32) * scale_inv.to(float32) per block,
    then cast to the model's dtype (bf16 unless another is asked: Dequantized.to computes it from the
    float32 product, never through bf16);
  quantize (Fp8Quantize._quantize_one): per block amax = max |w| in float32; scale = 448 / amax (1 for
    an all-zero block); stored scale_inv = 1 / scale (float32); weight = clamp(w * scale, -448, 448)
    cast to float8_e4m3fn.
transformers refuses (quantize) or mis-tiles (dequantize on CPU) a dimension that is not a multiple of
the block; DeepSeek's releases have such dimensions (kv_a_proj_with_mqa's 576 rows), where the last
block is partial and has a scale of its own (DeepSeek-V3 inference/kernel.py weight_dequant masks it).
Here a partial block is a whole one padded with zeros: its amax and its products are the partial
block's own, so both directions stay transformers' arithmetic element by element.

A weight quantized from bf16 this way reads back as bf16 values from which the same bytes and scales
are computed again (the block's amax is a bf16 value, so 448 * scale_inv rounds back to it), so
FP8 -> bf16 (Megatron, any layout) -> to-hf --fp8 reproduces the release; straight from an FP8
directory to-hf --fp8 writes the stored bytes and scales as they are.
"""
from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import torch

from ...families.family import Family
from ...lazy import Derived, LazyTensor
from .quant import FP8_DTYPE, FP8_MAX, RELEASE, SCALE_SUFFIX, BlockFP8, Stored, checked_scheme, scaled_weights

FP8 = getattr(torch, FP8_DTYPE)


def _padded(x: torch.Tensor, block) -> torch.Tensor:
    """x with zero rows / columns appended up to whole blocks (partial edge blocks made whole)."""
    rows, cols = x.shape
    pad_r, pad_c = -rows % block[0], -cols % block[1]
    return torch.nn.functional.pad(x, (0, pad_c, 0, pad_r)) if pad_r or pad_c else x


def _blocks(x: torch.Tensor, block) -> torch.Tensor:
    """[rows, cols] (whole blocks) viewed as [row blocks, block rows, col blocks, block cols]."""
    return x.reshape(x.shape[0] // block[0], block[0], x.shape[1] // block[1], block[1])


def scale_values(scale_inv: torch.Tensor) -> torch.Tensor:
    """Stored block scales as float32 (UE8M0 exponent bytes are 2^(b - 127), as transformers reads them)."""
    if scale_inv.dtype == torch.uint8:
        return (scale_inv.to(torch.float32) - 127.0).exp2()
    return scale_inv.to(torch.float32)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
    """weight (float8_e4m3fn [out, in]) times its block's scale, in float32, cast to dtype."""
    rows, cols = weight.shape
    q = _blocks(_padded(weight.to(torch.float32), block), block)
    out = q * scale_values(scale_inv)[:, None, :, None]
    return out.reshape(q.shape[0] * block[0], -1)[:rows, :cols].to(dtype)


def quantize(w: torch.Tensor, block) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of w, per block, by transformers' formula (module doc)."""
    rows, cols = w.shape
    x = _blocks(_padded(w.to(torch.float32), block), block)
    amax = x.abs().amax(dim=(1, 3))
    scale = FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))  # an all-zero block keeps scale 1
    q = torch.clamp(x * scale[:, None, :, None], min=-FP8_MAX, max=FP8_MAX).to(FP8)
    return q.reshape(x.shape[0] * block[0], -1)[:rows, :cols].contiguous(), (1.0 / scale).to(torch.float32)


class Dequantized(Derived):
    """A block-FP8 weight read as `dtype` (bf16 by default). It keeps its stored weight and scales, so
    .to(another dtype) computes from them (not from the bf16 values) and to-hf --fp8 can write them back."""

    def __init__(self, weight: LazyTensor, scale_inv: LazyTensor, scheme: BlockFP8,
                 dtype: torch.dtype = torch.bfloat16):
        block = scheme.block
        # memoised: tensor-parallel pieces of one weight share one dequantization inside a writer's load_scope
        super().__init__(lambda w, s: dequantize(w, s, block, dtype), [weight, scale_inv], memo=True,
                         shape=weight.shape, dtype=dtype)
        self.weight, self.scale_inv, self.scheme = weight, scale_inv, scheme

    def to(self, dtype: torch.dtype) -> LazyTensor:
        return self if dtype == self.dtype else Dequantized(self.weight, self.scale_inv, self.scheme, dtype)


# --- reading -------------------------------------------------------------------------------------

def stored(entries: Dict[str, LazyTensor]) -> Stored:
    """{name: (shape, dtype name)}: what quant.py's checks read."""
    return {k: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in entries.items()}


def dequantize_entries(entries: Dict[str, LazyTensor], conf: dict, path) -> Dict[str, LazyTensor]:
    """entries with every block-FP8 weight replaced by its lazy bf16 dequantization and the scales
    consumed (so they are not unknown names). A checkpoint without FP8 weights is returned as it is."""
    meta = stored(entries)
    pairs = scaled_weights(meta, path)
    if not pairs:
        return entries
    scheme = checked_scheme(meta, pairs, conf, path)
    out = dict(entries)
    for name, key in pairs:
        out[name] = Dequantized(out[name], out.pop(key), scheme)
    return out


# --- writing (to-hf --fp8) -----------------------------------------------------------------------

def release_pattern(family: Family) -> "re.Pattern":
    """The HF names the family's releases store block FP8 (Family.fp8_release keys, any layer and expert)."""
    layer = re.escape(family.names.layer_prefix).replace(re.escape("{i}"), r"\d+")
    keys = [re.escape(k).replace(re.escape("{e}"), r"\d+") for k in family.fp8_release]
    return re.compile(f"{layer}(?:{'|'.join(keys)})")


def _quantized(t: LazyTensor, scheme: BlockFP8) -> Tuple[LazyTensor, LazyTensor]:
    """(weight, scale_inv) to store for t: a weight read from block FP8 in the same blocks keeps its
    stored bytes and float32 scales; any other is quantized (once: both halves share one memoised result)."""
    if (isinstance(t, Dequantized) and t.scheme.block == scheme.block and t.scale_inv.dtype == torch.float32):
        return t.weight, t.scale_inv
    pair = Derived(lambda w: quantize(w, scheme.block), [t], memo=True, shape=t.shape, dtype=FP8)
    return (Derived(lambda p: p[0], [pair], shape=t.shape, dtype=FP8),
            Derived(lambda p: p[1], [pair], shape=scheme.grid(t.shape), dtype=torch.float32))


def quantized_items(items: Sequence[tuple], family: Family, scheme: BlockFP8 = RELEASE) -> List[tuple]:
    """The writer's (hf name, lazy, group) items with the family's released-FP8 weights as block FP8:
    each such weight followed by its `_scale_inv`; every other tensor as it was."""
    released = release_pattern(family)
    out: List[tuple] = []
    for name, t, group in items:
        if released.fullmatch(name) and len(t.shape) == 2:
            weight, scale = _quantized(t, scheme)
            out += [(name, weight, group), (name + SCALE_SUFFIX, scale, group)]
        else:
            out.append((name, t, group))
    return out
