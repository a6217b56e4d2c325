"""A DeepSpeed run with no canonical GPT form (a non-GPT Hugging Face model, any other nn.Module, a run
saved without its config.json) as the universal writer's input (ds_universal.Universal), under the
engine's own parameter names.

No name mapping is needed: a universal folder is keyed by the names the engine's
module.named_parameters() gives, and those are the names DeepSpeed saved (param_shapes,
frozen_param_shapes). The ZeRO partitions give each trainable parameter its fp32 master and Adam moments
whole (deepspeed_zero; ZeRO-1/2, BF16_Optimizer and ZeRO-3 alike), and with one model-parallel rank
every parameter is whole, so each gets DeepSpeed's merge fact for plain data parallelism, cat_dim 0
(ds_to_universal.py --inject_missing_state writes the same: a run without Megatron's
universal_checkpoint_info names no row-parallel, vocabulary or sub-parameter patterns). Frozen
parameters get their weight as fp32.pt only. Buffers are not written: the engine restores none on a
universal load (it restores parameters from zero/ only), so the ones the run saved are named in a warning.

Refused by name (CkptError): a save without its optimizer shards or from before the first step, and
(deepspeed_zero) elastic shards and optimizers without Adam moments. Model-parallel runs never get
here: the DeepSpeed reader refuses them, since how their slices merge is known only for Megatron's names.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from ...errors import CkptError, require
from ...lazy import LazyTensor
from .optim import hyperparameters, optimizer_step, scaler_state, stepped, stored_groups
from .zero import MOMENTS, RankStates, engine_state, param_shapes, rank_moments
from .universal import Param, Universal, engine_counters


def engine_universal(tf, ranks: Dict[int, RankStates], named_weights: Callable,
                     warn: Callable[[str], None] = print) -> Universal:
    """The run's training state under its engine names. named_weights(rank, "master") is the DeepSpeed
    reader's own (checkpoint.py): every parameter, frozen ones and buffers by engine name."""
    r = ranks[0]  # the reader refuses model-parallel runs under names that are not Megatron's
    _check_training_state(tf, r)
    moments = rank_moments(r)
    groups = stored_groups(r)
    group_of_flat = {f: g for g, stored in enumerate(groups) for f in stored.get("params", [])}
    params = []
    for f, names in enumerate(param_shapes(r.meta)):
        for name in names:
            slots = {"master": r.master[name], **{m: moments[m][name] for m in MOMENTS}}
            params.append(Param(name, slots, group=group_of_flat[f]))
    for name, weight in _frozen(r, named_weights).items():
        params.append(Param(name, {"master": _fp32(weight)}))
    if r.buffers:
        warn(f"{len(r.buffers)} buffers not written ({', '.join(list(r.buffers)[:3])}"
             f"{', ...' if len(r.buffers) > 3 else ''}): DeepSpeed's universal load restores parameters "
             "only, so a resumed run keeps the buffer values its model starts with")
    es = engine_counters(engine_state(r.meta))
    step = optimizer_step(r)
    return Universal(params, [hyperparameters(g) for g in groups], es["global_steps"] if step is None else step,
                     es, scaler_state(r), naming="engine names")


def _check_training_state(tf, r: RankStates) -> None:
    if r.missing_shard:
        raise CkptError(r.missing_shard, "--format ds-universal needs every *_optim_states.pt shard of the step")
    require(bool(r.osds), f"{tf.tag_dir}: --format ds-universal writes the training state, and this save keeps no "
            "ZeRO optimizer shards (*_optim_states.pt)", "copy them too, or convert a run trained with ZeRO 1, 2 or 3")
    require(stepped(r), f"{tf.tag_dir}: the optimizer never stepped (no Adam moments to carry)",
            "save the run after its first step")


def _frozen(r: RankStates, named_weights: Callable) -> Dict[str, LazyTensor]:
    """Parameters no optimizer group holds: every named weight but the trained ones, buffers and tied aliases."""
    return {k: v for k, v in named_weights(r, "master").items()
            if k not in r.master and k not in r.buffers and k not in r.shared}


def _fp32(t: LazyTensor) -> LazyTensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)
