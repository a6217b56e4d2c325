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
from .lazy import Checked, LazyTensor

# elements compared per step: the master's block is cast into one reused buffer of this size (a few
# MiB, so it stays in the core's cache), not into a weight-sized temporary per parameter
BLOCK = 1 << 20


def rounds_to(master: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether master cast to weight's dtype equals weight bit for bit (shapes must match)."""
    if master.shape != weight.shape:
        return False
    if master.dim() == 0 or master.numel() <= BLOCK:
        return torch.equal(master.to(weight.dtype), weight)
    row = master[0].numel()
    rows = max(1, BLOCK // max(1, row))  # whole rows per step (a column slice is strided; rows keep it simple)
    buf = torch.empty(rows * row, dtype=weight.dtype)
    for first in range(0, master.shape[0], rows):
        n = min(rows, master.shape[0] - first)
        cast = buf[:n * row].view((n,) + tuple(master.shape[1:]))
        cast.copy_(master[first:first + n])
        if not torch.equal(cast, weight[first:first + n]):
            return False
    return True


def checked_master(master: LazyTensor, weight: LazyTensor, error: str, hint: str) -> LazyTensor:
    """master, checked against weight as it loads (see the module's docstring); a master that does not
    round to its weight fails the load with CkptError(error, hint)."""
    def check(m: torch.Tensor, w: torch.Tensor) -> None:
        if not rounds_to(m, w):
            raise CkptError(error, hint)

    return Checked(master, check, [weight])
