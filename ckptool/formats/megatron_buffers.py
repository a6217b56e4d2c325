"""megatron-core's grad-buffer layout, where the distributed optimizer's flat state puts each parameter.

Torch-free, so the quick inspect (quick/megatron_distopt.py) and the full readers and writers
(megatron_distopt.py for distrib_optim.pt, dist_optim_buckets.py for torch_dist's dp_reshardable form)
lay buffers out by one set of rules; megatron_distopt.py's docstring says what they are and where
megatron-core keeps them (megatron/core/distributed/param_and_grad_buffer.py). ERAS holds how each
span of megatron-core versions aligns parameters, pads bucket ends and saves the buffers; buffer_layout
lays one buffer out; bucket_sizes says which bucket sizes a run may have used; stage_layers which
layers each pipeline stage (and so its buffers) holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from ..errors import CkptError
from ..spec import GPT, schema
from .megatron_groups import HINT

KEYS = ("param", "exp_avg", "exp_avg_sq")  # distrib_optim.pt's names for the master and the two moments
SLOT_OF_KEY = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
DEFAULT_BUCKET = 40_000_000  # megatron-core's default bucket size floor (max(40M, 1M x DP))
# the tied word embedding (first stage) and its head copy (last stage; role head_copy in the legacy
# dialects, output in megatron-core's): megatron-core marks them shared_embedding when PP > 1
SHARED_EMBEDDING_ROLES = GPT.with_trait("tied_embedding")  # the spec's role trait
# A torch_dist rank's parameters in its buffers (dist_optim_buckets.rank_params): the dialect of each
# transformer_impl gives a layer's order; the first chunk leads with HEAD, the last ends with TAIL and,
# tied at PP > 1, the head's copy of the word embedding (laid out, not read)
DIALECT_OF_IMPL = {"local": "mcore", "transformer_engine": "mcore-te"}
# (the spec's globals in its order: the first stage's by the first_stage trait, the rest the last stage's)
HEAD = GPT.with_trait("first_stage")
TAIL = tuple(t.role for t in GPT.tensors if t.role is not None and not t.axes and t.role not in HEAD)
HEAD_COPY = schema.HEAD_COPY
# args naming the first / last pipeline stage's layer counts (Megatron-LM's, and megatron-core's config)
FIRST_STAGE_ARGS = ("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage")
LAST_STAGE_ARGS = ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage")


@dataclass(frozen=True)
class Era:
    """How one span of megatron-core versions lays a grad buffer out and saves it."""
    name: str
    param_align: int  # each parameter starts at a multiple of this many elements (1: packed)
    bucket_multiple: Callable[[int], int]  # bucket ends padded to a multiple of this (from the DP size)
    form: str  # "coalesced" | "bucket-list"
    since: str = ""  # the era's first month: how --distrib-optim-era names it


ERAS = (  # newest first: a source is read by the first era whose layout matches its stored sizes
    Era("megatron-core 2024-07 and later", 64, lambda dp: math.lcm(dp, 128), "coalesced", "2024-07"),
    Era("megatron-core 2024-05..06", 1, lambda dp: math.lcm(dp, 128), "coalesced", "2024-05"),
    Era("megatron-core 2024-04", 1, lambda dp: dp, "coalesced", "2024-04"),
    Era("megatron-core 2024-02..03", 1, lambda dp: dp, "bucket-list", "2024-02"),
)
CURRENT = ERAS[0]
ERA_BY_SINCE = {e.since: e for e in ERAS}


@dataclass
class BufferLayout:
    """Where each parameter of one grad buffer sits. Parameter i (registration order) occupies
    [start[i], start[i] + numel) of bucket bucket_of[i] (offsets from the bucket's start)."""
    start: List[int]
    bucket_of: List[int]
    bucket_unpadded: List[int]
    bucket_padded: List[int]

    @property
    def numel_unpadded(self) -> int:
        return sum(self.bucket_unpadded)

    def coalesced_offset(self, i: int) -> int:
        """Parameter i's offset in the coalesced world tensors (every bucket's unpadded part in turn)."""
        return sum(self.bucket_unpadded[:self.bucket_of[i]]) + self.start[i]

    def padded_offset(self, i: int) -> int:
        """Parameter i's offset in the whole padded buffer."""
        return sum(self.bucket_padded[:self.bucket_of[i]]) + self.start[i]


def buffer_layout(numels: Sequence[int], shared: Sequence[bool], era: Era, dp: int,
                  bucket_size: Optional[int]) -> BufferLayout:
    """megatron-core's layout of one grad buffer holding parameters of these sizes (registration order);
    shared[i]: the parameter is a tied embedding copy across pipeline stages (a bucket of its own)."""
    n = len(numels)
    start, bucket_of = [0] * n, [0] * n
    unpadded: List[int] = []
    padded: List[int] = []
    pos = 0  # next free element, relative to the current bucket's start
    members = 0

    def close(end: int) -> None:
        nonlocal pos, members
        unpadded.append(end)
        padded.append(math.ceil(end / era.bucket_multiple(dp)) * era.bucket_multiple(dp))
        pos, members = 0, 0

    for i in reversed(range(n)):  # backprop order
        pos = math.ceil(pos / era.param_align) * era.param_align
        if shared[i] and members:
            close(pos)  # the bucket so far ends at the (aligned) start this parameter would have had
        start[i], bucket_of[i] = pos, len(unpadded)
        pos += numels[i]
        members += 1
        if shared[i] or (bucket_size is not None and pos >= bucket_size):
            close(pos)
    if members:
        close(pos)
    return BufferLayout(start, bucket_of, unpadded, padded)


def bucket_sizes(args, chunk: int, pp_rank: int, dp: int) -> List[Optional[int]]:
    """The bucket sizes the run may have used for this chunk, most likely first (megatron-core cuts
    buckets only with --overlap-grad-reduce, on pipeline stage 0, in model chunk 0)."""
    if chunk > 0 or pp_rank > 0 or not getattr(args, "overlap_grad_reduce", False) \
            or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return [None]
    given = getattr(args, "ddp_bucket_size", None)
    # None last: a file written for a run without bucketing (ckptool's writer) under args that had it
    return ([given] if given else [max(DEFAULT_BUCKET, 1_000_000 * dp), DEFAULT_BUCKET]) + [None]


def is_shared_embedding(role: str, tied: bool, pp: int) -> bool:
    """Whether a parameter of this role is bucketed alone (SHARED_EMBEDDING_ROLES, tied, PP > 1)."""
    return tied and pp > 1 and role in SHARED_EMBEDDING_ROLES


def file_form(state: dict) -> Optional[str]:
    """distrib_optim.pt's form by its marker keys (ERAS' `form`), None for the forms before 2024-02."""
    if state.get("buckets_coalesced") is True:
        return "coalesced"
    if "per_bucket_numel_unpadded" in state:
        return "bucket-list"
    return None


def _arg(args, names) -> Optional[int]:
    return next((int(getattr(args, n)) for n in names if getattr(args, n, None)), None)


def stage_layers(args, num_layers: int, pp: int, where: str) -> List[int]:
    """Layers per pipeline stage: the args' first / last stage counts, the stages between them split
    evenly."""
    first, last = _arg(args, FIRST_STAGE_ARGS), _arg(args, LAST_STAGE_ARGS)
    if pp == 1:
        return [num_layers]
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    counts = None
    if middle > 0 and rest >= 0 and rest % middle == 0:
        counts = [first] * (first is not None) + [rest // middle] * middle + [last] * (last is not None)
    elif middle == 0 and rest == 0:
        counts = [first, last]
    if counts is None:
        raise CkptError(f"{where}: the args' pipeline split (first stage {first}, last stage {last} layers, the "
                        f"others even) does not fit {num_layers} layers on {pp} stages", HINT)
    return counts
