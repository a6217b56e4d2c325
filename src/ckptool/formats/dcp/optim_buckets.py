"""The distributed optimizer's dp_reshardable torch_dist form (Megatron-LM's default): flat bucket buffers.

megatron-core saves, per model-parallel rank (dp_group_idx_N, N = pp_rank * TP + tp_rank: the rank's
index in its model-parallel group), per grad buffer and bucket, the fp32 masters and Adam moments as
flat tensors laid out like the grad buffer:

  optimizer.distributed.dp_group_idx_N.gbuf_idx_G.dtype_(param dtype, grad dtype).bucket_idx_B.{param,
  exp_avg, exp_avg_sq}                          fp32 [bucket numel], chunked by DP rank
  optimizer.distributed.dp_group_idx_N.per_bucket_numel(_unpadded)   objects: [[{dtypes: [numel per bucket]}]]

The deprecated dp_zero_gather_scatter form (megatron-core up to 0.14 without
--ckpt-fully-parallel-save) holds the same values gathered over DP into one object per model-parallel
rank, `optimizer.distributed.dp_group_idx_N.param_state`: distrib_optim.pt's coalesced form
({'buckets_coalesced': True, gbuf: {dtype: {param, exp_avg, exp_avg_sq: fp32 [numel_unpadded],
'numel_unpadded'}}}, every bucket's unpadded part in turn). Only the buffer's total size is stored, so
the layout is chosen among the bucket sizes the run may have used by that total, and the master check
decides. The object is read whole (one rank's three fp32 buffers in memory).

Nothing names a parameter: where each one sits is the buffer layout, recomputed from the model as
megatron-core builds it (megatron/buffers.py, torch-free, which the quick inspect's check
(formats/dcp/quick_buckets.py) shares: buffer_layout, the parameters in order (registered_roles), the optimizers
and their rank grids (Part, grid), the stored sizes (parse_unpadded); dp_reshardable exists only since
megatron-core 0.14, so the current era) for every model-parallel rank:
  - one grad buffer (gbuf_idx_K) per model chunk K: with virtual pipeline chunks, chunk K of stage p
    holds layer block K x PP + p (Layout.chunks); without, the stage's layers (an even split, or the
    args' --decoder-first/last-pipeline-num-layers);
  - the embeddings in the first chunk of the first stage, the final norm and output layer in the last
    chunk of the last; with tied embeddings and PP > 1 that last chunk also holds the head's copy of
    the word embedding (in the buffer, never in the canonical state);
  - in REVERSE registration order (the dialect's param_order within a layer), each starting at a
    multiple of 64 elements;
  - cut into buckets with --overlap-grad-reduce (--ddp-bucket-size, else megatron-core's default) in
    model chunk 0 of the first pipeline stage only, and a bucket of its own for a PP > 1 tied
    embedding copy;
  - an MoE layer's router, local experts and shared expert in its MLP's place (`registered`); at EP > 1
    the experts in buffers of their own, of a second optimizer: megatron-core's [dense, expert] chain,
    each one's keys prefixed chained_N. and its model-parallel ranks indexed on its own grid (`Part`).
The layout is never trusted: it must reproduce the stored per_bucket_numel_unpadded of every rank,
and every master is checked against its weight as it loads. Several dtypes per chunk (one buffer
each) are refused.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple, Union

import torch

from ...config import GPTConfig
from ...errors import CkptError
from ...io.dcp_io import DcpDir
from ...io.torchfile import load_torch_bytes
from ...lazy import Const, LazyTensor, derive
from ..megatron.buffers import (FLAT_PREFIX, HEAD_COPY, ONE, FlatRun, Part, is_expert, matching_layout, parse_unpadded,
                               parts, rank_param_shapes, stored_prefix)
from ..megatron.optim import HINT

PREFIX = FLAT_PREFIX
FLAT, GATHERED = "dp_reshardable", "dp_zero_gather_scatter"
STORED = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
def read_shards(dcp: DcpDir, weights, cfg: GPTConfig, args, where: str, form: str = FLAT
                ) -> Dict[str, Dict[Tuple[str, Optional[int]], List[LazyTensor]]]:
    """slot -> {(role, layer): [per TP rank lazy local tensor]} (experts: per expert-TP rank), for
    roles.assemble(); form: FLAT or GATHERED."""
    run = FlatRun.of(args, cfg, where)
    out: Dict[str, Dict[Tuple[str, Optional[int]], List[LazyTensor]]] = {s: {} for s in STORED}
    unpadded: Dict[str, List[List[int]]] = {}  # per model-parallel rank: its buffers' bucket sizes
    gathered: Dict[str, Tuple[str, dict]] = {}  # per model-parallel rank: its gathered buffers (GATHERED)
    shared = (cfg.tied_embeddings or cfg.mtp_num_layers > 0) and run.pp > 1  # MTP (issue 30): the word embedding's copy
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    for part in parts(cfg, run.ep):
        gbuf_of: Dict[str, int] = {}  # per model-parallel rank: its next grad buffer (one per chunk it has params in)
        for r in run.buffer_ranks(part):
            pp_rank, chunk, mp, t = r.pp_rank, r.chunk, r.mp, r.t
            prefix = stored_prefix(dcp.entries, part, mp)
            params = _rank_params(shapes, cfg, run, r, part, where)
            if not params:
                continue  # no buffer (e.g. a chunk without MoE layers has no expert buffer)
            gbuf = gbuf_of[prefix] = gbuf_of.get(prefix, -1) + 1
            # the pieces this rank contributes: an expert held by several dense TP ranks (EP 1, expert TP
            # below TP) is taken from the first
            keep = [role != HEAD_COPY and not (part.experts is None and is_expert(role) and t >= run.etp)
                    for role, _, _ in params]
            if form == GATHERED:
                if prefix not in gathered:
                    gathered[prefix] = _gathered_state(dcp, prefix, where)
                key, state = gathered[prefix]
                _add_gathered(out, state, gbuf, r, params, keep, args, shared, run.dp, f"{where}: {key}")
                continue
            if prefix not in unpadded:
                unpadded[prefix] = _stored_unpadded(dcp, prefix, where)
            if gbuf >= len(unpadded[prefix]):
                raise CkptError(f"{where}: {prefix}per_bucket_numel_unpadded lists {len(unpadded[prefix])} grad "
                                f"buffer(s); this model has more there", HINT)
            stored = unpadded[prefix][gbuf]
            lay = _matching_layout(params, stored, args, shared, chunk, pp_rank, run.dp,
                                   f"{where}: {prefix}gbuf_idx_{gbuf}")
            gbuf_key = f"{prefix}gbuf_idx_{gbuf}."
            buffers = [k for k in dcp.entries if k.startswith(gbuf_key) and k.endswith(".bucket_idx_0.param")]
            if len(buffers) != 1:
                raise CkptError(f"{where}: {gbuf_key[:-1]} has {len(buffers)} dtype buffers; one was expected",
                                HINT)
            base = buffers[0][:-len("bucket_idx_0.param")]
            for slot, name in STORED.items():
                for i, (role, layer, shape) in enumerate(params):
                    if not keep[i]:
                        continue
                    key = f"{base}bucket_idx_{lay.bucket_of[i]}.{name}"
                    if key not in dcp.entries:
                        raise CkptError(f"{where}: no {key}", HINT)
                    flat = dcp.lazy(key, (lay.start[i],), (math.prod(shape),))
                    out[slot].setdefault((role, layer), []).append(derive(lambda x, s=shape: x.view(s), [flat]))
        for prefix, last in gbuf_of.items():
            if prefix in unpadded and len(unpadded[prefix]) != last + 1:
                raise CkptError(f"{where}: {prefix}per_bucket_numel_unpadded lists {len(unpadded[prefix])} grad "
                                f"buffer(s), this model {last + 1} there (one per model chunk holding parameters "
                                "of that optimizer)", HINT)
    return out


def _rank_params(shapes, cfg: GPTConfig, run: FlatRun, r, part: Part, where: str):
    """megatron_buffers.rank_param_shapes, or the one-line error where a parameter does not split evenly."""
    params = rank_param_shapes(shapes, cfg, run, r, part)
    if params is None:
        raise CkptError(f"{where}: a parameter of TP rank {r.t} does not split evenly over the run's "
                        "tensor-parallel size", HINT)
    return params


def _matching_layout(params, stored: Union[List[int], int], args, shared_embedding: bool, chunk: int, pp_rank: int,
                     dp: int, where: str):
    """megatron_buffers.matching_layout for a rank's (role, layer, shape) params, or the one-line error.
    shared_embedding: the word embedding and its head copy (tied, PP > 1) each get a bucket of their own."""
    numels = [math.prod(shape) for _, _, shape in params]
    shared = [shared_embedding and role in ("word", HEAD_COPY) for role, _, _ in params]
    lay, tried = matching_layout(numels, shared, stored, args, chunk, pp_rank, dp)
    if lay is None:
        raise CkptError(f"{where} holds buckets of {stored} elements, megatron-core's layout for this model gives "
                        f"{'; '.join(tried)}: the model, its args or the layout era differ", HINT)
    return lay


def _gathered_state(dcp: DcpDir, prefix: str, where: str) -> Tuple[str, dict]:
    """(key, object) of a model-parallel rank's DP-gathered buffers (GATHERED form)."""
    key = next((k for k in dcp.entries if k.startswith(prefix + "param_state/")), None)
    if key is None:
        raise CkptError(f"{where}: no {prefix}param_state object (the gathered optimizer buffers)", HINT)
    state = load_torch_bytes(dcp.read_bytes(key), source=f"{where}:{key}")
    return key, state[0] if isinstance(state, list) and len(state) == 1 else state


def _add_gathered(out, state, gbuf: int, r, params, keep, args, shared: bool, dp: int, where: str) -> None:
    """Grad buffer gbuf's parameters (buffer rank r's model chunk) cut out of the rank's DP-gathered buffers
    (GATHERED form); keep[i]: whether parameter i is read from here."""
    entry = state.get(gbuf) if isinstance(state, dict) and state.get("buckets_coalesced") is True else None
    entry = next(iter(entry.values())) if isinstance(entry, dict) and len(entry) == 1 else None
    total = entry.get("numel_unpadded") if isinstance(entry, dict) else None
    if not isinstance(total, int) or any(not isinstance(entry.get(n), torch.Tensor) or
                                         tuple(entry[n].shape) != (total,) for n in STORED.values()):
        raise CkptError(f"{where} is not one coalesced buffer of one dtype for grad buffer {gbuf} "
                        "(param, exp_avg, exp_avg_sq of numel_unpadded elements)", HINT)
    lay = _matching_layout(params, total, args, shared, r.chunk, r.pp_rank, dp, f"{where} buffer {gbuf}")
    for slot, name in STORED.items():
        for i, (role, layer, shape) in enumerate(params):
            if keep[i]:
                start = lay.coalesced_offset(i)
                value = entry[name][start:start + math.prod(shape)].view(shape)
                out[slot].setdefault((role, layer), []).append(Const(value))


def _stored_unpadded(dcp: DcpDir, prefix: str, where: str) -> List[List[int]]:
    """Per grad buffer, the unpadded size of each bucket."""
    key = next((k for k in dcp.entries if k.startswith(prefix + "per_bucket_numel_unpadded/")), None)
    if key is None:
        raise CkptError(f"{where}: no {prefix}per_bucket_numel_unpadded", HINT)
    obj = load_torch_bytes(dcp.read_bytes(key), source=f"{where}:{key}")
    try:
        return parse_unpadded(obj)
    except ValueError as e:
        raise CkptError(f"{where}: {key} holds {obj!r}, {e}", HINT) from None


def read_scalars(dcp: DcpDir, common: dict, where: str, chain: Tuple[Part, ...] = ONE) -> dict:
    """A common state in the shape dist_optim.read_scalars expects: the non-tensor optimizer state
    (param groups with their step, grad scaler) is a per-rank object here (dp_group_idx_0's of each
    optimizer of the chain; every model-parallel rank holds the same groups); a chain's entries go
    under their index, as ChainedOptimizer keeps its common state."""
    per_part = []
    for part in chain:
        entries = {}
        head = part.prefix + PREFIX.format(mp=0)
        for name in ("optimizer", "grad_scaler"):
            key = next((k for k in dcp.entries if k.startswith(head + name + "/")), None)
            if key is None:
                continue
            obj = load_torch_bytes(dcp.read_bytes(key), source=f"{where}:{key}")
            entries[name] = obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
        if "optimizer" not in entries:
            raise CkptError(f"{where}: no {head}optimizer object (the param groups)", HINT)
        per_part.append(entries)
    return dict(common, optimizer=per_part[0] if len(per_part) == 1 else dict(enumerate(per_part)))
