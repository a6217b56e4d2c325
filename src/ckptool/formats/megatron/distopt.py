"""Megatron's distributed optimizer in the torch format (distrib_optim.pt beside each rank's file).

With --use-distributed-optimizer and --ckpt-format torch, Megatron-LM writes per (TP, PP) rank:
  model_optim_rng.pt  'optimizer': {'optimizer': {'param_groups': [...]}, 'grad_scaler'?}: the groups'
                      hyperparameters (and, with torch's own Adam, 'step'), no tensors, no 'params';
  distrib_optim.pt    the fp32 masters and Adam moments of every parameter, gathered over the DP ranks
                      into flat tensors laid out like megatron-core's grad buffers.

Nothing in distrib_optim.pt names a parameter: where each one sits is megatron-core's buffer layout
(megatron/core/distributed/param_and_grad_buffer.py), recomputed here from the model and the run's
args. The rules (each model chunk has one buffer per (param dtype, grad dtype); a dense model in one
dtype has one):
  - parameters enter the buffer in REVERSE registration order (named_parameters(), which is also the
    rank file's key order), roughly the order backprop produces their gradients;
  - since 2024-07 each parameter starts at a multiple of 64 elements (before: packed);
  - the buffer is cut into buckets of about bucket_size elements: only with --overlap-grad-reduce
    (bucket_size --ddp-bucket-size, default max(40M, 1M x DP)), only on the first pipeline stage and
    model chunk 0; with tied embeddings and PP > 1 the shared embedding (first stage) and its head
    copy (last stage) each get a bucket of their own;
  - each bucket's end is padded so DP ranks can shard it evenly (to a multiple of lcm(DP, 128) since
    2024-05, of DP before).
The file's forms by era (`ERAS`, `read_rank`):
  coalesced   (2024-04 ..)  {'buckets_coalesced': True, gbuf: {dtype key: {'param', 'exp_avg',
              'exp_avg_sq': fp32 [numel_unpadded], 'numel_unpadded'}}}: every bucket's unpadded part,
              one after the other (so the bucket end padding never shows, only the param alignment
              inside a bucket does);
  bucket-list (2024-02 .. 2024-03) {'per_bucket_numel', 'per_bucket_numel_unpadded', gbuf: {dtype:
              {'param': [fp32 [bucket numel] per bucket], ...}}}: each bucket padded.
Older forms (the 2023 per-bucket layout before megatron-core's ParamAndGradBuffer, the 2022-23
per-DP-rank optim.pt files) are refused by name.

MoE at EP > 1: megatron-core chains a dense and an expert optimizer (the expert one over the experts'
own grad buffers, sharded over the expert-data-parallel size); both files then hold their lists
[dense, expert], each part only in the file of that optimizer's DP rank 0 (`chain_sources`: with expert
TP = TP the dense state is in EP rank 0's file, every file holds its own experts'; with expert TP below
TP the two grids differ and a part may sit in another file of the stage; `read_rank`, DistributedTarget).

The layout is never trusted: its numel_unpadded (per bucket for the bucket-list form) must equal the
stored one, and every master is checked against its weight as it loads (megatron_optim).

Writing (`rank_files`, `write_files`) lays a target rank out by the same rules, in the form of the era
asked for and bucketed as the written args say (set_bucket_args); each flat tensor is a FlatSlot,
streamed into its zip record a parameter at a time, so no rank's buffer is ever in memory whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...errors import CkptError
from ...io import buffers, prefetch
from ...io.ahead import loaded_ahead
from ...io.torchfile import StoredTensor, load_torch_file
from ...lazy import Derived, LazyTensor
from . import buffers as megatron_buffers, optim as megatron_optim
# the layout rules are torch-free (megatron_buffers, shared with the quick inspect); their names stay here too
from .buffers import (CURRENT, KEYS, SLOT_OF_KEY, BufferLayout, Era, bucket_sizes, buffer_layout,
                               data_parallel_size, era_layout)
from .optim import (HINT, GroupRule, RankOptimizer, RankParam, groups_by_traits,
                             master_matching_weight)

FILE = "distrib_optim.pt"
ERA_BY_SINCE, DEFAULT_BUCKET = megatron_buffers.ERA_BY_SINCE, megatron_buffers.DEFAULT_BUCKET  # (their old home)
chain_sources = megatron_buffers.chain_sources  # torch-free there (the quick inspect finds the chain's parts too)


def buffer_key(era: Era, param_dtype: torch.dtype, grad_dtype: torch.dtype):
    """How the era's file keys a grad buffer's entry: by (param dtype, grad dtype) in megatron-core's
    ParamAndGradBuffer, by the grad dtype alone in the bucket-list era's per-chunk grad_buffers."""
    return (param_dtype, grad_dtype) if era.form == "coalesced" else grad_dtype


def set_bucket_args(args, overlap_grad_reduce: Optional[bool], ddp_bucket_size: Optional[int]) -> None:
    """The target run's bucketing in its args, under Megatron-LM's names: what is given wins, the
    source run's settings (copied into args) stay otherwise; the writer lays the buffers out by them."""
    if overlap_grad_reduce is not None:
        args.overlap_grad_reduce = overlap_grad_reduce
    if ddp_bucket_size is not None:
        args.ddp_bucket_size = ddp_bucket_size
        if getattr(args, "ddp_num_buckets", None) is not None:
            args.ddp_num_buckets = None  # Megatron-LM refuses both; the size given is the target's
    args.overlap_grad_reduce = bool(getattr(args, "overlap_grad_reduce", False))
    if args.overlap_grad_reduce and getattr(args, "ddp_num_buckets", None) is not None:
        raise CkptError(f"the source run cut its buckets by --ddp-num-buckets {args.ddp_num_buckets}, which "
                        "ckptool does not lay out", "give the target run's --ddp-bucket-size (with "
                        "--overlap-grad-reduce), or --no-overlap-grad-reduce")


def is_shared_embedding(param: RankParam, tied: bool, pp: int, mtp: bool = False) -> bool:
    """megatron-core marks the tied word embedding (first stage) and its head copy (last stage)
    shared_embedding when PP > 1; the distributed optimizer buckets each alone. The head copy reads as
    role head_copy in the legacy dialects, as output (output_layer.weight) in megatron-core's. With MTP layers
    (mtp) the word embedding and its copy on the MTP stage (megatron_buffers.is_shared_embedding)."""
    return megatron_buffers.is_shared_embedding(param.role, tied, pp, mtp)


# --- reading --------------------------------------------------------------------------------

def uses_distributed_optimizer(rank_dir: Path, args) -> bool:
    return (rank_dir / FILE).is_file() or bool(getattr(args, "use_distributed_optimizer", False))


@dataclass(frozen=True)
class RankRun:
    """What lays out one model-parallel rank's grad buffers besides its parameters: the run's args (bucket
    sizes, data-parallel sizes), whether its embeddings are tied, its pipeline size and this rank's stage."""
    args: Any
    tied: bool
    pp: int
    pp_rank: int
    mtp: bool = False  # the model has MTP layers (issue 30): the word embedding has a copy on the last stage


def read_rank(tree: dict, rank_dir: Path, params: List[RankParam], run: RankRun, where: str, ep: int = 1,
              dense_dir: Optional[Path] = None, expert_dir: Optional[Path] = None) -> Optional[RankOptimizer]:
    """One (TP, PP, EP) rank's distributed-optimizer state tied to its parameters (params in file order,
    each with its model chunk); None when the optimizer never stepped.

    At EP > 1 megatron-core chains a dense DistributedOptimizer (the grad buffers of the parameters
    all-reduced over data parallelism) and an expert one (its expert_parallel_buffers, sharded over the
    expert-data-parallel group): the rank file's 'optimizer' is the list of their groups and
    distrib_optim.pt the list of their states, each written only by that optimizer's DP rank 0 (None in
    the other places): the dense state in dense_dir's file, the experts' in expert_dir's (chain_sources;
    default: this file)."""
    path = rank_dir / FILE
    opt = tree.get("optimizer")
    if not path.is_file():
        raise CkptError(f"{where}: the run used the distributed optimizer but {path} is missing", HINT)
    parts = opt if isinstance(opt, list) else [opt]
    if not all(isinstance(o, dict) and isinstance(o.get("optimizer"), dict)
               and isinstance(o["optimizer"].get("param_groups"), list) for o in parts):
        raise CkptError(f"{where}: 'optimizer' is not a distributed optimizer's state dict "
                        "({'optimizer': {'param_groups'}}, or megatron-core's chained list of them)", HINT)
    states = _load(path)
    chained = isinstance(opt, list)
    if chained != isinstance(states, list) or (chained and (ep == 1 or len(parts) != 2 or len(states) != 2)):
        raise CkptError(f"{path}: {len(states) if isinstance(states, list) else 'one'} optimizer state(s) for the "
                        f"{len(parts) if chained else 'single'} optimizer(s) of the rank file at EP {ep} (megatron-core "
                        "chains [dense, expert] at EP > 1)", HINT)
    if not chained:
        return _read_part(parts[0], states, str(path), params, run, data_parallel_size(run.args, False), where)
    members = megatron_optim.chain_members(params, ep)
    states, files = list(states), [str(path), str(path)]
    for n, (kind, source_dir) in enumerate((("dense", dense_dir), ("expert", expert_dir))):
        if states[n] is not None or not members[n]:
            continue  # this file's writer was that optimizer's DP rank 0, or the part has no parameters here
        source = (source_dir or rank_dir) / FILE
        other = _load(source) if source != path else None
        if not isinstance(other, list) or len(other) != 2 or other[n] is None:
            elsewhere = f" nor in {source}" if source != path else ""
            raise CkptError(f"{path}: no {kind} optimizer state here{elsewhere} (the file of the {kind} "
                            "optimizer's DP rank 0, where megatron-core saves it, must hold it)", HINT)
        states[n], files[n] = other[n], str(source)
    # both optimizers' buffers are cut at one bucket size, its default from the dense DP size (megatron-core's
    # DDP); each pads its bucket ends for its own DP size
    tied_parts = [_read_part(part, state, file, [params[i] for i in idx], run, data_parallel_size(run.args, n == 1),
                             f"{where} (chained optimizer {n})", bucket_dp=data_parallel_size(run.args, False))
                  if idx or state is not None else None
                  for n, (part, state, file, idx) in enumerate(zip(parts, states, files, members))]
    return megatron_optim.join_chain(tied_parts, members, len(params), where)


def _load(path: Path):
    try:
        return load_torch_file(path)
    except CkptError as e:
        raise CkptError(f"{path} cannot be read: {e.message}", HINT) from None


def _read_part(opt: dict, state, where_file: str, params: List[RankParam], run: RankRun, dp: int, where: str,
               bucket_dp: Optional[int] = None) -> Optional[RankOptimizer]:
    """One DistributedOptimizer's state (its groups from the rank file, its buffers from distrib_optim.pt)
    tied to its parameters; dp: the size it was sharded over, bucket_dp: the one the default bucket size
    comes from (the dense DP size; default dp)."""
    groups = opt["optimizer"]["param_groups"]
    form = _form(state, where_file)
    chunks = sorted({p.chunk for p in params})
    buffers = sorted(k for k in state if isinstance(k, int))
    if buffers != list(range(len(chunks))):
        raise CkptError(f"{where_file}: {len(buffers)} grad buffers for {len(chunks)} model chunks "
                        "(several dtypes are not carried yet)", HINT)
    slots: List[Dict[str, LazyTensor]] = [dict() for _ in params]
    for gbuf, chunk in zip(buffers, chunks):
        members = [i for i, p in enumerate(params) if p.chunk == chunk]
        entry = _one_dtype(state[gbuf], f"{where_file} buffer {gbuf}")
        layout, _ = _matching_layout([params[i] for i in members], entry, form, run, chunk, dp,
                                       f"{where_file} buffer {gbuf}", bucket_dp or dp)
        for j, i in enumerate(members):
            shape = tuple(params[i].weight.shape)
            for key in KEYS:
                if form == "coalesced":
                    value = flat_view(entry[key], layout.coalesced_offset(j), shape)
                else:
                    value = flat_view(entry[key][layout.bucket_of[j]], layout.start[j], shape)
                slots[i][SLOT_OF_KEY[key]] = value
            slots[i]["master"] = master_matching_weight(
                slots[i]["master"], params[i], where_file,
                cause="the buffer layout does not fit this file or it is from another step")
    hypers = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]
    steps = {g["step"] for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise CkptError(f"{where}: param groups were stepped {sorted(steps)} times", HINT)
    step = int(steps.pop()) if steps else None
    if step == 0:
        return None
    return RankOptimizer(slots, group_by_rule(params, hypers, where, GroupRule.from_args(run.args)), hypers, step,
                         opt.get("grad_scaler"))


def _form(state, where: str) -> str:
    if not isinstance(state, dict):
        raise CkptError(f"{where}: not a distributed-optimizer state (a {type(state).__name__})", HINT)
    form = megatron_buffers.file_form(state)
    if form is None:
        raise CkptError(f"{where}: a distributed-optimizer form from before 2024-02 (no buckets_coalesced or "
                        "per_bucket_numel_unpadded; megatron-core's pre-ParamAndGradBuffer layout) is not read; "
                        "load it in Megatron with --ckpt-convert-update-legacy-dist-opt-format and save again", HINT)
    return form


def _one_dtype(buffer_state, where: str) -> dict:
    if not isinstance(buffer_state, dict) or len(buffer_state) != 1:
        raise CkptError(f"{where}: expected one dtype entry, found "
                        f"{len(buffer_state) if isinstance(buffer_state, dict) else buffer_state!r}", HINT)
    entry = next(iter(buffer_state.values()))
    if not isinstance(entry, dict) or any(k not in entry for k in KEYS):
        raise CkptError(f"{where}: no {'/'.join(KEYS)} tensors", HINT)
    return entry


def _matching_layout(params: List[RankParam], entry: dict, form: str, run: RankRun, chunk: int, dp: int, where: str,
                     bucket_dp: Optional[int] = None) -> Tuple[BufferLayout, Era]:
    """The first era (and bucket size) whose layout reproduces the stored sizes."""
    numels = [p.weight.numel for p in params]
    shared = [is_shared_embedding(p, run.tied, run.pp, run.mtp) for p in params]
    if form == "coalesced":
        stored = entry.get("numel_unpadded")
        for key in KEYS:
            t = entry[key]
            if not isinstance(t, LazyTensor) or tuple(t.shape) != (stored,) or t.dtype != torch.float32:
                raise CkptError(f"{where}: {key} is {getattr(t, 'shape', t)!r}, not fp32 "
                                f"[numel_unpadded={stored}]", HINT)
        want = stored
    else:  # one padded world tensor per bucket
        sizes = {key: [t.numel if isinstance(t, LazyTensor) else None for t in entry[key]] for key in KEYS}
        if len({tuple(v) for v in sizes.values()}) != 1:
            raise CkptError(f"{where}: the buckets of {', '.join(KEYS)} differ in size ({sizes})", HINT)
        want = sizes["param"]
    match, tried = era_layout(numels, shared, form, want, run.args, chunk, run.pp_rank, dp, bucket_dp)
    if match is None:
        raise CkptError(f"{where}: stored numel_unpadded {want} matches no megatron-core buffer layout of "
                        f"this model ({'; '.join(tried)}): the file does not belong to these weights or comes "
                        "from a version ckptool does not know", HINT)
    return match


def flat_view(flat: LazyTensor, offset: int, shape: Tuple[int, ...]) -> LazyTensor:
    """shape's worth of elements of a flat stored tensor from offset, read on demand (only its bytes)."""
    numel = math.prod(shape)
    if isinstance(flat, StoredTensor) and flat._contiguous():
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        return StoredTensor(flat.storage, flat.offset + offset, shape, strides)
    return Derived(lambda t: t[offset:offset + numel].reshape(shape), [flat])


def group_by_rule(params: List[RankParam], hypers: List[dict], where: str, rule: GroupRule = GroupRule()) -> List[int]:
    """Each parameter's group: the distributed optimizer's saved groups hold no parameter lists, so
    parameters are placed by megatron-core's group traits (megatron_groups.GROUP_TRAITS: weight decay,
    --decoupled-lr), which must single out one group for each."""
    if len(hypers) == 1:
        return [0] * len(params)
    group_of = groups_by_traits(params, hypers, rule)
    if group_of is None:
        raise CkptError(f"{where}: {len(hypers)} optimizer groups that megatron-core's group traits (weight decay, "
                        "--decoupled-lr) do not tell apart for every parameter (e.g. lr_mult groups of a run's "
                        "own condition)", HINT)
    return group_of


# --- writing --------------------------------------------------------------------------------

CHUNK = 4 << 20  # elements (16 MiB of fp32) per piece a flat tensor is written in
# loaded slots held ahead of the one being written (a larger one is still loaded, one at a time): the
# loads overlap the writes; the flat pass runs after the layer-by-layer files, so nothing else is held
AHEAD = 256 << 20


def target_bucket_size(args, chunk: int, pp_rank: int, dp: int) -> Optional[int]:
    """The bucket size the target run's grad buffer of this chunk will use (None: one bucket), from
    the args written with it: what the reader takes first (bucket_sizes)."""
    return None if args is None else bucket_sizes(args, chunk, pp_rank, dp)[0]


class FlatSlot(LazyTensor):
    """One flat fp32 tensor of distrib_optim.pt (a buffer's, or one bucket's in the bucket-list form):
    each parameter's slot at its offset, zeros in the gaps (alignment, bucket ends) as megatron-core
    leaves them. chunks() produces it in order, loading the parameters' slots a few ahead of the one
    being written (io/ahead.py: at most AHEAD bytes beside it), so writing it holds a few slots and one
    CHUNK in memory, never the rank's whole buffer."""

    def __init__(self, pieces: List[Tuple[int, LazyTensor]], numel: int):
        self.pieces = sorted(pieces, key=lambda p: p[0])
        self.shape, self.dtype = torch.Size([numel]), torch.float32

    def chunks(self, ahead=None):
        """The tensor's elements in order, in pieces; a yielded piece's memory is reused once the
        next one is asked for (the staging buffer for small parameters and gaps). ahead: a
        prefetch.Prefetcher asked for each parameter's source bytes before it loads."""
        stage = torch.zeros(max(1, min(CHUNK, self.numel)), dtype=torch.float32)
        used = cursor = 0
        loaded = loaded_ahead([piece for _, piece in self.pieces], AHEAD, ahead)
        try:
            for offset, piece in self.pieces + [(self.numel, None)]:
                if offset < cursor:
                    raise CkptError(f"internal: distrib_optim.pt pieces overlap at element {offset}")
                gap = offset - cursor
                while gap:  # zeros: the staging buffer is zeroed whenever it is reused
                    take = min(gap, len(stage) - used)
                    used, gap = used + take, gap - take
                    if used == len(stage):
                        yield stage
                        stage.zero_()
                        used = 0
                if piece is None:
                    break
                n = piece.numel
                value = next(loaded).reshape(-1)
                if n >= len(stage):  # a large parameter goes out from its own memory
                    if used:
                        yield stage[:used]
                        stage.zero_()
                        used = 0
                    yield value.to(torch.float32)
                else:
                    if used + n > len(stage):
                        yield stage[:used]
                        stage.zero_()
                        used = 0
                    stage[used:used + n] = value
                    used += n
                del value
                cursor = offset + n
            if used:
                yield stage[:used]
        finally:
            loaded.close()

    def load(self) -> torch.Tensor:
        parts = [c.clone() for c in self.chunks()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


def rank_files(entries: List[Tuple[int, int, Dict[str, LazyTensor], bool]], dp: int, step: int,
               groups: List[dict], grad_scaler: Optional[dict], dtype_key,
               bucket_size_of: Callable[[int], Optional[int]] = lambda chunk: None,
               era: Era = CURRENT) -> Tuple[dict, dict]:
    """The 'optimizer' entry of one target rank file and its distrib_optim.pt in era's form, laid out
    as that era's megatron-core lays its grad buffers out at DP size dp with bucket_size_of(chunk)
    (what load_parameter_state reads). The flat tensors are FlatSlots: write them with their chunks().

    entries: per parameter in registration order: (model chunk, group, slots, shared embedding?), slots
    holding fp32 master, exp_avg and exp_avg_sq of this rank's shard (full shape of the rank's piece).
    """
    coalesced = era.form == "coalesced"
    state: dict = {"buckets_coalesced": True} if coalesced else \
        {"per_bucket_numel": [], "per_bucket_numel_unpadded": []}
    chunks = sorted({c for c, _, _, _ in entries})
    for gbuf, chunk in enumerate(chunks):
        mine = [e for e in entries if e[0] == chunk]
        layout = buffer_layout([e[2]["master"].numel for e in mine], [e[3] for e in mine], era, dp,
                               bucket_size_of(chunk))
        if coalesced:
            world = {key: FlatSlot([(layout.coalesced_offset(j), e[2][SLOT_OF_KEY[key]]) for j, e in enumerate(mine)],
                                   layout.numel_unpadded) for key in KEYS}
            state[gbuf] = {dtype_key: dict(world, numel_unpadded=layout.numel_unpadded)}
            continue
        buckets = range(len(layout.bucket_padded))
        state[gbuf] = {dtype_key: {key: [FlatSlot([(layout.start[j], e[2][SLOT_OF_KEY[key]])
                                                   for j, e in enumerate(mine) if layout.bucket_of[j] == b],
                                                  layout.bucket_padded[b]) for b in buckets]
                                   for key in KEYS}}
        state["per_bucket_numel"].append({dtype_key: list(layout.bucket_padded)})
        state["per_bucket_numel_unpadded"].append({dtype_key: list(layout.bucket_unpadded)})
    param_groups = [dict(g, step=step) for g in groups]  # no 'params': the distributed optimizer's form
    optimizer: dict = {"optimizer": {"param_groups": param_groups}}
    if grad_scaler is not None:
        optimizer["grad_scaler"] = grad_scaler
    return optimizer, state


def write_files(writers: list, on_bytes=None) -> int:
    """Write distrib_optim.pt files (StreamingTorchWriters over rank_files' state): each flat tensor
    streamed from its FlatSlot's chunks (loaded ahead of the writes, their source bytes read ahead),
    one file after another. Returns the bytes written."""
    ahead = prefetch.prefetcher() if writers else None
    largest = max((piece.nbytes for w in writers for ps in w.pending if isinstance(ps.lazy, FlatSlot)
                   for _, piece in ps.lazy.pieces), default=0)
    try:  # loaded_ahead holds at most AHEAD, or the slot being written and the next: recycled memory
        with buffers.sized_for(max(AHEAD, 2 * largest)):
            total = _write_all(writers, ahead, on_bytes)
    finally:
        if ahead is not None:
            ahead.close()
    return total


def _write_all(writers: list, ahead, on_bytes) -> int:
    """write_files' work, each file in turn."""
    total = 0
    for w in writers:
        for ps in w.pending:
            if isinstance(ps.lazy, FlatSlot):
                total += w.write_chunks(ps, ps.lazy.chunks(ahead), on_bytes)
            else:
                n = w.write(ps)
                total += n
                if on_bytes:
                    on_bytes(n)
        w.finish()
    return total
