"""The distributed optimizer's dp_reshardable torch_dist form (Megatron-LM's default): flat bucket buffers.

megatron-core saves, per model-parallel rank (dp_group_idx_N, N = pp_rank * TP + tp_rank: the rank's
index in its model-parallel group), per grad buffer and bucket, the fp32 masters and Adam moments as
flat tensors laid out like the grad buffer:

  optimizer.distributed.dp_group_idx_N.gbuf_idx_G.dtype_(param dtype, grad dtype).bucket_idx_B.{param,
  exp_avg, exp_avg_sq}                          fp32 [bucket numel], chunked by DP rank
  optimizer.distributed.dp_group_idx_N.per_bucket_numel(_unpadded)   objects: [[{dtypes: [numel per bucket]}]]

Nothing names a parameter: where each one sits is the buffer layout, recomputed from the model as
megatron-core builds it (megatron_distopt.buffer_layout; dp_reshardable exists only since megatron-core
0.14, so the current era): parameters in REVERSE registration order (the dialect's param_order within a
layer), each starting at a multiple of 64 elements. Only the single-bucket case is recomputed (no
--overlap-grad-reduce bucketing, PP 1);
others are refused by name. The layout is never trusted: it must reproduce the stored
per_bucket_numel_unpadded, and every master is checked against its weight as it loads.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..config import GPTConfig
from ..errors import CkptError
from ..io.dcp_io import DcpDir
from ..io.torchfile import load_torch_bytes
from ..lazy import LazyTensor, derive
from ..roles import GLOBAL_ROLES, LAYER_ROLES, global_role_tensor, layer_role_tensor, shard_role
from .megatron_names import DIALECTS
from .megatron_distopt import CURRENT, buffer_layout
from .megatron_optim import HINT

PREFIX = "optimizer.distributed.dp_group_idx_{mp}."
STORED = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
DIALECT_OF_IMPL = {"local": "mcore", "transformer_engine": "mcore-te"}
HEAD = ("word", "pos")
TAIL = ("final_norm.weight", "final_norm.bias", "output")


def unsupported(args) -> Optional[str]:
    """Why this run's buffer layout is not recomputed, or None."""
    if (getattr(args, "pipeline_model_parallel_size", None) or 1) > 1:
        return "pipeline parallelism (per-stage buffers, shared-embedding buckets)"
    if getattr(args, "overlap_grad_reduce", False):
        return "--overlap-grad-reduce (buffers cut into buckets)"
    if getattr(args, "transformer_impl", "transformer_engine") not in DIALECT_OF_IMPL:
        return f"transformer_impl {getattr(args, 'transformer_impl', None)!r}"
    return None


def rank_params(weights: Dict[str, LazyTensor], cfg: GPTConfig, tp: int, t: int, impl: str
                ) -> List[Tuple[str, Optional[int], torch.Size]]:
    """(role, layer, local shape) of TP rank t's parameters in registration order (PP 1)."""
    order = DIALECTS[DIALECT_OF_IMPL[impl]].param_order
    out = []

    def add(role, layer, full):
        if full is not None:
            out.append((role, layer, shard_role(full, role, cfg, tp)[t].shape))

    for role in HEAD:
        add(role, None, global_role_tensor(weights, role))
    for i in range(cfg.num_layers):
        for role in order:
            if role in LAYER_ROLES:
                add(role, i, layer_role_tensor(weights, cfg, i, role))
    for role in TAIL:
        if role in GLOBAL_ROLES:
            add(role, None, global_role_tensor(weights, role))
    return out


def read_shards(dcp: DcpDir, weights, cfg: GPTConfig, args, where: str
                ) -> Dict[str, Dict[Tuple[str, Optional[int]], List[LazyTensor]]]:
    """slot -> {(role, layer): [per TP rank lazy local tensor]}, for roles.assemble()."""
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    impl = getattr(args, "transformer_impl", "transformer_engine")
    out: Dict[str, Dict[Tuple[str, Optional[int]], List[LazyTensor]]] = {s: {} for s in STORED}
    for t in range(tp):
        prefix = PREFIX.format(mp=t)
        params = rank_params(weights, cfg, tp, t, impl)
        # dp only pads bucket ends, which the stored tensors' offsets never depend on
        lay = buffer_layout([math.prod(shape) for _, _, shape in params], [False] * len(params), CURRENT, 1, None)
        stored = _stored_unpadded(dcp, prefix, where)
        if stored != lay.bucket_unpadded:
            raise CkptError(f"{where}: dp_group_idx_{t} holds buckets of {stored} elements, megatron-core's layout "
                            f"for this model gives {lay.bucket_unpadded}: the model, its args or the layout era "
                            "differ", HINT)
        buffers = [k for k in dcp.entries if k.startswith(prefix + "gbuf_idx_0.") and k.endswith(".bucket_idx_0.param")]
        if len(buffers) != 1:
            raise CkptError(f"{where}: dp_group_idx_{t} has {len(buffers)} single-dtype buffers; one was expected",
                            HINT)
        base = buffers[0][:-len("bucket_idx_0.param")]
        for slot, name in STORED.items():
            for i, (role, layer, shape) in enumerate(params):
                key = f"{base}bucket_idx_{lay.bucket_of[i]}.{name}"
                if key not in dcp.entries:
                    raise CkptError(f"{where}: no {key}", HINT)
                flat = dcp.lazy(key, (lay.start[i],), (math.prod(shape),))
                out[slot].setdefault((role, layer), []).append(derive(lambda x, s=shape: x.view(s), [flat]))
    return out


def _stored_unpadded(dcp: DcpDir, prefix: str, where: str) -> List[int]:
    key = next((k for k in dcp.entries if k.startswith(prefix + "per_bucket_numel_unpadded/")), None)
    if key is None:
        raise CkptError(f"{where}: no {prefix}per_bucket_numel_unpadded", HINT)
    obj = load_torch_bytes(dcp.read_bytes(key), source=f"{where}:{key}")
    try:  # [[{(param dtype, grad dtype): [numel per bucket]} per grad buffer]]
        (buffers,) = obj
        (per_dtype,) = buffers
        (sizes,) = per_dtype.values()
        return [int(n) for n in sizes]
    except (TypeError, ValueError, AttributeError):
        raise CkptError(f"{where}: {key} holds {obj!r}, not one buffer of one dtype", HINT)


def read_scalars(dcp: DcpDir, common: dict, where: str) -> dict:
    """A common state in the shape dist_optim.read_scalars expects: the non-tensor optimizer state
    (param groups with their step, grad scaler) is a per-rank object here (dp_group_idx_0's; every
    model-parallel rank holds the same groups)."""
    entries = {}
    for name in ("optimizer", "grad_scaler"):
        key = next((k for k in dcp.entries if k.startswith(PREFIX.format(mp=0) + name + "/")), None)
        if key is None:
            continue
        obj = load_torch_bytes(dcp.read_bytes(key), source=f"{where}:{key}")
        entries[name] = obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
    if "optimizer" not in entries:
        raise CkptError(f"{where}: no {PREFIX.format(mp=0)}optimizer object (the param groups)", HINT)
    return dict(common, optimizer=entries)
