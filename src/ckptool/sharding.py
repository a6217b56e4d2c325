"""Tensor-parallel split and merge, driven by one table of rules.

A rule says how a Megatron-style fused tensor is cut across TP ranks. The rules are generic; which
tensor gets which rule is data (see roles.ROLE_RULES). Merge and split are exact inverses for every
rule (tests/test_sharding.py checks that exhaustively), so any layout can be read and any layout
written.

  REPLICATED  every rank holds the whole tensor (norms, row-parallel biases, positions)
  COLUMN      ranks hold consecutive row blocks (dim 0)
  ROW         ranks hold consecutive column blocks (dim 1)
  VOCAB       like COLUMN, over the padded vocabulary (padding is applied before splitting)
  QKV         COLUMN over the grouped [ng, nq/ng + 2, hd] rows: whole query groups per rank when
              TP divides the groups; when TP is a multiple of the groups newer Megatron slices
              the grouped rows evenly, so a rank holds part of a group (still a dim-0 block)
  GATED       fc1 of a gated MLP: rank r holds [gate_r; up_r]; the merged tensor is [gate; up]
"""
from __future__ import annotations

import enum
from typing import Callable, List, Optional, Sequence

import torch

from .errors import CkptError
from .lazy import Concat, Derived, LazyTensor, Piece, Placement, cat


class Rule(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATED = "gated"


_DIM = {Rule.COLUMN: 0, Rule.VOCAB: 0, Rule.QKV: 0, Rule.ROW: 1}


def split(tensor: torch.Tensor, rule: Rule, tp: int) -> List[torch.Tensor]:
    """The tp per-rank pieces of a merged tensor."""
    if tp == 1:
        return [tensor]
    if rule is Rule.REPLICATED:
        return [tensor] * tp
    if rule is Rule.GATED:
        gate, up = _halves(tensor)
        return [torch.cat([g, u], dim=0) for g, u in zip(_even(gate, tp, 0), _even(up, tp, 0))]
    return _even(tensor, tp, _DIM[rule])


def merge(parts: Sequence[torch.Tensor], rule: Rule) -> torch.Tensor:
    """Inverse of split (REPLICATED takes the first part; see merge_lazy for replica checks)."""
    if len(parts) == 1:
        return parts[0]
    if rule is Rule.REPLICATED:
        return parts[0]
    if rule is Rule.GATED:
        halves = [_halves(p) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(parts), dim=_DIM[rule])


def _even(t: torch.Tensor, n: int, dim: int) -> List[torch.Tensor]:
    if t.dim() <= dim or t.shape[dim] % n:
        raise CkptError(f"cannot split a tensor of shape {tuple(t.shape)} into {n} tensor-parallel "
                        f"parts along dim {dim}")
    return list(torch.chunk(t, n, dim=dim))


def _halves(t: torch.Tensor):
    if t.shape[0] % 2:
        raise CkptError(f"gated fc1 tensor of shape {tuple(t.shape)} has an odd number of rows")
    return torch.chunk(t, 2, dim=0)


# --- lazy versions --------------------------------------------------------------------------

class ReplicaPolicy:
    """What to do when copies that should be identical differ across TP ranks.

    first: take rank 0's copy and warn; mean: average the copies and warn; strict: fail.
    `warn` is called once per tensor with the largest absolute difference; the figures are also kept
    in `divergences` (name -> largest difference): api.py returns them with a conversion's result
    (ConversionResult.replica_divergences) and the commands print the largest (report()). Replicas are
    compared as tensors load, so the figures are complete once a conversion has read everything.
    """

    CHOICES = ("first", "mean", "strict")

    def __init__(self, mode: str = "first", warn: Optional[Callable[[str], None]] = None):
        if mode not in self.CHOICES:
            raise CkptError(f"unknown --replicas mode {mode!r}", "use first, mean or strict")
        self.mode = mode
        self.warn = warn or (lambda msg: None)
        self.divergences: dict = {}

    def report(self) -> Optional[str]:
        """One line on the largest divergence seen so far, or None while every replica agreed."""
        return divergence_report(self.divergences)

    def resolve(self, name: str, copies: List[torch.Tensor]) -> torch.Tensor:
        first = copies[0]
        if len(copies) == 1:
            return first
        worst = 0.0
        for other in copies[1:]:
            if other.shape != first.shape:
                raise CkptError(f"{name}: replicated tensor has shape {tuple(other.shape)} on one "
                                f"rank and {tuple(first.shape)} on another", "the shards do not belong together")
            if not torch.equal(other, first):
                worst = max(worst, (other.float() - first.float()).abs().max().item())
        if worst == 0.0:
            return first
        self.divergences[name] = worst
        if self.mode == "strict":
            raise CkptError(f"{name}: tensor-parallel replicas differ (max abs diff {worst:.3g})",
                            "rerun with --replicas first or --replicas mean to choose a copy")
        how = "rank 0's copy" if self.mode == "first" else "the mean of the copies"
        self.warn(f"{name}: tensor-parallel replicas differ (max abs diff {worst:.3g}); using {how}")
        if self.mode == "mean":
            return torch.stack([c.float() for c in copies]).mean(0).to(first.dtype)
        return first


def divergence_report(divergences: dict) -> Optional[str]:
    """One line on the largest of {name: largest abs difference between replicas}, or None when empty."""
    if not divergences:
        return None
    name, worst = max(divergences.items(), key=lambda kv: kv[1])
    return (f"tensor-parallel replicas differ in {len(divergences)} tensor(s); the largest divergence is "
            f"{worst:.3g} (max abs diff) in {name}")


def merge_lazy(parts: Sequence[LazyTensor], rule: Rule, name: str,
               replicas: Optional[ReplicaPolicy] = None) -> LazyTensor:
    """A lazy merged tensor; memoised so q, k and v (or gate and up) share one read."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    if rule is Rule.REPLICATED:
        policy = replicas or ReplicaPolicy("first")
        return Derived(lambda *ts: policy.resolve(name, list(ts)), parts, memo=True,
                       shape=parts[0].shape, dtype=parts[0].dtype)
    # Megatron cuts every sharded tensor into equal pieces, so the shards' shapes (and dtypes) must match
    # exactly; a difference on the split dimension too means a damaged or foreign rank file.
    shapes = {(tuple(p.shape), p.dtype) for p in parts}
    if len(shapes) != 1:
        raise CkptError(f"{name}: shapes {[tuple(p.shape) for p in parts]} are inconsistent across "
                        "tensor-parallel ranks", "the rank files do not belong to one checkpoint")
    if rule is Rule.GATED:  # every rank's gate half, then every rank's up half
        rows = parts[0].shape[0]
        if rows % 2:
            raise CkptError(f"{name}: gated fc1 tensor of shape {tuple(parts[0].shape)} has an odd number of rows")
        half = rows // 2
        parts = [p.narrow(0, 0, half) for p in parts] + [p.narrow(0, half, half) for p in parts]
    # built in place: stored shards are read straight into the merged tensor (lazy.Concat)
    return Concat(parts, _DIM.get(rule, 0), memo=True)


def split_lazy(tensor: LazyTensor, rule: Rule, tp: int, names: Sequence[str] = ()) -> List[Piece]:
    """The tp per-rank pieces of a merged lazy tensor, each declaring its placement in it (names: the
    canonical names the tensor holds). Every piece is a narrow (two for GATED: gate_r and up_r) of the
    whole, so a rank's piece reads only its rows of a stored tensor."""
    names = tuple(names)
    if tp == 1 or rule is Rule.REPLICATED:
        rows = tensor.shape[0] if len(tensor.shape) else 1
        return [Piece(tensor, Placement(tensor, names, ((0, rows),))) for _ in range(tp)]
    if rule is Rule.GATED:
        rows = tensor.shape[0] if len(tensor.shape) else 1
        if rows % 2:
            raise CkptError(f"gated fc1 tensor of shape {tuple(tensor.shape)} has an odd number of rows")
        half = rows // 2
        if half % tp:
            raise CkptError(f"cannot split a tensor of shape {(half,) + tuple(tensor.shape[1:])} into {tp} "
                            "tensor-parallel parts along dim 0")
        step = half // tp
        blocks = [((r * step, step), (half + r * step, step)) for r in range(tp)]
        return [Piece(cat([tensor.narrow(0, a, n) for a, n in b], 0), Placement(tensor, names, b)) for b in blocks]
    dim = _DIM[rule]
    step = tensor.shape[dim] // tp if len(tensor.shape) > dim else 0
    return [Piece(p, Placement(tensor, names, ((r * step, step),), dim))
            for r, p in enumerate(tensor.chunk(tp, dim))]
