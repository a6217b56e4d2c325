"""The distributed optimizer's dp_reshardable torch_dist form (megatron-core 0.15/0.16's default) for
inspect, without torch.

What the full reader (formats/dist_optim_buckets.read_shards) checks on opening, from the DCP index and the
small per-rank objects alone, by the same torch-free rules (formats/megatron/buffers.py: the optimizers of
the run (Part: one, or at EP > 1 megatron-core's [dense, expert] chain under chained_0. / chained_1.), the
model-parallel ranks each saves (grid), the parameters of each buffer in registration order
(registered_roles), the buffer layout (buffer_layout) and the stored sizes (parse_unpadded)): for every
optimizer, model-parallel rank (dp_group_idx_N) and model chunk holding its parameters, the grad-buffer
layout of that rank's parameters must reproduce the stored per_bucket_numel_unpadded, and every bucket a
parameter falls in must hold the param / exp_avg / exp_avg_sq tensors. A parameter's size on a rank is its
role's rank shape (meta.rank_shape: the spec's canonical parts, cut by the role's TP rule over TP, or over
the expert TP size for a routed expert, of which an EP rank holds its own). The param groups and step
come from each optimizer's dp_group_idx_0 `optimizer` object, as the full reader takes them.

Covered: dense, MoE (EP 1 or EP > 1, expert TP, SequentialMLP or TEGroupedMLP order, the router's expert
bias in no buffer) and MLA models, at any TP / PP / VPP / DP and bucket size. NotQuick (the full reader
answers) for a transformer_impl or expert module whose layout the full reader does not recompute
(megatron_buffers.unsupported: the legacy GroupedMLP), a split that does not fit the layers, the gathered
dp_zero_gather_scatter form, several dtype buffers per chunk, and any size that does not come out as
stored. (The full reader cuts every role by its default TP rule here, also MLA's down projections that
Transformer Engine keeps whole; the quick check does the same, so both give one answer.)
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

from ...config import GPTConfig
from ...errors import CkptError
from ..megatron.buffers import (FLAT_PREFIX, HEAD_COPY, FlatRun, matching_layout, parse_unpadded, parts,
                                        rank_param_shapes, stored_prefix, unsupported)
from ...quick.meta import TensorMeta
from ...quick.torch_pickle import NotQuick, load_torch_zip

FORM = "dp_reshardable"
PREFIX = FLAT_PREFIX
STORED = ("param", "exp_avg", "exp_avg_sq")


def read(stored: Dict[str, TensorMeta], objects: Callable[[str], Optional[object]], cfg: GPTConfig, args,
         weights: Dict[str, TensorMeta]) -> Tuple[List[dict], str]:
    """(per optimizer of the run, the common-state entry the full reader reads its groups and step from; the
    slots' dtype), once every rank's layout is checked. objects(prefix): the one byte entry under that prefix,
    unpickled inertly (None where there is none); weights: the canonical parameters (no module buffer)."""
    why = unsupported(args)
    if why:
        raise NotQuick(why)
    try:
        run = FlatRun.of(args, cfg, "quick")
    except CkptError:
        raise NotQuick("a pipeline split that does not fit the layers") from None  # the full reader's error
    shared_embedding = (cfg.tied_embeddings or cfg.mtp_num_layers > 0) and run.pp > 1  # MTP: the word embedding's copy
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    dtypes = set()
    unpadded: Dict[str, List[List[int]]] = {}  # per model-parallel rank: its buffers' bucket sizes
    for part in parts(cfg, run.ep):
        gbuf_of: Dict[str, int] = {}  # per model-parallel rank: its next grad buffer
        for r in run.buffer_ranks(part):
            prefix = stored_prefix(stored, part, r.mp)
            params = rank_param_shapes(shapes, cfg, run, r, part)
            if params is None:
                raise NotQuick("a parameter does not split evenly")  # the full reader's error
            if not params:
                continue  # no buffer (a chunk without MoE layers has no expert buffer)
            gbuf = gbuf_of[prefix] = gbuf_of.get(prefix, -1) + 1
            if prefix not in unpadded:
                try:
                    unpadded[prefix] = parse_unpadded(objects(prefix + "per_bucket_numel_unpadded/"))
                except ValueError:
                    raise NotQuick("per_bucket_numel_unpadded of another shape") from None
            if gbuf >= len(unpadded[prefix]):
                raise NotQuick("more grad buffers than stored")
            layout = _layout(params, shared_embedding, unpadded[prefix][gbuf], args, r, run.dp)
            dtypes |= _bucket_dtypes(stored, f"{prefix}gbuf_idx_{gbuf}.", layout)
        if any(prefix in unpadded and len(unpadded[prefix]) != last + 1 for prefix, last in gbuf_of.items()):
            raise NotQuick("grad buffers do not match the model chunks")  # the full reader's error
    if len(dtypes) != 1:
        raise NotQuick("bucket tensors of several dtypes")
    entries = []
    for part in parts(cfg, run.ep):  # dist_optim_buckets.read_scalars: each optimizer's dp_group_idx_0 objects
        head = part.prefix + PREFIX.format(mp=0)
        entry, scaler = (_one(objects(head + name + "/")) for name in ("optimizer", "grad_scaler"))
        if entry is None:
            raise NotQuick("no param groups object")  # the full reader's error
        entries.append({"optimizer": entry, **({"grad_scaler": scaler} if scaler is not None else {})})
    return entries, dtypes.pop()


def _layout(params, shared_embedding: bool, stored_sizes: List[int], args, r, dp: int):
    """The layout megatron_buffers.matching_layout finds for a rank's params (NotQuick where none does)."""
    shared = [shared_embedding and role in ("word", HEAD_COPY) for role, _, _ in params]
    layout, _ = matching_layout([math.prod(shape) for _, _, shape in params], shared, stored_sizes, args, r.chunk,
                                r.pp_rank, dp)
    if layout is None:
        raise NotQuick("no megatron-core layout reproduces the stored bucket sizes")
    return layout


def _bucket_dtypes(stored: Dict[str, TensorMeta], gbuf_key: str, layout) -> set:
    """The dtypes of one grad buffer's bucket tensors (NotQuick where one is missing, or the buffer is not one
    dtype's)."""
    heads = [k for k in stored if k.startswith(gbuf_key) and k.endswith(".bucket_idx_0.param")]
    if len(heads) != 1:
        raise NotQuick("not one dtype buffer per model chunk")
    base = heads[0][:-len("bucket_idx_0.param")]
    dtypes = set()
    for b in sorted(set(layout.bucket_of)):
        for name in STORED:
            t_meta = stored.get(f"{base}bucket_idx_{b}.{name}")
            if t_meta is None:
                raise NotQuick("a bucket tensor is missing")  # the full reader names it
            dtypes.add(t_meta.dtype)
    return dtypes


def _one(obj):
    """A per-rank object as dist_optim_buckets.read_scalars takes it: torch.save([obj]) is obj."""
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj


def object_reader(keys: List[str], read_bytes: Callable[[str], Optional[bytes]]) -> Callable[[str], Optional[object]]:
    """objects(prefix) for read(): the first byte entry (of keys, in index order) whose key starts with
    prefix (as the full reader finds it), unpickled inertly."""
    def objects(prefix: str):
        key = next((k for k in keys if k.startswith(prefix)), None)
        raw = read_bytes(key) if key is not None else None
        if raw is None:
            return None
        return load_torch_zip(raw)
    return objects
