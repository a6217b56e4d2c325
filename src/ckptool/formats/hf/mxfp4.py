"""GPT-OSS's MXFP4 experts (config.json quantization_config {"quant_method": "mxfp4"}) dequantized on read.

The facts, from transformers 5.24 integrations/mxfp4.py (FP4_VALUES, _convert_moe_packed_tensors), which the
released openai/gpt-oss checkpoints load through:
  <name>_blocks  uint8 [E, out, G, 16]: 32 fp4 (e2m1) codes per block of the input axis, two per byte, the LOW
                 nibble the even element (2j), the HIGH nibble the odd one (2j + 1)
  <name>_scales  uint8 [E, out, G]: one e8m0 exponent per block, the block's scale 2 ** (scale - 127)
  a code's value: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6
and the weight is those values times the scale, [E, out, G * 32], then transposed to [E, in, out]: the layout of
the unquantized gate_up_proj / down_proj. transformers builds the values in the parameter's dtype and scales them
with torch.ldexp in that dtype; this does the same in bfloat16 (what the released model loads as), so the values
are bit for bit transformers'."""
from __future__ import annotations

from typing import Dict

import torch

from ...lazy import LazyTensor
from .fp8 import stored
from .quant import mxfp4_pairs

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # bits 0-2 of a code; bit 3 negates
SCALE_BIAS = 127  # e8m0: the exponent is the byte minus 127
DTYPE = torch.bfloat16


def e2m1_table(dtype: torch.dtype) -> torch.Tensor:
    """The 16 code values in dtype, code c at index c."""
    return torch.tensor(list(E2M1) + [-v for v in E2M1], dtype=dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """[..., out, G, 16] codes and [..., out, G] exponents -> [..., in = G * 32, out] values."""
    table = e2m1_table(dtype)
    codes = blocks.to(torch.uint8)
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)  # low nibble first
    values = values.reshape(*codes.shape[:-1], codes.shape[-1] * 2)  # [..., out, G, 32]
    # torch.ldexp multiplies by 2.0 ** exponent in float32; the product rounds to dtype as transformers' out= does
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)).to(dtype)
    return values.flatten(-2).transpose(-1, -2).contiguous()


class Mxfp4Tensor(LazyTensor):
    """The dequantized [E, in, out] tensor of one stacked MXFP4 entry; narrowing the expert axis reads only
    those experts' blocks and scales."""

    def __init__(self, blocks: LazyTensor, scales: LazyTensor):
        self.blocks, self.scales = blocks, scales
        e, out, groups, half = blocks.shape
        self.shape = torch.Size((e, groups * half * 2, out))
        self.dtype = DTYPE

    @property
    def parents(self):
        return (self.blocks, self.scales)

    def load(self) -> torch.Tensor:
        return dequantize(self.blocks.load(), self.scales.load())

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        if dim != 0:
            return super().narrow(dim, start, length)
        return Mxfp4Tensor(self.blocks.narrow(0, start, length), self.scales.narrow(0, start, length))


def dequantize_mxfp4(entries: Dict[str, LazyTensor], conf: dict, path) -> Dict[str, LazyTensor]:
    """Each <name>_blocks with its <name>_scales -> <name> in bfloat16; anything else MXFP4-looking refused
    (quant.mxfp4_pairs, the quick reader's check too)."""
    out = dict(entries)
    for name, blocks, scales in mxfp4_pairs(stored(entries), conf, path):
        out[name] = Mxfp4Tensor(out.pop(blocks), out.pop(scales))
    return out
