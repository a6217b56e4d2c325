"""The optimizer state of Megatron-LM's --ckpt-format fsdp_dtensor (Megatron-FSDP's distributed optimizer).

What Megatron-LM saves (megatron-core 0.16.1 optimizer/distrib_optimizer.py sharded_param_state_fsdp_dtensor,
_param_name, _param_groups_to_param2group_meta; transformer/fsdp_dtensor_checkpoint.py handle_swiglu_in_state_dict;
Megatron-LM d98e8a64 training/checkpointing.py generate_state_dict / preprocess_fsdp_dtensor_state_dict, and its
tools/checkpoint/checkpoint_inspector.py, whose torch_dist -> fsdp_dtensor converter writes the same keys):
`{"state": {param name: the torch optimizer's state of it}, "param_to_group_meta": {param name: its param group
without "params"}}` under `optimizer`, which torch.distributed.checkpoint flattens to

    optimizer.state.<param name>.exp_avg | exp_avg_sq | step          (DTensors, each the parameter's shape)
    optimizer.param_to_group_meta.<param name>.<hyperparameter>       (byte entries)

The param name is the Megatron-FSDP wrapper's named_parameters() name of the model key (`module.module.module.`
before the GPTModel's own name in the converter; any number of `module.` wrappers is taken off here), experts under
their global index. A GLU fc1's moments are split into `_w` / `_v` halves like its weight, while its group meta
keeps the unsplit name. Megatron-FSDP's optimizer steps the very DTensors the model state dict holds
(param_and_grad_buffer.optimizer_named_parameters; megatron_fsdp.py _replace_param_with_distributed_if_needed),
so the fp32 master is the stored weight itself (made fp32 where it is not).

The state is read through the weights' own key table (torch_dist._collect) by presenting each slot under
`optimizer.state.<slot>.<model key>` (SlotView), the form the model-space optimizers use.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch

from ...errors import CkptError, require
from ...io.dcp_io import DcpDir
from ...io.torchfile import load_torch_bytes
from ...lazy import Derived, LazyTensor
from ...state import OptimizerState, ParamGroup
from ..deepspeed.optim import Tag, reaches
from ..megatron.optim import HINT

STATE = "optimizer.state."
GROUP_META = "optimizer.param_to_group_meta."
WRAPPER = "module."
MOMENTS = ("exp_avg", "exp_avg_sq")
KNOWN = MOMENTS + ("step",)
GLU_SUFFIXES = ("_w", "_v")  # handle_swiglu_in_state_dict's halves: the group meta keeps the unsplit name
KIND = "megatron-fsdp-dtensor"


def holds(dcp: DcpDir) -> bool:
    """Whether the DCP holds Megatron-FSDP's optimizer entries (its param_to_group_meta is its own)."""
    return any(k.startswith(GROUP_META) for k in dcp.entries)


def model_key(param_name: str) -> str:
    """The GPTModel's own key of a Megatron-FSDP parameter name (wrappers' `module.` prefixes off)."""
    while param_name.startswith(WRAPPER):
        param_name = param_name[len(WRAPPER):]
    return param_name


def _state_keys(dcp: DcpDir) -> Dict[str, Dict[str, str]]:
    """{slot: {model key: DCP key}} of the per-parameter state."""
    out: Dict[str, Dict[str, str]] = defaultdict(dict)
    for key in dcp.tensor_keys():
        if key.startswith(STATE):
            name, slot = key[len(STATE):].rsplit(".", 1)
            out[slot][model_key(name)] = key
    return dict(out)


class SlotView:
    """What torch_dist._collect reads of a DcpDir (tensor_keys, entries, lazy), with one slot's tensors under
    `optimizer.state.<slot>.<model key>`; tag=True hands out tracing Tags (one per stored key) instead of data."""

    def __init__(self, dcp: DcpDir, slot: str, stored: Dict[str, str], tag: bool = False):
        self.dcp, self.prefix = dcp, f"{STATE}{slot}."
        self.stored = {self.prefix + k: key for k, key in stored.items()}
        self.entries = {k: dcp.entries[key] for k, key in self.stored.items()}
        self.tags = {k: Tag(dcp.lazy(key)) for k, key in self.stored.items()} if tag else None

    def tensor_keys(self) -> List[str]:
        return list(self.stored)

    def lazy(self, key: str, offsets=(), sizes=None, squeeze: int = 0) -> LazyTensor:
        if self.tags is None:
            return self.dcp.lazy(self.stored[key], offsets, sizes, squeeze)
        t = self.tags[key]
        for dim, (o, s) in enumerate(zip(offsets, sizes or ())):
            t = t.narrow(dim, o, s)
        for _ in range(squeeze):
            t = Derived(lambda x: x.squeeze(0), [t], shape=t.shape[1:], dtype=t.dtype)
        return t


def read(dcp: DcpDir, weights: Dict[str, LazyTensor], canonical: Callable[[SlotView], Dict[str, LazyTensor]],
         where: str, warn: Callable[[str], None]) -> Optional[OptimizerState]:
    """The AdamW state as canonical slots; canonical(view) maps a SlotView through the weights' key table (the
    canonical name -> tensor of each parameter). Another optimizer's state is dropped with a warning naming it."""
    keys = _state_keys(dcp)
    other = sorted(set(keys) - set(KNOWN))
    if other or not all(m in keys for m in MOMENTS):
        warn(f"optimizer state dropped: Megatron-FSDP's per-parameter state {sorted(keys)} is not Adam's "
             f"({', '.join(KNOWN)}); the output holds the weights only")
        return None
    slots = {"master": {n: t.to(torch.float32) for n, t in weights.items()}}
    for moment in MOMENTS:
        got = canonical(SlotView(dcp, moment, keys[moment]))
        missing = [n for n in weights if n not in got]
        require(not missing, f"{where}: no {moment} optimizer state for {', '.join(missing[:3])}", HINT)
        for n, t in got.items():
            require(tuple(t.shape) == tuple(weights[n].shape), f"{where}: {moment} of {n} has shape "
                    f"{tuple(t.shape)}, the weight {tuple(weights[n].shape)}", HINT)
        slots[moment] = {n: got[n] for n in weights}
    metas = _group_metas(dcp, where)
    return OptimizerState(kind=KIND, slots=slots, step=_step(dcp, keys.get("step", {}), metas, where),
                          param_groups=_groups(dcp, keys[MOMENTS[0]], metas, canonical, list(weights), where))


def _group_metas(dcp: DcpDir, where: str) -> Dict[str, dict]:
    """{model key: its param group's hyperparameters} from the param_to_group_meta byte entries."""
    metas: Dict[str, dict] = defaultdict(dict)
    for key, entry in dcp.entries.items():
        if key.startswith(GROUP_META) and not hasattr(entry, "chunks"):
            name, hyper = key[len(GROUP_META):].rsplit(".", 1)
            metas[model_key(name)][hyper] = load_torch_bytes(dcp.read_bytes(key), source=f"{where}:{key}")
    return dict(metas)


def _meta_of(stored_key: str, metas: Dict[str, dict]) -> Optional[dict]:
    if stored_key in metas:
        return metas[stored_key]
    if stored_key.endswith(GLU_SUFFIXES):
        return metas.get(stored_key[:-2])
    return None


def _step(dcp: DcpDir, steps: Dict[str, str], metas: Dict[str, dict], where: str) -> int:
    """The one step count: torch Adam's per-parameter `step` tensors, else a `step` in the groups (fused Adam)."""
    values = {int(dcp.lazy(k).load().item()) for k in steps.values()}
    values |= {int(m["step"]) for m in metas.values() if isinstance(m.get("step"), (int, float))}
    require(len(values) == 1, f"{where}: the optimizer state's step counts are {sorted(values) or 'missing'}",
            HINT)
    return values.pop()


def _groups(dcp: DcpDir, stored: Dict[str, str], metas: Dict[str, dict], canonical: Callable, order: List[str],
            where: str) -> List[ParamGroup]:
    """Canonical names per group of equal hyperparameters: each canonical tensor traced back to the stored
    parameters it is made of (Tags through the weights' mapping), whose group meta must agree."""
    view = SlotView(dcp, MOMENTS[0], stored, tag=True)
    owners = {id(tag): key[len(view.prefix):] for key, tag in view.tags.items()}
    traced = canonical(view)
    groups: Dict[str, ParamGroup] = {}
    for name in order:
        found = {}
        for stored_key in reaches(traced[name], owners):
            meta = _meta_of(stored_key, metas)
            if meta is None:
                raise CkptError(f"{where}: no param_to_group_meta entry for {stored_key}", HINT)
            found[repr(sorted(meta.items()))] = meta
        require(len(found) == 1, f"{where}: {name} is made of parameters of {len(found)} param groups", HINT)
        (key, meta), = found.items()
        hyper = {k: v for k, v in meta.items() if k != "step"}
        groups.setdefault(key, ParamGroup([], hyper)).names.append(name)
    return list(groups.values())
