"""verl's FSDP optimizer files: optim_world_size_{N}_rank_{R}.pt beside the model's rank files.

verl's FSDPCheckpointManager.save_checkpoint (volcengine/verl b178a3c verl/utils/checkpoint/fsdp_checkpoint_manager.py)
has every rank torch.save its `optimizer.state_dict()`; under FSDP2 get_fsdp_state_ctx is a no-op, so that is torch's
own form: `{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{hyperparameters..., "params":
[index...]}]}`, the moments DTensors sharded like their parameters (Shard(0) over the N ranks), indices counting the
parameters in the order the optimizer was given them: verl builds it as build_optimizer(actor_module_fsdp.parameters())
(verl/workers/fsdp_workers.py, verl/workers/config/optimizer.py), i.e. named_parameters() order, which is the model
state dict's order without a tied head's second name (fsdp.py _parameter_names). That order is checked, not
assumed: the index count must equal the parameter count and every moment must have its parameter's global shape;
otherwise the state is dropped with a warning saying which check failed. Only AdamW's state is carried (master =
the fp32 weight, which FSDP2 steps); any other optimizer is dropped with a warning naming its state.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ...errors import require
from ...io.dtensor import DTensorShard
from ...io.torchfile import load_torch_file
from ...lazy import LazyTensor
from ...state import OptimizerState
from ..dcp.fsdp import ADAM_STATE, MOMENTS, groups_by_hyper
from .files import OPTIM_FILE

HINT = "the optimizer files do not belong to these model files"


def _files(d: Path, world: int) -> List[dict]:
    states = []
    for rank in range(world):
        f = d / OPTIM_FILE.format(world=world, rank=rank)
        require(f.is_file(), f"{d}: {f.name} is missing (optimizer files of {world} ranks expected)", HINT)
        s = load_torch_file(f)
        require(isinstance(s, dict) and isinstance(s.get("state"), dict) and isinstance(s.get("param_groups"), list),
                f"{f}: not a torch optimizer state_dict ({{state, param_groups}})", HINT)
        states.append(s)
    return states


def _why_not(states: List[dict], names: List[str], weights: Dict[str, LazyTensor]) -> Optional[str]:
    """Why the optimizer's parameter indices cannot be tied to names (None: they can)."""
    first = states[0]
    indices = [i for g in first["param_groups"] for i in g.get("params", [])]
    if sorted(indices) != list(range(len(names))):
        return f"its param groups list {len(indices)} parameters, the model has {len(names)}"
    kinds = {k for st in first["state"].values() if isinstance(st, dict) for k in st}
    if kinds - set(ADAM_STATE) or not set(MOMENTS) <= kinds:
        return f"its per-parameter state {sorted(kinds)} is not AdamW's ({', '.join(ADAM_STATE)})"
    for i, name in enumerate(names):
        for moment in MOMENTS:
            t = first["state"].get(i, {}).get(moment)
            shape = tuple(t.global_shape) if isinstance(t, DTensorShard) else tuple(getattr(t, "shape", ()))
            if shape != tuple(weights[name].shape):
                return f"parameter {i}'s {moment} has shape {shape}, not that of {name} {tuple(weights[name].shape)}"
    return None


def read(d: Path, world: int, names: List[str], named: Dict[str, LazyTensor], canonical: Callable,
         tensors: Dict[str, LazyTensor], whole: Callable, warn: Callable[[str], None]) -> Optional[OptimizerState]:
    """The AdamW state of d's optimizer files as canonical slots. names: the model's parameters (HF names) in the
    optimizer's order; named: the HF-named full weights; canonical maps {HF name: tensor} to {canonical name:
    tensor}; whole(name, per-rank pieces, where) puts a DTensor together as the weights are."""
    states = _files(d, world)
    why = _why_not(states, names, named)
    if why:
        warn(f"optimizer state dropped: verl's {OPTIM_FILE.format(world=world, rank='R')} cannot be tied to the "
             f"model's parameters ({why}); the output holds the weights only")
        return None
    slots = {"master": {n: t.to(torch.float32) for n, t in tensors.items()}}
    for moment in MOMENTS:
        by_name = {name: whole(f"{name} ({moment})", [s["state"][i][moment] for s in states], str(d))
                   for i, name in enumerate(names)}
        slots[moment] = canonical(by_name)
        require(set(slots[moment]) == set(tensors), f"{d}: the {moment} state maps onto other tensors than the "
                "weights", HINT)
    steps = {int(s["state"][i]["step"].load().item()) for s in states for i in range(len(names))}
    require(len(steps) == 1, f"{d}: the parameters' AdamW steps differ ({sorted(steps)[:4]})", HINT)
    hyper = {names[i]: {k: v for k, v in g.items() if k != "params"}
             for g in states[0]["param_groups"] for i in g["params"]}
    moments = {name: named[name] for name in names}
    groups = groups_by_hyper(hyper, moments, canonical, list(tensors))
    return OptimizerState(kind="verl-fsdp-adamw", slots=slots, step=steps.pop(), param_groups=groups)
