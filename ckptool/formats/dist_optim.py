"""megatron-core's optimizer state in torch_dist checkpoints: read into slots, write the fully_reshardable form.

What megatron-core stores (checked against megatron-core 0.16 saves, tests/mcore_optim_dist_helper.py):
model-space forms keep one DCP tensor per parameter and slot, under the parameter's own key with its
global shape (stacked layers included), so the weights' key table reads them unchanged:

  form (common optimizer.param_state_sharding_type)    master key          moments
  non-distributed optimizer (no sharding type)          fp32_param          exp_avg, exp_avg_sq
  distributed, fully_reshardable                        param               exp_avg, exp_avg_sq
  distributed, fully_sharded_model_space (<= 0.14)      fp32_param          exp_avg, exp_avg_sq
                  (N-D flattened DP slices: dist_optim_flattened.py shows them in model shape)
  distributed, dp_reshardable (the default since 0.15)  flat per-bucket buffers (dist_optim_buckets.py)
  distributed, dp_zero_gather_scatter (deprecated)      per-rank object of DP-gathered buffers (same)

each as `optimizer.state.<stored slot>.<model key>`. The scalars live in the common state: the param
groups (hyperparameters without their parameter lists), the step (`state.common_step` for the
non-distributed optimizer, `step` in every group for the distributed one), the grad scaler, and beside
the optimizer the LR scheduler (`opt_param_scheduler`) and `content_metadata`, which tells a loading
Megatron-LM run which form to expect.

Groups carry no parameter names: they are tied by Megatron's default rule (biases and 1-D parameters
in the group without weight decay; megatron_optim.no_weight_decay), and refused when a source has
other groups (lr_mult, decoupled lr).

The writer emits the fully_reshardable form, which megatron-core loads at any TP/PP with the
distributed optimizer, plus `fp32_param` entries that alias the same bytes (one copy on disk), so a
run with the non-distributed optimizer loads the same checkpoint.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CkptError
from ..lazy import Const, Derived, LazyTensor
from ..state import OPTIMIZER_SLOTS, OptimizerState, ParamGroup
from .megatron_optim import HINT, NO_WEIGHT_DECAY_KEYS, no_weight_decay

PREFIX = "optimizer.state."
NON_DISTRIBUTED = "non-distributed"
# param_state_sharding_type -> stored slot name of each canonical slot (model-space forms only).
STORED_SLOTS = {
    NON_DISTRIBUTED: {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_reshardable": {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_sharded_model_space": {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
# The forms laid out like the grad buffers (dist_optim_buckets.py recomputes where each parameter
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
    opt = common.get("optimizer")
    if not isinstance(opt, dict):
        return None
    return opt.get("param_state_sharding_type") or NON_DISTRIBUTED


def chained_count(common: dict) -> int:
    """How many optimizers a ChainedOptimizer saved (0: one optimizer): it stores one entry per
    optimizer under its index."""
    opt = common.get("optimizer")
    return sum(1 for k in opt if isinstance(k, int)) if isinstance(opt, dict) else 0


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


def read_scalars(common: dict, where: str) -> Tuple[Optional[int], List[dict], Optional[dict]]:
    """(step, group hyperparameters without 'params'/'step', grad scaler)."""
    opt = common["optimizer"]
    torch_state = _torch_state(opt)
    groups = torch_state.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CkptError(f"{where}: the common state's optimizer has no param_groups", HINT)
    steps = set()
    state = torch_state.get("state")
    if isinstance(state, dict) and "common_step" in state:
        steps.add(_number(state["common_step"]))
    steps |= {_number(g["step"]) for g in groups if g.get("step") is not None}
    steps.discard(None)
    if len(steps) > 1:
        raise CkptError(f"{where}: the optimizer groups were stepped {sorted(steps)} times", HINT)
    hypers = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
    return (int(steps.pop()) if steps else None), hypers, opt.get("grad_scaler")


def tie_groups(hypers: List[dict], weights: Dict[str, LazyTensor], where: str) -> List[ParamGroup]:
    """Canonical names per group by Megatron's default rule (one group, or one with and one without
    weight decay); anything else is refused."""
    if len(hypers) == 1:
        return [ParamGroup(list(weights), dict(hypers[0]))]
    zero = [any(h.get(k) == 0 for k in NO_WEIGHT_DECAY_KEYS) for h in hypers]
    if len(hypers) == 2 and sum(zero) == 1:
        return [ParamGroup([n for n, w in weights.items() if no_weight_decay(n, w) == z], dict(h))
                for h, z in zip(hypers, zero)]
    raise CkptError(f"{where}: {len(hypers)} optimizer param groups ({sum(zero)} without weight decay); only "
                    "Megatron's default grouping (with / without weight decay) is carried", HINT)


def master_checked(master: LazyTensor, weight: LazyTensor, name: str, where: str) -> LazyTensor:
    """The fp32 master, checked as it loads: cast to the weight's dtype it equals the weight bit for bit."""
    if master.dtype == weight.dtype:
        return master

    def checked(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not torch.equal(m.to(w.dtype), w):
            raise CkptError(f"{where}: the fp32 master of {name} does not round to its stored weight: the "
                            "optimizer state belongs to another step or model", HINT)
        return m

    return Derived(checked, [master, weight], shape=master.shape, dtype=master.dtype)


def read(common: dict, form: str, slot_tensors: Callable[[str], Dict[str, LazyTensor]],
         weights: Dict[str, LazyTensor], consumed_samples: Optional[int], where: str) -> OptimizerState:
    """The optimizer state of a model-space form. slot_tensors(stored slot name) -> canonical name ->
    lazy full tensor (the weights' own key table applied to `optimizer.state.<stored slot>.` keys)."""
    step, hypers, scaler = read_scalars(common, where)
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
                          param_groups=tie_groups(hypers, weights, where), grad_scaler=scaler,
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


def common_entries(opt: OptimizerState, mixed: bool) -> dict:
    """The common-state entries megatron-core's optimizers read back: the distributed optimizer's
    (param groups with their step, the sharding type) and the non-distributed one's (common_step;
    at fp32 its torch state sits at the top of the entry)."""
    groups = [dict(_with_identifiers(g.hyper), step=float(opt.step)) for g in opt.param_groups]
    torch_state = {"param_groups": groups, "state": {"common_step": Const(torch.tensor(float(opt.step)))}}
    entry = {"optimizer": torch_state, "param_state_sharding_type": WRITE_FORM}
    if not mixed:
        entry.update(param_groups=[dict(g) for g in groups], state=dict(torch_state["state"]))
    if opt.grad_scaler is not None:
        entry["grad_scaler"] = opt.grad_scaler
    out = {"optimizer": entry, "content_metadata": dict(CONTENT_METADATA)}
    if opt.scheduler is not None:
        out["opt_param_scheduler"] = opt.scheduler
    return out


assert all(set(m) == set(OPTIMIZER_SLOTS) for m in STORED_SLOTS.values())
