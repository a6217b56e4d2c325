"""The distributed optimizer's fully_sharded_model_space torch_dist form: N-D flattened tensors.

Megatron-LM's default for --use-distributed-optimizer with torch_dist up to megatron-core 0.14 (0.15
with --dist-ckpt-save-pre-mcore-014 or torch < 2.6; 0.16 no longer stores it). Each parameter's master
and moments live under `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>` like the other
model-space forms, but each DP rank saved only its slice (`flattened_range`) of the flattened TP shard,
so dist_checkpointing stored them "N-D flattened": a parameter of global shape [X, Y, Z] cut into
local [x, y, z] chunks (TP shards; a stacked layer axis has chunks of 1) is stored as a
[X/x, Y/y, Z/z, x*y*z] tensor, each chunk's flattened values along the last axis at its grid
position (megatron-core 0.15 strategies/torch.py). `.metadata` keeps the original global shape of each
such key in megatron-core's `mcore_data` (dcp_io reads it); the weight under the same model key has it
too, and the two must agree.

ModelSpaceView presents such a DCP directory with every N-D flattened tensor under its original
global shape, so the weights' key table (dist._collect) reads the optimizer state unchanged. A region
of the original tensor reads only the chunk-grid cells it covers (one layer of a stacked tensor), and
DcpTensor refuses a region the stored pieces do not cover completely (a missing DP rank's slice).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional, Sequence, Tuple

import torch

from ...errors import CkptError
from ...io.dcp_io import DcpDir, DcpTensor, Region
from ...lazy import LazyTensor
from ..megatron.optim import HINT

FORM = "fully_sharded_model_space"
ND_SHAPE_KEY = "nd_reformulated_orig_global_shape"  # megatron-core's mcore_data entry per key


def chunk_shape(stored: Sequence[int], original: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The local chunk shape of an N-D flattened tensor ([grid..., chunk numel]) of this original
    global shape, or None when the stored shape is not one."""
    if len(stored) != len(original) + 1 or any(g <= 0 or n % g for n, g in zip(original, stored)):
        return None
    local = tuple(n // g for n, g in zip(original, stored))
    return local if math.prod(local) == stored[-1] else None


class Unflattened(Region):
    """A region [offsets, offsets + sizes) of an N-D flattened tensor, in its original shape; `squeeze`
    leading axes dropped. Reads the chunk-grid cells that cover the region."""

    def __init__(self, dcp: DcpDir, key: str, local: Tuple[int, ...], original: Tuple[int, ...],
                 offsets: Sequence[int] = (), sizes=None, squeeze: int = 0):
        self.dcp, self.key, self.local, self.original = dcp, key, local, original
        self._region(original, offsets, sizes, squeeze, dcp.entries[key].properties.dtype)

    def _at(self, offsets, sizes) -> "Unflattened":
        return Unflattened(self.dcp, self.key, self.local, self.original, offsets, sizes, self.squeeze)

    def load(self) -> torch.Tensor:
        first = [o // n for o, n in zip(self.offsets, self.local)]
        end = [-(-(o + s) // n) for o, s, n in zip(self.offsets, self.sizes, self.local)]
        cells = [e - f for f, e in zip(first, end)]
        stored = DcpTensor(self.dcp, self.key, first + [0], cells + [math.prod(self.local)]).load()
        m = len(self.local)
        # [cells..., flattened chunk] -> [cells..., chunk dims...] -> interleave -> [cells x chunk dims]
        t = stored.view(*cells, *self.local).permute(*[a for i in range(m) for a in (i, m + i)])
        t = t.reshape([c * n for c, n in zip(cells, self.local)])
        for dim, (o, s, f, n) in enumerate(zip(self.offsets, self.sizes, first, self.local)):
            t = t.narrow(dim, o - f * n, s)
        for _ in range(self.squeeze):
            t = t.squeeze(0)
        return t.contiguous()


class ModelSpaceView:
    """What dist._collect reads (tensor_keys, entries[key].size, lazy) of a DcpDir, with the N-D
    flattened optimizer tensors under `prefix` shown in their original global shape (that of the
    weight under the same model key, checked against mcore_data where the save recorded it)."""

    def __init__(self, dcp: DcpDir, prefix: str, where: str):
        self.dcp = dcp
        self.local = {}
        self.entries = dict(dcp.entries)
        for key in dcp.tensor_keys():
            if not key.startswith(prefix):
                continue
            weight = dcp.entries.get(key[len(prefix):])
            original = tuple(weight.size) if weight is not None and hasattr(weight, "size") else None
            info = getattr(dcp, "mcore_data", {}).get(key)
            recorded = info.get(ND_SHAPE_KEY) if isinstance(info, dict) else None
            if not (isinstance(recorded, (tuple, list)) and all(type(n) is int for n in recorded)):
                recorded = None  # absent (saves before mcore_data) or not a shape: the weight's decides
            stored = tuple(dcp.entries[key].size)
            if recorded is not None and original is not None and tuple(recorded) != original:
                raise CkptError(f"{where}: {key} was flattened from shape {tuple(recorded)}, the weight "
                                f"{key[len(prefix):]} has {original}", HINT)
            original = original or (tuple(recorded) if recorded is not None else None)
            if original is None or stored == original:
                continue  # not flattened (or no weight to compare with: dist._collect names it)
            local = chunk_shape(stored, original)
            if local is None:
                raise CkptError(f"{where}: {key} has shape {stored}, neither the weight's {original} nor its "
                                "N-D flattened form [chunk grid..., chunk numel]", HINT)
            self.local[key] = (local, original)
            # chunks in the original shape: the weight's (its stacked-layer offsets); else one chunk, all of it
            chunks = getattr(weight, "chunks", None) or [SimpleNamespace(offsets=(0,) * len(original), sizes=original)]
            self.entries[key] = SimpleNamespace(size=torch.Size(original), properties=dcp.entries[key].properties,
                                                chunks=chunks)

    def tensor_keys(self):
        return self.dcp.tensor_keys()

    def lazy(self, key: str, offsets: Sequence[int] = (), sizes=None, squeeze: int = 0) -> LazyTensor:
        if key not in self.local:
            return self.dcp.lazy(key, offsets, sizes, squeeze)
        local, original = self.local[key]
        return Unflattened(self.dcp, key, local, original, offsets, sizes, squeeze)
