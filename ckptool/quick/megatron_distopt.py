"""The distributed optimizer's state (distrib_optim.pt beside each rank file) for inspect, without torch.

What the full reader (formats/megatron_distopt.py) ties, read here from shapes: the rank file's
`optimizer` entry holds the param groups (with their `step`, without parameter lists), distrib_optim.pt
one fp32 flat buffer per model chunk and slot (coalesced since megatron-core 2024-04, a list of padded
buckets before). Each parameter's place in a buffer follows from megatron-core's grad-buffer layout;
the full reader takes the first era (and bucket size) whose layout reproduces the stored sizes and
refuses a file none reproduces. The layout arithmetic is restated below from megatron_distopt (ERAS,
buffer_layout, bucket_sizes), which imports torch: a restatement can only make this path stricter,
since a layout it does not reproduce (an era added there, a rule changed) raises NotQuick and the full
reader answers. Groups are placed by megatron-core's traits (quick/optim.py), as group_by_rule does.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from .meta import TensorMeta
from .torch_pickle import NotQuick

KEYS = ("param", "exp_avg", "exp_avg_sq")
SLOT_OF_KEY = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
DEFAULT_BUCKET = 40_000_000
# megatron_distopt.ERAS, newest first: (parameter alignment, bucket-end multiple from the DP size, form)
ERAS = ((64, lambda dp: math.lcm(dp, 128), "coalesced"), (1, lambda dp: math.lcm(dp, 128), "coalesced"),
        (1, lambda dp: dp, "coalesced"), (1, lambda dp: dp, "bucket-list"))


def buffer_sizes(numels: Sequence[int], shared: Sequence[bool], align: int, multiple: int,
                 bucket_size: Optional[int]) -> Tuple[List[int], List[int]]:
    """(unpadded, padded) bucket sizes of one grad buffer (megatron_distopt.buffer_layout): parameters in
    backprop order, each at an aligned start, a shared embedding in a bucket of its own."""
    unpadded: List[int] = []
    padded: List[int] = []
    pos = members = 0
    for i in reversed(range(len(numels))):
        pos = math.ceil(pos / align) * align
        if shared[i] and members:
            unpadded.append(pos)
            padded.append(math.ceil(pos / multiple) * multiple)
            pos = members = 0
        pos += numels[i]
        members += 1
        if shared[i] or (bucket_size is not None and pos >= bucket_size):
            unpadded.append(pos)
            padded.append(math.ceil(pos / multiple) * multiple)
            pos = members = 0
    if members:
        unpadded.append(pos)
        padded.append(math.ceil(pos / multiple) * multiple)
    return unpadded, padded


def bucket_sizes(args, chunk: int, pp_rank: int, dp: int) -> List[Optional[int]]:
    """megatron_distopt.bucket_sizes: the bucket sizes the run may have used, most likely first."""
    if chunk > 0 or pp_rank > 0 or not getattr(args, "overlap_grad_reduce", False) \
            or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return [None]
    given = getattr(args, "ddp_bucket_size", None)
    return ([given] if given else [max(DEFAULT_BUCKET, 1_000_000 * dp), DEFAULT_BUCKET]) + [None]


def rank_state(tree: dict, state, params, args, tied: bool, pp: int, pp_rank: int):
    """(hypers, step, grad scaler, slot dtypes) of one rank's distributed optimizer, every buffer's sizes
    checked against its parameters' layout; None when it never stepped. params: quick/optim.Param."""
    opt = tree.get("optimizer")
    if not (isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict)
            and isinstance(opt["optimizer"].get("param_groups"), list)) or not isinstance(state, dict):
        raise NotQuick("not a distributed optimizer's state (or a chained one)")
    groups = opt["optimizer"]["param_groups"]
    form = "coalesced" if state.get("buckets_coalesced") is True else \
        "bucket-list" if "per_bucket_numel_unpadded" in state else None
    if form is None or not all(isinstance(g, dict) for g in groups):
        raise NotQuick("a distributed-optimizer form from before 2024-02")
    chunks = sorted({p.chunk for p in params})
    if sorted(k for k in state if isinstance(k, int)) != list(range(len(chunks))):
        raise NotQuick("grad buffers do not match the model chunks")
    dp = int(getattr(args, "data_parallel_size", 0) or 0) or 1
    dtypes = {slot: set() for slot in SLOT_OF_KEY.values()}
    for gbuf, chunk in enumerate(chunks):
        entry = state[gbuf]
        if not isinstance(entry, dict) or len(entry) != 1 or not isinstance(next(iter(entry.values())), dict):
            raise NotQuick("a buffer of several dtypes")
        entry = next(iter(entry.values()))
        members = [p for p in params if p.chunk == chunk]
        want = _stored_sizes(entry, form)
        numels = [math.prod(p.shape) for p in members]
        shared = [tied and pp > 1 and p.role in ("word", "head_copy", "output") for p in members]
        if not any(_fits(numels, shared, era, dp, size, want)
                   for era in ERAS if era[2] == form for size in bucket_sizes(args, chunk, pp_rank, dp)):
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


def _fits(numels, shared, era, dp: int, bucket_size: Optional[int], want) -> bool:
    align, multiple, form = era
    unpadded, padded = buffer_sizes(numels, shared, align, multiple(dp), bucket_size)
    return (sum(unpadded) if form == "coalesced" else padded) == want
