"""Megatron torch-format checkpoints for inspect, without torch: the rank files' pickles read for
structure (quick/torch_pickle.py), the config from the stored args as the full reader computes it
(megatron_args.config_from_args), the dialect and layer layout from the keys (megatron/files.py,
megatron/names.py), the canonical tensors' shapes from the config (quick/meta.py), and the
optimizer's state as the training-state reader ties it (formats/megatron/quick_optim.py, formats/megatron/quick_distopt.py).

Covered: dense GPT models whose files store args: converted, released and from-hf checkpoints, and
training saves with or without optimizer state (the rank files' own, or distrib_optim.pt beside
them: formats/megatron/quick_distopt.py, an MoE model's chained [dense, expert] buffers at EP > 1 too); MoE
models' weights at any TP / PP / EP / expert TP, in each expert module form (formats/megatron/quick_experts.py); MLA models (DeepSeek-V2/V3 style, with a q latent or a
direct q, MoE or dense) in the local spec's names (mcore: every latent projection column-parallel)
and the TE spec's (mcore-te: the down projections whole on every rank, the latent norms inside the
up projections). Every stored tensor must have the rank shape its role has in the model the args
describe (meta.rank_shape, the experts by megatron_experts.holds); a module buffer (the router's fp32
expert bias) keeps its own dtype and joins no optimizer. Anything else returns None and
the full reader answers: the 2022-23 optim.pt, optimizer state the quick tie cannot decide
(formats/megatron/quick_optim.py) or whose buffers no layout reproduces (formats/megatron/quick_distopt.py), 2019 files
without args, missing or stray rank directories, parameters of several dtypes, keys outside the dialect, or files
that disagree with one another or with their args (the full reader has the error message for each).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...config import Layout
from ...errors import CkptError
from . import args as megatron_args
from .files import (detect_dialect, expert_grid, flatten, list_rank_dirs, model_file, rank_coordinates,
                                      resolve_iteration_dir)
from .names import KeyMatcher, global_layer, is_ignorable, is_mla, stage_layer_counts
from ...spec.schema import HEAD_COPY
from ...state import Checkpoint, SourceInfo
from . import quick_experts as experts
from ...quick.meta import BUFFER_ROLES, TensorMeta, canonical_meta, canonical_shapes, is_buffer, rank_shape, split_dtypes
from .quick_optim import Param, training_state
from ...quick.torch_pickle import NotQuick, load_torch_zip

VERSIONS = (0.0, 1.0, 2.0, 3.0)  # checkpoint_version values the full reader accepts
DISTRIB_FILE = "distrib_optim.pt"  # the distributed optimizer's state beside a rank file (megatron/distopt.py)
OPTIM_FILE = "optim.pt"  # the 2022-23 distributed optimizer's, one per data-parallel rank


def read(path: Path, format_name: str) -> Optional[Checkpoint]:
    try:
        it_dir, iteration, release = resolve_iteration_dir(path)
        dirs = list_rank_dirs(it_dir)
        if not dirs or any((d / OPTIM_FILE).exists() for d in it_dir.iterdir()):
            return None  # the 2022-23 distributed optimizer's files: the full reader names what it drops
        loaded = {d: load_torch_zip(model_file(d)) for d in dirs}
        if not isinstance(loaded[dirs[0]], dict):
            return None
        ranks = rank_coordinates(dirs, loaded[dirs[0]])  # (tp, pp, ep) as the full reader names them
        trees = {rk: loaded[d] for rk, d in ranks.items()}
        distrib = {rk: load_torch_zip(d / DISTRIB_FILE) if (d / DISTRIB_FILE).is_file() else None
                   for rk, d in ranks.items()}
    except (CkptError, NotQuick, OSError):
        return None
    if any(not isinstance(t, dict) or "model" not in t and not _chunk_keys(t) for t in trees.values()):
        return None
    try:
        return _checkpoint(path, format_name, trees, distrib, iteration, release)
    except (NotQuick, LookupError, TypeError, AttributeError, ValueError):
        return None  # structures the quick reader does not know: the full reader says what they are


PER_PROCESS_ARGS = ("rank", "local_rank")  # args each process of one run sets to its own value


def _plain_args(args) -> Optional[dict]:
    """The args' plain values (numbers, strings, flags) but each process's own: what the ranks of one
    run share exactly (stricter than the full reader's check of the layout fields)."""
    if args is None:
        return None
    return {k: v for k, v in vars(args).items()
            if type(v) in (int, float, str, bool, type(None)) and k not in PER_PROCESS_ARGS}


def _chunk_keys(tree: dict) -> Dict[int, str]:
    return {int(m.group(1)): k for k in tree for m in [re.match(r"^model(\d+)$", str(k))] if m}


def _checkpoint(path: Path, format_name: str, trees, distrib, iteration, release) -> Optional[Checkpoint]:
    grid = _grid(trees)
    if grid is None:
        return None
    args, tp, pp, ep, etp = grid
    first = trees[(0, 0, 0)]
    models = {rk: ({0: flatten(t["model"])} if "model" in t else
                   {v: flatten(t[k]) for v, k in _chunk_keys(t).items()}) for rk, t in trees.items()}
    keys = _matched_keys(models, float(first.get("checkpoint_version", 0) or 0))
    if keys is None:
        return None
    dialect, matcher, version = keys
    dtype, buffer_dtype = split_dtypes(_stored_dtypes(models, matcher))  # ValueError (None) for several
    counts = _layer_counts(models, matcher)
    vpp = len(models[(0, 0, 0)])
    if counts is None or any(len(c) != vpp for c in models.values()):
        return None
    if not _same_across_tp(models, tp, pp):
        return None  # Megatron splits evenly: a shard that differs is the full reader's error to report
    cfg = _config(args, _word_rows(models, matcher, tp))
    if cfg is None or cfg.num_layers != sum(counts.values()) or not experts.holds(models, matcher, cfg, counts, ep, etp):
        return None
    warnings: List[str] = []
    if dialect.name.startswith("mcore"):
        cfg, note = megatron_args.as_megatron_core_computes(cfg)
        warnings += [note] if note else []
    shapes = canonical_shapes(cfg)
    if not _shapes_hold(models, matcher, cfg, shapes, counts, tp, dialect.rule_column):
        return None  # files that disagree with their args: the full reader reads what they hold, or refuses
    weights = canonical_meta(shapes, cfg, dtype, buffer_dtype)
    trained = {n: t for n, t in weights.items() if not is_buffer(n, cfg)}
    optimizer = training_state(trees, _optimizer_params(models, matcher), args, trained, distrib, cfg.tied_embeddings,
                               ep, etp)
    stages = [counts[(p, 0)] for p in range(pp)]
    layout = Layout(tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, ep=ep, etp=etp if etp != tp else None,
                    stage_layers=None if vpp > 1 or len(set(stages)) == 1 else stages)
    info = SourceInfo(path=str(path), format=format_name, dialect=dialect.name, layout=layout,
                      iteration=iteration if iteration is not None else first.get("iteration"), release=release,
                      checkpoint_version=None if dialect.qkv_version0_only else version, args=args)
    return Checkpoint(cfg, weights, info, warnings, optimizer)


def _grid(trees):
    """(args, tp, pp, ep, expert tp) of a save whose rank directories are one run's complete grid, as its
    args say; None otherwise (missing or stray directories, ranks of different runs: the full reader names
    what differs)."""
    tp, pp, ep = (max(rk[i] for rk in trees) + 1 for i in range(3))
    first = trees.get((0, 0, 0))
    args = first.get("args") if first is not None else None
    if args is None or any(_plain_args(t.get("args")) != _plain_args(args) for t in trees.values()):
        return None
    want = (getattr(args, "tensor_model_parallel_size", None), getattr(args, "pipeline_model_parallel_size", None) or 1,
            getattr(args, "expert_model_parallel_size", None) or 1)
    etp = (getattr(args, "expert_tensor_parallel_size", None) or tp) if getattr(args, "num_experts", None) else tp
    if want != (tp, pp, ep) or etp < 1 or tp % etp or set(trees) != _saved_ranks(tp, pp, ep, etp):
        return None
    return args, tp, pp, ep, etp


def _matched_keys(models, version: float):
    """(dialect, key matcher, checkpoint_version) when every key of every rank is one the dialect knows (or
    may be ignored) and the QKV ordering is one ckptool reads; None otherwise."""
    all_keys = {k for chunks in models.values() for c in chunks.values() for k in c}
    try:
        dialect = detect_dialect(all_keys)
    except CkptError:
        return None
    if dialect.qkv_version0_only:
        version = 0.0
    matcher = KeyMatcher(dialect, mla=is_mla(all_keys))  # MLA: q_layernorm is the q latent norm
    if version not in VERSIONS or any(matcher.match(k) is None and not is_ignorable(k) for k in all_keys):
        return None
    return dialect, matcher, version


def _stored_dtypes(models, matcher) -> Dict[str, set]:
    """role -> the dtypes stored: the parameters' one, a module buffer's its own."""
    dtypes: Dict[str, set] = {}
    for chunks in models.values():
        for c in chunks.values():
            for k, v in c.items():
                if isinstance(v, TensorMeta) and matcher.match(k) is not None:
                    dtypes.setdefault(matcher.match(k)[0], set()).add(v.dtype)
    return dtypes


def _config(args, rows):
    """The GPTConfig the args give for `rows` stored vocabulary rows; None where they give none."""
    if rows is None:
        return None
    try:
        return megatron_args.config_from_args(args, rows)
    except CkptError:
        return None


def _optimizer_params(models, matcher):
    """Per rank, the optimizer's parameters in file order: a module buffer (the router's expert bias) is in
    no optimizer."""
    return {rk: [Param(k, role, v.shape, c) for c in sorted(chunks) for k, v in chunks[c].items()
                 for role in [(matcher.match(k) or (None,))[0] if isinstance(v, TensorMeta) else None]
                 if role is not None and role not in BUFFER_ROLES]
            for rk, chunks in models.items()}


def _saved_ranks(tp: int, pp: int, ep: int, etp: int):
    """The (tp, pp, ep) rank directories a complete save holds: every (TP, EP) pair of the expert grid
    that Megatron-LM's saving ranks write (formats/megatron_files.expert_grid; the full reader's check)."""
    pairs = {(x % tp, (x // etp) % ep) for x in range(max(tp, etp * ep))}
    if pairs != set(expert_grid(tp, ep, etp)):
        raise NotQuick("a grid whose later pairs some eras do not save")
    return {(t, p, e) for p in range(pp) for t, e in pairs}


def _shapes_hold(models, matcher, cfg, shapes, counts, tp: int, column) -> bool:
    """Every stored (non-expert) tensor has the shape its role's rank shard has in the model the args describe
    (meta.rank_shape); the experts are megatron_experts.holds' to check."""
    offsets = experts.layer_offsets(counts)
    for (_, p, _), chunks in models.items():
        for v, flat in chunks.items():
            for key, value in flat.items():
                hit = matcher.match(key) if isinstance(value, TensorMeta) else None
                if hit is None or hit[0].startswith("experts."):
                    continue
                layer = global_layer(hit[1], offsets[(p, v)], cfg.num_layers)
                role = HEAD_COPY if hit[0] == "output" and cfg.tied_embeddings else hit[0]  # megatron-core's key
                if value.shape != rank_shape(role, layer, cfg, shapes, tp, column):
                    return False
    return True


def _same_across_tp(models, tp: int, pp: int) -> bool:
    """Every tensor- and expert-parallel rank of a stage holds the same keys with the same shapes (expert
    keys count experts locally; expert TP cuts them evenly)."""
    for p in range(pp):
        first = models[(0, p, 0)]
        for (t, q, e), other in models.items():
            if q != p:
                continue
            if other.keys() != first.keys():
                return False
            for v, flat in first.items():
                if {k: getattr(x, "shape", None) for k, x in flat.items()} != \
                        {k: getattr(x, "shape", None) for k, x in other[v].items()}:
                    return False
    return True


def _layer_counts(models, matcher) -> Optional[Dict[Tuple[int, int], int]]:
    """Layers per (pipeline stage, virtual chunk), as the full reader counts them (names.stage_layer_counts); None
    where the TP ranks disagree (the full reader then says so)."""
    try:
        return stage_layer_counts(models, matcher)
    except CkptError:
        return None


def _word_rows(models, matcher, tp: int) -> Optional[int]:
    """Stored vocabulary rows: the word embedding's rows summed over the TP ranks of the first stage (each
    TP rank's first file: with expert TP below TP not every (TP, EP) pair has one)."""
    rows = 0
    for t in range(tp):
        first = min(rk for rk in models if rk[:2] == (t, 0))
        words = [v for k, v in models[first][0].items()
                 if isinstance(v, TensorMeta) and (matcher.match(k) or (None,))[0] == "word"]
        if len(words) != 1:
            return None
        rows += words[0].shape[0]
    return rows
