"""The optimizer state of a DeepSpeed checkpoint (ZeRO-1/2/3, BF16_Optimizer) as an OptimizerState.

Masters and Adam moments come from the same flat partitions (deepspeed_zero.rank_moments places the
moments exactly like the masters) and each slot goes through the weights' own name mapping
(checkpoint.py's canonical()), so a slot's canonical names and shapes are the weights' by
construction. Nothing here runs until the slots or groups are first used.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch

from ...errors import CkptError
from ...lazy import LazyTensor
from ...ondemand import Builder, OnDemandDict, OnDemandList
from ...options import ReadOptions
from ...sharding import ReplicaPolicy
from ...state import OptimizerState, ParamGroup, expected_names
from .zero import MOMENTS, NO_OPTIMIZER_HINT, RankStates, base_optimizer, rank_moments, param_shapes


class _SlotWarnings(list):
    """Where the canonical mapping of one optimizer slot reports (TP replicas, tied copies): into the
    checkpoint's warnings, saying which slot, each message once."""

    def __init__(self, sink: List[str], slot: str):
        super().__init__()
        self.sink, self.slot = sink, slot

    def _say(self, message: str) -> str:
        return f"optimizer {self.slot}: {message}"

    def __contains__(self, message) -> bool:
        return self._say(message) in self.sink

    def append(self, message: str) -> None:
        if self._say(message) not in self.sink:
            self.sink.append(self._say(message))


class _Zeros(LazyTensor):
    """The moments of a parameter the optimizer does not hold (frozen) or a buffer: zeros."""

    def __init__(self, shape):
        self.shape, self.dtype = torch.Size(shape), torch.float32

    def load(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)


def _slot_named(r: RankStates, slot: str, moments: Dict[str, Dict[str, LazyTensor]],
                named_weights: Callable) -> Dict[str, LazyTensor]:
    """Engine name -> this slot's tensor for one MP rank, with the names named_weights gives the weights:
    the optimizer's own tensors for trainable parameters; for frozen ones and buffers the fp32 weight
    (master) or zeros (moments), so the canonical mapping sees the same set of names."""
    base = named_weights(r, "master")
    if slot == "master":
        return {k: v if v.dtype == torch.float32 else v.to(torch.float32) for k, v in base.items()}
    held = moments[slot]
    out = {}
    for k, v in base.items():
        owner = r.shared.get(k, k)
        out[k] = held[owner] if owner in held else _Zeros(v.shape)
    return out


class Tag(LazyTensor):
    """A stand-in for one engine parameter while tracing which canonical tensors it feeds. Unlike a
    stored tensor it keeps plain narrow()s, so every derived tensor still points back to it."""

    def __init__(self, like: LazyTensor):
        self.shape, self.dtype = like.shape, like.dtype

    def load(self):  # pragma: no cover - tracing never loads
        raise RuntimeError("internal: a tracing tag was loaded")


def reaches(t: LazyTensor, owners: Dict[int, int]) -> set:
    """The values of owners (keyed by id of a lazy node) met walking t's graph towards its inputs."""
    found, stack, seen = set(), [t], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if id(n) in owners:
            found.add(owners[id(n)])
            continue
        stack.extend(getattr(n, "parents", ()))
    return found


def _param_groups(tf, ranks: Dict[int, RankStates], opts, canonical: Callable, named_weights: Callable) -> List[ParamGroup]:
    """One ParamGroup per torch optimizer param group, its hyperparameters as stored and the canonical
    names fed by the flat partitions it steps (traced through the same canonical mapping). ZeRO-1/2
    and BF16 give each group one flat (params [g]); ZeRO-3 lists its sub-group flats (params [0, 1, ..])."""
    owners: Dict[int, int] = {}  # id(tag) -> index of the flat (param_shapes group) holding it
    named = {}
    for mp, r in ranks.items():
        flat_of = {n: f for f, names in enumerate(param_shapes(r.meta)) for n in names}
        named[mp] = {}
        for k, v in named_weights(r, "master").items():
            tag = Tag(v)
            owner = r.shared.get(k, k)
            if owner in flat_of:
                owners[id(tag)] = flat_of[owner]
            named[mp][k] = tag
    _, traced, *_ = canonical(tf, ranks, named, opts, ReplicaPolicy("first", lambda m: None), [])
    by_flat: Dict[int, List[str]] = defaultdict(list)
    for name, t in traced.items():
        for f in sorted(reaches(t, owners)):
            by_flat[f].append(name)
    return [ParamGroup([n for f in g.get("params", []) for n in by_flat.get(f, [])], hyperparameters(g))
            for g in stored_groups(ranks[0])]


def stored_groups(r0: RankStates) -> List[dict]:
    """The torch optimizer's param groups as stored, each listing the flats it steps (its "params"):
    ZeRO-1/2 and BF16 give each group one flat ([g]); ZeRO-3 lists its sub-group flats ([0, 1, ..]).
    Checked against the flats the model states describe (param_shapes)."""
    flats = len(param_shapes(r0.meta))
    stored = [g for g in base_optimizer(r0).get("param_groups") or [] if isinstance(g, dict)]
    if not stored:
        stored = [{"params": [f]} for f in range(flats)]
    listed = [f for g in stored for f in g.get("params", [])]
    if sorted(listed) != list(range(flats)):
        raise CkptError(f"{r0.tag_dir}: the optimizer's param groups step flats {sorted(listed)} but the model "
                        f"states describe {flats}", NO_OPTIMIZER_HINT)
    return stored


def hyperparameters(group: dict) -> dict:
    """A stored param group's hyperparameters (all but the flats it lists)."""
    return {k: v for k, v in group.items() if k != "params"}


def stepped(r: RankStates) -> bool:
    """Whether the torch optimizer inside holds any state (an engine saved before its first step
    keeps fp32 partitions but no moments: nothing to carry beyond the weights)."""
    osd = r.osds.get(0) or {}
    if isinstance(osd.get("base_optimizer_state"), list):  # elastic: refused with its reason when used
        return True
    return bool(base_optimizer(r).get("state"))


def optimizer_step(r0: RankStates) -> Optional[int]:
    """The torch optimizer's step as DP rank 0 stored it (None where it keeps none)."""
    state = base_optimizer(r0).get("state")
    first = state.get(0) if isinstance(state, dict) else None
    step = first.get("step") if isinstance(first, dict) else None
    if isinstance(step, LazyTensor):
        step = step.load().item()
    return int(step) if isinstance(step, (int, float)) else None


def optimizer_state(tf, ranks: Dict[int, RankStates], opts: ReadOptions, cfg, warnings: List[str],
                    canonical: Callable, named_weights: Callable) -> OptimizerState:
    """The optimizer state of a DeepSpeed run, its slots and groups built on first use.

    canonical(tf, ranks, named, opts, policy, warnings) and named_weights(rank, "master") are the
    weights' own mapping (checkpoint.py): each slot goes through them unchanged."""
    r0 = ranks[0]

    def build():
        missing = next((r.missing_shard for r in ranks.values() if r.missing_shard), None)
        if missing:
            raise CkptError(missing, NO_OPTIMIZER_HINT)
        moments = {mp: rank_moments(r) for mp, r in ranks.items()}
        slots = {}
        for slot in ("master",) + MOMENTS:
            named = {mp: _slot_named(r, slot, moments[mp], named_weights) for mp, r in ranks.items()}
            sink = _SlotWarnings(warnings, slot)
            policy = ReplicaPolicy(opts.replicas, sink.append)
            _, tensors, *_ = canonical(tf, ranks, named, opts, policy, sink)
            want = expected_names(cfg)
            slots[slot] = {n: tensors[n] for n in want if n in tensors}
            lost = [n for n in want if n not in tensors]
            if lost:
                raise CkptError(f"{tf.tag_dir}: the optimizer holds no {slot} for {lost[0]}", NO_OPTIMIZER_HINT)
        groups = _param_groups(tf, ranks, opts, canonical, named_weights)
        order = {n: i for i, n in enumerate(slots["master"])}
        for g in groups:
            g.names.sort(key=lambda n: order.get(n, 1 << 30))
        return slots, groups

    builder = Builder(build)
    kind = {"bf16_optimizer": "deepspeed-bf16"}.get(r0.optimizer_kind, f"deepspeed-zero{r0.zero_stage}")
    return OptimizerState(kind=kind, slots=OnDemandDict(builder, 0), step=optimizer_step(r0) if r0.osds else None,
                          param_groups=OnDemandList(builder, 1), grad_scaler=scaler_state(r0) or None,
                          scheduler=r0.meta.get("lr_scheduler"), consumed_samples=r0.meta.get("global_samples"))


# what a ZeRO optimizer shard keeps beside the partitions that a resumed engine reads back
SCALER_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")


def scaler_state(r0: RankStates) -> dict:
    """The loss scaler and clip_grad DP rank 0's optimizer shard keeps."""
    osd0 = r0.osds.get(0) or {}
    return {k: osd0[k] for k in SCALER_KEYS if k in osd0}
