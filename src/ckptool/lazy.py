"""Lazy tensors: handles that know their shape and dtype and produce their bytes on demand.

Readers hand out LazyTensors (a range of a torch file, a safetensors entry, a DCP chunk, a concat
of tensor-parallel shards); writers call .load() one layer at a time. Derived tensors (splits,
merges, transposes) compute their shape on the meta device, so no transform needs shape
bookkeeping of its own. Inside a `load_scope()` memoised nodes keep their value until the scope
ends: that is how q, k and v share one read of a fused QKV while peak memory stays at one layer.
A piece cut from a whole (a tensor-parallel rank's share, q of a fused QKV) declares where it sits in
its `placement` (Placement), so writers and verify read that instead of re-deriving it.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from .io import profile
from .errors import CkptError

_local = threading.local()  # each thread its own stack of scopes (writers may load in parallel)


def load_scopes() -> list:
    stack = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def memoised(node, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """node's value, computed once in the innermost load scope and kept there for its other users;
    outside a scope every call computes (nothing would ever release the value)."""
    scopes = load_scopes()
    if not scopes:
        return compute()
    cache = scopes[-1]
    hit = cache.get(id(node))
    if hit is None:
        hit = cache[id(node)] = (node, compute())  # node kept alive so id() stays unique
    return hit[1]


@contextlib.contextmanager
def load_scope():
    """Memoise loads of memo=True nodes until the block ends (writers wrap one layer in this)."""
    load_scopes().append({})
    try:
        yield
    finally:
        load_scopes().pop()


class LazyTensor:
    shape: torch.Size
    dtype: torch.dtype
    placement: Optional["Placement"] = None  # set on pieces cut from a whole tensor (see Placement)

    def load(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # --- conveniences ------------------------------------------------------------------
    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        return derive(lambda t: t.narrow(dim, start, length), [self])

    def chunk(self, n: int, dim: int = 0) -> list:
        size = self.shape[dim]
        if size % n:
            raise CkptError(f"cannot split a tensor of shape {tuple(self.shape)} into {n} equal "
                            f"parts along dim {dim}")
        step = size // n
        return [self.narrow(dim, i * step, step) for i in range(n)]

    def load_into(self, out: torch.Tensor) -> None:
        """Write this tensor's values into out (same shape, maybe a slice of a larger tensor).
        Stored tensors override it to read straight into out's memory."""
        out.copy_(self.load())

    def to(self, dtype: torch.dtype) -> "LazyTensor":
        if dtype == self.dtype:
            return self
        return derive(lambda t: t.to(dtype), [self])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a piece sits in the whole tensor it was cut from, declared by the split that cut it
    (megatron-core's ShardedTensor idea: each shard states its global shape and offset, so nothing
    downstream re-derives it).

      whole   the tensor the piece is cut from (its global shape is whole.shape)
      names   the canonical names the whole holds: one, or the parts of a fused tensor in order
              (q, k, v of a fused QKV; gate, up of a gated fc1)
      blocks  (offset, length) ranges of the whole along `dim`; the piece is their concatenation in
              order: one range for a plain tensor-parallel slice, two for a gated fc1 rank
              ([gate_r; up_r]), one per query group for q, k or v of a fused QKV
      part    for a canonical part of a fused whole (q=0, k=1, v=2; gate=0, up=1): its index
    """
    whole: "LazyTensor"
    names: Tuple[str, ...]
    blocks: Tuple[Tuple[int, int], ...]
    dim: int = 0
    part: Optional[int] = None

    @property
    def shape(self) -> torch.Size:
        return self.whole.shape

    @property
    def offset(self) -> Tuple[int, ...]:
        """The global index of the piece's first element (its first block's start along dim)."""
        return tuple(self.blocks[0][0] if d == self.dim else 0 for d in range(len(self.whole.shape)))

    def is_part(self, whole: "LazyTensor", part: int) -> bool:
        return self.whole is whole and self.part == part


class Piece(LazyTensor):
    """A lazy tensor that declares its placement; loads (and narrows) as the tensor it wraps."""

    def __init__(self, data: LazyTensor, placement: Placement):
        self.data = data.data if isinstance(data, Piece) else data
        self.shape = data.shape
        self.dtype = data.dtype
        self.placement = placement

    @property
    def parents(self) -> Tuple[LazyTensor]:
        """What it reads (walked like a Derived's parents, e.g. by the read-ahead of io/prefetch.py)."""
        return (self.data,)

    def load(self) -> torch.Tensor:
        return self.data.load()

    def load_into(self, out: torch.Tensor) -> None:
        self.data.load_into(out)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        return self.data.narrow(dim, start, length)

    def to(self, dtype: torch.dtype) -> LazyTensor:
        return self if dtype == self.dtype else Piece(self.data.to(dtype), self.placement)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Const(LazyTensor):
    """A tensor already in memory."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.shape = tensor.shape
        self.dtype = tensor.dtype

    def load(self) -> torch.Tensor:
        return self.tensor

    def narrow(self, dim, start, length):
        return Const(self.tensor.narrow(dim, start, length))


class Derived(LazyTensor):
    """fn applied to the loaded parents; shape and dtype found by running fn on meta tensors."""

    def __init__(self, fn: Callable, parents: Sequence[LazyTensor], memo: bool = False,
                 shape=None, dtype=None):
        self.fn = fn
        self.parents = list(parents)
        self.memo = memo
        if shape is None:  # data-dependent fns (replica checks) pass shape and dtype themselves
            metas = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in self.parents]
            out = fn(*metas)
            shape, dtype = out.shape, out.dtype
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def load(self) -> torch.Tensor:
        return memoised(self, self._compute) if self.memo else self._compute()

    def _compute(self) -> torch.Tensor:
        with profile.stage("transform"):
            return self.fn(*[p.load() for p in self.parents])


class Memo(LazyTensor):
    """data, loaded once per load_scope for all its users (a weight that is both written and checked
    against its fp32 master: one read for both). Outside a scope every load reads.

    Loaded into a slice of a larger tensor (a part of a merge), it goes straight from the source
    into that slice and the scope keeps the slice, not a copy: no layer-sized temporary, no copy."""

    def __init__(self, data: LazyTensor):
        self.data, self.shape, self.dtype = data, data.shape, data.dtype

    @property
    def parents(self) -> Tuple[LazyTensor]:
        return (self.data,)

    def load(self) -> torch.Tensor:
        return memoised(self, self.data.load)

    def load_into(self, out: torch.Tensor) -> None:
        scopes = load_scopes()
        cache = scopes[-1] if scopes else None
        hit = cache.get(id(self)) if cache is not None else None
        if hit is not None:
            out.copy_(hit[1])
            return
        self.data.load_into(out)
        if cache is not None:
            # the slice itself: callers load into memory they do not refill (Concat's fresh result, which
            # writers only read), so it holds these values for as long as the scope lasts
            cache[id(self)] = (self, out)


class Checked(LazyTensor):
    """data, checked as it loads: check(value, *others) raises when value does not agree with the
    others' values (an fp32 master that does not round to its stored weight). The check must be
    elementwise, so a slice of a Checked is that slice checked against the same slices of the others:
    a target that takes part of it (TP2 -> TP4) reads and checks only that part, and the parts all
    targets take together check the whole once. load_into reads straight into out and checks it there."""

    def __init__(self, data: LazyTensor, check: Callable, others: Sequence[LazyTensor]):
        self.data, self.check, self.others = data, check, list(others)
        self.shape, self.dtype = data.shape, data.dtype

    @property
    def parents(self) -> Tuple[LazyTensor, ...]:
        return (self.data, *self.others)

    def _checked(self, value: torch.Tensor) -> torch.Tensor:
        others = [o.load() for o in self.others]
        with profile.stage("check"):
            self.check(value, *others)
        return value

    def load(self) -> torch.Tensor:
        return self._checked(self.data.load())

    def load_into(self, out: torch.Tensor) -> None:
        self.data.load_into(out)
        self._checked(out)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        return Checked(self.data.narrow(dim, start, length), self.check,
                       [o.narrow(dim, start, length) for o in self.others])


def derive(fn: Callable, parents: Sequence[LazyTensor], memo: bool = False) -> Derived:
    return Derived(fn, parents, memo=memo)


def cat_shape(shapes: Sequence[Sequence[int]], dim: int = 0) -> torch.Size:
    """The shape torch.cat would give. Derived nodes built on cat pass it themselves: torch.cat on
    meta tensors imports torch._dynamo, 3-10 s of start-up for every conversion."""
    first = list(shapes[0])
    first[dim] = sum(s[dim] for s in shapes)
    return torch.Size(first)


class Concat(Derived):
    """torch.cat of the parts, built in place: the result is allocated once (on recycled memory)
    and each part loads into its own slice, so tensor-parallel shards stored in a file go straight
    from the file into the merged tensor with no intermediate copy."""

    def __init__(self, parts: Sequence[LazyTensor], dim: int = 0, memo: bool = False):
        super().__init__(None, parts, memo=memo, shape=cat_shape([p.shape for p in parts], dim),
                         dtype=parts[0].dtype)
        self.dim = dim

    def _compute(self) -> torch.Tensor:
        from .io.buffers import empty  # io.buffers imports this module: the one place it is needed
        with profile.stage("merge"):
            out = empty(self.shape, self.dtype)
            start = 0
            for part in self.parents:
                length = part.shape[self.dim]
                part.load_into(out.narrow(self.dim, start, length))
                start += length
        return out

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        # A slice along the joined dim is the parts' slices it covers: inside one part (TP2 -> TP4)
        # that part's slice, a ranged read; across a boundary (a vocabulary re-padded for TP4: rank
        # 1's rows span both TP2 shards) the two slices joined, so the whole merged tensor is never
        # built (and, memoised, held for the group's load) for a quarter of it: peak RSS.
        if dim != self.dim or length <= 0 or start < 0 or start + length > self.shape[dim]:
            return super().narrow(dim, start, length)  # (out of range: fails on load, as torch's narrow)
        cuts, first = [], 0
        for part in self.parents:
            size = part.shape[dim]
            lo, hi = max(start, first), min(start + length, first + size)
            if lo < hi:
                cuts.append(part.narrow(dim, lo - first, hi - lo))
            first += size
        if len(cuts) == 1:
            return cuts[0]
        return Concat(cuts, dim) if cuts else super().narrow(dim, start, length)


def cat(parts: Sequence[LazyTensor], dim: int = 0, memo: bool = False) -> LazyTensor:
    if len(parts) == 1:
        return parts[0]
    return Concat(parts, dim, memo=memo)
