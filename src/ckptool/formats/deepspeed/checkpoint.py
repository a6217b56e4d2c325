"""DeepSpeed checkpoints (global_stepN/ or the save dir holding `latest`) as ckptool sources.

Three kinds of model hide behind DeepSpeed's files, told apart by parameter names:
  Megatron-DeepSpeed pipeline  layer_* files, pipe names `<idx>.<key>` (deepspeed/pipeline.py)
  Megatron names under module  2019 DeepSpeedExamples flat keys, MDS --no-pipeline-parallel
  Hugging Face names           any HF model trained under DeepSpeed (GPT-2 and the Llama family
                               become GPT sources through hf/reader.py's tables; every model can be
                               consolidated with consolidate_hf_state / deepspeed/hf_export.py)

Which weights (--weights): `master` = fp32 masters reassembled from the optimizer partitions, as
zero_to_fp32 does (default where shards exist); `model` = the 16-bit module weights the engine
saved (module / layer files; ZeRO-3 keeps none). They differ by 16-bit rounding, so the choice is
always visible in `inspect`.

The optimizer state (fp32 masters, Adam moments, step, param groups) becomes Checkpoint.optimizer
(deepspeed/optim.py), built on first use through the same name mapping as the weights; the engine
names and counters the ds-universal writer needs are kept in source.extra.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple


from ...config import Layout
from ...errors import CkptError, NoCanonicalForm, require
from ...io.torchfile import load_torch_file
from ...lazy import Derived, LazyTensor
from ...options import ReadOptions
from ...roles import HEAD_COPY, assemble
from ...sharding import ReplicaPolicy
from ...state import Checkpoint, SourceInfo, expected_names, in_model_order
from ...vocab import with_true_vocab_size
from ..megatron import args as megatron_args
from ..hf import reader as hf_format
from .optim import optimizer_state, stepped
from .hf_export import write_hf_state
from .tied import TiedCopies
from .universal_source import engine_universal
from .universal import export_universal
from ..registry import ways_out
from .zero import RankStates, engine_state, find_files, looks_like_deepspeed, read_rank, param_shapes
from .files import find_hf_config, looks_megatron, megatron_key  # noqa: F401 (this module's interface)
from ..megatron.checkpoint import config_for_shards, detect_dialect, flatten
from ...summary import WriteSummary
from ..megatron.names import KeyMatcher, is_ignorable, qkv_to_grouped
from . import pipeline as mds

FORMAT = "deepspeed"
WEIGHTS = ("master", "model")


def looks_like(path) -> bool:
    return looks_like_deepspeed(Path(path))


# --- which weights --------------------------------------------------------------------------

def available_weights(ranks: Dict[int, RankStates], has_layers: bool) -> Tuple[str, ...]:
    """The --weights choices this save holds: master (every rank's optimizer shards), model (layer files
    or real module weights; ZeRO-3 keeps 0-element placeholders)."""
    has_master = all(r.master for r in ranks.values())
    has_model = has_layers or all(_module_has_weights(r) for r in ranks.values())
    return tuple(w for w, held in zip(WEIGHTS, (has_master, has_model)) if held)


def _choose_weights(requested: Optional[str], ranks: Dict[int, RankStates], has_layers: bool) -> str:
    missing = next((r.missing_shard for r in ranks.values() if r.missing_shard), None)
    if missing and requested != "model":
        raise CkptError(missing, "copy the complete global_step directory, or pass --weights model "
                        "(the 16-bit module weights) with --no-optimizer")
    held = available_weights(ranks, has_layers)
    has_master, has_model = "master" in held, "model" in held
    if requested is None:
        if not has_master and not has_model:  # a ZeRO-3 save copied without its optimizer shards
            raise CkptError("this checkpoint has no ZeRO optimizer shards and keeps no 16-bit module weights "
                            "(ZeRO-3 saves 0-element placeholders)", "copy the *_optim_states.pt files of this step too")
        return "master" if has_master else "model"
    require(requested in WEIGHTS, f"unknown --weights {requested!r}", "choose master or model")
    if requested == "master" and not has_master:
        raise CkptError("this checkpoint has no ZeRO optimizer shards, so no fp32 master weights",
                        "use --weights model")
    if requested == "model" and not has_model:
        raise CkptError("this checkpoint keeps no 16-bit module weights (ZeRO-3 saves 0-element placeholders)",
                        "use --weights master")
    return requested


def _module_has_weights(r: RankStates) -> bool:
    tensors = [v for v in r.module.values() if isinstance(v, LazyTensor)]
    return bool(tensors) and all(v.numel > 0 for v in tensors)


def named_weights(r: RankStates, weights: str) -> Dict[str, LazyTensor]:
    """Engine parameter name -> lazy tensor for one MP rank: trainable, frozen, buffers, aliases."""
    if weights == "model":
        return {k: v for k, v in r.module.items() if isinstance(v, LazyTensor)}
    out: Dict[str, LazyTensor] = dict(r.master)
    out.update({k: v for k, v in r.frozen.items() if k not in out})
    out.update({k: v for k, v in r.buffers.items() if k not in out})
    # ZeRO-1 never saves frozen params apart (deepspeed.md 1.2): take them from `module`.
    for k, v in r.module.items():
        if k not in out and k not in r.shared and isinstance(v, LazyTensor) and v.numel > 0:
            out[k] = v
    for alias, owner in r.shared.items():
        if owner in out and alias not in out:
            out[alias] = out[owner]
    return out


# --- reading --------------------------------------------------------------------------------

def _open(path, opts: ReadOptions):
    tf = find_files(Path(path), opts.iteration)
    ranks = {mp: read_rank(tf, mp) for mp in tf.mp_ranks}
    weights = _choose_weights(opts.weights, ranks, bool(tf.layers))
    return tf, ranks, weights


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    opts = opts or ReadOptions()
    tf, ranks, weights = _open(path, opts)
    warnings: List[str] = []
    policy = ReplicaPolicy(opts.replicas, warnings.append)
    tied = TiedCopies(warnings)  # one line per tied tensor, for the weights and every optimizer slot
    r0 = ranks[0]
    # A pipeline's 16-bit weights live in its layer files; everything else is named per MP rank.
    named = None if tf.layers and weights == "model" else {mp: named_weights(r, weights) for mp, r in ranks.items()}
    cfg, tensors, layout, dialect, naming = _canonical(tf, ranks, named, opts, policy, warnings, tied)
    layout.dp = r0.dp
    args = _args_with_true_vocab(r0.meta.get("args"), cfg)
    stage = f"zero-{r0.zero_stage}" if r0.zero_stage else "no ZeRO"
    if r0.optimizer_kind == "bf16_optimizer":
        stage = "BF16_Optimizer"
    dtype = next(iter(tensors.values())).dtype if tensors else None
    info = SourceInfo(path=str(path), format=FORMAT,
                      dialect=dialect, storage=f"{stage}, {weights} weights ({str(dtype).replace('torch.', '')})",
                      layout=layout, iteration=r0.meta.get("iteration", r0.meta.get("global_steps")),
                      checkpoint_version=r0.meta.get("checkpoint_version"), args=args,
                      extra={"replica_policy": policy, "weights": weights, "zero_stage": r0.zero_stage,
                             "weights_held": available_weights(ranks, bool(tf.layers)),  # verify's FAIL hint
                             "optimizer": r0.optimizer_kind, "tag_dir": str(tf.tag_dir),
                             # pipeline saves: spec index -> embed | layer | final_norm | head (deepspeed/ranks.py)
                             "pipe_kinds": (naming or {}).get("kinds") if tf.layers else None,
                             "universal_checkpoint_info": r0.meta.get("universal_checkpoint_info"),
                             "engine_state": engine_state(r0.meta),
                             "param_names": naming})
    tensors = in_model_order(tensors, cfg)
    missing = [n for n in expected_names(cfg) if n not in tensors]
    if missing:
        raise CkptError(f"{tf.tag_dir}: {len(missing)} tensors of the model are missing (e.g. {missing[0]})",
                        "the checkpoint is incomplete")
    ckpt = Checkpoint(cfg, tensors, info, warnings)
    wanted = getattr(opts, "optimizer", True)  # --no-optimizer: leave it unread
    if wanted and (all(r.osds and stepped(r) for r in ranks.values()) or any(r.missing_shard for r in ranks.values())):
        ckpt.optimizer = optimizer_state(tf, ranks, opts, cfg, warnings,
                                         canonical=lambda *a: _canonical(*a, tied),
                                         named_weights=named_weights)
    return ckpt


def _canonical(tf, ranks, named, opts, policy, warnings, tied: TiedCopies):
    """(cfg, canonical tensors, layout, dialect, naming) from one name -> tensor dict per MP rank
    (named; None: a pipeline's layer files). Weights and every optimizer slot go through here, so
    a slot's canonical names and shapes are the weights' by construction; warnings is an optimizer
    slot's sink (deepspeed_optim._SlotWarnings, which names the slot) or the checkpoint's list."""
    if tf.layers:
        return _read_pipeline(tf, ranks, named, opts, policy, warnings, tied)
    if mds.is_pipe_names(named[0]):
        raise CkptError(f"{tf.tag_dir}: pipeline parameter names but no layer_* files",
                        "copy the layer_*-model_states.pt files of this step too")
    if looks_megatron(named[0]):
        return _read_megatron_module(named, ranks[0], opts, policy)
    return _read_hf_gpt(tf, ranks, named, opts)


def _args_with_true_vocab(args, cfg):
    """A copy of args that say the true vocabulary, so written checkpoints keep it.

    Megatron-DeepSpeed's NullTokenizer adds an end-of-document token: args.vocab_size 1000 means
    1001 real rows (universal_checkpoint_info.original_vocab_size); such args already say 1001
    (megatron_args.vocab_args counts the old NullTokenizer's EOD). Writers copy the args, and a later
    reader of the output would trim a real row where they said less."""
    if args is None or cfg.vocab_size is None:
        return args
    updates = megatron_args.vocab_args(args, cfg.vocab_size)
    if all(getattr(args, k, None) == v for k, v in updates.items()):
        return args
    fixed = copy.copy(args)
    for k, v in updates.items():
        setattr(fixed, k, v)
    return fixed


def _gpt_config(args, rows: int, meta: dict, opts: ReadOptions, num_layers: int):
    if args is None:
        return None
    extra = {"universal_checkpoint_info": meta.get("universal_checkpoint_info")}
    cfg = megatron_args.config_from_args(args, rows, extra)
    ov = {k: v for k, v in opts.overrides.items() if v is not None}
    if ov:
        cfg = cfg.replace(**ov)
    cfg = with_true_vocab_size(cfg, opts.true_vocab_size, rows)
    require(cfg.num_layers == num_layers, f"args say {cfg.num_layers} layers but the files hold {num_layers}",
            "the checkpoint is incomplete or its args are wrong")
    return cfg


def _read_pipeline(tf, ranks, named, opts, policy, warnings, tied: TiedCopies):
    tp = max(t for _, t in tf.layers) + 1
    nmp = len(ranks)
    require(nmp % tp == 0, f"{tf.tag_dir}: {nmp} model-parallel ranks is not a multiple of TP {tp}",
            "the checkpoint is incomplete")
    pp = nmp // tp
    entries, copies = _pipe_entries(tf, ranks, named, tp)
    # The tied embedding's layer file index: its master name has none.
    keys_by_idx: Dict[Optional[int], set] = defaultdict(set)
    for (idx, key) in entries:
        keys_by_idx[idx].add(key)
    kinds = mds.classify(keys_by_idx)
    numbers = mds.layer_numbers(kinds)
    shards: Dict[Tuple[str, Optional[int]], List[LazyTensor]] = {}
    for (idx, key), parts in entries.items():
        if any(x is None for x in parts):
            raise CkptError(f"{key} of pipeline layer {idx} is missing on some tensor-parallel ranks",
                            "copy every layer_*-model_TT file")
        kind = kinds[idx]
        role = mds.role_of(kind, key)
        if (idx, key) in copies:
            slot = getattr(warnings, "slot", None)
            parts = [tied.checked(key, t, a, b, slot) for t, (a, b) in enumerate(zip(parts, copies[(idx, key)]))]
        shards[(role, numbers[idx] if kind == "layer" else None)] = parts
    word = shards.get(("word", None))
    require(word is not None, f"{tf.tag_dir}: no word embeddings found", "the embedding layer file is missing")
    rows = sum(p.shape[0] for p in word)
    meta = ranks[0].meta
    cfg = _gpt_config(meta.get("args"), rows, meta, opts, len(numbers))
    require(cfg is not None, f"{tf.tag_dir}: the model states hold no Megatron args", "not a Megatron-DeepSpeed save")
    layout_name = opts.qkv_layout or "grouped"
    for k in list(shards):
        if k[0].startswith("qkv."):
            shards[k] = mds.regroup_qkv(shards[k], cfg, layout_name)
    tensors = assemble(cfg, shards, policy)
    stage_layers = _stage_layers(ranks, tp, pp, numbers)
    layout = Layout(tp=tp, pp=pp, stage_layers=None if len(set(stage_layers)) <= 1 or sum(stage_layers) != cfg.num_layers
                    else stage_layers)
    first = mds.first_layer_index(kinds)
    return (cfg, tensors, layout, f"mds-pipeline (transformer layers from spec index {first}, qkv {layout_name})",
            dict(_pipe_naming(ranks, layout_name), kinds=kinds))


def _pipe_entries(tf, ranks, named, tp: int):
    """(entries, copies): (layer file index, key) -> [per TP rank] of a pipeline run's tensors, from its
    layer files (named None) or the optimizer's per-rank names; copies holds later pipeline stages' copies
    of the tied tensors (a name met twice on one TP rank)."""
    entries: Dict[Tuple[Optional[int], str], List[Optional[LazyTensor]]] = defaultdict(lambda: [None] * tp)
    copies: Dict[Tuple[Optional[int], str], List[Optional[LazyTensor]]] = defaultdict(lambda: [None] * tp)
    if named is None:
        for (idx, t), p in sorted(tf.layers.items()):
            tree = load_torch_file(p)
            if not isinstance(tree, dict):
                raise CkptError(f"{p.name}: not a layer state dict", "the file is damaged")
            for key, v in tree.items():
                if isinstance(v, LazyTensor):
                    entries[(idx, key)][t] = v
    else:
        for mp, r in sorted(ranks.items()):
            stage, t = divmod(mp, tp)
            for name, v in named[mp].items():
                hit = mds.split_pipe_name(name)
                if hit is None:
                    raise CkptError(f"unexpected parameter {name!r} in a pipeline checkpoint",
                                    "ckptool converts Megatron-DeepSpeed GPT models")
                target = entries if entries[hit][t] is None else copies
                target[hit][t] = v
    return entries, copies


def _stage_layers(ranks, tp: int, pp: int, numbers) -> List[int]:
    """Transformer layers per pipeline stage, from the names each stage's optimizer holds (param_shapes)."""
    counts = defaultdict(int)
    for mp, r in ranks.items():
        if mp % tp == 0:
            names = [n for g in (r.meta.get("param_shapes") or []) for n in g]
            counts[mp // tp] = len({mds.split_pipe_name(n)[0] for n in names
                                   if (mds.split_pipe_name(n) or (None,))[0] in numbers})
    return [counts[s] for s in range(pp)]


def _pipe_naming(ranks: Dict[int, RankStates], qkv_layout: str) -> dict:
    """How this run names its parameters: (role, layer number or None) -> pipe name, from the names
    the optimizer used (param_shapes), so a tied embedding keeps `tied_modules.embed.*`."""
    names = set()
    for r in ranks.values():
        names.update(n for g in param_shapes(r.meta) for n in g)
        names.update((r.meta.get("frozen_param_shapes") or {}).keys())
    split = {n: mds.split_pipe_name(n) for n in names}
    keys_by_idx: Dict[Optional[int], set] = defaultdict(set)
    for hit in split.values():
        if hit is not None:
            keys_by_idx[hit[0]].add(hit[1])
    kinds = mds.classify(keys_by_idx)
    numbers = mds.layer_numbers(kinds)
    roles = {}
    for name, hit in split.items():
        if hit is not None:
            idx, key = hit
            kind = kinds[idx]
            roles[(mds.role_of(kind, key), numbers[idx] if kind == "layer" else None)] = name
    return {"scheme": "mds-pipe", "roles": roles, "qkv_layout": qkv_layout}


# --- Megatron names stored under `module` ---------------------------------------------------

def _read_megatron_module(named, r0, opts, policy):
    tp = len(named)
    flat = {mp: {megatron_key(k): v for k, v in (flatten(n) if any(isinstance(x, dict) for x in n.values()) else n).items()}
            for mp, n in named.items()}
    dialect = detect_dialect(flat[0])
    m = KeyMatcher(dialect)
    shards: Dict[Tuple[str, Optional[int]], List[Optional[LazyTensor]]] = defaultdict(lambda: [None] * tp)
    for t, keys in flat.items():
        for key, v in keys.items():
            hit = m.match(key)
            if hit is None:
                if is_ignorable(key) or not isinstance(v, LazyTensor):
                    continue
                raise CkptError(f"key {key!r} is not part of a {dialect.name} GPT model", "ckptool converts GPT models")
            role, layer = hit
            if role == HEAD_COPY:
                continue
            shards[(role, layer)][t] = v
    num_layers = 1 + max(layer for (_, layer) in shards if layer is not None)
    rows = sum(p.shape[0] for p in shards[("word", None)])
    args = r0.meta.get("args")
    cfg = _gpt_config(args, rows, r0.meta, opts, num_layers) if args is not None else \
        config_for_shards(None, dialect, shards, num_layers, tp, rows, opts, 0.0)
    if dialect.qkv_version0_only:  # 2019: each rank's QKV is [3, np, hd]
        heads_local = cfg.num_attention_heads // tp
        for k in list(shards):
            if k[0].startswith("qkv."):
                shards[k] = [Derived(lambda x: qkv_to_grouped(x, 0, heads_local, cfg.head_dim), [x]) for x in shards[k]]
    tensors = assemble(cfg, dict(shards), policy)
    return cfg, tensors, Layout(tp=tp, pp=1), f"megatron module ({dialect.name})", _module_naming(r0, m, dialect)


def _module_naming(r0: RankStates, matcher: KeyMatcher, dialect) -> dict:
    """(role, layer or None) -> the engine's dotted parameter name, for Megatron models kept under
    `module` (Megatron-DeepSpeed --no-pipeline-parallel), from the names the optimizer used."""
    names = [n for g in param_shapes(r0.meta) for n in g] + list((r0.meta.get("frozen_param_shapes") or {}))
    roles = {}
    for name in names:
        hit = matcher.match(megatron_key(name))
        if hit is not None and hit[0] != HEAD_COPY:
            roles[hit] = name
    return {"scheme": "megatron-module", "roles": roles,
            "qkv_layout": "v0" if dialect.qkv_version0_only else "grouped"}


# --- Hugging Face names ---------------------------------------------------------------------

def _read_hf_gpt(tf, ranks, named, opts):
    require(len(named) == 1, f"{tf.tag_dir}: Hugging Face names with {len(named)} model-parallel ranks",
            "ckptool reads HF models trained with data parallelism (ZeRO) only")
    hf = find_hf_config(tf.tag_dir, opts.hf_config)
    sample = ", ".join(list(named[0])[:3])
    # No GPT to read: the files opened here can still be written under the model's own names
    # (NoCanonicalForm's exports: to-hf needs the config.json, a universal checkpoint does not)
    universal = partial(export_universal, lambda warn: engine_universal(tf, ranks, named_weights, warn))
    if hf is None:
        raise NoCanonicalForm(f"{tf.tag_dir}: the parameter names ({sample}, ...) are not Megatron's and no "
                              "config.json sits beside the checkpoint",
                              f"give --hf-config PATH (the model's config.json), or use {ways_out(['ds-universal'])}",
                              kind="deepspeed-module", exports={"ds-universal": universal})
    mt = hf_format.gpt_model_type(hf)
    if mt is None:
        model_type = str(hf.get("model_type"))
        export = lambda out_dir, **kw: _export_hf(hf, _own_names(ranks[0], named[0], hf), out_dir, model_type, **kw)  # noqa: E731
        exports = {"hf": export, "ds-universal": universal}
        raise NoCanonicalForm(f"{tf.tag_dir} holds a Hugging Face {model_type} model, which is not a GPT "
                              "ckptool can reshard", f"use {ways_out(exports)}", kind="deepspeed-hf", exports=exports)
    n = {k[len("module."):] if k.startswith("module.") else k: v for k, v in named[0].items()}
    cfg, tensors = hf_format.to_canonical(n, hf, mt, opts, tf.tag_dir)
    return cfg, tensors, Layout(tp=1, pp=1), f"hf {mt}", {"scheme": "hf", "model_type": mt, "hf_config": hf}


def consolidate_hf_state(path, opts: Optional[ReadOptions] = None) -> Tuple[dict, Dict[str, LazyTensor]]:
    """(config.json dict, {HF name: lazy tensor}) of any HF model trained under DeepSpeed.

    Names are the model's own; tied aliases (shared_params) are left out when the config ties them,
    since HF re-ties on load and safetensors refuses shared storage. Master weights (fp32) by default.
    """
    opts = opts or ReadOptions()
    tf, ranks, weights = _open(path, opts)
    require(not tf.layers and len(ranks) == 1,
            f"{tf.tag_dir}: a model-parallel checkpoint is not a Hugging Face model",
            "use `ckptool merge` / `convert` for Megatron-DeepSpeed checkpoints")
    hf = find_hf_config(tf.tag_dir, opts.hf_config)
    if hf is None:
        raise CkptError(f"{tf.tag_dir}: no config.json beside the checkpoint", "give --hf-config PATH")
    return hf, _own_names(ranks[0], named_weights(ranks[0], weights), hf)


def _own_names(r: RankStates, named: Dict[str, LazyTensor], hf: dict) -> Dict[str, LazyTensor]:
    """The model's own HF names (no `module.` prefix); tied aliases left out where the config ties them."""
    named = dict(named)
    if hf.get("tie_word_embeddings", True):
        for alias in r.shared:
            named.pop(alias, None)
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in named.items()}


def _export_hf(hf: dict, named: Dict[str, LazyTensor], out_dir, model_type: str, **kw) -> WriteSummary:
    summary = write_hf_state(hf, named, out_dir, **kw)
    summary.details["model_type"] = model_type
    return summary
