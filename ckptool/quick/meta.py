"""Tensors as inspect shows them, without torch: TensorMeta (shape, dtype name), and the canonical
tensors' shapes a GPTConfig implies (state.py's table of names and shapes, as data)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..config import GPTConfig
from ..state import expected_names

ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
            "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
            "float8_e4m3fn": 1, "float8_e5m2": 1}
# torch's typed storage classes as a torch.save pickle names them -> the dtype's name
STORAGE_DTYPES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
                  "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32",
                  "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


@dataclass(frozen=True)
class TensorMeta:
    """What inspect shows of a tensor, without the tensor: describe() prints str(dtype), so the
    dtype is torch's name for it ("bfloat16")."""
    shape: Tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def canonical_shapes(cfg: GPTConfig) -> Optional[Dict[str, Tuple[int, ...]]]:
    """Every canonical tensor of a dense model with cfg and its full shape, in expected_names order
    (shapes as state.py documents them). None for MoE and MLA models, whose shapes the quick path
    leaves to the full reader."""
    if cfg.moe is not None or cfg.mla is not None:
        return None
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ffn = cfg.num_attention_heads * hd, cfg.num_query_groups * hd, cfg.ffn_hidden_size
    # what a name ends with -> (weight shape, bias shape)
    by_part = {"attn_norm": ((h,), (h,)), "mlp_norm": ((h,), (h,)), "final_norm": ((h,), (h,)),
               "q": ((q, h), (q,)), "k": ((kv, h), (kv,)), "v": ((kv, h), (kv,)),
               "q_norm": ((hd,), (hd,)), "k_norm": ((hd,), (hd,)), "out": ((h, q), (h,)),
               "gate": ((ffn, h), (ffn,)), "up": ((ffn, h), (ffn,)), "down": ((h, ffn), (h,))}
    whole = {"embed.word": (cfg.padded_vocab_size, h), "embed.pos": (cfg.max_position_embeddings, h),
             "output.weight": (cfg.padded_vocab_size, h)}
    shapes = {}
    for name in expected_names(cfg):
        if name in whole:
            shapes[name] = whole[name]
            continue
        part, kind = name.split(".")[-2:]
        weight, bias = by_part[part]
        shapes[name] = weight if kind == "weight" else bias
    return shapes
