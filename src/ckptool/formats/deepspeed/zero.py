"""DeepSpeed tag directories: which files are there, and ZeRO partitions back into parameters.

Facts (shared/reference/deepspeed.md 1.1-1.4):
  mp_rank_XX_model_states.pt              ZeRO 0/1/2 and pipeline runs, one per model-parallel rank
  zero_pp_rank_D_mp_rank_XX_model_states.pt  ZeRO-3, one per data-parallel rank D
  [bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt  the fp32 master partition of DP rank D
  layer_LL[-model_TT]-model_states.pt     pipeline (PipelineModule) layer weights, TP rank TT

Everything here is lazy: a parameter is the narrow()s of the flat partitions that hold it,
concatenated on load, so only that parameter's bytes are read (ZeRO-3: one slice per rank).
Names returned are the engine's parameter names (module.named_parameters()).
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...errors import CkptError
from ...io.torchfile import load_torch_file
from ...lazy import Derived, LazyTensor, cat
from .files import (LAYER_RE, MODEL_RE, OPTIM_RE, TAG_DIR, TagFiles,  # noqa: F401
                              looks_like_deepspeed, resolve_tag_dir, scan_tag_dir)

def find_files(path: Path, iteration: Optional[int] = None) -> TagFiles:
    tf = scan_tag_dir(resolve_tag_dir(path, iteration))
    if not (tf.model or tf.zero_model):
        raise CkptError(f"{tf.tag_dir}: no mp_rank_*_model_states.pt files",
                        "the model-state files are missing; copy the complete global_step directory")
    return tf


# --- lazy pieces ------------------------------------------------------------------------------

def reshape(t: LazyTensor, shape) -> LazyTensor:
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    return Derived(lambda x: x.reshape(shape), [t], shape=shape, dtype=t.dtype)


def virtual_slice(parts: List[LazyTensor], start: int, numel: int, what: str) -> LazyTensor:
    """Elements [start, start+numel) of the concatenation of 1-D parts, reading only those."""
    pieces, base = [], 0
    for p in parts:
        n = p.shape[0]
        lo, hi = max(start, base), min(start + numel, base + n)
        if lo < hi:
            pieces.append(p.narrow(0, lo - base, hi - lo))
        base += n
    got = sum(x.shape[0] for x in pieces)
    if got != numel:
        raise CkptError(f"{what}: the optimizer partitions hold {got} of its {numel} elements",
                        "the optimizer shards are incomplete or do not belong to these model states")
    return cat(pieces) if pieces else parts[0].narrow(0, 0, 0)


# --- reading the states of one model-parallel rank ------------------------------------------

@dataclass
class RankStates:
    """What one model-parallel rank's files say, with ZeRO partitions already reassembled."""
    meta: dict  # the DP-rank-0 model-states dict (args, param_shapes, shared_params, ...)
    module: Dict[str, LazyTensor]  # the `module` state dict (16-bit weights, buffers); {} for pipelines
    master: Dict[str, LazyTensor]  # fp32 masters of trainable params ({} when no optimizer shards)
    frozen: Dict[str, LazyTensor]  # frozen params (16-bit), from fragments or from `module`
    buffers: Dict[str, LazyTensor]
    shared: Dict[str, str]  # alias -> owner
    zero_stage: Optional[int]  # 1, 2, 3; 1 for BF16_Optimizer files (no zero_stage key)
    optimizer_kind: str  # "zero" | "bf16_optimizer" | "zero3" | "none"
    dp: int
    osds: Dict[int, dict] = field(default_factory=dict)  # DP rank -> optimizer_state_dict (lazy tensors)
    optim_paths: Dict[int, Path] = field(default_factory=dict)  # DP rank -> its optimizer shard file
    tag_dir: Optional[Path] = None
    missing_shard: Optional[str] = None  # "<file> is missing ..." when some DP rank's shard is absent


# model-states keys a DeepSpeed engine reads back besides the weights (kept for ds-universal output)
ENGINE_STATE_KEYS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                     "lr_scheduler", "ds_version", "ds_config", "iteration", "checkpoint_version", "tokens")


def engine_state(meta: dict) -> dict:
    """The engine counters and client state of a model-states dict (None where it keeps none)."""
    return {k: meta.get(k) for k in ENGINE_STATE_KEYS}


def param_shapes(meta) -> List["OrderedDict[str, tuple]"]:
    """The engine's parameter names and shapes per optimizer param group, in group order."""
    ps = meta.get("param_shapes")
    if ps is None:
        return []
    if isinstance(ps, dict):  # very old engines stored one dict
        ps = [ps]
    return [OrderedDict((k, tuple(v)) for k, v in g.items()) for g in ps]


def _partition_count(osd) -> int:
    """How many DP ranks the shard says it was cut for (a list per group for ZeRO-1/2, an int for ZeRO-3)."""
    count = osd.get("partition_count")
    if isinstance(count, (list, tuple)) and count:
        return max(int(c) for c in count if isinstance(c, int)) if any(isinstance(c, int) for c in count) else 0
    return count if isinstance(count, int) else 0


def _stage_of(osd) -> Optional[int]:
    z = osd.get("zero_stage")
    if z is None:
        return None
    return int(getattr(z, "value", z))


def read_rank(tf: TagFiles, mp: int) -> RankStates:
    zero3_files = {d: p for (d, m), p in tf.zero_model.items() if m == mp}
    if zero3_files:
        metas = {d: load_torch_file(p) for d, p in sorted(zero3_files.items())}
    else:
        if mp not in tf.model:
            raise CkptError(f"{tf.tag_dir}: no mp_rank_{mp:02d}_model_states.pt",
                            "copy the complete global_step directory")
        metas = {0: load_torch_file(tf.model[mp])}
    meta = metas[min(metas)]
    if not isinstance(meta, dict) or "module" not in meta:
        raise CkptError(f"{tf.tag_dir}: model-states file for MP rank {mp} has no `module` entry",
                        "not a DeepSpeed engine checkpoint")
    module = meta.get("module") or {}
    module = {k: v for k, v in module.items()} if isinstance(module, dict) else {}
    shared = dict(meta.get("shared_params") or {})
    buffers = {n: module[n] for n in (meta.get("buffer_names") or []) if isinstance(module.get(n), LazyTensor)}

    optim_paths = {d: p for (d, m), p in tf.optim.items() if m == mp}
    osds = {d: _optimizer_state(load_torch_file(p), p) for d, p in sorted(optim_paths.items())}
    master: Dict[str, LazyTensor] = {}
    stage, kind, dp = None, "none", max(1, len(osds))
    if osds:
        absent = set(range(max(max(osds) + 1, _partition_count(osds[min(osds)])))) - set(osds)
        if absent:
            # Kept apart rather than refused here: --weights model needs no optimizer shard.
            gap = min(absent)
            missing = re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{gap}_", optim_paths[min(osds)].name)
            return RankStates(meta, module, {}, _frozen(meta, metas, module, None), buffers, shared, None, "none",
                              1, {}, {}, tf.tag_dir, missing_shard=f"{tf.tag_dir / missing} is missing (the "
                              f"optimizer shards of MP rank {mp} cover DP ranks {sorted(osds)})")
        first = osds[0]
        stage = _stage_of(first)
        if stage == 3 or "fp32_flat_groups" in first:
            stage, kind = 3, "zero3"
            master = _zero3_master(osds, param_shapes(meta), tf.tag_dir)
        else:
            kind = "zero" if stage is not None else "bf16_optimizer"
            stage = stage or 1  # BF16_Optimizer partitions like ZeRO-1
            master = _zero12_master(osds, param_shapes(meta), tf.tag_dir)
    frozen = _frozen(meta, metas, module, stage)
    return RankStates(meta, module, master, frozen, buffers, shared, stage, kind, dp, osds, optim_paths, tf.tag_dir)


def _optimizer_state(tree, path) -> dict:
    osd = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
    if not isinstance(osd, dict):
        raise CkptError(f"{path.name}: no optimizer_state_dict", "not a DeepSpeed ZeRO optimizer shard")
    if osd.get("elastic_checkpoint") or isinstance(osd.get("base_optimizer_state"), list):
        pass  # elastic files keep the same fp32 partitions; only the moments are stored differently
    return osd


def _zero12_master(osds: Dict[int, dict], shapes, tag_dir) -> Dict[str, LazyTensor]:
    """ZeRO-1/2 and BF16_Optimizer: per group one flat fp32 vector cut into DP partitions."""
    ranks = [osds[d] for d in sorted(osds)]
    groups = [r.get("single_partition_of_fp32_groups") for r in ranks]
    if any(g is None for g in groups):
        raise CkptError(f"{tag_dir}: an optimizer shard lacks single_partition_of_fp32_groups",
                        "not a ZeRO-1/2 or BF16_Optimizer shard")
    if len(shapes) != len(groups[0]):
        raise CkptError(f"{tag_dir}: param_shapes lists {len(shapes)} groups but the optimizer holds "
                        f"{len(groups[0])}", "the model states and optimizer shards come from different saves")
    return _zero12_params(groups, [r.get("param_slice_mappings") for r in ranks], shapes, tag_dir, check_tail=True)


def _zero12_params(groups: List[list], mappings: List[Optional[list]], shapes, tag_dir,
                   check_tail: bool) -> Dict[str, LazyTensor]:
    """Parameters out of per-rank, per-group flat partitions (groups[rank][group]).

    The fp32 masters and the Adam moments share one placement: a moment partition is its master
    partition plus (at most) the group's trailing alignment padding, so the same offsets serve both."""
    out: Dict[str, LazyTensor] = {}
    for g, names in enumerate(shapes):
        parts = [grp[g] for grp in groups]
        if all(m is not None for m in mappings):
            # Each rank says where each parameter's fragment starts in its partition; this also
            # survives per-parameter alignment padding (param_alignment_paddings, DeepSpeed >= 0.19).
            for name, shape in names.items():
                pieces = []
                for r, m in enumerate(mappings):
                    frag = m[g].get(name)
                    if frag is not None and int(frag.numel):
                        pieces.append(parts[r].narrow(0, int(frag.start), int(frag.numel)))
                numel = math.prod(shape)
                got = sum(p.shape[0] for p in pieces)
                if got != numel:
                    raise CkptError(f"{name}: the optimizer partitions hold {got} of its {numel} elements",
                                    "the optimizer shards are incomplete or do not belong to these model states")
                out[name] = reshape(cat(pieces), shape)
            continue
        offset = 0  # older files: parameters back to back, padding only at the group's end
        for name, shape in names.items():
            numel = math.prod(shape)
            out[name] = reshape(virtual_slice(parts, offset, numel, name), shape)
            offset += numel
        total = sum(p.shape[0] for p in parts)
        # What is left is the group's alignment padding (< 2 * dp elements; kept by BF16_Optimizer).
        if check_tail and (offset > total or total - offset >= 2 * len(parts)):
            raise CkptError(f"{tag_dir}: group {g} consumed {offset} of {total} master elements",
                            "param_shapes does not describe these optimizer partitions")
    return out


def _zero3_master(osds: Dict[int, dict], shapes, tag_dir) -> Dict[str, LazyTensor]:
    """ZeRO-3: every parameter is cut into ws equal (padded) slices, one per rank."""
    ws = len(osds)
    count = osds[0].get("partition_count")
    if isinstance(count, int) and count != ws:
        raise CkptError(f"{tag_dir}: the ZeRO-3 shards say {count} partitions but {ws} files are present",
                        "copy every zero_pp_rank_* shard of this step")
    return _zero3_params([list(osds[d]["fp32_flat_groups"]) for d in sorted(osds)], shapes, tag_dir)


def _zero3_params(flats: List[list], shapes, tag_dir) -> Dict[str, LazyTensor]:
    """Parameters out of per-rank lists of sub-group flats (masters and moments alike)."""
    ws = len(flats)
    out: Dict[str, LazyTensor] = {}
    offset = 0
    for names in shapes:
        for name, shape in names.items():
            numel = math.prod(shape)
            pn = -(-numel // ws)
            pieces = [virtual_slice(flats[r], offset, pn, name) for r in range(ws)]
            full = cat(pieces)
            out[name] = reshape(full.narrow(0, 0, numel) if full.shape[0] != numel else full, shape)
            offset += pn
    have = sum(f.shape[0] for f in flats[0])
    if offset > have:
        raise CkptError(f"{tag_dir}: param_shapes needs {offset} elements per rank but the shards hold {have}",
                        "the model states and optimizer shards come from different saves")
    return out


# --- Adam moments (read only when optimizer state is asked for) -----------------------------

MOMENTS = ("exp_avg", "exp_avg_sq")
NO_OPTIMIZER_HINT = "pass --no-optimizer to convert the weights only"


def _moment_flats(r: "RankStates", d: int, key: str) -> list:
    """Per group (ZeRO-3: per sub-group) flat `key` tensors of DP rank d, checked against the masters."""
    osd, path = r.osds[d], r.optim_paths[d]
    if r.optimizer_kind == "zero3":
        base, masters, paddings = osd.get("optimizer_state_dict"), list(osd["fp32_flat_groups"]), None
    else:
        base = osd.get("base_optimizer_state")
        masters, paddings = list(osd["single_partition_of_fp32_groups"]), osd.get("group_paddings")
    if isinstance(base, list) or osd.get("elastic_checkpoint"):
        raise CkptError(f"{path.name}: an elastic ZeRO checkpoint keeps its Adam moments per group without "
                        "placement information ckptool can check", NO_OPTIMIZER_HINT)
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict):
        raise CkptError(f"{path.name}: no torch optimizer state beside the fp32 partitions", NO_OPTIMIZER_HINT)
    out = []
    for g, master in enumerate(masters):
        t = (state.get(g) or {}).get(key)
        if not isinstance(t, LazyTensor):
            raise CkptError(f"{path.name}: group {g} has no {key} (an optimizer that never stepped, or not Adam)",
                            NO_OPTIMIZER_HINT)
        pad = int(paddings[g]) if paddings and g < len(paddings) else 0
        if t.numel not in (master.numel, master.numel + pad):
            raise CkptError(f"{path.name}: group {g} {key} holds {t.numel} elements but its fp32 partition "
                            f"{master.numel} (+{pad} padding)", NO_OPTIMIZER_HINT)
        out.append(t.narrow(0, 0, master.numel) if t.numel != master.numel else t)
    return out


def rank_moments(r: "RankStates") -> Dict[str, Dict[str, LazyTensor]]:
    """{"exp_avg": {param name: lazy}, "exp_avg_sq": {...}} of one MP rank, placed exactly like its
    fp32 masters (the same partitions, offsets and slice mappings)."""
    if not r.osds:
        return {}
    shapes = param_shapes(r.meta)
    out = {}
    for key in MOMENTS:
        flats = [_moment_flats(r, d, key) for d in sorted(r.osds)]
        if r.optimizer_kind == "zero3":
            out[key] = _zero3_params(flats, shapes, r.tag_dir)
        else:
            mappings = [r.osds[d].get("param_slice_mappings") for d in sorted(r.osds)]
            out[key] = _zero12_params(flats, mappings, shapes, r.tag_dir, check_tail=False)
    return out


def base_optimizer(r: "RankStates") -> dict:
    """The wrapped torch optimizer's state_dict of DP rank 0 (param_groups, per-group step)."""
    osd = r.osds.get(0) or {}
    base = osd.get("optimizer_state_dict") if r.optimizer_kind == "zero3" else osd.get("base_optimizer_state")
    return base if isinstance(base, dict) else {}


def _frozen(meta, metas, module, stage) -> Dict[str, LazyTensor]:
    shapes = meta.get("frozen_param_shapes") or {}
    out: Dict[str, LazyTensor] = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        numel = math.prod(shape)
        frags = [m.get("frozen_param_fragments", {}).get(name) for _, m in sorted(metas.items())]
        if stage == 3 and all(f is not None for f in frags):
            have = sum(f.numel for f in frags)
            if have < numel:  # each rank holds its padded share: together at least the parameter
                raise CkptError(f"ZeRO-3 frozen parameter {name} {list(shape)}: the model-states files' "
                                f"frozen_param_fragments hold {have} of its {numel} elements",
                                "the save is incomplete or damaged: copy it again from the run")
            full = cat(frags)
            out[name] = reshape(full.narrow(0, 0, numel), shape)
        elif frags[0] is not None and frags[0].numel == numel:
            out[name] = reshape(frags[0], shape)
    return out
