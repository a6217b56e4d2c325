"""DeepSpeed saves for inspect, without torch: Megatron-DeepSpeed pipelines (GPTModelPipe:
mp_rank_XX_model_states.pt and layer_LL-model_TT-model_states.pt) and Megatron names under `module`
(--no-pipeline-parallel), with ZeRO-1/2/3 or BF16_Optimizer shards
([bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt) or none; and Hugging Face models trained under
DeepSpeed with ZeRO-1/2/3 or BF16_Optimizer (their names and groups: formats/deepspeed/quick_hf.py). The
ranks are read here for both: ZeRO-3's per-DP-rank model states and sub-group flats, frozen
parameters (fragments or `module`), buffers and tied aliases, as formats/deepspeed/zero.py reads them.

What the full reader (formats/deepspeed/checkpoint.py, deepspeed/zero.py, deepspeed/optim.py) shows by default
follows from the pickles' structure alone (quick/torch_pickle.py):
  - the weights are the fp32 masters where every rank has its shards: each parameter of param_shapes
    (its engine name and shape) placed in the flat fp32 partitions of single_partition_of_fp32_groups
    by param_slice_mappings (or back to back in older files), every placement checked as the full
    reader checks it; else the 16-bit weights of the layer files or of `module`;
  - pipe names <LL>.<key> / tied_modules.embed.<key> onto roles by formats/deepspeed/pipeline.py's own
    tables, Megatron names by their dialect's key table (megatron/names.py); the config from the
    stored args (megatron_args.config_from_args, with universal_checkpoint_info), the canonical shapes
    from the config (quick/meta.py), every role the config implies checked present;
  - the optimizer: the Adam moments' flats checked against their partitions, the step (a 0-d tensor read
    as a Scalar), each torch param group's canonical tensors (all of them for a single group; else those
    with the group's weight-decay trait, which every parameter of its flats must have: biases and 1-D
    norms in the group without weight decay), the loss scaler's entries, the scheduler, the sample count.

NotQuick (the full reader answers) for everything else: Megatron models with frozen parameters,
buffers or shared aliases, saves without args, a missing optimizer shard or shards for
some model-parallel ranks only, elastic checkpoints, groups the trait does not tell apart, mixed dtypes,
MoE or MLA models; HF models that are not GPTs, lack a config.json beside them, or sit at model-parallel ranks.
"""
from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...config import Layout
from ...errors import CkptError
from ..megatron import args as megatron_args
from . import pipeline as mds
from .files import TagFiles, looks_megatron, megatron_key, resolve_tag_dir, scan_tag_dir
from ..megatron.files import detect_dialect
from ..megatron.names import KeyMatcher, is_ignorable
from ...spec import GPT
from ...spec.schema import HEAD_COPY, MDS
from ...state import Checkpoint, OptimizerState, ParamGroup, SourceInfo, in_model_order
from . import quick_hf as deepspeed_hf
from ...quick.meta import TensorMeta, canonical_shapes
from ...quick.torch_pickle import NotQuick, Scalar, load_torch_zip

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALER_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")  # deepspeed_optim's grad_scaler


@dataclass
class _Rank:
    """One model-parallel rank as formats/deepspeed_zero.RankStates holds it, tensors as TensorMeta."""
    meta: dict
    osds: Dict[int, dict]
    shapes: List["OrderedDict[str, tuple]"]
    master: Dict[str, TensorMeta]
    stage: Optional[int]  # None: no optimizer shards
    kind: str  # "zero" | "bf16_optimizer" | "zero3" | "none"
    module: Dict[str, TensorMeta] = field(default_factory=dict)  # the `module` state dict's tensors
    frozen: Dict[str, TensorMeta] = field(default_factory=dict)  # frozen parameters (fragments)
    buffers: Dict[str, TensorMeta] = field(default_factory=dict)
    shared: Dict[str, str] = field(default_factory=dict)  # alias -> owner


def read(path: Path, format_name: str) -> Optional[Checkpoint]:
    try:
        return _checkpoint(path, format_name)
    except (NotQuick, CkptError, OSError, LookupError, ValueError, TypeError, AttributeError):
        return None  # the full reader gives the answer, or its error


def _checkpoint(path: Path, format_name: str) -> Checkpoint:
    tf = scan_tag_dir(resolve_tag_dir(Path(path)))
    mps = tf.mp_ranks
    if not mps or mps != list(range(len(mps))):
        raise NotQuick("no model states, or model-parallel ranks missing")
    ranks = {mp: _rank(tf, mp, pipeline=bool(tf.layers)) for mp in mps}
    r0 = ranks[0]
    if all(r.osds for r in ranks.values()):
        weights = "master"  # the full reader's default where every rank has its shards
    elif not any(r.osds for r in ranks.values()):
        weights = "model"
    else:
        raise NotQuick("optimizer shards for some model-parallel ranks only")
    if not tf.layers:
        named = {mp: _named(r, weights) for mp, r in ranks.items()}
        if not mds.is_pipe_names(named[0]) and not looks_megatron(named[0]):  # a Hugging Face model's names
            return _hf_checkpoint(path, format_name, tf, ranks, named, weights)
    if any(r.meta.get("frozen_param_shapes") or r.meta.get("buffer_names") or r.meta.get("shared_params")
           for r in ranks.values()):
        raise NotQuick("a Megatron model with frozen parameters, buffers or aliases")
    args = r0.meta.get("args")
    if args is None:
        raise NotQuick("no args")  # the full reader's config then needs the shapes' arithmetic
    shards, num_layers, layout, dialect = (_pipeline(tf, ranks, weights) if tf.layers else _module(ranks, weights))
    for (role, layer), parts in shards.items():
        if any(p is None for p in parts) or len({p.shape for p in parts}) != 1:
            raise NotQuick(f"{role} of layer {layer} differs across TP ranks")
    word = shards.get(("word", None))
    if word is None:
        raise NotQuick("no word embeddings")
    cfg = megatron_args.config_from_args(args, sum(p.shape[0] for p in word),
                                         {"universal_checkpoint_info": r0.meta.get("universal_checkpoint_info")})
    shapes = canonical_shapes(cfg)
    dtypes = {p.dtype for parts in shards.values() for p in parts}
    if cfg.moe is not None or cfg.mla is not None:  # (meta.canonical_shapes answers for both; DeepSpeed's expert
        raise NotQuick("an MoE or MLA model")         # files and Megatron-DeepSpeed's MLA names are not read here)
    if cfg.num_layers != num_layers or len(dtypes) != 1 or set(shards) != _roles(shapes, cfg):
        raise NotQuick("the files do not hold the model the args describe")
    dtype = dtypes.pop()
    tensors = {n: TensorMeta(s, dtype) for n, s in shapes.items()}
    if layout.stage_layers and sum(layout.stage_layers) != cfg.num_layers:
        layout.stage_layers = None
    layout.dp = max(1, len(r0.osds))
    stage = "BF16_Optimizer" if r0.kind == "bf16_optimizer" else f"zero-{r0.stage}" if r0.stage else "no ZeRO"
    info = SourceInfo(path=str(path), format=format_name, dialect=dialect, storage=f"{stage}, {weights} weights ({dtype})",
                      layout=layout, iteration=r0.meta.get("iteration", r0.meta.get("global_steps")),
                      checkpoint_version=r0.meta.get("checkpoint_version"), args=args)
    return Checkpoint(cfg, tensors, info, [], _optimizer(ranks, tensors) if weights == "master" else None)


def _hf_checkpoint(path: Path, format_name: str, tf: TagFiles, ranks: Dict[int, _Rank],
                   named: Dict[int, Dict[str, TensorMeta]], weights: str) -> Checkpoint:
    """A Hugging Face model trained under DeepSpeed (deepspeed._read_hf_gpt and the optimizer state
    deepspeed/optim.py builds for it), from formats/deepspeed/quick_hf.py's mapping."""
    r0 = ranks[0]
    names = deepspeed_hf.single_rank(named)
    if weights == "model" and any(math.prod(t.shape) == 0 for t in names.values()):
        raise NotQuick("ZeRO-3 placeholders and no optimizer shards")
    cfg, tensors, model_type, sources = deepspeed_hf.canonical(names, tf.tag_dir)
    dtype = next(iter(tensors.values())).dtype
    stage = "BF16_Optimizer" if r0.kind == "bf16_optimizer" else f"zero-{r0.stage}" if r0.stage else "no ZeRO"
    info = SourceInfo(path=str(path), format=format_name, dialect=f"hf {model_type}",
                      storage=f"{stage}, {weights} weights ({dtype})", layout=Layout(tp=1, pp=1, dp=max(1, len(r0.osds))),
                      iteration=r0.meta.get("iteration", r0.meta.get("global_steps")),
                      checkpoint_version=r0.meta.get("checkpoint_version"), args=r0.meta.get("args"))
    optimizer = None
    if weights == "master" and _base(r0.osds[0]).get("state"):
        slots = deepspeed_hf.slots(tensors, sources, r0.shared, {key: held_moments(r0, key) for key in MOMENTS})
        stored = [g for g in _base(r0.osds[0]).get("param_groups") or [] if isinstance(g, dict)]
        osd0 = r0.osds[0]
        kind = {"bf16_optimizer": "deepspeed-bf16"}.get(r0.kind, f"deepspeed-zero{r0.stage}")
        optimizer = OptimizerState(kind=kind, slots=slots, step=_step(r0),
                                   param_groups=deepspeed_hf.param_groups(tensors, sources, r0.shared, r0.shapes, stored),
                                   grad_scaler={k: osd0[k] for k in SCALER_KEYS if k in osd0} or None,
                                   scheduler=r0.meta.get("lr_scheduler"), consumed_samples=r0.meta.get("global_samples"))
    return Checkpoint(cfg, in_model_order(tensors, cfg), info, [], optimizer)


def _pipeline(tf: TagFiles, ranks: Dict[int, _Rank], weights: str):
    """A GPTModelPipe save: (role, layer) -> [tensor per TP rank], layers, layout, dialect."""
    tp = max(t for _, t in tf.layers) + 1
    if len(ranks) % tp:
        raise NotQuick("model-parallel ranks not a multiple of TP")
    pp = len(ranks) // tp
    entries, copies = _pipe_entries(ranks, tp) if weights == "master" else (_layer_entries(tf, tp), {})
    keys_by_idx: Dict[Optional[int], set] = defaultdict(set)
    for idx, key in entries:
        keys_by_idx[idx].add(key)
    kinds = mds.classify(keys_by_idx)
    numbers = mds.layer_numbers(kinds)
    shards: Dict[Tuple[str, Optional[int]], List[TensorMeta]] = {}
    for (idx, key), parts in entries.items():
        copy = copies.get((idx, key))
        if copy is not None and any(c is not None and p is not None and c.shape != p.shape
                                    for c, p in zip(copy, parts)):
            raise NotQuick(f"the tied copy of {key} differs in shape")
        kind = kinds[idx]
        shards[(mds.role_of(kind, key), numbers[idx] if kind == "layer" else None)] = parts
    counts = [len({mds.split_pipe_name(n)[0] for g in ranks[s * tp].shapes for n in g
                   if (mds.split_pipe_name(n) or (None,))[0] in numbers}) for s in range(pp)]
    layout = Layout(tp=tp, pp=pp, stage_layers=None if len(set(counts)) <= 1 else counts)
    return (shards, len(numbers), layout,
            f"mds-pipeline (transformer layers from spec index {mds.first_layer_index(kinds)}, qkv grouped)")


def _module(ranks: Dict[int, _Rank], weights: str):
    """A Megatron model's parameters under `module` (Megatron-DeepSpeed --no-pipeline-parallel): its
    dialect's key table, as formats/deepspeed/checkpoint.py's _read_megatron_module applies it."""
    named = {mp: {megatron_key(k): v for k, v in _named(r, weights).items()} for mp, r in ranks.items()}
    if not named[0] or mds.is_pipe_names(named[0]):
        raise NotQuick("no parameters, or pipe names without layer files")
    dialect = detect_dialect(list(named[0]))
    matcher = KeyMatcher(dialect)
    if sum(1 for k in named[0] if matcher.match(k)) * 2 <= len(named[0]):
        raise NotQuick("not a Megatron model's names (Hugging Face names: the full reader's tables)")
    tp = len(named)
    shards: Dict[Tuple[str, Optional[int]], list] = defaultdict(lambda: [None] * tp)
    for t, keys in named.items():
        for key, v in keys.items():
            hit = matcher.match(key)
            if hit is None:
                if is_ignorable(key):
                    continue
                raise NotQuick(f"{key} is not part of a {dialect.name} GPT model")
            if hit[0] != HEAD_COPY:
                shards[hit][t] = v
    layers = [layer for _, layer in shards if layer is not None]
    return dict(shards), (1 + max(layers)) if layers else 0, Layout(tp=tp, pp=1), f"megatron module ({dialect.name})"


def _named(r: _Rank, weights: str) -> Dict[str, TensorMeta]:
    """Engine parameter name -> tensor, as formats/deepspeed.named_weights gives them: the masters,
    then frozen parameters, buffers, what else `module` holds (ZeRO-1 keeps frozen parameters only
    there) and the aliases of shared parameters."""
    if weights == "model":
        return dict(r.module)
    out = dict(r.master)
    for more in (r.frozen, r.buffers):
        out.update({k: v for k, v in more.items() if k not in out})
    out.update({k: v for k, v in r.module.items() if k not in out and k not in r.shared and math.prod(v.shape) > 0})
    for alias, owner in r.shared.items():
        if owner in out and alias not in out:
            out[alias] = out[owner]
    return out


def _roles(shapes: Dict[str, tuple], cfg) -> set:
    """(role, layer) of every tensor the canonical names imply: the spec's role holding each, where the
    Megatron-DeepSpeed layer files name that role (the spec's "mds" column)."""
    out = set()
    for name in shapes:
        hit = GPT.match(name, cfg)
        role = GPT.roles[hit[0].role] if hit is not None and hit[0].role is not None else None
        if role is None or role.is_expert or role.key(MDS) is None:
            raise NotQuick(f"{name} has no Megatron-DeepSpeed role")
        out.add((role.name, hit[1]))
    return out


def _pipe_entries(ranks: Dict[int, _Rank], tp: int):
    """(spec index, key) -> [master per TP rank], and the later stages' copies (the tied embedding)."""
    entries: Dict[tuple, list] = defaultdict(lambda: [None] * tp)
    copies: Dict[tuple, list] = defaultdict(lambda: [None] * tp)
    for mp, r in sorted(ranks.items()):
        t = mp % tp
        for name, v in r.master.items():
            hit = mds.split_pipe_name(name)
            if hit is None:
                raise NotQuick(f"parameter {name} is not a pipe name")
            target = entries if entries[hit][t] is None else copies
            target[hit][t] = v
    return dict(entries), dict(copies)


def _layer_entries(tf: TagFiles, tp: int) -> Dict[tuple, list]:
    """(spec index, key) -> [16-bit weight per TP rank] from the layer files (no optimizer shards)."""
    entries: Dict[tuple, list] = defaultdict(lambda: [None] * tp)
    for (idx, t), p in sorted(tf.layers.items()):
        tree = load_torch_zip(p)
        if not isinstance(tree, dict):
            raise NotQuick(f"{p.name}: not a layer state dict")
        for key, v in tree.items():
            if isinstance(v, TensorMeta):
                entries[(idx, key)][t] = v
    return dict(entries)


def _rank(tf: TagFiles, mp: int, pipeline: bool) -> _Rank:
    """deepspeed_zero.read_rank on the pickles' structure: the model states (ZeRO-3: one file per DP
    rank), frozen parameters, buffers and aliases, and the fp32 masters placed in their partitions."""
    zero3_files = {d: p for (d, m), p in tf.zero_model.items() if m == mp}
    if zero3_files:
        metas = {d: load_torch_zip(p) for d, p in sorted(zero3_files.items())}
    elif mp in tf.model:
        metas = {0: load_torch_zip(tf.model[mp])}
    else:
        raise NotQuick(f"no model states for MP rank {mp}")
    meta = metas[min(metas)]
    if not isinstance(meta, dict) or "module" not in meta:
        raise NotQuick("no module entry")
    if meta.get("module") if pipeline else not isinstance(meta.get("module"), dict):
        raise NotQuick("module weights in a pipeline save")
    module = {k: v for k, v in (meta.get("module") or {}).items() if isinstance(v, TensorMeta)}
    parts = dict(module=module, shared=dict(meta.get("shared_params") or {}),
                 buffers={n: module[n] for n in (meta.get("buffer_names") or []) if n in module})
    paths = {d: p for (d, m), p in tf.optim.items() if m == mp}
    if not paths:  # the layer files' or `module`'s 16-bit weights are the only ones
        return _Rank(meta, {}, _param_shapes(meta), {}, None, "none", frozen=_frozen(meta, metas, None), **parts)
    osds = {}
    for d, p in sorted(paths.items()):
        tree = load_torch_zip(p)
        osds[d] = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
        if not isinstance(osds[d], dict):
            raise NotQuick("no optimizer_state_dict")
    first = osds[min(osds)]
    count = first.get("partition_count")
    count = max((c for c in count if type(c) is int), default=0) if isinstance(count, (list, tuple)) else count
    if set(range(max(max(osds) + 1, count if type(count) is int else 0))) != set(osds):
        raise NotQuick("an optimizer shard is missing")
    z = first.get("zero_stage")
    stage = None if z is None else int(getattr(z, "value", z))
    shapes = _param_shapes(meta)
    if stage == 3 or "fp32_flat_groups" in first:
        if type(count) is int and count != len(osds):
            raise NotQuick("ZeRO-3 shards cut for another count of ranks")
        master = _place_zero3([_flat_list(osds[d], "fp32_flat_groups") for d in sorted(osds)], shapes)
        return _Rank(meta, osds, shapes, master, 3, "zero3", frozen=_frozen(meta, metas, 3), **parts)
    groups = [osds[d].get("single_partition_of_fp32_groups") for d in sorted(osds)]
    if any(not isinstance(g, list) or len(g) != len(shapes) for g in groups):
        raise NotQuick("param_shapes does not describe the fp32 partitions")
    mappings = [osds[d].get("param_slice_mappings") for d in sorted(osds)]
    master = _place(groups, mappings, shapes, check_tail=True)
    return _Rank(meta, osds, shapes, master, stage or 1, "zero" if stage is not None else "bf16_optimizer",
                 frozen=_frozen(meta, metas, stage or 1), **parts)


def _flat_list(osd: dict, key: str) -> list:
    flats = osd.get(key)
    if not isinstance(flats, (list, tuple)) or not flats:
        raise NotQuick(f"no {key}")
    return list(flats)


def _frozen(meta: dict, metas: Dict[int, dict], stage: Optional[int]) -> Dict[str, TensorMeta]:
    """deepspeed_zero._frozen: a frozen parameter from the fragments every ZeRO-3 rank saves, or from
    DP rank 0's whole fragment (ZeRO-1/2); neither: left to `module` (_named)."""
    out = {}
    for name, shape in (meta.get("frozen_param_shapes") or {}).items():
        shape = tuple(int(x) for x in shape)
        frags = [m.get("frozen_param_fragments", {}).get(name) for _, m in sorted(metas.items())]
        if stage == 3 and all(f is not None for f in frags):
            if any(not isinstance(f, TensorMeta) or len(f.shape) != 1 for f in frags) or len({f.dtype for f in frags}) != 1 \
                    or sum(f.shape[0] for f in frags) < math.prod(shape):
                raise NotQuick(f"the fragments of frozen {name} do not hold it")
            out[name] = TensorMeta(shape, frags[0].dtype)
        elif isinstance(frags[0], TensorMeta) and math.prod(frags[0].shape) == math.prod(shape):
            out[name] = TensorMeta(shape, frags[0].dtype)
    return out


def _place_zero3(flats: List[list], shapes) -> Dict[str, TensorMeta]:
    """deepspeed_zero._zero3_params on shapes: every parameter cut into ws equal (padded) slices, one
    at the same offset in each rank's sub-group flats taken end to end, checked to fit every rank."""
    every = [f for rank in flats for f in rank]
    if any(not isinstance(f, TensorMeta) or len(f.shape) != 1 for f in every) or len({f.dtype for f in every}) != 1:
        raise NotQuick("ZeRO-3 flats of several dtypes")
    ws, dtype = len(flats), every[0].dtype
    room = min(sum(f.shape[0] for f in rank) for rank in flats)
    out, offset = {}, 0
    for names in shapes:
        for name, shape in names.items():
            offset += -(-math.prod(shape) // ws)
            if offset > room:
                raise NotQuick(f"the ZeRO-3 partitions do not hold {name}")
            out[name] = TensorMeta(shape, dtype)
    return out


def _param_shapes(meta) -> List["OrderedDict[str, tuple]"]:
    ps = meta.get("param_shapes")
    if ps is None:
        return []
    ps = [ps] if isinstance(ps, dict) else ps
    return [OrderedDict((k, tuple(int(x) for x in v)) for k, v in g.items()) for g in ps]


def _place(groups: List[list], mappings: List[Optional[list]], shapes, check_tail: bool) -> Dict[str, TensorMeta]:
    """deepspeed_zero._zero12_params on shapes: each parameter's fragments in the per-rank, per-group flat
    partitions (groups[rank][group]), checked to hold exactly its elements; its dtype the partitions'."""
    out: Dict[str, TensorMeta] = {}
    for g, names in enumerate(shapes):
        parts = [grp[g] for grp in groups]
        if any(not isinstance(p, TensorMeta) or len(p.shape) != 1 for p in parts) or len({p.dtype for p in parts}) != 1:
            raise NotQuick("flat partitions of several dtypes")
        dtype = parts[0].dtype
        if all(m is not None for m in mappings):
            for name, shape in names.items():
                got = 0
                for r, m in enumerate(mappings):
                    frag = m[g].get(name)
                    numel = int(frag.numel) if frag is not None else 0
                    if numel:
                        if not 0 <= int(frag.start) <= int(frag.start) + numel <= parts[r].shape[0]:
                            raise NotQuick(f"a fragment of {name} outside its partition")
                        got += numel
                if got != math.prod(shape):
                    raise NotQuick(f"the partitions hold {got} elements of {name}")
                out[name] = TensorMeta(shape, dtype)
            continue
        offset, total = 0, sum(p.shape[0] for p in parts)
        for name, shape in names.items():
            offset += math.prod(shape)
            out[name] = TensorMeta(shape, dtype)
        if offset > total or (check_tail and total - offset >= 2 * len(parts)):
            raise NotQuick("param_shapes does not describe the partitions")
    return out


def _zero3(osd: dict) -> bool:
    z = osd.get("zero_stage")
    return "fp32_flat_groups" in osd or (z is not None and int(getattr(z, "value", z)) == 3)


def _base(osd: dict) -> dict:
    """The wrapped torch optimizer's state_dict (deepspeed_zero.base_optimizer)."""
    base = osd.get("optimizer_state_dict") if _zero3(osd) else osd.get("base_optimizer_state")
    if isinstance(base, list) or osd.get("elastic_checkpoint"):
        raise NotQuick("an elastic checkpoint")  # the full reader refuses its moments when they are read
    return base if isinstance(base, dict) else {}


def _optimizer(ranks: Dict[int, _Rank], tensors: Dict[str, TensorMeta]) -> Optional[OptimizerState]:
    if not all(_base(r.osds[0]).get("state") for r in ranks.values()):
        return None  # never stepped: the weights only
    r0 = ranks[0]
    dtypes: Dict[str, set] = {"master": {t.dtype for r in ranks.values() for t in r.master.values()}}
    for key in MOMENTS:
        dtypes[key] = {t.dtype for r in ranks.values() for t in held_moments(r, key).values()}
    if any(len(d) != 1 for d in dtypes.values()):
        raise NotQuick("a slot of several dtypes")
    slot_dtype = {s: next(iter(d)) for s, d in dtypes.items()}
    slots = {s: {n: TensorMeta(t.shape, slot_dtype[s]) for n, t in tensors.items()} for s in ("master",) + MOMENTS}
    osd0 = r0.osds[0]
    scaler = {k: osd0[k] for k in SCALER_KEYS if k in osd0}
    return OptimizerState(kind="deepspeed-bf16" if r0.kind == "bf16_optimizer" else f"deepspeed-zero{r0.stage}",
                          slots=slots, step=_step(r0), param_groups=_groups(ranks, tensors),
                          grad_scaler=scaler or None, scheduler=r0.meta.get("lr_scheduler"),
                          consumed_samples=r0.meta.get("global_samples"))


def held_moments(r: _Rank, key: str) -> Dict[str, TensorMeta]:
    """Engine parameter name -> its Adam `key` moment, placed exactly like its fp32 master
    (deepspeed_zero.rank_moments): the same partitions, offsets and slice mappings."""
    flats = [_moment_flats(r.osds[d], key) for d in sorted(r.osds)]
    if r.kind == "zero3":
        return _place_zero3(flats, r.shapes)
    return _place(flats, [r.osds[d].get("param_slice_mappings") for d in sorted(r.osds)], r.shapes, check_tail=False)


def _moment_flats(osd: dict, key: str) -> List[TensorMeta]:
    """One DP rank's `key` flats, checked against its fp32 partitions (deepspeed_zero._moment_flats)."""
    state = _base(osd).get("state")
    if _zero3(osd):
        masters, paddings = osd["fp32_flat_groups"], None
    else:
        masters, paddings = osd["single_partition_of_fp32_groups"], osd.get("group_paddings")
    if not isinstance(state, dict):
        raise NotQuick("no torch optimizer state")
    out = []
    for g, master in enumerate(masters):
        t = (state.get(g) or {}).get(key)
        pad = int(paddings[g]) if paddings and g < len(paddings) else 0
        if not isinstance(t, TensorMeta) or len(t.shape) != 1 or \
                t.shape[0] not in (master.shape[0], master.shape[0] + pad):
            raise NotQuick(f"group {g} {key} does not fit its partition")
        out.append(TensorMeta(master.shape, t.dtype))
    return out


def _step(r0: _Rank) -> Optional[int]:
    state = _base(r0.osds[0]).get("state")
    first = state.get(0) if isinstance(state, dict) else None
    step = first.get("step") if isinstance(first, dict) else None
    if isinstance(step, Scalar):
        if step.value is None:
            raise NotQuick("a step whose value is not in the pickle")
        step = step.value
    elif isinstance(step, TensorMeta):
        raise NotQuick("a step tensor that is not a scalar")
    return int(step) if type(step) in (int, float) else None


def _no_decay(hyper: dict) -> bool:
    return hyper["wd_mult"] == 0 if "wd_mult" in hyper else hyper.get("weight_decay") == 0


def _groups(ranks: Dict[int, _Rank], tensors: Dict[str, TensorMeta]) -> List[ParamGroup]:
    """Each torch param group with the canonical tensors its flats feed. The full reader traces every
    flat through the name mapping; here a group's tensors are those with its weight-decay trait, which
    holds where every parameter of every group's flats has its group's trait and the groups' traits
    differ (a fused QKV weight is 2-D like q, k and v; a bias stays a bias)."""
    r0 = ranks[0]
    flats = len(r0.shapes)
    stored = [g for g in _base(r0.osds[0]).get("param_groups") or [] if isinstance(g, dict)]
    if not stored:
        raise NotQuick("param groups without hyperparameters")
    listed = [f for g in stored for f in g.get("params", [])]
    if sorted(listed) != list(range(flats)):
        raise NotQuick("the param groups do not step the flats param_shapes describes")
    if len(stored) == 1:  # every flat is its: every canonical tensor
        return [ParamGroup(list(tensors), {k: v for k, v in stored[0].items() if k != "params"})]
    traits = [_no_decay(g) for g in stored]
    if len(set(t for t, g in zip(traits, stored) if g.get("params"))) != sum(1 for g in stored if g.get("params")):
        raise NotQuick("groups the weight-decay trait does not tell apart")
    for trait, g in zip(traits, stored):
        for f in g.get("params", []):
            for r in ranks.values():
                if any((n.endswith("bias") or len(s) == 1) != trait for n, s in r.shapes[f].items()):
                    raise NotQuick("a parameter outside its group's trait")
    return [ParamGroup([n for n, t in tensors.items()
                        if g.get("params") and (n.endswith("bias") or len(t.shape) == 1) == trait],
                       {k: v for k, v in g.items() if k != "params"}) for trait, g in zip(traits, stored)]

