"""The check that ties an optimizer's fp32 master to its model weight.

Megatron (and DeepSpeed) copy the fp32 masters into the 16-bit model after every step, so a master
cast to the weight's dtype equals the stored weight bit for bit; where it does not, the optimizer
state was tied to the wrong parameter or comes from another step. Readers wrap every master in
`checked_master`: the check runs as the master loads (lazy.Checked), on whatever part of it a
target takes, against the same part of the weight.
"""
from __future__ import annotations

import torch

from .errors import CkptError
from .io.buffers import empty
from .lazy import Checked, LazyTensor


def rounds_to(master: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether master cast to weight's dtype equals weight bit for bit (shapes must match). The cast
    goes into recycled memory (io/buffers.py): a fresh weight-sized tensor per parameter costs a page
    fault per 4 KiB, more than the cast itself. One cast and one compare per tensor, not per block:
    each is a parallel region of torch's thread pool, and on a loaded host every region waits for its
    slowest thread (measured on the 2-core box: 1M-element blocks made the check 2-4x slower)."""
    if master.shape != weight.shape:
        return False
    cast = empty(master.shape, weight.dtype)
    cast.copy_(master)
    return torch.equal(cast, weight)


def checked_master(master: LazyTensor, weight: LazyTensor, error: str, hint: str) -> LazyTensor:
    """master, checked against weight as it loads (see the module's docstring); a master that does not
    round to its weight fails the load with CkptError(error, hint)."""
    def check(m: torch.Tensor, w: torch.Tensor) -> None:
        if not rounds_to(m, w):
            raise CkptError(error, hint)

    return Checked(master, check, [weight])
