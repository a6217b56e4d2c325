"""megatron-core's optimizer state in a torch_dist checkpoint as inspect shows it, without torch.

The model-space forms (formats/dcp/optim.py: the non-distributed optimizer's, and the distributed
optimizer's fully_reshardable) keep one DCP tensor per parameter and slot under
`optimizer.state.<stored slot>.<model key>`, with the weight's global shape: the DCP index gives every
slot's shapes and dtypes, the common state the param groups, the step (`state.common_step` or each
group's `step`, a plain number or a 0-d tensor read as a Scalar), the grad scaler and the scheduler.
Groups are tied as the full reader ties them: each canonical tensor joins the one group whose traits
(megatron_groups.GROUP_TRAITS: weight decay, --decoupled-lr) are its own.

The flat per-bucket dp_reshardable form (the default since megatron-core 0.15), where each parameter
sits by the grad-buffer layout, is read by formats/dcp/quick_buckets.py: each rank's layout checked against
its stored bucket sizes, as the full reader checks it.

A ChainedOptimizer's entries ({0: dense, 1: expert} of an MoE model at EP > 1, one tensor prefix for
both) are tied per part as dist_optim.tie_groups ties them (_tie_chain).

A chain of flat buckets (dp_reshardable at EP > 1) is checked per optimizer by formats/dcp/quick_buckets.py and
tied the same way.

NotQuick (the full reader answers, with its warning or error) for other chains, optimizer
tensors without an optimizer entry, the gathered dp_zero_gather_scatter form, the N-D flattened
fully_sharded_model_space, groups the traits do not tell apart, and any slot that does not cover
exactly the model's weights with their shapes in one dtype.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from ...errors import CkptError
from ..megatron.groups import GroupRule, canonical_traits, groups_by_traits, merge_groups
from ...spec import spec_for
from ...state import OptimizerState, ParamGroup
from . import quick_buckets as dist_buckets
from ...quick.meta import TensorMeta
from ...quick.torch_pickle import NotQuick, Scalar

PREFIX = "optimizer.state."
NON_DISTRIBUTED = "non-distributed"
# param_state_sharding_type -> stored slot name of each canonical slot (the model-space forms read here;
# formats/dist_optim.STORED_SLOTS has them all)
STORED_SLOTS = {
    NON_DISTRIBUTED: {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_reshardable": {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}


def training_state(common: dict, stored: Dict[str, TensorMeta], model_keys: Dict[str, TensorMeta],
                   weights: Dict[str, TensorMeta], args, tied_head: Optional[str], cfg=None,
                   objects: Optional[Callable[[str], object]] = None) -> Optional[OptimizerState]:
    """stored: every DCP tensor entry (key -> TensorMeta); model_keys: the weights' DCP keys; weights:
    the canonical tensors; tied_head: the DCP key of a tied model's output-layer copy (not a slot of its
    own); cfg and objects (dist_buckets.object_reader) for the dp_reshardable form. None where the
    checkpoint holds no optimizer state."""
    opt = common.get("optimizer")
    if not isinstance(opt, dict):
        if any(k.startswith(PREFIX) or ".optimizer." in k for k in stored):
            raise NotQuick("optimizer tensors without an optimizer entry")  # the full reader's warning
        return None
    chain = _chain(opt, args, cfg)
    opt = chain[0]  # the dense optimizer's entry holds the form, the grad scaler
    forms = {part.get("param_state_sharding_type") or NON_DISTRIBUTED for part in chain}
    if len(forms) != 1:
        raise NotQuick("a chained optimizer of several forms")  # the full reader's error
    form = opt.get("param_state_sharding_type") or NON_DISTRIBUTED
    if form == dist_buckets.FORM and cfg is not None and objects is not None:
        return _flat_buckets(common, stored, weights, args, cfg, objects, len(chain))
    if form not in STORED_SLOTS:
        raise NotQuick(f"the {form} form")
    want = {k: t for k, t in model_keys.items() if k != tied_head}
    slots = {}
    for slot, name in STORED_SLOTS[form].items():
        prefix = f"{PREFIX}{name}."
        have = {k[len(prefix):]: t for k, t in stored.items() if k.startswith(prefix)}
        have.pop(tied_head, None)
        if not have:
            continue  # fp32 non-distributed training keeps no masters apart
        if have.keys() != want.keys() or any(t.shape != want[k].shape for k, t in have.items()):
            raise NotQuick(f"{name} does not cover the model's weights")
        dtypes = {t.dtype for t in have.values()}
        if len(dtypes) != 1:
            raise NotQuick(f"{name} in several dtypes")
        dtype = dtypes.pop()
        slots[slot] = {n: TensorMeta(w.shape, dtype) for n, w in weights.items()}
    if "exp_avg" not in slots or "exp_avg_sq" not in slots:
        raise NotQuick("no Adam moments")
    step, hypers = _chain_scalars(chain)
    rule = GroupRule.from_args(args)
    groups = _tie_groups(hypers[0], weights, rule) if len(chain) == 1 else _tie_chain(hypers, weights, rule, cfg)
    return OptimizerState(kind=f"megatron-core-dist ({form})", slots=slots, step=step,
                          param_groups=groups,
                          grad_scaler=opt.get("grad_scaler"), scheduler=common.get("opt_param_scheduler"),
                          consumed_samples=getattr(args, "consumed_train_samples", None))


def _chain(opt: dict, args, cfg) -> list:
    """[the one optimizer's entry], or a ChainedOptimizer's [dense, expert] entries (stored under 0 and 1)
    of an MoE model at EP > 1, as dist_optim.parts / unsupported_chain take them."""
    keys = sorted(k for k in opt if isinstance(k, int))
    if not keys:
        return [opt]
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    if keys != [0, 1] or ep == 1 or cfg is None or cfg.moe is None or not all(isinstance(opt[k], dict) for k in keys):
        raise NotQuick("a chained optimizer other than megatron-core's [dense, expert]")
    return [opt[0], opt[1]]


def _tie_chain(hypers: List[List[dict]], weights: Dict[str, TensorMeta], rule: GroupRule, cfg) -> List[ParamGroup]:
    """dist_optim.tie_groups of a [dense, expert] chain: each canonical tensor joins the group of its own
    optimizer (the experts the second: the spec names them) whose traits are its own; an expert group and
    its dense twin are one canonical group (megatron_groups.merge_groups)."""
    try:
        canonical, local = merge_groups({(0,): [h for part in hypers for h in part]}, "quick")
    except CkptError:
        raise NotQuick("groups that do not merge") from None
    spec = spec_for(cfg)
    is_expert = {n: spec.match(n, cfg)[2] is not None for n in weights}
    names: List[List[str]] = [[] for _ in canonical]
    offset = 0
    for n, part in enumerate(hypers):
        if {h["is_expert_parallel"] for h in part if "is_expert_parallel" in h} - {n == 1}:
            raise NotQuick("a chain out of megatron-core's order")  # the full reader's error
        mine = [name for name in weights if is_expert[name] == (n == 1)]
        group_of = groups_by_traits([canonical_traits(m, weights[m].shape, rule) for m in mine], part, rule) \
            if mine and len(part) > 1 else [0] * len(mine)
        if group_of is None or mine and not part:
            raise NotQuick("a parameter fits no group, or several")
        for m, g in zip(mine, group_of):
            names[local[(0,)][offset + g]].append(m)
        offset += len(part)
    return [ParamGroup(ns, dict(h)) for ns, h in zip(names, canonical)]


def _flat_buckets(common: dict, stored: Dict[str, TensorMeta], weights: Dict[str, TensorMeta], args, cfg,
                  objects, chained: int) -> OptimizerState:
    """The dp_reshardable form (formats/dcp/quick_buckets.py): every slot of every weight in the flat buckets'
    dtype, the groups and step from each optimizer's per-rank object (dist_optim_buckets.read_scalars), a
    [dense, expert] chain's tied per part (_tie_chain)."""
    entries, dtype = dist_buckets.read(stored, objects, cfg, args, weights)
    if len(entries) != chained:
        raise NotQuick("a chain the common state and the buffers count differently")  # the full reader's error
    step, hypers = _chain_scalars(entries)
    rule = GroupRule.from_args(args)
    groups = _tie_groups(hypers[0], weights, rule) if len(entries) == 1 else _tie_chain(hypers, weights, rule, cfg)
    slots = {slot: {n: TensorMeta(w.shape, dtype) for n, w in weights.items()} for slot in STORED_SLOTS[NON_DISTRIBUTED]}
    return OptimizerState(kind=f"megatron-core-dist ({dist_buckets.FORM})", slots=slots, step=step,
                          param_groups=groups, grad_scaler=entries[0].get("grad_scaler"),
                          scheduler=common.get("opt_param_scheduler"),
                          consumed_samples=getattr(args, "consumed_train_samples", None))


def _number(v) -> Optional[float]:
    if isinstance(v, Scalar):
        if v.value is None:
            raise NotQuick("a step whose value is not in the pickle")
        return float(v.value)
    if isinstance(v, TensorMeta):
        raise NotQuick("a step tensor that is not a scalar")
    return float(v) if type(v) in (int, float) else None


def _chain_scalars(opts: List[dict]):
    """(step, per optimizer its group hyperparameters) of a chain, as dist_optim.read_scalars takes them: the
    steps of every optimizer together (one without parameters, an expert optimizer of a stage without MoE
    layers, stores none), exactly one."""
    steps, hypers = set(), []
    for opt in opts:
        torch_state = opt["optimizer"] if isinstance(opt.get("optimizer"), dict) else opt
        groups, state = torch_state.get("param_groups"), torch_state.get("state")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise NotQuick("no param_groups")
        steps |= {_number(state["common_step"])} if isinstance(state, dict) and "common_step" in state else set()
        steps |= {_number(g["step"]) for g in groups if g.get("step") is not None}
        hypers.append([{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups])
    steps.discard(None)
    if len(steps) != 1:
        raise NotQuick("no step count, or several")
    return int(steps.pop()), hypers


def _tie_groups(hypers, weights: Dict[str, TensorMeta], rule: GroupRule):
    """dist_optim.tie_groups of one optimizer: one group holds everything; else each canonical tensor
    joins the one group whose traits are its own."""
    if len(hypers) == 1:
        return [ParamGroup(list(weights), dict(hypers[0]))]
    group_of = groups_by_traits([canonical_traits(n, w.shape, rule) for n, w in weights.items()], hypers, rule)
    if group_of is None:
        raise NotQuick("groups the traits do not tell apart")  # the full reader's error
    return [ParamGroup([n for n, g in zip(weights, group_of) if g == i], dict(h)) for i, h in enumerate(hypers)]
