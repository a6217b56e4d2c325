"""Megatron's optimizer state in the torch format (the non-distributed optimizer): read and write.

Each rank file's `optimizer` entry holds the torch optimizer state of that rank's parameters
(shared/reference/megatron.md section 4):

  mixed precision (bf16 / fp16)  {'optimizer': {'state', 'param_groups'}, 'fp32_from_fp16_params':
                                  [[fp32 master per param] per group], 'grad_scaler' (fp16 only)}
  2019-2020 fp16 optimizer       {'optimizer_state_dict', 'fp32_from_fp16', 'loss_scaler', ...}
  fp32 training                  {'state', 'param_groups'} (the torch state dict itself)

torch numbers the parameters 0, 1, 2... group after group; nothing in the file names them. Megatron
builds its groups from model.named_parameters() of each model chunk in turn (chunk 0 first under
virtual pipelining), putting biases and 1-D parameters (norms) in a no-weight-decay group and the rest
in a weight-decay group; every era does so, only the group order and extra groups differ. named_parameters()
runs in module registration order, which is also the order of the rank file's model state dict, so
a source is tied by its own file's key order and a target by the dialect's PARAM_ORDER (our writer
emits model keys in that same order). Ties are checked, not trusted: group sizes, every slot's shape,
and each fp32 master cast to the model dtype equals the stored weight bit for bit (checked as the
master is read).

Groups beyond that pair are data too: megatron-core keys each group by (wd_mult, lr_mult,
is_expert_parallel, is_decoupled_lr) and, since 0.16, by the config override that made it (max_lr /
min_lr for --decoupled-lr); megatron_groups.GROUP_TRAITS says how a parameter and a stored group each show a trait. A
source's groups become canonical groups (one per group identity, megatron_groups.GROUP_IDENTITY: expert-parallel and
dense copies of a group are one canonical group), each with the canonical names of its parameters; a
target rank's groups are re-formed from them by the rule megatron-core applies at the target layout
(target_groups). With expert parallelism (EP > 1) megatron-core runs a ChainedOptimizer: each rank file's
`optimizer` is the list [dense optimizer's state dict, expert optimizer's], the second holding the
rank's LOCAL experts in parameter order; expert_parallel() says which parameters the second holds.

This module only ties slots to (role, layer) pieces of one rank; roles.assemble() merges them across
TP and EP ranks with the same table as the weights (experts by their global index). With expert TP !=
TP a file's expert slots are its expert-TP shard, as its expert weights are (each file is one rank's
own optimizer.state_dict()); megatron_training.slot_shards gathers them by megatron.expert_grid.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...errors import CkptError
from ...spec.schema import HEAD_COPY
from ...lazy import Const, LazyTensor
from ...masters import checked_master
from ...state import OPTIMIZER_SLOTS, ParamGroup
# The group rules are torch-free (megatron_groups, shared with the quick inspect); their names stay here too.
from .groups import (HINT, MIXED_FORMS, MOMENTS, NO_WEIGHT_DECAY_KEYS, GroupRule, expert_parallel,
                              traits_of)
from . import groups as megatron_groups

# the trait table's names, as they were known here before it moved
GROUP_TRAITS, EMBEDDING_OR_OUTPUT_ROLES = megatron_groups.GROUP_TRAITS, megatron_groups.EMBEDDING_OR_OUTPUT_ROLES
group_traits = megatron_groups.group_traits
CANONICAL_EXPERT = re.compile(r"^layers\.\d+\.mlp\.experts\.\d+\.")  # state.py's expert names


@dataclass
class RankParam:
    """One parameter of one rank file, in the order Megatron built its optimizer groups."""
    key: str
    role: str
    layer: Optional[int]  # global layer index; None for embeddings, final norm, output
    weight: LazyTensor
    chunk: int = 0  # virtual-pipeline model chunk (each has its own grad buffers)


def role_shards(values: Dict[Tuple[int, int], List[LazyTensor]], params: Dict[Tuple[int, int], List[RankParam]],
                 tp: int):
    """{(role, layer): [value per TP rank]} from per-rank lists aligned with params; and the last
    stage's copy of the tied embedding (role head_copy), kept apart."""
    shards: Dict[Tuple[str, Optional[int]], List[Optional[LazyTensor]]] = defaultdict(lambda: [None] * tp)
    head_copy = None
    for rk in sorted(params):  # expert-parallel ranks in order: the dense part is taken from EP rank 0
        t = rk[0]
        for param, value in zip(params[rk], values[rk]):
            if param.role == HEAD_COPY:
                head_copy = head_copy if head_copy is not None else value
            elif shards[(param.role, param.layer)][t] is None:
                shards[(param.role, param.layer)][t] = value
    return shards, head_copy


def no_weight_decay(key: str, weight: LazyTensor) -> bool:
    """Megatron's default rule (all eras): biases and 1-D parameters (norms) get no weight decay."""
    return megatron_groups.no_weight_decay(key, weight.shape)


def param_traits(param: "RankParam", rule: GroupRule) -> Tuple[bool, ...]:
    return traits_of(param.key, param.role, tuple(param.weight.shape), rule)


@dataclass
class RankOptimizer:
    """One rank's optimizer state tied to its parameters."""
    slots: List[Dict[str, LazyTensor]]  # per RankParam: slot name -> lazy tensor
    group_of: List[int]  # per RankParam: index into hypers
    hypers: List[dict]  # per group: hyperparameters as stored (without 'params')
    step: Optional[int]
    grad_scaler: Optional[dict]


def unsupported_form(tree: dict, ep: int = 1) -> Optional[str]:
    """Why this rank's optimizer state cannot be carried (a valid form ckptool does not read yet)."""
    opt = tree.get("optimizer")
    if isinstance(opt, list) and (len(opt) != 2 or ep == 1):
        # megatron-core chains [dense, expert] at EP > 1; other chains (e.g. the first model chunk's own
        # optimizer with --overlap-param-gather-with-optimizer-step) are not tied yet
        return f"a chained optimizer of {len(opt)} optimizers at EP {ep} is not carried yet"
    return None


def read_rank(tree: dict, params: List[RankParam], where: str, rule: GroupRule = GroupRule(),
              ep: int = 1) -> Optional[RankOptimizer]:
    """Tie one rank file's optimizer state to its parameters; None when the file has none, or an
    optimizer that never stepped (torch keeps no state before the first step). A chained optimizer
    (EP > 1: [dense, expert]) ties each part to its own parameters; the result lists the dense
    optimizer's groups, then the expert optimizer's."""
    opt = tree.get("optimizer")
    if opt is None:
        return None
    parts = [opt] if not isinstance(opt, list) else opt
    members = [list(range(len(params)))] if not isinstance(opt, list) else chain_members(params, ep)
    tied = [_read_one(part, [params[i] for i in idx], f"{where}" + (f" (chained optimizer {n})" if len(parts) > 1 else ""),
                      rule) for n, (part, idx) in enumerate(zip(parts, members))]
    return join_chain(tied, members, len(params), where)


def chain_members(params: List[RankParam], ep: int) -> List[List[int]]:
    """The parameters (indices into params) of each optimizer of megatron-core's chain [dense, expert]."""
    return [[i for i, p in enumerate(params) if expert_parallel(p.role, ep) == is_expert] for is_expert in (False, True)]


def join_chain(tied: List[Optional[RankOptimizer]], members: List[List[int]], n: int, where: str
               ) -> Optional[RankOptimizer]:
    """One rank's RankOptimizer from the chain's parts (each tied to its members): the dense optimizer's
    groups, then the expert optimizer's; None when none stepped."""
    if all(r is None for r in tied):
        return None
    slots: List[Dict[str, LazyTensor]] = [dict() for _ in range(n)]
    group_of, hypers, steps = [0] * n, [], set()
    for r, idx in zip(tied, members):
        if r is None:  # one optimizer stepped, the other not: the files do not belong together
            if idx:
                raise CkptError(f"{where}: one optimizer of the chain holds no state, the other does", HINT)
            continue
        for j, i in enumerate(idx):
            slots[i], group_of[i] = r.slots[j], len(hypers) + r.group_of[j]
        hypers += r.hypers
        steps |= {r.step} if r.step is not None else set()
    if len(steps) > 1:
        raise CkptError(f"{where}: the chained optimizers were stepped {sorted(steps)} times", HINT)
    return RankOptimizer(slots, group_of, hypers, steps.pop() if steps else None, tied[0].grad_scaler if tied[0] else None)


def _read_one(opt, params: List[RankParam], where: str, rule: GroupRule) -> Optional[RankOptimizer]:
    """One optimizer's state dict tied to its parameters (in Megatron's order)."""
    if not isinstance(opt, dict):
        raise CkptError(f"{where}: 'optimizer' is a {type(opt).__name__}, not a state dict", HINT)
    torch_state, masters, scaler = _split_form(opt, where)
    groups = torch_state.get("param_groups")
    state = torch_state.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CkptError(f"{where}: optimizer state without param_groups/state", HINT)
    if not state:  # never stepped: no moments yet, masters equal the weights; a fresh optimizer is the same
        return None
    members = _tie_groups(groups, params, where, rule)
    if masters is not None:
        if len(masters) != len(groups) or any(len(m) != len(g["params"]) for m, g in zip(masters, groups)):
            raise CkptError(f"{where}: fp32 master groups {[len(m) for m in masters]} do not match the "
                            f"optimizer's groups {[len(g['params']) for g in groups]}", HINT)
    slots: List[Dict[str, LazyTensor]] = [dict() for _ in params]
    group_of = [0] * len(params)
    steps = set()
    for g, (group, member) in enumerate(zip(groups, members)):
        for j, (idx, pi) in enumerate(zip(group["params"], member)):
            param = params[pi]
            group_of[pi] = g
            entry = state.get(idx)
            if entry is None:
                raise CkptError(f"{where}: no optimizer state for {param.key} (parameter {idx})", HINT)
            for slot in MOMENTS:
                slots[pi][slot] = _checked_shape(entry.get(slot), param, slot, where)
            if "step" in entry:
                s = entry["step"]
                steps.add(int(s.load().item()) if isinstance(s, LazyTensor) else int(s))
            if masters is not None:
                master = _checked_shape(masters[g][j], param, "fp32 master", where)
                slots[pi]["master"] = master_matching_weight(master, param, where)
    if len(steps) > 1:
        raise CkptError(f"{where}: parameters were stepped {sorted(steps)} times", HINT)
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return RankOptimizer(slots, group_of, hypers, steps.pop() if steps else None, scaler)


def _split_form(opt: dict, where: str):
    for state_key, master_key, scaler_key in MIXED_FORMS:
        if state_key in opt and master_key in opt:
            return opt[state_key], opt[master_key], opt.get(scaler_key)
    if "state" in opt and "param_groups" in opt:
        return opt, None, None
    raise CkptError(f"{where}: unknown optimizer layout (keys {sorted(map(str, opt))[:6]})", HINT)


def _tie_groups(groups: List[dict], params: List[RankParam], where: str, rule: GroupRule) -> List[List[int]]:
    """For each optimizer group, the indices (into params) of its parameters, in order: each parameter
    joins the one group whose traits (GROUP_TRAITS) equal its own; empty groups (megatron-core >= 0.16
    gives every rank every group) join nothing."""
    counts = [len(g.get("params", ())) for g in groups]
    if len(groups) == 1 and counts[0] == len(params):
        return [list(range(len(params)))]
    group_of = groups_by_traits(params, groups, rule, counts)
    if group_of is not None:
        members: List[List[int]] = [[] for _ in groups]
        for i, g in enumerate(group_of):
            members[g].append(i)
        if [len(m) for m in members] == counts:
            return members
    legacy = _tie_by_sizes(groups, params, counts)  # eras whose groups differ in nothing the traits see
    if legacy is not None:
        return legacy
    decay = sum(not no_weight_decay(p.key, p.weight) for p in params)
    lr_mult = sorted({g.get("lr_mult") for g in groups} - {None, 1.0, 1})
    why = (f"lr_mult {lr_mult} groups whose members no rule in the checkpoint names (a run's own scale-lr "
           "condition) cannot be tied" if lr_mult else
           "the groups are not megatron-core's weight-decay / --decoupled-lr groups of these parameters")
    raise CkptError(f"{where}: optimizer groups hold {counts} parameters, but the model has "
                    f"{decay} with and {len(params) - decay} without weight decay: {why}", HINT)


def groups_by_traits(params: List[RankParam], hypers: List[dict], rule: GroupRule,
                     counts: Optional[Sequence[int]] = None) -> Optional[List[int]]:
    """Each parameter's group: the one group (non-empty, where counts are known) whose traits equal its
    own (megatron_groups.groups_by_traits); None when a parameter fits no group or several."""
    return megatron_groups.groups_by_traits([param_traits(p, rule) for p in params], hypers, rule, counts)


def _tie_by_sizes(groups: List[dict], params: List[RankParam], counts: List[int]) -> Optional[List[List[int]]]:
    """Two groups told apart by their sizes alone (older eras, e.g. --weight-decay 0 with no wd_mult)."""
    if len(groups) != 2 or any("wd_mult" in g for g in groups):
        return None
    decay = [i for i, p in enumerate(params) if not no_weight_decay(p.key, p.weight)]
    no_decay = [i for i, p in enumerate(params) if no_weight_decay(p.key, p.weight)]
    zero_wd = [any(g.get(k) == 0 for k in NO_WEIGHT_DECAY_KEYS) for g in groups]
    fits = [order for order in ((decay, no_decay), (no_decay, decay)) if [len(x) for x in order] == counts]
    if len(fits) == 2:  # equal sizes: the group without weight decay holds the biases and norms
        fits = [fits[1]] if zero_wd[0] and not zero_wd[1] else [fits[0]]
    return [list(x) for x in fits[0]] if fits else None


def _checked_shape(t, param: RankParam, what: str, where: str) -> LazyTensor:
    if not isinstance(t, LazyTensor):
        raise CkptError(f"{where}: {what} of {param.key} is missing", HINT)
    if tuple(t.shape) != tuple(param.weight.shape):
        raise CkptError(f"{where}: {what} of {param.key} has shape {tuple(t.shape)}, the weight "
                        f"{tuple(param.weight.shape)}: the optimizer state does not belong to this model", HINT)
    return t


def master_matching_weight(master: LazyTensor, param: RankParam, where: str,
                           cause: str = "the optimizer state is mis-tied or from another step") -> LazyTensor:
    """master, checked as it loads: cast to the weight's dtype it must equal the weight bit for bit
    (Megatron copies masters into the model after every step; in fp32 training they are the same
    values), or the tie is wrong (cause says how, in the message)."""
    return checked_master(master, param.weight, f"{where}: the fp32 master of {param.key} does not round to "
                          f"its stored weight: {cause}", HINT)


# --- writing --------------------------------------------------------------------------------

def group_index(groups: List[ParamGroup], names: List[str], key: str, weight_shape) -> int:
    """Which of the source's groups a target parameter joins: the group holding its canonical
    names, else (a source without names) Megatron's weight-decay rule."""
    for i, g in enumerate(groups):
        if names[0] in g.names:
            return i
    wants_zero = len(weight_shape) == 1 or key.endswith("bias")
    for i, g in enumerate(groups):
        is_zero = any(g.hyper.get(k) == 0 for k in NO_WEIGHT_DECAY_KEYS)
        if is_zero == wants_zero:
            return i
    return 0


def target_groups(groups: List[ParamGroup], ep: int) -> List[List[int]]:
    """The canonical groups each optimizer of a target rank lists, in order: [dense] or, at EP > 1 with
    experts, [dense, expert] (megatron-core's ChainedOptimizer). As megatron-core >= 0.16 builds them,
    every rank lists every group of its optimizer, empty or not (its _get_param_groups aligns the groups
    over all ranks), so a group is in the dense optimizer when any non-expert-parallel parameter of
    the model holds it, in the expert optimizer when any expert-parallel one does."""
    def held(g: ParamGroup, expert: bool) -> bool:
        if not g.names:  # a source without names: the group is one of the dense pair
            return not expert
        return any((ep > 1 and CANONICAL_EXPERT.match(n) is not None) == expert for n in g.names)

    dense = [i for i, g in enumerate(groups) if held(g, False)]
    experts = [i for i, g in enumerate(groups) if held(g, True)]
    return [dense, experts] if experts else [dense]


def rank_state(entries: List[Tuple[int, bool, Dict[str, LazyTensor]]], groups: List[ParamGroup],
               optimizers: List[List[int]], step: int, mixed: bool, grad_scaler: Optional[dict]):
    """The `optimizer` entry of one target rank file: one optimizer's state dict, or the list of a
    ChainedOptimizer's (len(optimizers) == 2: [dense, expert]). entries: (canonical group, expert-parallel?,
    slots) per parameter in the target model's parameter order; slots holds master (mixed precision),
    exp_avg and exp_avg_sq. optimizers: target_groups()."""
    chained = len(optimizers) > 1
    states = [_optimizer_state([(g, slots) for g, is_expert, slots in entries if is_expert == (n == 1)],
                               groups, ids, step, mixed, grad_scaler, chained and n == 1 if chained else None)
              for n, ids in enumerate(optimizers)]
    return states if chained else states[0]


def _optimizer_state(entries: List[Tuple[int, Dict[str, LazyTensor]]], groups: List[ParamGroup], ids: List[int],
                     step: int, mixed: bool, grad_scaler: Optional[dict], is_expert: Optional[bool]) -> dict:
    by_group: Dict[int, List[Dict[str, LazyTensor]]] = {g: [] for g in ids}
    for g, slots in entries:
        if g not in by_group:
            raise CkptError(f"a target parameter's optimizer group {groups[g].hyper} is not one of its "
                            "optimizer's groups", HINT)
        by_group[g].append(slots)
    state, param_groups, masters, idx = {}, [], [], 0
    for g in ids:
        params = []
        for slots in by_group[g]:
            state[idx] = {"step": Const(torch.tensor(float(step))), "exp_avg": slots["exp_avg"],
                          "exp_avg_sq": slots["exp_avg_sq"]}
            params.append(idx)
            idx += 1
        hyper = dict(groups[g].hyper)
        if is_expert is not None or "is_expert_parallel" in hyper:  # the target layout decides it
            hyper["is_expert_parallel"] = bool(is_expert)
        param_groups.append(dict(hyper, params=params))
        if mixed:
            masters.append([slots["master"] for slots in by_group[g]])
    torch_state = {"state": state, "param_groups": param_groups}
    if not mixed:
        return torch_state
    out = {"optimizer": torch_state}
    if grad_scaler is not None:
        out["grad_scaler"] = grad_scaler
    out["fp32_from_fp16_params"] = masters
    return out


assert set(MOMENTS) | {"master"} == set(OPTIMIZER_SLOTS)
