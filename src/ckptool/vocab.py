"""Vocabulary padding policy, applied at the edges.

Readers report the rows they found (config.padded_vocab_size) and the true vocabulary when some
source says it (config.vocab_size, with config.vocab_size_source naming that source). Writers call
target_rows() for their layout and resize_rows() to get there: padding rows are only ever added
(filled as --pad-fill says) or removed; a real row is never dropped.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .config import GPTConfig, padded_vocab_size
from .errors import CkptError, require
from .lazy import Concat, Derived, LazyTensor

PAD_FILLS = ("zero", "mean", "last")


def with_true_vocab_size(cfg: GPTConfig, true_vocab_size: Optional[int], stored_rows: int) -> GPTConfig:
    """cfg with the user's --true-vocab-size (every reader's one override; None leaves cfg as read).
    More than the stored embedding rows cannot be true: refused."""
    if true_vocab_size is None:
        return cfg
    require(true_vocab_size >= 1, f"--true-vocab-size {true_vocab_size} must be positive")
    require(true_vocab_size <= stored_rows,
            f"--true-vocab-size {true_vocab_size} exceeds the {stored_rows} embedding rows stored")
    return cfg.replace(vocab_size=true_vocab_size, vocab_size_source="--true-vocab-size")


def target_rows(cfg: GPTConfig, tp: int, divisible_by: Optional[int] = None,
                warn: Callable[[str], None] = lambda m: None) -> int:
    """Rows the word embedding must have for a Megatron layout with this TP size."""
    div = divisible_by or cfg.make_vocab_size_divisible_by or 1
    if cfg.vocab_size is not None:
        return padded_vocab_size(cfg.vocab_size, div, tp)
    rows = cfg.padded_vocab_size
    if rows % (div * tp) == 0:
        warn(f"true vocabulary size unknown: keeping the stored {rows} embedding rows "
             "(give --true-vocab-size to re-pad exactly)")
        return rows
    new = padded_vocab_size(rows, div, tp)
    warn(f"true vocabulary size unknown: padding the stored {rows} rows to {new} for TP {tp} "
         "(give --true-vocab-size to re-pad exactly)")
    return new


def resize_rows(t: LazyTensor, rows: int, cfg: GPTConfig, fill: str = "zero",
                name: str = "embedding") -> LazyTensor:
    """Trim padding rows or append new ones so t has `rows` rows."""
    have = t.shape[0]
    if rows == have:
        return t
    if rows < have:
        floor = cfg.vocab_size
        if floor is not None and rows < floor:
            raise CkptError(f"{name}: refusing to cut {have} rows to {rows}: the true vocabulary has "
                            f"{floor} rows (from {cfg.vocab_size_source})",
                            "choose a size at least as large as the true vocabulary")
        return t.narrow(0, 0, rows)
    if fill not in PAD_FILLS:
        raise CkptError(f"unknown --pad-fill {fill!r}", "use zero, mean or last")
    real = cfg.vocab_size if cfg.vocab_size is not None else have
    extra, tail = rows - have, tuple(t.shape[1:])
    if fill == "zero":
        pad = Derived(lambda: torch.zeros((extra,) + tail, dtype=t.dtype), [], shape=(extra,) + tail, dtype=t.dtype)
    elif fill == "mean":  # every real row feeds the pad: one load of t, shared inside a scope
        pad = Derived(lambda x: x[:real].float().mean(0, keepdim=True).to(x.dtype).expand(extra, *tail),
                      [t], memo=True, shape=(extra,) + tail, dtype=t.dtype)
    else:
        pad = Derived(lambda x: x.expand(extra, *tail), [t.narrow(0, real - 1, 1)],
                      shape=(extra,) + tail, dtype=t.dtype)
    return PaddedRows(t, pad)


class PaddedRows(Concat):
    """Rows of t followed by pad rows, whose row slices (a target rank's share of the vocabulary)
    load only what they cover: a slice of t's rows is t's slice (a ranged read), one across the
    end of t is t's tail plus the pad's head. Built whole and memoised before (the padded tensor
    of every optimizer slot held at once while the ranks took their quarters), a TP2 -> TP4
    reshard of a model with its optimizer state went over the RSS bound (docs/benchmarks.md)."""

    def __init__(self, t: LazyTensor, pad: LazyTensor):
        super().__init__([t, pad], dim=0, memo=True)  # memo: a whole load (TP1) is shared too
        # row slices: Concat.narrow cuts each part it covers (t's slice a ranged read, the pad's head)


def resize_vocab(tensors: dict, cfg: GPTConfig, rows: int, fill: str = "zero") -> dict:
    """New tensor dict whose word embedding (and untied output) have `rows` rows."""
    out = dict(tensors)
    for name in ("embed.word", "output.weight"):
        if name in out:
            out[name] = resize_rows(out[name], rows, cfg, fill, name)
    return out


def resize_slot_vocab(slot: dict, weights: dict, cfg: GPTConfig, rows: int, fill: str) -> dict:
    """resize_vocab for an optimizer slot. fill "from-weight" (fp32 masters) copies new rows from the
    already re-padded weights, so a new row's master equals its weight; "zero" gives zero moments."""
    if fill != "from-weight":
        return resize_vocab(slot, cfg, rows, fill)
    out = dict(slot)
    for name in ("embed.word", "output.weight"):
        if name not in out:
            continue
        have = out[name].shape[0]
        if rows <= have:  # trimming (or nothing): the same cut as every other slot
            out[name] = resize_rows(out[name], rows, cfg, "zero", name)
            continue
        m, new_rows = out[name], weights[name].narrow(0, have, rows - have)
        out[name] = PaddedRows(m, Derived(lambda w, dtype=m.dtype: w.to(dtype), [new_rows],
                                          shape=new_rows.shape, dtype=m.dtype))
    return out
