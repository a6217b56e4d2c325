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

This module only ties slots to (role, layer) pieces of one rank; roles.assemble() merges them across
TP ranks with the same table as the weights.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import CkptError
from ..lazy import Const, Derived, LazyTensor
from ..state import OPTIMIZER_SLOTS, ParamGroup

HINT = "pass --no-optimizer to convert the weights only"

# Where each era keeps the torch state, the fp32 masters and the loss scaler.
MIXED_FORMS = (
    ("optimizer", "fp32_from_fp16_params", "grad_scaler"),  # Megatron-LM 2020-11 .. today
    ("optimizer_state_dict", "fp32_from_fp16", "loss_scaler"),  # 2019-2020 FP16_Optimizer
)
MOMENTS = ("exp_avg", "exp_avg_sq")
NO_WEIGHT_DECAY_KEYS = ("wd_mult", "weight_decay")  # a group with either at 0 holds biases and norms


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
            if param.role == "head_copy":
                head_copy = head_copy if head_copy is not None else value
            elif shards[(param.role, param.layer)][t] is None:
                shards[(param.role, param.layer)][t] = value
    return shards, head_copy


def no_weight_decay(key: str, weight: LazyTensor) -> bool:
    """Megatron's default rule (all eras): biases and 1-D parameters (norms) get no weight decay."""
    return key.endswith("bias") or len(weight.shape) == 1


@dataclass
class RankOptimizer:
    """One rank's optimizer state tied to its parameters."""
    slots: List[Dict[str, LazyTensor]]  # per RankParam: slot name -> lazy tensor
    group_of: List[int]  # per RankParam: index into hypers
    hypers: List[dict]  # per group: hyperparameters as stored (without 'params')
    step: Optional[int]
    grad_scaler: Optional[dict]


def unsupported_form(tree: dict) -> Optional[str]:
    """Why this rank's optimizer state cannot be carried (a valid form ckptool does not read yet)."""
    opt = tree.get("optimizer")
    if isinstance(opt, list):
        return "a chained optimizer (several optimizer state dicts per rank) is not carried yet"
    return None


def read_rank(tree: dict, params: List[RankParam], where: str) -> Optional[RankOptimizer]:
    """Tie one rank file's optimizer state to its parameters; None when the file has none, or an
    optimizer that never stepped (torch keeps no state before the first step)."""
    opt = tree.get("optimizer")
    if opt is None:
        return None
    if not isinstance(opt, dict):
        raise CkptError(f"{where}: 'optimizer' is a {type(opt).__name__}, not a state dict", HINT)
    torch_state, masters, scaler = _split_form(opt, where)
    groups = torch_state.get("param_groups")
    state = torch_state.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CkptError(f"{where}: optimizer state without param_groups/state", HINT)
    if not state:  # never stepped: no moments yet, masters equal the weights; a fresh optimizer is the same
        return None
    members = _tie_groups(groups, params, where)
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


def _tie_groups(groups: List[dict], params: List[RankParam], where: str) -> List[List[int]]:
    """For each optimizer group, the indices (into params) of its parameters, in order."""
    counts = [len(g.get("params", ())) for g in groups]
    decay = [i for i, p in enumerate(params) if not no_weight_decay(p.key, p.weight)]
    no_decay = [i for i, p in enumerate(params) if no_weight_decay(p.key, p.weight)]
    if len(groups) == 1 and counts[0] == len(params):
        return [list(range(len(params)))]
    if len(groups) == 2:
        zero_wd = [any(g.get(k) == 0 for k in NO_WEIGHT_DECAY_KEYS) for g in groups]
        fits = [order for order in ((decay, no_decay), (no_decay, decay))
                if [len(x) for x in order] == counts]
        if len(fits) == 2:  # equal sizes: the group without weight decay holds the biases and norms
            fits = [fits[1]] if zero_wd[0] and not zero_wd[1] else [fits[0]]
        if fits:
            return [list(x) for x in fits[0]]
    raise CkptError(f"{where}: optimizer groups hold {counts} parameters, but the model has "
                    f"{len(decay)} with and {len(no_decay)} without weight decay "
                    "(extra groups such as --decoupled-lr or lr_mult are not carried yet)", HINT)


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
    def checked(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not torch.equal(m.to(w.dtype), w):
            raise CkptError(f"{where}: the fp32 master of {param.key} does not round to its stored "
                            f"weight: {cause}", HINT)
        return m

    return Derived(checked, [master, param.weight], shape=master.shape, dtype=master.dtype)


def merge_hypers(per_rank: List[List[dict]], where: str) -> List[dict]:
    """One list of group hyperparameters for the whole model (ranks must agree group by group)."""
    longest = max(per_rank, key=len)
    for hypers in per_rank:
        for h, ref in zip(hypers, longest):
            if h != ref and {k: h.get(k) for k in ("lr", "weight_decay")} != {k: ref.get(k) for k in ("lr", "weight_decay")}:
                raise CkptError(f"{where}: optimizer groups differ across ranks ({h} vs {ref})", HINT)
    return [dict(h) for h in longest]


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


def rank_state(entries: List[Tuple[int, Dict[str, LazyTensor]]], groups: List[ParamGroup], step: int,
               mixed: bool, grad_scaler: Optional[dict]) -> dict:
    """The `optimizer` entry of one target rank file. entries: (group, slots) per parameter in the
    target model's parameter order; slots holds master (mixed precision), exp_avg and exp_avg_sq."""
    by_group: Dict[int, List[Dict[str, LazyTensor]]] = {}
    for g, slots in entries:
        by_group.setdefault(g, []).append(slots)
    state, param_groups, masters, idx = {}, [], [], 0
    for g in sorted(by_group):  # Megatron builds only the groups a rank has parameters for
        ids = []
        for slots in by_group[g]:
            state[idx] = {"step": Const(torch.tensor(float(step))), "exp_avg": slots["exp_avg"],
                          "exp_avg_sq": slots["exp_avg_sq"]}
            ids.append(idx)
            idx += 1
        param_groups.append(dict(groups[g].hyper, params=ids))
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
