"""What `verify` is asked to do, and the one-line errors of a request that cannot run: torch-free, so a
bad request (or a missing target) is answered before the forwards (verify/run.py) import torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import require
from ..options import CHOICES, ReadOptions
from ..formats import registry


@dataclass
class Request:
    """What to verify: the target, what it is compared with, on which tokens, in which dtype."""
    target: str
    reference: Optional[str] = None  # a checkpoint or Hugging Face directory (None: the target's merged state)
    reference_logits: Optional[str] = None  # "FILE[:KEY]" of recorded tokens and logits
    opts: ReadOptions = field(default_factory=ReadOptions)
    dtype: str = "fp32"  # one of CHOICES["compute_dtype"] (run.COMPUTE_DTYPES: the torch dtypes)
    tolerance: Optional[float] = None
    # tokens, tokenizer, batch, seq_len (None: inputs.default_seq_len), seed
    token_args: tuple = (None, None, 2, None, 0)
    tp: Optional[int] = None  # torch_dist targets under torchrun: the layout to run
    pp: Optional[int] = None
    vpp: Optional[int] = None


def check_request(target, reference, reference_logits, dtype: str) -> None:
    """The one-line errors of a request that cannot run, before anything is read; then the target's own
    (a path that does not exist or holds no checkpoint ckptool knows: the format table's error)."""
    require(target is not None, "give the checkpoint to verify", "ckptool verify TARGET [--reference REF]")
    require(not (reference and reference_logits), "give --reference or --reference-logits, not both")
    allowed = CHOICES["compute_dtype"]
    require(dtype in allowed, f"unknown compute dtype {dtype!r}", f"choose one of {', '.join(allowed)}")
    registry.source_format(target)
