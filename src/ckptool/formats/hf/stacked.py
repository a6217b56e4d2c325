"""GPT-OSS's stacked experts (families/family.py STACKED ops) both ways: one HF tensor [E, ...] per layer and
kind <-> each expert's canonical tensors. transformers' GptOssExperts (5.24 models/gpt_oss/modeling_gpt_oss.py)
computes x @ gate_up_proj[e] + gate_up_proj_bias[e] and takes gate = [..., ::2], up = [..., 1::2], then
out @ down_proj[e] + down_proj_bias[e]: the weights are stored [in, out] (the transpose of a Linear's [out, in]),
gate and up interleaved along `out`. Expert e's tensors read only its slice of the stacked entry (narrow on the
expert axis), so a layer is never loaded whole per expert."""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from ...errors import require
from ...families.family import STACKED, stacked_part_shape
from ...lazy import Derived, LazyTensor


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows [gate 0, up 0, gate 1, up 1, ...]."""
    return torch.stack([gate, up], dim=1).reshape(gate.shape[0] * 2, *gate.shape[1:])


def _one_expert(op: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Expert e's HF slice from its canonical tensors (Linear layout [out, in])."""
    joined = _interleave(*parts) if op in ("stack_glu", "stack_glu_T") else parts[0]
    return joined.t() if op.endswith("_T") else joined


def stack(op: str, parts: Sequence[LazyTensor]) -> LazyTensor:
    """The stacked HF tensor of every expert's canonical parts (expert by expert, STACKED[op] each)."""
    per = STACKED[op]
    experts = len(parts) // per
    one = parts[0].shape
    rows = one[0] * per
    shape = (experts,) + ((one[1], rows) if op.endswith("_T") else (rows,) + tuple(one[1:]))

    def build(*xs):
        return torch.stack([_one_expert(op, xs[e * per:(e + 1) * per]) for e in range(experts)])
    return Derived(build, parts, shape=shape, dtype=parts[0].dtype)


def _part(op: str, which: int, per: int):
    def take(x: torch.Tensor) -> torch.Tensor:
        one = x[0].t() if op.endswith("_T") else x[0]  # [out, in] or [out]
        return one[which::per].contiguous()
    return take


def unstack(op: str, hf_name: str, t: LazyTensor, names: Sequence[str]) -> Dict[str, LazyTensor]:
    """Each expert's canonical tensors (names: expert by expert, STACKED[op] each) from the stacked HF tensor t."""
    per = STACKED[op]
    experts = len(names) // per
    want_dims = 3 if op.endswith("_T") else 2
    require(len(t.shape) == want_dims and t.shape[0] == experts,
            f"{hf_name} has shape {tuple(t.shape)}, expected {want_dims} dimensions with {experts} experts first")
    out_rows = t.shape[2] if op.endswith("_T") else t.shape[1]
    require(out_rows % per == 0, f"{hf_name} has {out_rows} gate/up features, an odd number: not interleaved halves")
    one = stacked_part_shape(op, tuple(t.shape))
    out = {}
    for e in range(experts):
        piece = t.narrow(0, e, 1)
        for which in range(per):
            out[names[e * per + which]] = Derived(_part(op, which, per), [piece], shape=one, dtype=t.dtype)
    return out
