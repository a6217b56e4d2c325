"""Megatron's non-distributed optimizer state (each rank file's `optimizer` entry) as inspect shows it,
without torch: kind, step, slots and their dtypes, bytes, and the canonical param groups with the
number of canonical tensors each holds.

The full reader (formats/megatron/optim.py, megatron/training.py) ties every stored slot to its
parameter and merges the slots like the weights; inspect only shows what that tie implies, so here
the same decisions are taken on the pickle's shapes alone (quick/torch_pickle.py: moments and fp32
masters are TensorMeta records; Adam's 0-d `step` tensors are read as Scalars):

- each rank's parameters (its model keys in file order) join the one non-empty stored group whose
  traits (no weight decay: a bias or 1-D; --decoupled-lr: word embedding / output layer) are theirs,
  or the single group that holds them all, and the group sizes must come out as stored;
- every slot tensor (exp_avg, exp_avg_sq, fp32 master) has its parameter's shape, every parameter
  its state entry, and all parameters of all ranks the same step;
- stored groups merge into canonical groups by megatron_groups.GROUP_IDENTITY, copies agreeing on lr
  and weight_decay; a canonical group's tensors are the canonical tensors with its traits (a
  parameter and its canonical parts have the same traits: a fused QKV weight is 2-D as q, k and v
  are, a bias stays a bias).

The distributed optimizer's ranks (distrib_optim.pt: formats/megatron/quick_distopt.py) join their groups
by the same traits; at EP > 1 megatron-core's [dense, expert] chain part by part (each part's members
by their traits, as a chain in the rank files), a part saved in another file of the stage found where
megatron_buffers.chain_sources says. Anything this cannot decide the way the full reader does (groups told apart by
sizes alone, lr_mult groups, chains other than megatron-core's [dense, expert] at EP > 1, mixed slot dtypes) raises NotQuick and the full
reader answers. The trait rules are the full reader's own table (megatron_groups.GROUP_TRAITS,
torch-free); the tests compare both paths' output on real Megatron-LM saves.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ...errors import CkptError
from .groups import (MIXED_FORMS, MOMENTS, GroupRule, canonical_traits, expert_parallel,
                                       group_traits, groups_by_traits, merge_groups, traits_of)
from ...state import OPTIMIZER_SLOTS, OptimizerState, ParamGroup
from .buffers import chain_sources
from .quick_distopt import chain_states, rank_state
from ...quick.meta import TensorMeta
from ...quick.torch_pickle import NotQuick, Scalar



@dataclass(frozen=True)
class Param:
    """One parameter of one rank file, in the order Megatron built its optimizer groups."""
    key: str
    role: str
    shape: Tuple[int, ...]
    chunk: int = 0  # virtual-pipeline model chunk (each has its own grad buffer)


@dataclass
class _Rank:
    group_of: List[int]
    hypers: List[dict]
    step: Optional[int]
    scaler: object
    dtypes: Dict[str, set]
    single_group: bool


def _traits(params: List[Param], rule: GroupRule) -> List[Tuple[bool, ...]]:
    return [traits_of(p.key, p.role, p.shape, rule) for p in params]


def training_state(trees: Dict[tuple, dict], params: Dict[tuple, List[Param]], args,
                   weights: Dict[str, TensorMeta], distrib: Dict[tuple, object],
                   tied: bool, ep: int = 1, etp: Optional[int] = None) -> Optional[OptimizerState]:
    """The OptimizerState the full reader would build (slots as TensorMeta of the weights' shapes), None
    where no rank's optimizer ever stepped; NotQuick where only the full reader can say. trees, params,
    distrib: per rank (tp, pp) or (tp, pp, ep); distrib: each rank's distrib_optim.pt
    (formats/megatron/quick_distopt.py), None where the rank has none; ep: the expert-parallel size (at EP > 1
    an MoE rank's entry is megatron-core's chained [dense, expert] list), etp the expert TP size (where a
    chain's distributed parts are saved: megatron_buffers.chain_sources; default TP)."""
    if not any("optimizer" in t for t in trees.values()):
        return None
    rule = GroupRule.from_args(args)
    has_file = {distrib.get(rk) is not None for rk in trees}
    distributed = has_file == {True} or bool(getattr(args, "use_distributed_optimizer", False))
    if len(has_file) > 1 or distributed and has_file != {True}:
        raise NotQuick("distrib_optim.pt beside some rank files only")  # the full reader's error
    tp, pp = (max(rk[i] for rk in trees) + 1 for i in range(2))

    def sources(rk) -> list:  # the files holding a chain's [dense, expert] distributed parts for rank rk
        return [distrib.get((t, rk[1], e)) for t, e in chain_sources(rk[0], rk[2], tp, ep, etp or tp)]
    per_rank = {rk: _dist_rank(trees[rk], distrib[rk], params[rk], args, tied, pp, rk[1], rule, ep,
                               sources(rk) if len(rk) == 3 else [])
                if distributed else _rank(trees[rk], params[rk], rule, ep) for rk in sorted(trees)}
    if all(r is None for r in per_rank.values()):
        return None
    if any(r is None for r in per_rank.values()):
        raise NotQuick("some ranks never stepped")  # the full reader's error
    steps = {r.step for r in per_rank.values()}
    slot_names = [s for s in OPTIMIZER_SLOTS if all(s in r.dtypes for r in per_rank.values())]
    dtypes = {s: set().union(*(r.dtypes[s] for r in per_rank.values())) for s in slot_names}
    if len(steps) != 1 or any(len(d) != 1 for d in dtypes.values()):
        raise NotQuick("ranks stepped differently, or a slot of several dtypes")
    hypers = _canonical_groups(per_rank)
    names = _group_names(hypers, per_rank, weights, rule)
    first = trees[min(trees)]
    slots = {s: {n: TensorMeta(t.shape, next(iter(dtypes[s]))) for n, t in weights.items()} for s in slot_names}
    kind = "megatron-distributed" if distributed else "megatron" if "master" in slots else "megatron-fp32"
    return OptimizerState(kind=kind, slots=slots, step=steps.pop(),
                          param_groups=[ParamGroup(n, h) for n, h in zip(names, hypers)],
                          grad_scaler=per_rank[min(per_rank)].scaler,
                          scheduler=first.get("opt_param_scheduler", first.get("lr_scheduler")),
                          consumed_samples=getattr(args, "consumed_train_samples", None))


def _split_form(opt):
    if not isinstance(opt, dict):
        raise NotQuick("a chained or unknown optimizer entry")
    for state_key, master_key, scaler_key in MIXED_FORMS:
        if state_key in opt and master_key in opt:
            return opt[state_key], opt[master_key], opt.get(scaler_key)
    if "state" in opt and "param_groups" in opt:
        return opt, None, None
    raise NotQuick("unknown optimizer layout")


def _rank(tree: dict, params: List[Param], rule: GroupRule, ep: int = 1) -> Optional[_Rank]:
    """One rank's optimizer tied to its parameters, as megatron_optim.read_rank ties it: a chained
    [dense, expert] optimizer (EP > 1) each part to its own parameters (megatron_optim.chain_members),
    the dense part's groups first (megatron_optim.join_chain)."""
    opt = tree.get("optimizer")
    if opt is None:
        return None
    if not isinstance(opt, list):
        return _rank_part(opt, params, rule)
    if len(opt) != 2 or ep == 1:
        raise NotQuick("a chain other than megatron-core's [dense, expert]")  # the full reader's warning
    members = _chain_members(params, ep)
    # each part's groups tied by their traits even where a part has one group (the expert part often has:
    # experts have no 1-D weights), so every canonical group's tensors are told apart by traits below
    return _join_chain([_rank_part(part, [params[i] for i in idx], rule, by_traits=True)
                        for part, idx in zip(opt, members)], members, len(params))


def _chain_members(params: List[Param], ep: int) -> List[List[int]]:
    """megatron_optim.chain_members: the parameters (indices) of the chain's dense and expert optimizers."""
    return [[i for i, p in enumerate(params) if expert_parallel(p.role, ep) == is_expert] for is_expert in (False, True)]


def _join_chain(parts: List[Optional[_Rank]], members: List[List[int]], n: int) -> Optional[_Rank]:
    """One rank's _Rank from the chain's parts, each tied to its members (megatron_optim.join_chain): the dense
    optimizer's groups first; None when none stepped."""
    if all(r is None for r in parts):
        return None
    if any(r is None and idx for r, idx in zip(parts, members)):
        raise NotQuick("one optimizer of the chain stepped, the other not")  # the full reader's error
    group_of, hypers, steps, dtypes = [0] * n, [], set(), defaultdict(set)
    for r, idx in zip(parts, members):
        if r is None:
            continue
        for j, i in enumerate(idx):
            group_of[i] = len(hypers) + r.group_of[j]
        hypers += r.hypers
        steps |= {r.step} if r.step is not None else set()
        for slot, ds in r.dtypes.items():
            dtypes[slot] |= ds
    if len(steps) > 1 or len({frozenset(r.dtypes) for r in parts if r is not None}) > 1:
        raise NotQuick("the chained optimizers stepped differently or keep other slots")
    return _Rank(group_of, hypers, steps.pop() if steps else None, parts[0].scaler if parts[0] else None,
                 dict(dtypes), False)


def _rank_part(opt, params: List[Param], rule: GroupRule, by_traits: bool = False) -> Optional[_Rank]:
    """One optimizer's state dict tied to its parameters (megatron_optim._read_one); by_traits: a single
    group too only where every parameter's traits are the group's."""
    torch_state, masters, scaler = _split_form(opt)
    groups, state = torch_state.get("param_groups"), torch_state.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(isinstance(g, dict) for g in groups):
        raise NotQuick("optimizer state without param_groups/state")
    if not state:
        return None  # never stepped
    counts = [len(g.get("params", ())) for g in groups]
    single = not by_traits and len(groups) == 1 and counts[0] == len(params)
    members = [list(range(len(params)))] if single else _tie_by_traits(groups, params, counts, rule)
    if masters is not None and (not isinstance(masters, list) or len(masters) != len(groups)
                                or any(len(m) != n for m, n in zip(masters, counts))):
        raise NotQuick("fp32 master groups do not match the optimizer's groups")
    group_of, steps, dtypes = [0] * len(params), set(), defaultdict(set)
    for g, (group, member) in enumerate(zip(groups, members)):
        for j, (idx, pi) in enumerate(zip(group["params"], member)):
            group_of[pi] = g
            entry = state.get(idx)
            if not isinstance(entry, dict):
                raise NotQuick(f"no optimizer state for parameter {idx}")
            values = [(slot, entry.get(slot)) for slot in MOMENTS]
            if masters is not None:
                values.append(("master", masters[g][j]))
            for slot, t in values:
                if not isinstance(t, TensorMeta) or t.shape != params[pi].shape:
                    raise NotQuick(f"{slot} of {params[pi].key} is missing or of another shape")
                dtypes[slot].add(t.dtype)
            if "step" in entry:
                steps.add(_step(entry["step"]))
    if len(steps) > 1:
        raise NotQuick("parameters stepped differently")
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return _Rank(group_of, hypers, steps.pop() if steps else None, scaler, dict(dtypes), single)


def _dist_rank(tree: dict, state, params: List[Param], args, tied: bool, pp: int, pp_rank: int,
               rule: GroupRule, ep: int = 1, sources: Optional[list] = None) -> Optional[_Rank]:
    """One rank's distributed optimizer (megatron_distopt.read_rank): its groups hold no parameter
    lists, so each parameter joins the one group whose traits are its own (group_by_rule); megatron-core's
    [dense, expert] chain (EP > 1) part by part, each part's members by their traits even where it has one
    group (as _rank ties a chain), then joined."""
    if isinstance(tree.get("optimizer"), list):
        members = _chain_members(params, ep)
        found = chain_states(tree, state, sources or [None, None], params, members, args, tied, pp, pp_rank, ep)
        return _join_chain([None if f is None else _tied(f, [params[i] for i in idx], rule, by_traits=True)
                            for f, idx in zip(found, members)], members, len(params))
    found = rank_state(tree, state, params, args, tied, pp, pp_rank)
    return None if found is None else _tied(found, params, rule)


def _tied(found, params: List[Param], rule: GroupRule, by_traits: bool = False) -> _Rank:
    """A distributed optimizer's (hypers, step, scaler, dtypes) with each parameter in its group."""
    hypers, step, scaler, dtypes = found
    if len(hypers) == 1 and not by_traits:
        return _Rank([0] * len(params), hypers, step, scaler, dtypes, True)
    group_of = groups_by_traits(_traits(params, rule), hypers, rule)
    if group_of is None:
        raise NotQuick("a parameter fits no group, or several")
    return _Rank(group_of, hypers, step, scaler, dtypes, False)


def _step(value) -> int:
    if isinstance(value, Scalar) and value.value is not None:
        return int(value.value)
    if type(value) in (int, float):
        return int(value)
    raise NotQuick("a step whose value is not in the pickle")


def _tie_by_traits(groups: List[dict], params: List[Param], counts: List[int], rule: GroupRule) -> List[List[int]]:
    group_of = groups_by_traits(_traits(params, rule), groups, rule, counts)
    if group_of is None:
        raise NotQuick("a parameter fits no stored group, or several")
    members: List[List[int]] = [[] for _ in groups]
    for i, g in enumerate(group_of):
        members[g].append(i)
    if [len(m) for m in members] != counts:
        raise NotQuick("groups not tied by their traits")  # sizes alone, or lr_mult groups: the full reader's
    return members


def _canonical_groups(per_rank: Dict[tuple, _Rank]) -> List[dict]:
    """The canonical groups by the full reader's rule (megatron_groups.merge_groups)."""
    try:
        return merge_groups({rk: r.hypers for rk, r in per_rank.items()}, "quick")[0]
    except CkptError:
        raise NotQuick("groups differ across ranks") from None


def _group_names(hypers: List[dict], per_rank: Dict[tuple, _Rank], weights: Dict[str, TensorMeta],
                 rule: GroupRule) -> List[List[str]]:
    """The canonical tensors of each canonical group: all of them for a single group, else those whose
    traits are the group's (each canonical group's traits must be its own)."""
    if len(hypers) == 1:
        return [list(weights)]
    traits = [group_traits(h, rule) for h in hypers]
    if len(set(traits)) != len(traits) or any(r.single_group for r in per_rank.values()):
        raise NotQuick("canonical groups not told apart by their traits")
    names: List[List[str]] = [[] for _ in hypers]
    for n, t in weights.items():
        mine = canonical_traits(n, t.shape, rule)
        if mine not in traits:
            raise NotQuick(f"{n} fits no group")
        names[traits.index(mine)].append(n)
    return names
