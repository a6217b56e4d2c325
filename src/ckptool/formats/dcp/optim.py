"""megatron-core's optimizer state in torch_dist checkpoints: read into slots, write the fully_reshardable form.

What megatron-core stores (checked against megatron-core 0.16 saves, tests/mcore_optim_dist_helper.py):
model-space forms keep one DCP tensor per parameter and slot, under the parameter's own key with its
global shape (stacked layers included), so the weights' key table reads them unchanged:

  form (common optimizer.param_state_sharding_type)    master key          moments
  non-distributed optimizer (no sharding type)          fp32_param          exp_avg, exp_avg_sq
  distributed, fully_reshardable                        param               exp_avg, exp_avg_sq
  distributed, fully_sharded_model_space (<= 0.14)      fp32_param          exp_avg, exp_avg_sq
                  (N-D flattened DP slices: dcp/optim_flattened.py shows them in model shape)
  distributed, dp_reshardable (the default since 0.15)  flat per-bucket buffers (dcp/optim_buckets.py)
  distributed, dp_zero_gather_scatter (deprecated)      per-rank object of DP-gathered buffers (same)

each as `optimizer.state.<stored slot>.<model key>`, for parameters only: a module buffer among the weights
(the router's expert bias, roles.BUFFER_ROLES) has no optimizer state and no slot. The scalars live in the common state: the param
groups (hyperparameters without their parameter lists), the step (`state.common_step` for the
non-distributed optimizer, `step` in every group for the distributed one), the grad scaler, and beside
the optimizer the LR scheduler (`opt_param_scheduler`) and `content_metadata`, which tells a loading
Megatron-LM run which form to expect.

Groups carry no parameter names: each canonical tensor joins the group whose traits equal its own, by
the torch format's table (megatron_optim.GROUP_TRAITS: weight decay, --decoupled-lr); groups the traits
cannot tell apart are refused. At EP > 1 megatron-core's ChainedOptimizer [dense, expert] stores its
common entries as {0: ..., 1: ...}, the tensors of both under the one prefix above (no chained_N.
prefix in the model-space forms; the flat-buffer forms prefix each optimizer's per-rank keys chained_N.,
dist_optim_buckets.Part); the experts (megatron_optim.chain_members) tie to the second.

The writer emits the fully_reshardable form, which megatron-core loads at any TP/PP with the
distributed optimizer, plus `fp32_param` entries that alias the same bytes (one copy on disk), so a
run with the non-distributed optimizer loads the same checkpoint; its common entries follow the
target's EP (one optimizer, or the [dense, expert] chain: megatron_optim.target_groups).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...errors import CkptError
from ...lazy import Const, LazyTensor
from ...masters import checked_master
from ...state import OPTIMIZER_SLOTS, OptimizerState, ParamGroup
from ...roles import GLOBAL_ROLES, is_parameter
from ..megatron.distopt import group_by_rule
from ..megatron.groups import merge_groups
from ..megatron.optim import (CANONICAL_EXPERT, HINT, GroupRule, RankParam, chain_members,
                             target_groups)

PREFIX = "optimizer.state."
NON_DISTRIBUTED = "non-distributed"
# param_state_sharding_type -> stored slot name of each canonical slot (model-space forms only).
STORED_SLOTS = {
    NON_DISTRIBUTED: {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_reshardable": {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_sharded_model_space": {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
# The forms laid out like the grad buffers (dcp/optim_buckets.py recomputes where each parameter
# sits): flat per-bucket tensors, and (before 0.14 without --ckpt-fully-parallel-save) one object per
# model-parallel rank gathered over DP; same slot names.
FLAT_BUCKETS = "dp_reshardable"
GATHERED_BUFFERS = "dp_zero_gather_scatter"
BUFFER_FORMS = (FLAT_BUCKETS, GATHERED_BUFFERS)
for _form in BUFFER_FORMS:
    STORED_SLOTS[_form] = STORED_SLOTS["fully_reshardable"]
# Other forms that are not model space: why ckptool cannot carry them.
NOT_MODEL_SPACE = {
    "fully_sharded_bucket_space": "flat per-bucket shards (deprecated in megatron-core)",
    "fsdp_dtensor": "Megatron-FSDP DTensor state",
}
# The keys megatron-core's distributed optimizer matches a checkpoint's groups to its own by (a
# KeyError without them); sources that predate them (older Megatron-LM, DeepSpeed) get the values a
# default run has: wd_mult 0 exactly for the group without weight decay.
GROUP_IDENTIFIER_DEFAULTS = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
WRITE_FORM = "fully_reshardable"
CONTENT_METADATA = {"distrib_optim_sharding_type": WRITE_FORM, "distrib_optim_fully_reshardable_mem_efficient": False,
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def sharding_type(common: dict) -> Optional[str]:
    """The form of a checkpoint's optimizer state, from its common state (None: no optimizer)."""
    if not isinstance(common.get("optimizer"), dict):
        return None
    forms = {part.get("param_state_sharding_type") or NON_DISTRIBUTED for part in parts(common)}
    return forms.pop() if len(forms) == 1 else f"mixed ({', '.join(sorted(forms))})"


def chained_count(common: dict) -> int:
    """How many optimizers a ChainedOptimizer saved (0: one optimizer): it stores one entry per
    optimizer under its index."""
    opt = common.get("optimizer")
    return sum(1 for k in opt if isinstance(k, int)) if isinstance(opt, dict) else 0


def parts(common: dict) -> List[dict]:
    """The common-state entry of each optimizer: [the one optimizer's], or a ChainedOptimizer's in
    chain order ([dense, expert] at EP > 1)."""
    opt = common["optimizer"]
    if not chained_count(common):
        return [opt]
    return [opt[k] for k in sorted(k for k in opt if isinstance(k, int))]


def unsupported_chain(common: dict, ep: int) -> Optional[str]:
    """Why a chained optimizer cannot be tied (None: one optimizer, or megatron-core's [dense, expert]
    pair at EP > 1, which megatron_optim.chain_members splits by megatron-core's own rule)."""
    n = chained_count(common)
    if n and (n != 2 or ep == 1):
        return f"a chained optimizer of {n} optimizers at EP {ep}"
    return None


def _torch_state(opt: dict) -> dict:
    """The torch optimizer part of the common `optimizer` entry: nested under 'optimizer' for mixed
    precision and the distributed optimizer, the entry itself for fp32 non-distributed training."""
    inner = opt.get("optimizer")
    return inner if isinstance(inner, dict) else opt


def _number(v) -> Optional[float]:
    if isinstance(v, LazyTensor):
        return float(v.load().item())
    if isinstance(v, torch.Tensor):
        return float(v.item())
    return float(v) if isinstance(v, (int, float)) else None


def read_scalars(common: dict, where: str) -> Tuple[Optional[int], List[List[dict]], Optional[dict]]:
    """(step, per optimizer of the chain: its group hyperparameters without 'params'/'step', grad scaler)."""
    steps, hypers = set(), []
    for opt in parts(common):
        torch_state = _torch_state(opt)
        groups = torch_state.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CkptError(f"{where}: the common state's optimizer has no param_groups", HINT)
        state = torch_state.get("state")
        if isinstance(state, dict) and "common_step" in state:
            steps.add(_number(state["common_step"]))
        steps |= {_number(g["step"]) for g in groups if g.get("step") is not None}
        hypers.append([{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups])
    steps.discard(None)
    if len(steps) > 1:
        raise CkptError(f"{where}: the optimizer groups were stepped {sorted(steps)} times", HINT)
    return (int(steps.pop()) if steps else None), hypers, parts(common)[0].get("grad_scaler")


GLOBAL_ROLE_OF = {name: role for role, name in GLOBAL_ROLES.items()}


def canonical_params(weights: Dict[str, LazyTensor]) -> List[RankParam]:
    """The model's parameters as megatron_optim's group traits see them: the canonical name (biases end
    in 'bias' there too), the shape, and a role where a trait depends on it (the word embedding and
    output layer for --decoupled-lr, experts.* for the expert optimizer of a chain)."""
    def role(name: str) -> str:
        m = CANONICAL_EXPERT.match(name)
        return GLOBAL_ROLE_OF.get(name) or ("experts." + name[m.end():] if m else name)
    return [RankParam(n, role(n), None, w) for n, w in weights.items()]


def tie_groups(hypers: List[List[dict]], weights: Dict[str, LazyTensor], rule: GroupRule, ep: int,
               where: str) -> List[ParamGroup]:
    """Canonical names per canonical group. The stored groups list no parameters, so each parameter
    joins the group whose traits (megatron_optim.GROUP_TRAITS: weight decay, --decoupled-lr) equal its
    own, within its optimizer of the chain (megatron_optim.chain_members); an expert optimizer's group
    and its dense twin are one canonical group (megatron_groups.merge_groups), as the torch format reads them."""
    params = canonical_params(weights)
    members = [list(range(len(params)))] if len(hypers) == 1 else chain_members(params, ep)
    flat = [h for part in hypers for h in part]
    canonical, local = merge_groups({(0,): flat}, where)
    names: List[List[str]] = [[] for _ in canonical]
    offset = 0
    for n, (part, idx) in enumerate(zip(hypers, members)):
        mine = [params[i] for i in idx]
        at = where + (f" (chained optimizer {n})" if len(hypers) > 1 else "")
        flags = {h["is_expert_parallel"] for h in part if "is_expert_parallel" in h}
        if len(hypers) > 1 and flags - {n == 1}:  # a chain out of order, or not the [dense, expert] pair
            raise CkptError(f"{at}: its groups say is_expert_parallel {sorted(flags)}, but megatron-core's chain "
                            f"holds the {'expert' if n else 'dense'} optimizer there", HINT)
        for p, g in zip(mine, group_by_rule(mine, part, at, rule) if mine else []):
            names[local[(0,)][offset + g]].append(p.key)
        offset += len(part)
    return [ParamGroup(n, h) for n, h in zip(names, canonical)]


def master_checked(master: LazyTensor, weight: LazyTensor, name: str, where: str) -> LazyTensor:
    """The fp32 master, checked as it loads: cast to the weight's dtype it equals the weight bit for bit."""
    if master.dtype == weight.dtype:
        return master
    return checked_master(master, weight, f"{where}: the fp32 master of {name} does not round to its stored "
                          "weight: the optimizer state belongs to another step or model", HINT)


def read(common: dict, form: str, slot_tensors: Callable[[str], Dict[str, LazyTensor]],
         weights: Dict[str, LazyTensor], consumed_samples: Optional[int], where: str, rule: GroupRule = GroupRule(),
         ep: int = 1) -> OptimizerState:
    """The optimizer state of a model-space form. slot_tensors(stored slot name) -> canonical name ->
    lazy full tensor (the weights' own key table applied to `optimizer.state.<stored slot>.` keys; a
    chained optimizer's parts hold disjoint parameters under the same prefix). rule, ep: the source
    run's --decoupled-lr and expert-parallel size, which its groups and chain follow."""
    step, hypers, scaler = read_scalars(common, where)
    weights = {n: w for n, w in weights.items() if is_parameter(n)}  # module buffers have no optimizer state
    slots = {}
    for slot, stored in STORED_SLOTS[form].items():
        tensors = slot_tensors(stored)
        if not tensors:
            continue  # fp32 non-distributed training: the weights are the masters
        missing = [n for n in weights if n not in tensors]
        if missing:
            raise CkptError(f"{where}: no {stored} optimizer state for {', '.join(missing[:3])}", HINT)
        for n, t in tensors.items():
            if tuple(t.shape) != tuple(weights[n].shape):
                raise CkptError(f"{where}: {stored} of {n} has shape {tuple(t.shape)}, the weight "
                                f"{tuple(weights[n].shape)}", HINT)
        if slot == "master":
            tensors = {n: master_checked(t, weights[n], n, where) for n, t in tensors.items()}
        slots[slot] = {n: tensors[n] for n in weights}
    for slot in ("exp_avg", "exp_avg_sq"):
        if slot not in slots:
            raise CkptError(f"{where}: the optimizer state has no {slot} tensors", HINT)
    if step is None:
        raise CkptError(f"{where}: the optimizer state has no step count", HINT)
    return OptimizerState(kind=f"megatron-core-dist ({form})", slots=slots, step=step,
                          param_groups=tie_groups(hypers, weights, rule, ep, where), grad_scaler=scaler,
                          scheduler=common.get("opt_param_scheduler"), consumed_samples=consumed_samples)


# --- writing --------------------------------------------------------------------------------

def stored_keys(slot: str, model_key: str) -> List[str]:
    """The DCP keys one canonical slot of one parameter is written under (aliases share bytes)."""
    names = [STORED_SLOTS[WRITE_FORM][slot]]
    if slot == "master":
        names.append(STORED_SLOTS[NON_DISTRIBUTED]["master"])
    return [f"{PREFIX}{n}.{model_key}" for n in names]


def _with_identifiers(hyper: dict) -> dict:
    out = dict(GROUP_IDENTIFIER_DEFAULTS, **hyper)
    if "wd_mult" not in out:
        out["wd_mult"] = 0.0 if out.get("weight_decay") == 0 else 1.0
    return out


def common_entries(opt: OptimizerState, mixed: bool, ep: int = 1) -> dict:
    """The common-state entries megatron-core's optimizers read back: the distributed optimizer's
    (param groups with their step, the sharding type) and the non-distributed one's (common_step;
    at fp32 its torch state sits at the top of the entry). The groups are re-formed for the target as
    megatron-core forms them there (megatron_optim.target_groups): at EP > 1 with experts a
    ChainedOptimizer's entries {0: dense, 1: expert}, the expert groups flagged is_expert_parallel; so
    the optimizer part of the common state is for the target's EP (the tensors load at any layout)."""
    optimizers = target_groups(opt.param_groups, ep)
    chained = len(optimizers) > 1
    entries = [_entry(opt, ids, mixed, is_expert=chained and n == 1) for n, ids in enumerate(optimizers)]
    out = {"optimizer": dict(enumerate(entries)) if chained else entries[0], "content_metadata": dict(CONTENT_METADATA)}
    if opt.scheduler is not None:
        out["opt_param_scheduler"] = opt.scheduler
    return out


def _entry(opt: OptimizerState, ids: List[int], mixed: bool, is_expert: bool) -> dict:
    groups = [dict(_with_identifiers(opt.param_groups[i].hyper), step=float(opt.step), is_expert_parallel=is_expert)
              for i in ids]
    torch_state = {"param_groups": groups, "state": {"common_step": Const(torch.tensor(float(opt.step)))}}
    entry = {"optimizer": torch_state, "param_state_sharding_type": WRITE_FORM}
    if not mixed:
        entry.update(param_groups=[dict(g) for g in groups], state=dict(torch_state["state"]))
    if opt.grad_scaler is not None:
        entry["grad_scaler"] = opt.grad_scaler
    return entry


assert all(set(m) == set(OPTIMIZER_SLOTS) for m in STORED_SLOTS.values())
