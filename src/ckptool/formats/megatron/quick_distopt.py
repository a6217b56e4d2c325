"""The distributed optimizer's state (distrib_optim.pt beside each rank file) for inspect, without torch.

What the full reader (formats/megatron/distopt.py) ties, read here from shapes: the rank file's
`optimizer` entry holds the param groups (with their `step`, without parameter lists), distrib_optim.pt
one fp32 flat buffer per model chunk and slot (coalesced since megatron-core 2024-04, a list of padded
buckets before). Each parameter's place in a buffer follows from megatron-core's grad-buffer layout;
the full reader takes the first era (and bucket size) whose layout reproduces the stored sizes and
refuses a file none reproduces. The layout rules are the full reader's own (formats/megatron/buffers.py:
ERAS, buffer_layout, bucket_sizes, era_layout, torch-free); groups are placed by megatron-core's traits
(formats/megatron/groups.py, via formats/megatron/quick_optim.py), as group_by_rule does.

An MoE model at EP > 1 (megatron-core's [dense, expert] chain: the rank file's `optimizer` and
distrib_optim.pt both lists of two) is checked per optimizer (chain_states): each part's buffers hold its
own parameters (the experts the expert one's, sharded over the expert-data-parallel size), and a part
saved only by that optimizer's DP rank 0 is found in the file megatron_buffers.chain_sources names, as
the full reader finds it.
"""
from __future__ import annotations

import math
from typing import Optional

from ...errors import CkptError
from .buffers import (KEYS, SLOT_OF_KEY, data_parallel_size, era_layout, file_form,
                                        is_shared_embedding)
from ...quick.meta import TensorMeta
from ...quick.torch_pickle import NotQuick


def rank_state(tree: dict, state, params, args, tied: bool, pp: int, pp_rank: int):
    """(hypers, step, grad scaler, slot dtypes) of one rank's (single) distributed optimizer, every buffer's
    sizes checked against its parameters' layout; None when it never stepped. params: quick/optim.Param."""
    opt = tree.get("optimizer")
    if not _is_part(opt) or not isinstance(state, dict):
        raise NotQuick("not a distributed optimizer's state")
    return part_state(opt, state, params, args, tied, pp, pp_rank, dp_size(args, False))


def chain_states(tree: dict, state, sources, params, members, args, tied: bool, pp: int, pp_rank: int, ep: int):
    """Per optimizer of megatron-core's [dense, expert] chain (EP > 1), part_state of its parameters (members:
    their indices in params), None for a part without parameters or state here (megatron_distopt.read_rank).
    Each part is saved only by that optimizer's DP rank 0, into its own file: where this file's entry is None,
    sources[n] (the distrib_optim.pt of the file megatron_buffers.chain_sources names) holds it."""
    opt = tree.get("optimizer")
    if not (isinstance(opt, list) and len(opt) == 2 and all(_is_part(o) for o in opt)) or ep == 1 \
            or not (isinstance(state, list) and len(state) == 2):
        raise NotQuick("not megatron-core's chained [dense, expert] distributed optimizer")  # the full reader's error
    states = list(state)
    for n, source in enumerate(sources):
        if states[n] is None and members[n]:
            if not (isinstance(source, list) and len(source) == 2 and source[n] is not None):
                raise NotQuick("a part of the chain in no file")  # the full reader names the file
            states[n] = source[n]
    # both optimizers' buffers are cut at one bucket size, its default from the dense DP size; each pads its
    # bucket ends for its own DP size (the expert-data-parallel one for the experts)
    return [part_state(part, st, [params[i] for i in idx], args, tied, pp, pp_rank, dp_size(args, n == 1),
                       dp_size(args, False)) if idx or st is not None else None
            for n, (part, st, idx) in enumerate(zip(opt, states, members))]


def dp_size(args, expert: bool) -> int:
    try:
        return data_parallel_size(args, expert)
    except CkptError:
        raise NotQuick("DP x TP that expert TP x EP does not divide") from None  # the full reader's error


def _is_part(opt) -> bool:
    return isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict) \
        and isinstance(opt["optimizer"].get("param_groups"), list)


def part_state(opt: dict, state, params, args, tied: bool, pp: int, pp_rank: int, dp: int,
               bucket_dp: Optional[int] = None):
    """(hypers, step, grad scaler, slot dtypes) of one DistributedOptimizer (megatron_distopt._read_part): its
    groups from the rank file's entry, its buffers (one per model chunk of its parameters) checked against
    their layout; None when it never stepped. dp: the size it was sharded over; bucket_dp: the one its default
    bucket size comes from."""
    groups = opt["optimizer"]["param_groups"]
    form = file_form(state) if isinstance(state, dict) else None
    if form is None or not all(isinstance(g, dict) for g in groups):
        raise NotQuick("a distributed-optimizer form from before 2024-02")
    chunks = sorted({p.chunk for p in params})
    if sorted(k for k in state if isinstance(k, int)) != list(range(len(chunks))):
        raise NotQuick("grad buffers do not match the model chunks")
    dtypes = {slot: set() for slot in SLOT_OF_KEY.values()}
    for gbuf, chunk in enumerate(chunks):
        entry = state[gbuf]
        if not isinstance(entry, dict) or len(entry) != 1 or not isinstance(next(iter(entry.values())), dict):
            raise NotQuick("a buffer of several dtypes")
        entry = next(iter(entry.values()))
        members = [p for p in params if p.chunk == chunk]
        want = _stored_sizes(entry, form)
        numels = [math.prod(p.shape) for p in members]
        shared = [is_shared_embedding(p.role, tied, pp) for p in members]
        if era_layout(numels, shared, form, want, args, chunk, pp_rank, dp, bucket_dp)[0] is None:
            raise NotQuick("no megatron-core buffer layout reproduces the stored sizes")
        for key, slot in SLOT_OF_KEY.items():
            flats = entry[key] if form == "bucket-list" else [entry[key]]
            dtypes[slot] |= {t.dtype for t in flats}
    hypers = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
    steps = {g["step"] for g in groups if g.get("step") is not None}
    if len(steps) > 1 or any(type(s) not in (int, float) for s in steps):
        raise NotQuick("groups stepped differently")
    step = int(steps.pop()) if steps else None
    if step == 0:
        return None
    return hypers, step, opt.get("grad_scaler"), dtypes


def _stored_sizes(entry: dict, form: str):
    if form == "coalesced":
        stored = entry.get("numel_unpadded")
        if any(not isinstance(entry.get(k), TensorMeta) or entry[k].shape != (stored,) or entry[k].dtype != "float32"
               for k in KEYS):
            raise NotQuick("a coalesced buffer that is not fp32 [numel_unpadded]")
        return stored
    sizes = {k: [t.shape[0] if isinstance(t, TensorMeta) and len(t.shape) == 1 else None for t in entry.get(k) or []]
             for k in KEYS}
    if len({tuple(v) for v in sizes.values()}) != 1 or None in sizes["param"]:
        raise NotQuick("buckets of different sizes")
    return sizes["param"]
