"""The distributed optimizer's dp_reshardable torch_dist form (megatron-core 0.15/0.16's default) for
inspect, without torch.

What the full reader (formats/dist_optim_buckets.py) checks on opening, from the DCP index and the small
per-rank objects alone: for every model-parallel rank (dp_group_idx_N) and model chunk, the grad-buffer
layout of that rank's parameters (formats/megatron_buffers.buffer_layout, the full reader's own rules)
must reproduce the stored per_bucket_numel_unpadded, and every bucket a parameter falls in must hold
the param / exp_avg / exp_avg_sq tensors. A parameter's size on a rank is its role's size (the spec's
canonical parts, summed) divided by TP unless the role is replicated; its order is the dialect's.
The param groups and step come from dp_group_idx_0's `optimizer` object, as the full reader takes them.

The rank order, stage split and layout rules are the full reader's own (formats/megatron_buffers.py).
NotQuick (the full reader answers) for MoE (the quick torch_dist reader leaves MoE to it anyway), a
transformer_impl the full reader does not lay out, a split that does not fit the layers, the gathered
dp_zero_gather_scatter form, several dtype buffers per chunk, and any size that does not come out as
stored.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

from ..config import GPTConfig, Layout
from ..errors import CkptError
from ..formats.megatron_buffers import (CURRENT, DIALECT_OF_IMPL, HEAD, HEAD_COPY, TAIL, bucket_sizes, buffer_layout,
                                        stage_layers)
from ..formats.megatron_names import DIALECTS
from ..spec import GPT
from .meta import TensorMeta
from .torch_pickle import NotQuick, load_torch_zip

FORM = "dp_reshardable"
PREFIX = "optimizer.distributed.dp_group_idx_{mp}."
STORED = ("param", "exp_avg", "exp_avg_sq")
LAYER_ROLES = frozenset(r.name for r in GPT.role_list("layer"))


def read(stored: Dict[str, TensorMeta], objects: Callable[[str], Optional[object]], cfg: GPTConfig, args,
         weights: Dict[str, TensorMeta]) -> Tuple[dict, str]:
    """(the common-state optimizer entry the full reader reads the groups and step from, the slots'
    dtype), once every rank's layout is checked. objects(prefix): the one byte entry under that prefix,
    unpickled inertly (None where there is none)."""
    if cfg.moe is not None or cfg.mla is not None:
        raise NotQuick("the flat buffers of an MoE / MLA model")
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if impl not in DIALECT_OF_IMPL:
        raise NotQuick("a transformer_impl whose layout the full reader does not recompute")
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    dp = int(getattr(args, "data_parallel_size", None) or 1)
    try:
        split = stage_layers(args, cfg.num_layers, pp, "quick") if vpp == 1 else None
        chunks = Layout(tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, stage_layers=split).chunks(cfg.num_layers)
    except CkptError:
        raise NotQuick("a pipeline split that does not fit the layers") from None  # the full reader's error
    shared_embedding = cfg.tied_embeddings and pp > 1
    dtypes = set()
    for pp_rank, chunk, first_layer, count in sorted(chunks):
        for t in range(tp):
            prefix = PREFIX.format(mp=pp_rank * tp + t)
            params = rank_params(weights, cfg, tp, impl, range(first_layer, first_layer + count),
                                 pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == vpp - 1, pp)
            want = _stored_unpadded(objects(prefix + "per_bucket_numel_unpadded/"), vpp)[chunk]
            shared = [shared_embedding and role in ("word", HEAD_COPY) for role, _ in params]
            layout = _matching_layout([n for _, n in params], shared, want, args, chunk, pp_rank, dp)
            gbuf = f"{prefix}gbuf_idx_{chunk}."
            heads = [k for k in stored if k.startswith(gbuf) and k.endswith(".bucket_idx_0.param")]
            if len(heads) != 1:
                raise NotQuick("not one dtype buffer per model chunk")
            base = heads[0][:-len("bucket_idx_0.param")]
            for b in sorted(set(layout.bucket_of)):
                for name in STORED:
                    t_meta = stored.get(f"{base}bucket_idx_{b}.{name}")
                    if t_meta is None:
                        raise NotQuick("a bucket tensor is missing")  # the full reader names it
                    dtypes.add(t_meta.dtype)
    if len(dtypes) != 1:
        raise NotQuick("bucket tensors of several dtypes")
    entry, scaler = (_one(objects(PREFIX.format(mp=0) + name + "/")) for name in ("optimizer", "grad_scaler"))
    if entry is None:
        raise NotQuick("no param groups object")  # the full reader's error
    return {"optimizer": entry, **({"grad_scaler": scaler} if scaler is not None else {})}, dtypes.pop()


def _one(obj):
    """A per-rank object as dist_optim_buckets.read_scalars takes it: torch.save([obj]) is obj."""
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj


def rank_params(weights: Dict[str, TensorMeta], cfg: GPTConfig, tp: int, impl: str, layers: range, first: bool,
                last: bool, pp: int) -> List[Tuple[str, int]]:
    """(role, numel on one TP rank) of a model-parallel rank's parameters in registration order
    (dist_optim_buckets.rank_params, by sizes: a TP-split role holds 1/TP of its elements)."""
    out: List[Tuple[str, int]] = []

    def add(role: str, layer: Optional[int], as_role: Optional[str] = None) -> None:
        names = [t.format(layer, None) for t in GPT.parts(role, cfg, layer)]
        if not names or any(n not in weights for n in names):
            return  # the model has no such tensor
        numel = sum(math.prod(weights[n].shape) for n in names)
        if GPT.roles[role].rule != "replicated":
            if numel % tp:
                raise NotQuick(f"{role} does not split over TP {tp}")
            numel //= tp
        out.append((as_role or role, numel))

    if first:
        for role in HEAD:
            add(role, None)
    for i in layers:
        for role in DIALECTS[DIALECT_OF_IMPL[impl]].param_order:
            if role in LAYER_ROLES:
                add(role, i)
    if last:
        for role in TAIL:
            add(role, None)
        if cfg.tied_embeddings and pp > 1:
            add("word", None, as_role=HEAD_COPY)
    return out


def _stored_unpadded(obj, buffers: int) -> List[List[int]]:
    """[[{dtypes: [numel per bucket]} per grad buffer]] as per grad buffer the bucket sizes."""
    try:
        (per_buffer,) = obj
        out = []
        for per_dtype in per_buffer:
            (sizes,) = per_dtype.values()
            out.append([int(n) for n in sizes])
    except (TypeError, ValueError, AttributeError):
        raise NotQuick("per_bucket_numel_unpadded of another shape") from None
    if len(out) != buffers:
        raise NotQuick("grad buffers do not match the model chunks")
    return out


def _matching_layout(numels: List[int], shared: List[bool], stored: List[int], args, chunk: int, pp_rank: int,
                     dp: int):
    """dist_optim_buckets._matching_layout: the args' bucket sizes, then each stored bucket size."""
    sizes = bucket_sizes(args, chunk, pp_rank, dp)
    if sizes != [None] and len(stored) > 1:
        sizes = sizes[:-1] + sorted(set(stored) - set(sizes)) + [None]
    for size in sizes:
        layout = buffer_layout(numels, shared, CURRENT, dp, size)
        if layout.bucket_unpadded == stored:
            return layout
    raise NotQuick("no megatron-core layout reproduces the stored bucket sizes")


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
