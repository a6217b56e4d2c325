"""Megatron's optimizer param groups as canonical groups: which stored groups are one group.

Torch-free, so the quick inspect (quick/optim.py) and the full readers (megatron_optim.py, dist_optim.py,
megatron_training.py) merge groups by one rule. A stored group's identity is its GROUP_IDENTITY values
(the keys megatron-core tells groups apart by) and, where a run has no wd_mult, its weight decay; a
dense group and its expert-parallel copy are one canonical group.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

from ..errors import CkptError

HINT = "pass --no-optimizer to convert the weights only"
GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr", "default_config")


def group_identity(hyper: dict) -> tuple:
    """Which canonical group a stored group is (see GROUP_IDENTITY)."""
    return tuple(hyper.get(k) for k in GROUP_IDENTITY) + (None if "wd_mult" in hyper else hyper.get("weight_decay"),)


def merge_groups(per_rank: Dict[tuple, List[dict]], where: str) -> Tuple[List[dict], Dict[tuple, List[int]]]:
    """The canonical groups of the whole model: one per group identity, in the order the ranks (in
    order) list them, a dense group before its expert-parallel copy; and, per rank, the canonical index
    of each of its groups. Copies of a group must agree on lr and weight_decay. Groups of one optimizer
    that look the same (older eras with --weight-decay 0: two groups with weight_decay 0) stay apart,
    by their position among their look-alikes."""
    canonical: List[dict] = []
    index: Dict[tuple, int] = {}
    local: Dict[tuple, List[int]] = {}
    for rk in sorted(per_rank):
        local[rk] = []
        seen: Dict[tuple, int] = defaultdict(int)
        for h in per_rank[rk]:
            same = (group_identity(h), h.get("is_expert_parallel"))
            ident = same[0] + (seen[same],)
            seen[same] += 1
            if ident not in index:
                index[ident] = len(canonical)
                canonical.append(dict(h))
            ref = canonical[index[ident]]
            if {k: h.get(k) for k in ("lr", "weight_decay")} != {k: ref.get(k) for k in ("lr", "weight_decay")}:
                raise CkptError(f"{where}: optimizer groups differ across ranks ({h} vs {ref})", HINT)
            local[rk].append(index[ident])
    return canonical, local
