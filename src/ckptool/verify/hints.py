"""Hints a FAILed verify adds about how a side was read (Report.hints, printed before result=FAIL)."""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:  # torch-free at import: the command imports this module before it needs torch
    from ..state import Checkpoint


def weights_hint(ckpt: Checkpoint, reference_is_own_merge: bool) -> List[str]:
    """For a DeepSpeed target read with its fp32 masters (the default where optimizer shards exist) that also
    keeps its 16-bit module weights: the framework's forward (and the logits it records) runs those 16-bit
    weights, one 16-bit rounding from the masters, so --weights model is what reproduces it. Nothing when the
    reference is the target's own merged view: it was read with the same weights."""
    src = ckpt.source
    if reference_is_own_merge or src.format != "deepspeed" or src.extra.get("weights") != "master" \
            or "model" not in src.extra.get("weights_held", ()):
        return []
    return [f"hint: {src.path} was read with its fp32 master weights (--weights master, the default where "
            "optimizer shards exist), but the framework's forward runs the 16-bit module weights, one 16-bit "
            "rounding away: rerun with --weights model to compare with what the framework computed"]
