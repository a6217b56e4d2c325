"""The last pipeline stage's copies of a tied module (Megatron-DeepSpeed's embedding), checked against the first's.

DeepSpeed's pipeline engine holds a TiedLayerSpec module on every stage that uses it: Megatron-DeepSpeed's
EmbeddingPipe on the first stage (the embedding) and on the last (the LM head, `_logits_helper`, which
multiplies by `word_embeddings_weight` only). The engine ties only the attributes named by
`tied_weight_attr` (`word_embeddings_weight`): their gradients are all-reduced between the stages and the
first stage's copy is broadcast to the others on load. So the last stage's word embeddings track the first
stage's, while its position embeddings take no part in the forward and go stale in its optimizer
(deepspeed.md 8). The merged read keeps the first stage's copy and says, once per tensor, where the last
stage's disagrees and whether that matters.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional

import torch

from ...lazy import Derived, LazyTensor

# tied key -> what the last stage's copy means for the forward (the word embeddings' line is the default)
CONSEQUENCE = {
    "position_embeddings.weight": "the first stage adds its positions, and the last stage's copy is not used by the "
                                  "forward (DeepSpeed ties only the word embeddings between stages; the LM head "
                                  "multiplies by those alone), so this does not change the logits",
}
WORD_CONSEQUENCE = ("the last stage multiplied by its own copy for the logits in training (DeepSpeed broadcasts the "
                    "first stage's to it only when it loads the 16-bit weights), so logits computed from these "
                    "tensors can differ from what the framework computed")
WEIGHTS = "weights"  # the slot name of the model's weights (optimizer slots are named by deepspeed_optim)


class TiedCopies:
    """One warning line per tied tensor whose last-stage copy differs, whatever the TP ranks and the
    optimizer slots it differs in: the line is written on the first difference and rewritten in place
    as more are found (the checks run as tensors load, possibly on reader threads)."""

    def __init__(self, sink: List[str]):
        self.sink = sink
        self.found: Dict[str, Dict[str, object]] = {}  # key -> {"ranks": set, "diffs": {slot: diff}, "line": str}
        self.lock = threading.Lock()

    def checked(self, key: str, t: int, owner: LazyTensor, copy: Optional[LazyTensor], slot: Optional[str]) -> LazyTensor:
        """owner (the first stage's, TP rank t), checked on load against the last stage's copy."""
        if copy is None:
            return owner

        def check(a, b):
            if not torch.equal(a, b):
                self.add(key, t, slot or WEIGHTS, (a.float() - b.float()).abs().max().item())
            return a
        return Derived(check, [owner, copy], memo=True, shape=owner.shape, dtype=owner.dtype)

    def add(self, key: str, t: int, slot: str, diff: float) -> None:
        with self.lock:
            seen = self.found.setdefault(key, {"ranks": set(), "diffs": {}, "line": None})
            seen["ranks"].add(t)
            seen["diffs"][slot] = max(diff, seen["diffs"].get(slot, 0.0))
            line = self.line(key, seen["ranks"], seen["diffs"])
            if seen["line"] in self.sink:
                self.sink[self.sink.index(seen["line"])] = line
            else:
                self.sink.append(line)
            seen["line"] = line

    @staticmethod
    def line(key: str, ranks, diffs: Dict[str, float]) -> str:
        where = ", ".join(f"{slot} {d:.3g}" for slot, d in diffs.items())
        return (f"tied {key}: the last pipeline stage's copy differs from the first stage's on TP rank"
                f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))} (max abs diff: {where}); "
                f"using the first stage's: {CONSEQUENCE.get(key, WORD_CONSEQUENCE)}")
