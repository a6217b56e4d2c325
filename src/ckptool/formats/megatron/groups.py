"""Megatron's optimizer param groups: which group a parameter is in, and which stored groups are one
canonical group.

Torch-free, so the quick inspect (formats/megatron/quick_optim.py, formats/megatron/quick_distopt.py, formats/dcp/quick_optim.py) and the
full readers (megatron/optim.py, megatron/distopt.py, dcp/optim.py, megatron/training.py) decide by one
table. GROUP_TRAITS: how a parameter and a stored group each show the traits megatron-core keys its
groups by (weight decay, --decoupled-lr); a parameter joins the one group whose traits are its own.
merge_groups: a stored group's identity is its GROUP_IDENTITY values (the keys megatron-core tells groups
apart by) and, where a run has no wd_mult, its weight decay; a dense group and its expert-parallel copy
are one canonical group.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import CkptError
from ...spec import GPT

HINT = "pass --no-optimizer to convert the weights only"

# Where each era of the torch format keeps the torch state, the fp32 masters and the loss scaler.
MIXED_FORMS = (
    ("optimizer", "fp32_from_fp16_params", "grad_scaler"),  # Megatron-LM 2020-11 .. today
    ("optimizer_state_dict", "fp32_from_fp16", "loss_scaler"),  # 2019-2020 FP16_Optimizer
)
MOMENTS = ("exp_avg", "exp_avg_sq")
NO_WEIGHT_DECAY_KEYS = ("wd_mult", "weight_decay")  # a group with either at 0 holds biases and norms
# megatron-core sets is_embedding_or_output_parameter on the word embedding and the output layer (the
# last stage's copy of a tied embedding included): the parameters --decoupled-lr applies to
EMBEDDING_OR_OUTPUT_ROLES = frozenset(GPT.with_trait("embedding_or_output"))  # the spec's role trait
# the role of each canonical name outside the layers (the spec's table), so a canonical tensor shows
# the traits its parameter had
ROLE_OF_GLOBAL_NAME = {t.name: t.role for t in GPT.tensors if t.role is not None and not t.axes}


@dataclass(frozen=True)
class GroupRule:
    """The run's settings the group traits depend on: --decoupled-lr (from the args), if any."""
    decoupled_lr: Optional[float] = None

    @classmethod
    def from_args(cls, args) -> "GroupRule":
        return cls(getattr(args, "decoupled_lr", None))


def no_weight_decay(key: str, shape: Sequence[int]) -> bool:
    """Megatron's default rule (all eras): biases and 1-D parameters (norms) get no weight decay."""
    return key.endswith("bias") or len(shape) == 1


def expert_parallel(role: str, ep: int) -> bool:
    """megatron-core's is_expert_parallel: expert weights are kept out of the data-parallel all-reduce
    (allreduce=False), and so in the expert optimizer, only when expert parallelism is on (EP > 1)."""
    return ep > 1 and role.startswith("experts.")


def _group_no_wd(hyper: dict, rule: GroupRule) -> bool:
    return hyper["wd_mult"] == 0 if "wd_mult" in hyper else hyper.get("weight_decay") == 0


def _group_decoupled(hyper: dict, rule: GroupRule) -> bool:
    # megatron-core < 0.16 flags the group; 0.16 gives it the override max_lr = --decoupled-lr (and so
    # default_config False, which tells it apart even when --decoupled-lr equals --lr)
    return bool(hyper.get("is_decoupled_lr")) or (
        rule.decoupled_lr is not None and hyper.get("max_lr") == rule.decoupled_lr and hyper.get("default_config") is False)


# Each trait of megatron-core's group key that a checkpoint lets ckptool decide: (name, for a parameter:
# key, role, shape, rule; for a stored group: hyperparameters, rule). is_expert_parallel is not here: it
# picks the optimizer of a chained pair, not a group within one. lr_mult has no rule a checkpoint records
# (a run's own scale-lr condition or config override): a group with lr_mult != 1 is tied only where
# these traits single it out.
GROUP_TRAITS = (
    ("no_weight_decay", lambda key, role, shape, rule: no_weight_decay(key, shape), _group_no_wd),
    ("decoupled_lr", lambda key, role, shape, rule: rule.decoupled_lr is not None and role in EMBEDDING_OR_OUTPUT_ROLES,
     _group_decoupled),
)


def traits_of(key: str, role: str, shape: Sequence[int], rule: GroupRule) -> Tuple[bool, ...]:
    """A parameter's traits (GROUP_TRAITS order): its key in the rank file, its role, its shape."""
    return tuple(of_param(key, role, tuple(shape), rule) for _, of_param, _ in GROUP_TRAITS)


def canonical_traits(name: str, shape: Sequence[int], rule: GroupRule) -> Tuple[bool, ...]:
    """A canonical tensor's traits: its parameter's (a fused QKV weight is 2-D as q, k and v are, a
    bias stays a bias; the word embedding and the output layer keep their roles)."""
    return traits_of(name, ROLE_OF_GLOBAL_NAME.get(name, ""), shape, rule)


def group_traits(hyper: dict, rule: GroupRule) -> Tuple[bool, ...]:
    """A stored group's traits (GROUP_TRAITS order), from its hyperparameters."""
    return tuple(of_group(hyper, rule) for _, _, of_group in GROUP_TRAITS)


def groups_by_traits(traits: Sequence[Tuple[bool, ...]], hypers: List[dict], rule: GroupRule,
                     counts: Optional[Sequence[int]] = None) -> Optional[List[int]]:
    """Each parameter's group (traits: each parameter's traits_of): the one group (non-empty, where
    counts are known) whose traits equal its own; None when a parameter fits no group or several."""
    wanted = [group_traits(h, rule) for h in hypers]
    out = []
    for mine in traits:
        fits = [g for g, t in enumerate(wanted) if t == mine and (counts is None or counts[g])]
        if len(fits) != 1:
            return None
        out.append(fits[0])
    return out
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
