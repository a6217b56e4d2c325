"""Megatron-LM torch-format checkpoints (mp_rank_XX[_YYY]/model_optim_rng.pt): reader and writer.

Directory facts (shared/reference/megatron.md section 1): a tracker file
latest_checkpointed_iteration.txt holds an iteration or `release`; iter_{:07d}/ or release/ holds
one directory per model-parallel rank, mp_rank_{tp:02d} (no pipeline) or mp_rank_{tp:02d}_{pp:03d};
each holds model_optim_rng.pt (or model_rng.pt in the 2022-23 distributed-optimizer era) with the
model under `model` (or `model0`, `model1`, ... for virtual pipeline chunks).

This module owns only the directory walk and the key names (megatron/names.py); the tensor maths
is shared with every Megatron-family format (roles.py, sharding.py).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...config import GPTConfig, Layout, check_tensor_parallel
from ...errors import CkptError, require
from ...io.torchfile import StoredTensor, StreamingTorchWriter, load_torch_file, write_grouped
from ...lazy import Const, Derived, LazyTensor, Memo, Piece, Placement
from ...options import ReadOptions
from ...roles import (BUFFER_ROLES, FIRST_STAGE_ROLES, assemble, canonical_names, fc_major, global_role_tensor,
                     layer_role_tensor, moe_layer_roles, scope_of, shard_role, tables_for)
from ...sharding import ReplicaPolicy
from ...state import HF_EXPERTS_ARG, Checkpoint, SourceInfo, in_model_order
from ...summary import WriteSummary
from ...vocab import resize_vocab, target_rows, with_true_vocab_size
from ...write_options import WriteOptions
from . import (args as megatron_args, distopt as megatron_distopt, optim as megatron_optim, training as megatron_training)
from .optim import RankParam, role_shards
from .names import (DIALECTS, Dialect, KeyMatcher, dialects_for, global_layer, is_ignorable, is_mla,
                             qkv_from_grouped, qkv_to_grouped, refused_module, stacked_expert_block, stage_layer_counts)
from .files import (ITER_DIR, MODEL_FILES, RANK_DIR, TRACKER, detect_dialect, flatten,  # noqa: F401
                             etp_refusal, expert_grid, rank_coordinates, is_optimizer_only, looks_like_megatron, model_file, list_rank_dirs, resolve_iteration_dir)

def unflatten(flat: Dict[str, object]) -> dict:
    out: dict = {}
    for key, v in flat.items():
        parts = key.split("/")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


# --- reading --------------------------------------------------------------------------------

def read_megatron(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    """Read a Megatron-LM torch-format checkpoint into the canonical state, as a list of steps: find the
    rank files and check they are one save, name the model's keys (dialect), place the layers, collect each
    rank's parameters, join their shards, derive the config, assemble the canonical tensors, then the
    optimizer state."""
    opts = opts or ReadOptions()
    src = _open_rank_files(Path(path), opts)
    models = _model_chunks(src.trees)
    dialect, matcher, all_keys, version = _name_keys(models, src)
    counts, offsets, num_layers = _layer_offsets(models, matcher, src.pp)
    stacked_local, per_ep, stored, unstack, params = _rank_params(models, matcher, all_keys, offsets, num_layers, src,
                                                                  opts)
    shards, head_copy = _joined_shards(params, src)
    _check_stage_copies(params, shards, src)
    cfg, warnings = _read_config(src, dialect, shards, num_layers, per_ep, version, opts)
    if cfg.tied_embeddings and ("output", None) in shards:
        # megatron-core keeps a synchronised copy of the tied embedding on the last stage
        head_copy = shards[("output", None)][0]
    policy = ReplicaPolicy(opts.replicas, warnings.append)
    canonical = _canonical_assembler(cfg, src.tp, version, policy, dialect.rule_column)
    tensors = canonical(shards)
    if not cfg.tied_embeddings and "output.weight" not in tensors and head_copy is not None:
        tensors["output.weight"] = head_copy
    optimizer = _read_optimizer(src, params, cfg, canonical, warnings, (stored, unstack) if stacked_local else None,
                                opts)
    info = _source_info(path, src, dialect, version, counts, len(models[(0, 0, 0)]), policy)
    if optimizer is not None:
        optimizer = optimizer.with_slots({slot: in_model_order(ts, cfg) for slot, ts in optimizer.slots.items()})
    return Checkpoint(cfg, in_model_order(tensors, cfg), info, warnings, optimizer)


@dataclass
class _RankFiles:
    """One save's rank files, loaded lazily, with the parallel sizes they were saved at."""
    it_dir: Path
    iteration: Optional[int]
    release: bool
    ranks: Dict[Tuple[int, int, int], Path]  # (tp, pp, ep) -> rank directory
    trees: Dict[Tuple[int, int, int], dict]  # (tp, pp, ep) -> the loaded file
    tp: int
    pp: int
    ep: int
    etp: int
    grid: Dict[Tuple[int, int], int]  # expert_grid
    args: object
    version: float

    @property
    def first(self) -> dict:
        return self.trees[(0, 0, 0)]


def _open_rank_files(path: Path, opts: ReadOptions) -> _RankFiles:
    """Find the iteration's rank directories, load their files (lazily) and check they are one complete
    save: every rank Megatron-LM writes is there, the files hold a model, their args agree, and the
    checkpoint_version is one ckptool knows. Why first: every later step indexes the files by rank."""
    it_dir, iteration, release = resolve_iteration_dir(path, opts.iteration)
    rank_dirs = list_rank_dirs(it_dir)
    loaded = {d: load_torch_file(model_file(d)) for d in rank_dirs}
    ranks = rank_coordinates(rank_dirs, loaded[rank_dirs[0]])
    trees = {rk: loaded[d] for rk, d in ranks.items()}
    tp, pp, ep = _parallel_sizes(ranks, loaded[rank_dirs[0]], it_dir)
    etp = _expert_tp(loaded[rank_dirs[0]], tp, it_dir)
    grid = expert_grid(tp, ep, etp)
    _check_rank_dirs(ranks, grid, tp, pp, ep, etp, it_dir)
    first = trees[(0, 0, 0)]
    if not isinstance(first, dict) or not any(k == "model" or re.match(r"^model\d+$", str(k)) for k in first):
        raise CkptError(f"{model_file(ranks[(0, 0, 0)])}: no 'model' entry", "not a Megatron checkpoint file")
    args = first.get("args")
    _check_args_agree(trees, ranks)
    version = float(first.get("checkpoint_version", 0) or 0)
    if version not in (0.0, 1.0, 2.0, 3.0):
        raise CkptError(f"unknown checkpoint_version {version}", "ckptool reads versions 0, 1.0, 2.0 and 3.0")
    return _RankFiles(it_dir, iteration, release, ranks, trees, tp, pp, ep, etp, grid, args, version)


def _model_chunks(trees) -> Dict[Tuple[int, int, int], Dict[int, Dict[str, object]]]:
    """Per rank: {chunk: {flat key: value}}; `model`, or `model0`, `model1`, ... with virtual pipeline
    parallelism (one per model chunk the rank holds)."""
    models: Dict[Tuple[int, int, int], Dict[int, Dict[str, object]]] = {}
    for rk, tree in trees.items():
        chunks = {}
        if "model" in tree:
            chunks[0] = flatten(tree["model"])
        else:
            for k in tree:
                m = re.match(r"^model(\d+)$", str(k))
                if m:
                    chunks[int(m.group(1))] = flatten(tree[k])
        models[rk] = chunks
    return models


def _name_keys(models, src: _RankFiles) -> Tuple[Dialect, KeyMatcher, set, float]:
    """(dialect, its key matcher, every key, the QKV version): the dialect from the key names; keys of
    modules ckptool knows it does not convert are refused by name, the MTP layers by the args, and any
    other key no role matches as not a GPT model, so nothing is silently dropped."""
    version = src.version
    all_keys = {k for chunks in models.values() for c in chunks.values() for k in c}
    dialect = detect_dialect(all_keys)
    if dialect.qkv_version0_only:
        version = 0.0
    matcher = KeyMatcher(dialect, mla=is_mla(all_keys))
    unknown = sorted(k for k in all_keys if matcher.match(k) is None and not is_ignorable(k)
                     and not (isinstance(_any_value(models, k), type(None))))
    for key in unknown:  # modules ckptool knows it does not convert, by name
        refused = refused_module(key)
        if refused:
            raise CkptError(f"{src.it_dir}: {refused[0]}: {sum(1 for k in unknown if refused_module(k) == refused)} "
                            f"keys such as {key}", refused[1])
    _check_mtp_declared(all_keys, matcher, src)
    if unknown:
        raise CkptError(f"{len(unknown)} keys are not part of a {dialect.name} GPT model "
                        f"(e.g. {', '.join(unknown[:3])})",
                        "ckptool converts GPT models; other architectures are not supported")
    return dialect, matcher, all_keys, version


def _check_mtp_declared(all_keys, matcher: KeyMatcher, src: "_RankFiles") -> None:
    """The MTP layers the keys hold are the ones the args declare (--mtp-num-layers): a model is read as its args
    describe it, so MTP keys the args do not declare (or declared layers without keys) are refused by name."""
    keys = sorted(k for k in all_keys if (hit := matcher.match(k)) is not None and hit[1] is not None and hit[1] < 0)
    held = len({matcher.match(k)[1] for k in keys})
    declared = int(getattr(src.args, "mtp_num_layers", None) or 0)
    if held and not declared:
        raise CkptError(f"{src.it_dir}: multi-token prediction (MTP) layers (--mtp-num-layers): {len(keys)} keys such "
                        f"as {keys[0]}, but the args declare no --mtp-num-layers",
                        "the args do not describe the files; convert the checkpoint its run saved")
    require(held == declared, f"{src.it_dir}: the args say --mtp-num-layers {declared} but the files hold {held} "
            "multi-token prediction (MTP) layers (mtp.layers.*)", "copy the complete checkpoint (MTP layers sit on "
            "the last pipeline stage)")


def _layer_offsets(models, matcher: KeyMatcher, pp: int):
    """(layers per (pp, chunk), first global layer per (pp, chunk), number of layers): each file numbers its
    layers from 0; counted from the keys, then offset in Megatron's order (chunk-major)."""
    vpp = len(models[(0, 0, 0)])
    counts = stage_layer_counts(models, matcher)
    offsets, first_layer = {}, 0
    for v in range(vpp):
        for p in range(pp):
            offsets[(p, v)] = first_layer
            first_layer += counts.get((p, v), 0)
    return counts, offsets, first_layer


def _rank_params(models, matcher: KeyMatcher, all_keys, offsets, num_layers: int, src: _RankFiles, opts: ReadOptions):
    """(stacked local experts, experts per EP rank, stored, unstack, params): each rank's parameters in file
    order, which is the order Megatron built its optimizer from. stored: one per tensor of the file (a
    legacy GroupedMLP fc stacks all local experts: role experts.*.<fc>), what the optimizer's entries count;
    params: the stacked ones cut per expert, as the weights are used; an expert's local index j on EP rank e
    is global expert e * (experts per rank) + j; unstack cuts a stored parameter's optimizer slot the same way."""
    stacked_local = _stacked_local_experts(all_keys, matcher, src.args, src.ep, src.it_dir)
    per_ep = stacked_local or max(_local_expert_count(chunks, matcher) for chunks in models.values())  # a stage may be all dense
    # with the optimizer carried, each weight is read twice: as the weight and to check its fp32 master
    # (megatron_optim.master_matching_weight); memoised, a writer's load of a layer reads it once for both
    once = _read_once if opts.optimizer and any("optimizer" in tree for tree in src.trees.values()) else lambda role, x: x
    stored: Dict[Tuple[int, int, int], List[RankParam]] = {}
    for (t, p, e), chunks in models.items():
        stored[(t, p, e)] = [RankParam(key, hit[0], global_layer(hit[1], offsets[(p, v)], num_layers),
                                       once(hit[0], value), v)
                             for v in sorted(chunks) for key, value in chunks[v].items()
                             for hit in [matcher.match(key)] if hit is not None and isinstance(value, LazyTensor)]

    def unstack(rk, param: RankParam, value: LazyTensor) -> List[Tuple[RankParam, LazyTensor]]:
        """A stored parameter's (or its optimizer slot's) pieces: each local expert's under its global role."""
        return [(RankParam(param.key, _global_expert(role, rk[2], per_ep), param.layer, piece, param.chunk), cut)
                for (role, piece), (_, cut) in zip(unstack_grouped(param.role, param.weight, stacked_local),
                                                   unstack_grouped(param.role, value, stacked_local))]
    params = {rk: [q for x in ps for q, _ in unstack(rk, x, x.weight)] for rk, ps in stored.items()}
    return stacked_local, per_ep, stored, unstack, params


def _joined_shards(params, src: _RankFiles):
    """({(role, layer): [shard per TP or expert-TP rank]}, the tied head's last-stage copy): every role
    must be on every rank that cuts it, and the word embeddings must be there (first stage)."""
    shards, head_copy = _weight_shards(params, src.grid, src.tp, src.etp)
    for (role, layer), parts in shards.items():
        if any(x is None for x in parts):
            raise CkptError(f"{role}{'' if layer is None else f' of layer {layer}'} is missing on some "
                            "tensor-parallel ranks", "the rank files do not belong to one checkpoint")
    if shards.get(("word", None)) is None:
        raise CkptError(f"{src.it_dir}: no word embeddings found", "the first pipeline stage is missing or not a GPT model")
    return shards, head_copy


def _check_stage_copies(params, shards, src: _RankFiles) -> None:
    """A first-stage tensor (the embeddings) that a later stage's file holds too, as megatron-core's MTP block keeps
    the word embedding on the last stage (see _check_mtp_stages_fit), must equal the first stage's piece on the same
    TP rank: the model has one, so a copy that differs is refused by name rather than dropped. The dense part of
    each stage is read from EP rank 0 (role_shards), so the copies there are the ones compared."""
    for (t, p, e), ps in params.items():
        for param in ps if p > 0 and e == 0 else ():
            if param.role in FIRST_STAGE_ROLES and not torch.equal(param.weight.load(), shards[(param.role, None)][t].load()):
                raise CkptError(f"{src.it_dir}: {param.key} on pipeline stage {p} (TP rank {t}) differs from the "
                                "first stage's: megatron-core keeps this copy for its multi-token-prediction (MTP) "
                                "layers, and the model has one such tensor",
                                "convert a checkpoint whose copies agree (a learned position table is never "
                                "synchronised between the stages: write such a model at --pp 1)")


def _read_config(src: _RankFiles, dialect: Dialect, shards, num_layers: int, per_ep: int, version: float,
                 opts: ReadOptions) -> Tuple[GPTConfig, List[str]]:
    """(config, warnings so far): from the args (or shapes), checked against the experts the files hold;
    a megatron-core dialect's config as megatron-core computes it (its note the first warning)."""
    stored_rows = sum(p.shape[0] for p in shards[("word", None)])
    cfg = config_for_shards(src.args, dialect, shards, num_layers, src.tp, stored_rows, opts, version)
    _check_experts(cfg, shards, per_ep, src.ep, src.it_dir)
    layer_note = None
    if dialect.name.startswith("mcore"):
        cfg, layer_note = megatron_args.as_megatron_core_computes(cfg)
    return cfg, [layer_note] if layer_note else []


def _canonical_assembler(cfg: GPTConfig, tp: int, version: float, policy: ReplicaPolicy,
                         rule_column: Optional[str] = None):
    """role shards -> canonical tensors (roles.assemble), the weights' and the optimizer slots' alike: the
    tied head's copy dropped, and QKV of checkpoint versions before 2 reordered to grouped per rank;
    rule_column: the dialect's (Dialect.rule_column), whose modules may shard a role otherwise."""
    def canonical(role_shards) -> Dict[str, LazyTensor]:
        if cfg.tied_embeddings:
            role_shards.pop(("output", None), None)
        if version < 2:  # old QKV orders -> grouped, per rank (Megatron fixes them the same way at load)
            heads_local = cfg.num_attention_heads // tp
            for (role, layer), parts in list(role_shards.items()):
                if role.startswith("qkv."):
                    role_shards[(role, layer)] = [
                        Derived(lambda x: qkv_to_grouped(x, version, heads_local, cfg.head_dim), [x]) for x in parts]
        return assemble(cfg, dict(role_shards), policy, rule_column)
    return canonical


def _read_optimizer(src: _RankFiles, params, cfg: GPTConfig, canonical, warnings: List[str], stacked,
                    opts: ReadOptions):
    """The optimizer state when asked for and carried (megatron_training), else None; the 2022-23
    distributed-optimizer form is dropped with a warning. stacked: (stored, unstack) of a legacy GroupedMLP."""
    it_dir = src.it_dir
    if opts.optimizer and any(is_optimizer_only(d) for d in it_dir.iterdir() if d.is_dir() and RANK_DIR.match(d.name)):
        warnings.append("optimizer state dropped: the 2022-23 distributed-optimizer form (one optim.pt per "
                        "data-parallel rank) is not carried; the output holds the weights only")
    elif opts.optimizer:  # with expert TP != TP each file's expert optimizer holds its experts' grid shard
        # a legacy GroupedMLP's optimizer holds one entry per stacked fc: tied to the stored tensors, then
        # cut per expert by the weights' own cut
        return megatron_training.read_training_state(
            src, {rk: model_file(d) for rk, d in src.ranks.items()}, params, cfg, canonical, warnings, stacked)
    return None


def _source_info(path, src: _RankFiles, dialect: Dialect, version: float, counts, vpp: int,
                 policy: ReplicaPolicy) -> SourceInfo:
    """Where the state came from: the layout it was saved at (uneven first/last stages kept), the dialect,
    iteration and version, so a write back can reproduce the source."""
    pp = src.pp
    layout = Layout(tp=src.tp, pp=pp, vpp=vpp if vpp > 1 else None, ep=src.ep, etp=src.etp if src.etp != src.tp else None,
                    stage_layers=None if vpp > 1 or len({counts[(p, 0)] for p in range(pp)}) == 1
                    else [counts[(p, 0)] for p in range(pp)])
    return SourceInfo(path=str(path), format="megatron", dialect=dialect.name, layout=layout,
                      iteration=src.iteration if src.iteration is not None else src.first.get("iteration"),
                      release=src.release, checkpoint_version=None if dialect.qkv_version0_only else version,
                      args=src.args, extra={"replica_policy": policy})


def _rank_name(t: int, p: int, e: int, pp: int, ep: int) -> str:
    """Megatron-LM's rank directory: mp_rank_TT, then _PPP with pipeline parallelism, then _EEE with
    expert parallelism (megatron/training/checkpointing.py get_checkpoint_name)."""
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def _parallel_sizes(ranks, first_tree, it_dir: Path) -> Tuple[int, int, int]:
    """(TP, PP, EP): the args' when they store them (a missing directory is then named), else the directories'."""
    tp, pp, ep = (max(rk[i] for rk in ranks) + 1 for i in range(3))
    args = first_tree.get("args") if isinstance(first_tree, dict) else None
    want_tp = getattr(args, "tensor_model_parallel_size", None) or getattr(args, "model_parallel_size", None)
    if not want_tp:
        return tp, pp, ep
    want = (want_tp, getattr(args, "pipeline_model_parallel_size", None) or 1,
            getattr(args, "expert_model_parallel_size", None) or 1)
    if any(found > w for found, w in zip((tp, pp, ep), want)):
        raise CkptError(f"{it_dir}: found {tp}x{pp}x{ep} (TP x PP x EP) rank directories but args say "
                        f"{want[0]}x{want[1]}x{want[2]}: an extra rank directory",
                        "remove stray mp_rank_* directories or copy the missing ones")
    return want


def _expert_tp(first_tree, tp: int, it_dir: Path) -> int:
    """The source's expert TP size (args.expert_tensor_parallel_size; = TP when absent or dense)."""
    args = first_tree.get("args") if isinstance(first_tree, dict) else None
    if not getattr(args, "num_experts", None):
        return tp  # dense: Megatron-LM's args carry an expert TP size whatever the model
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    msg, hint = etp_refusal(tp, etp)
    require(tp % etp == 0, f"{it_dir}: {msg}", hint)
    return etp


def _check_rank_dirs(ranks, grid, tp: int, pp: int, ep: int, etp: int, it_dir: Path) -> None:
    """Every rank directory Megatron-LM saves is there (ranks x < max(TP, ETP x EP) of each stage: data-
    parallel rank 0 and expert-data-parallel rank 0, expert_grid), and none lies off the grid."""
    for rk in sorted(ranks):
        require((rk[0], rk[2]) in grid, f"{it_dir}: rank directory {ranks[rk].name} is not part of a TP{tp} EP{ep} "
                f"expert-TP {etp} save (which holds only some (TP, EP) pairs when expert TP differs from TP)",
                "remove the stray directory, or check --expert-tensor-parallel-size in the args")
    saved = {x: (x % tp, (x // etp) % ep) for x in range(max(tp, etp * ep))}
    for p in range(pp):
        for x, (t, e) in saved.items():
            if (t, p, e) in ranks:
                continue
            why = ""
            if x >= etp * ep:  # saved by data-parallel rank 0 only
                why = (f"; at TP{tp} ETP{etp} EP{ep} Megatron-LM before 2026-05 saved only expert-data-parallel "
                       "rank 0's files, leaving this tensor-parallel rank's dense weights out")
            raise CkptError(f"{it_dir}: missing rank directory {_rank_name(t, p, e, pp, ep)} "
                            f"(have {len(ranks)} of {pp * len(set(saved.values()))}){why}",
                            "copy the complete checkpoint; every tensor/pipeline/expert rank is needed")


def _weight_shards(params, grid, tp: int, etp: int):
    """{(role, layer): [shard per TP rank]} of the dense part, and per expert-TP rank of the experts (file
    (t, p, e) holds expert-TP shard grid[(t, e)]; the first file of each is taken, as for the dense part)."""
    dense = {rk: [x for x in ps if not x.role.startswith("experts.")] for rk, ps in params.items()}
    experts: Dict[Tuple[int, int, int], List[RankParam]] = {}
    for (t, p, e), ps in sorted(params.items()):
        experts.setdefault((grid[(t, e)], p, e), [x for x in ps if x.role.startswith("experts.")])
    shards, head_copy = role_shards({rk: [x.weight for x in ps] for rk, ps in dense.items()}, dense, tp)
    expert_shards, _ = role_shards({rk: [x.weight for x in ps] for rk, ps in experts.items()}, experts, etp)
    return {**shards, **expert_shards}, head_copy


def _local_expert_count(chunks: Dict[int, Dict[str, object]], matcher: KeyMatcher) -> int:
    """Experts per MoE layer in one rank's file (0 for a dense model)."""
    locals_ = {(v, hit[1], int(hit[0].split(".")[1])) for v, flat in chunks.items() for k in flat
               for hit in [matcher.match(k)] if hit is not None and hit[0].startswith("experts.")}
    per_layer: Dict[Tuple[int, int], int] = defaultdict(int)
    for v, layer, _ in locals_:
        per_layer[(v, layer)] += 1
    return max(per_layer.values(), default=0)


def _read_once(role: str, value: LazyTensor) -> LazyTensor:
    """value, memoised within a load_scope (the stacked GroupedMLP tensors stay stored tensors: their
    per-expert cut reads byte ranges of them)."""
    if role.startswith("experts.*."):
        return value
    return Memo(value)


def _stacked_local_experts(keys, matcher: KeyMatcher, args, ep: int, it_dir: Path) -> int:
    """Local experts per file of a legacy GroupedMLP save (0 for other expert forms): its one tensor per fc
    does not say how many experts it stacks, the args do."""
    if not any((hit := matcher.match(k)) is not None and hit[0].startswith("experts.*.") for k in keys):
        return 0
    per_expert = sorted(k for k in keys if (hit := matcher.match(k)) is not None and hit[0].startswith("experts.")
                        and not hit[0].startswith("experts.*."))
    require(not per_expert, f"{it_dir}: legacy GroupedMLP tensors (mlp.experts.weight1 / weight2) beside per-expert "
            f"ones (e.g. {per_expert[0] if per_expert else ''})", "the rank files mix expert module forms; "
            "they do not belong to one checkpoint")
    experts = getattr(args, "num_experts", None)
    require(isinstance(experts, int) and experts > 0 and experts % ep == 0,
            f"{it_dir}: legacy GroupedMLP experts (mlp.experts.weight1 / weight2) but the args give no number of "
            f"experts that {ep} expert-parallel ranks divide", "the args must carry --num-experts")
    return experts // ep


def unstack_grouped(role: str, value: LazyTensor, local_experts: int):
    """[(role, tensor)] of one key: itself, or each local expert's [out, in] shard of a stacked tensor."""
    if not role.startswith("experts.*."):
        return [(role, value)]
    base = role[len("experts.*."):]
    hidden = value.shape[0] if base == "fc1.weight" else value.shape[1]
    n, block = stacked_expert_block(base, hidden, local_experts, value.numel)
    require(n * local_experts == value.numel and n % hidden == 0,
            f"a legacy GroupedMLP {base.split('.')[0]} of shape {tuple(value.shape)} does not hold {local_experts} "
            "experts", "the args' --num-experts or expert-parallel size do not match the files")
    return [(f"experts.{j}.{base}", Derived(lambda b: b.t().contiguous(), [_flat_block(value, j * n, block)]))
            for j in range(local_experts)]


def _flat_block(t: LazyTensor, first: int, shape: Tuple[int, int]) -> LazyTensor:
    """Elements first .. first + prod(shape) - 1 of t's row-major order, as shape: a ranged read of a
    contiguous stored tensor, else a slice of the loaded one."""
    n = shape[0] * shape[1]
    if isinstance(t, StoredTensor) and t.stride == tuple(_row_major_strides(t.shape)):
        return StoredTensor(t.storage, t.offset + first, shape, (shape[1], 1))
    return Derived(lambda x: x.reshape(-1)[first:first + n].reshape(shape), [t])


def _row_major_strides(shape) -> List[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def _global_expert(role: str, ep_rank: int, per_ep: int) -> str:
    if not role.startswith("experts."):
        return role
    _, j, base = role.split(".", 2)
    return f"experts.{ep_rank * per_ep + int(j)}.{base}"


def _check_experts(cfg: GPTConfig, shards, per_ep: int, ep: int, it_dir: Path) -> None:
    """The files hold exactly the experts the args describe, each MoE layer all of them, nothing else."""
    moe = cfg.moe
    held = {(layer, int(role.split(".")[1])) for role, layer in shards if role.startswith("experts.")}
    if moe is None or not moe.layers:  # (--num-experts with a --moe-layer-freq that leaves every layer dense)
        require(not held, f"{it_dir}: the files hold MoE experts but the args describe a dense model",
                "the args are missing --num-experts; the checkpoint cannot be read as it is")
        return
    require(per_ep * ep == moe.num_experts,
            f"{it_dir}: {ep} expert-parallel ranks x {per_ep} experts each, but the args say {moe.num_experts} experts",
            "the rank files do not belong to one checkpoint")
    for (role, layer), parts in shards.items():  # each expert's fc1 rows over the TP ranks: the expert's FFN
        if role.startswith("experts.") and role.endswith("fc1.weight"):
            rows = sum(p.shape[0] for p in parts if p is not None)
            want_rows = moe.ffn_hidden_size * (2 if cfg.gated else 1)
            require(rows == want_rows, f"{it_dir}: layer {layer} {role} has {rows} rows over the TP ranks, "
                    f"expected {want_rows} for the expert FFN size {moe.ffn_hidden_size}",
                    "the args' --moe-ffn-hidden-size or expert tensor parallelism do not match the files")
    want = {(i, e) for i in range(cfg.all_layers) if cfg.is_moe_layer(i) for e in range(moe.num_experts)}  # MTP too
    missing, extra = sorted(want - held), sorted(held - want)
    require(not missing and not extra,
            f"{it_dir}: expert weights of (layer, expert) {(missing or extra)[:3]} are "
            f"{'missing' if missing else 'in layers the args say are dense'}",
            "check --moe-layer-freq in the args, or copy the complete checkpoint")
    # each expert whole: its weights and (GPT-OSS, --add-bias-linear) its biases, wherever its file is
    held_roles = {(layer, role) for role, layer in shards if role.startswith("experts.")}
    bases = ("fc1.weight", "fc2.weight") + (("fc1.bias", "fc2.bias") if cfg.add_bias_linear else ())
    lost = [f"layer {i} experts.{e}.{b}" for i, e in sorted(want) for b in bases
            if (i, f"experts.{e}.{b}") not in held_roles]
    require(not lost, f"{it_dir}: {', '.join(lost[:3])} missing from the files", "copy the complete checkpoint")


def _any_value(models, key):
    for chunks in models.values():
        for flat in chunks.values():
            if key in flat:
                return flat[key]
    return None


def _check_args_agree(trees, ranks) -> None:
    fields = ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size", "num_experts",
              "expert_model_parallel_size", "expert_tensor_parallel_size",
              "pipeline_model_parallel_size", "padded_vocab_size", "ffn_hidden_size")
    ref = trees[(0, 0, 0)].get("args")
    for rk, tree in trees.items():
        a = tree.get("args")
        if (a is None) != (ref is None):
            raise CkptError(f"{ranks[rk].name} stores args but {ranks[(0, 0, 0)].name} does not (or the reverse)",
                            "the rank files do not belong to one checkpoint")
        if a is None:
            continue
        for f in fields:
            if getattr(a, f, None) != getattr(ref, f, None):
                raise CkptError(f"args disagree across ranks: {f} is {getattr(a, f, None)} in {ranks[rk].name} "
                                f"but {getattr(ref, f, None)} in {ranks[(0, 0, 0)].name}",
                                "the rank files come from different runs")


def config_for_shards(args, dialect, shards, num_layers, tp, stored_rows, opts: ReadOptions, version) -> GPTConfig:
    """The GPTConfig of Megatron-named shards: from the run's args where stored, else from shapes and
    the user's flags; --true-vocab-size and the layer count checked (the DeepSpeed reader's too)."""
    ov = opts.config_overrides()
    if args is not None:
        cfg = megatron_args.config_from_args(args, stored_rows)
        if ov:
            cfg = cfg.replace(**ov)
    else:
        cfg = _config_from_shapes(dialect, shards, num_layers, tp, stored_rows, ov)
    cfg = with_true_vocab_size(cfg, opts.true_vocab_size, stored_rows)
    require(cfg.num_layers == num_layers,
            f"args say {cfg.num_layers} layers but the files hold {num_layers}",
            "the checkpoint is incomplete or its args are wrong")
    return cfg


def _config_from_shapes(dialect, shards, num_layers, tp, stored_rows, ov) -> GPTConfig:
    """2019-style files carry no args: sizes from shapes, the rest from the user's flags."""
    word = shards[("word", None)][0]
    hidden = word.shape[1]
    heads = ov.get("num_attention_heads")
    if not heads:
        raise CkptError("this checkpoint stores no args, and the number of attention heads cannot be "
                        "read from tensor shapes", "give --num-attention-heads N")
    fc1 = shards.get(("fc1.weight", 0))
    activation = ov.get("activation") or "gelu_tanh"  # 2019 and fused-bias-gelu Megatron: tanh GeLU
    ffn = fc1[0].shape[0] * tp // (2 if activation == "swiglu" else 1) if fc1 else 4 * hidden
    pos = shards.get(("pos", None))
    has_norm_bias = ("attn_norm.bias", 0) in shards
    has_bias = ("proj.bias", 0) in shards
    kw = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
              padded_vocab_size=stored_rows,
              max_position_embeddings=pos[0].shape[0] if pos else ov.get("max_position_embeddings", 0),
              position_embedding="learned" if pos else ov.get("position_embedding", "rope"),
              normalization="layernorm" if has_norm_bias else "rmsnorm", activation=activation,
              add_bias_linear=has_bias, add_qkv_bias=("qkv.bias", 0) in shards,
              tied_embeddings=("output", None) not in shards)
    kw.update({k: v for k, v in ov.items() if k not in ("activation",)})
    return GPTConfig(**kw)


# --- writing --------------------------------------------------------------------------------

def default_dialect(ckpt: Checkpoint) -> str:
    return ckpt.source.dialect if ckpt.source.dialect in DIALECTS else "mcore"


def _check_dialect_fits(d: Dialect, cfg: GPTConfig, layout: Layout) -> None:
    if d.name == "flat2019":
        gpt2 = (cfg.position_embedding == "learned" and cfg.normalization == "layernorm"
                and cfg.tied_embeddings and cfg.num_query_groups == cfg.num_attention_heads
                and not cfg.gated and cfg.add_bias_linear)
        require(gpt2, "the 2019 flat dialect only holds GPT-2 style models (learned positions, "
                "LayerNorm, tied embeddings, no GQA/SwiGLU)", "choose --dialect mcore or legacy-norm")
        require(layout.pp == 1 and not layout.vpp, "the 2019 flat dialect has no pipeline parallelism",
                "use --pp 1, or another --dialect")
    if d.name in ("legacy-2020", "legacy") and (cfg.num_query_groups != cfg.num_attention_heads):
        raise CkptError(f"the {d.name} dialect predates grouped-query attention",
                        "choose --dialect legacy-norm or mcore")
    if cfg.qk_layernorm and not d.name.startswith("mcore"):
        raise CkptError("qk_layernorm exists only in megatron-core models", "choose --dialect mcore")
    if cfg.post_norms and not d.name.startswith("mcore"):
        raise CkptError(f"Gemma's post-attention / post-MLP norms: the {d.name} dialect has no place for them",
                        "choose --dialect mcore or mcore-te")
    if (cfg.attn_sinks or cfg.sliding_window is not None) and not d.name.startswith("mcore"):  # GPT-OSS, Gemma
        raise CkptError(f"attention sinks and sliding windows exist only in megatron-core models, not the {d.name} "
                        "dialect", "choose --dialect mcore")
    if cfg.mla is not None and not d.name.startswith("mcore"):
        raise CkptError(f"Multi-Latent Attention: the {d.name} dialect predates MLA models",
                        "choose --dialect mcore or mcore-te")
    if cfg.mtp_num_layers and d.mtp_prefix is None:
        raise CkptError(f"multi-token prediction (MTP) layers: the {d.name} dialect predates megatron-core's MTP block",
                        "choose --dialect mcore or mcore-te, or give --drop-mtp")
    if cfg.mtp_num_layers and layout.pp > 1:
        _check_mtp_stages_fit(cfg, layout)
    if d.name.startswith("mcore"):
        megatron_args.refuse_what_megatron_core_ignores(cfg, "choose --dialect legacy or legacy-norm")
    if cfg.moe is None:
        require(layout.ep == 1, f"--ep {layout.ep}: the model has no MoE layers to spread over expert-parallel ranks",
                "drop --ep")
        require(layout.expert_tp == layout.tp, f"--etp {layout.etp}: the model has no MoE experts to cut", "drop --etp")
        return
    require(bool(d.experts), f"the {d.name} dialect has no place for MoE experts",
            "choose --dialect mcore (megatron-core's local spec, SequentialMLP experts)")
    layout.local_experts(cfg.moe.num_experts, 0)  # EP divides the experts
    require(layout.expert_tp >= 1, f"--etp {layout.etp}: the expert tensor-parallel size is at least 1", "give --etp 1 or more")
    expert_grid(layout.tp, layout.ep, layout.expert_tp)  # expert TP divides TP
    for size, what, n, flag in ((cfg.moe.ffn_hidden_size, "expert FFN size", layout.expert_tp, "--etp"),
                                (cfg.moe.shared_ffn_hidden_size, "shared-expert FFN size", layout.tp, "--tp")):
        require(size % n == 0, f"{flag} {n} does not divide the {what} {size}",
                f"choose a {flag} size that divides it (expert TP defaults to TP)")


# --- MTP at PP > 1 (issue 30) ---------------------------------------------------------------------------------
# megatron-core 0.16.1 builds the MTP block on the last pipeline stage (multi_token_prediction.mtp_on_this_rank
# without a custom --pipeline-model-parallel-layout) and, as the MTP layers embed the tokens again, a
# LanguageModelEmbedding there too (GPTModel.__init__: `if self.pre_process or self.mtp_process`), registered
# before the decoder: `embedding.word_embeddings.weight` on the last stage's file, initialised from stage 0's by an
# all-reduce over the embedding group and kept equal by finalize_model_grads (_allreduce_word_embedding_grads), so
# its optimizer state is the first stage's too. Megatron-LM main (9d71cb1cd2, 2026-02, MTP for hybrid models) lets
# GPTModel decide mtp_process itself (mtp_on_this_rank, MTP on any stage of a custom layout); the key is the same.
# The position table is not kept equal (its group holds the first stage only: parallel_state.
# default_position_embedding_ranks), so learned positions with MTP at PP > 1 have no canonical form. With the
# distributed optimizer both the embedding and its copy are `shared_embedding`, each in a bucket of its own
# (megatron_buffers.is_shared_embedding).


def _check_mtp_stages_fit(cfg: GPTConfig, layout: Layout) -> None:
    """An MTP model at PP > 1 fits megatron-core's layout: no virtual stages, no learned position table (see above),
    untied embeddings (tied, the MTP stage also holds an output_layer.weight its forward never uses)."""
    require(not layout.vpp, f"multi-token prediction (MTP) layers with virtual pipeline stages (--vpp {layout.vpp}): "
            "not written (megatron-core places them on the last virtual stage of the last rank)", "drop --vpp")
    require(cfg.position_embedding != "learned", f"multi-token prediction (MTP) layers at --pp {layout.pp} with "
            "learned absolute position embeddings: megatron-core 0.16.1 keeps a second position table on the last "
            "stage for them that it never synchronises with the first stage's, which the model does not have",
            "write --pp 1 (any --tp), or give --drop-mtp")
    require(not cfg.tied_embeddings, f"multi-token prediction (MTP) layers at --pp {layout.pp} with tied embeddings: "
            "megatron-core 0.16.1 keeps there, beside its copy of the embedding, an output layer weight that its "
            "forward never uses nor synchronises, which the model does not have", "write --pp 1 (any --tp), or give "
            "--drop-mtp")


def write_megatron(ckpt: Checkpoint, out_dir: Path, layout: Layout, opts: WriteOptions = WriteOptions(),
                   progress: Optional[Callable[[int], None]] = None, warn=print,
                   rank_filter: Optional[Callable[[int, int, int], bool]] = None) -> WriteSummary:
    """Write ckpt as a Megatron torch-format checkpoint with the given layout into out_dir, as opts say
    (dialect, dtype, checkpoint_version, release, divisible_by, pad_fill, iteration, the training state).

    With opts.optimizer (the default) and a source holding optimizer state, each rank file also holds
    that rank's optimizer state in the non-distributed layout and the LR scheduler (megatron/optim.py);
    with opts.distributed_optimizer, a distrib_optim.pt beside each rank file holds it instead, laid out for
    a run at data-parallel size opts.dp (megatron/distopt.py), bucketed as a run with overlap_grad_reduce /
    ddp_bucket_size does (default: as the source run's args say), in the form of distrib_optim_era's
    megatron-core (default: today's).

    MoE models are written at layout.ep expert-parallel ranks and expert TP layout.expert_tp: one file per
    (TP, PP, EP) rank in mp_rank_TT[_PPP][_EEE], holding the dense part and that EP rank's experts under
    their local index, cut at expert-TP rank TT % ETP; with expert TP below TP only the (TP, EP) pairs
    Megatron-LM's ranks load exist (expert_grid), as Megatron-LM saves them. opts.moe_grouped_gemm: the target
    run uses --moe-grouped-gemm, so the experts are written as the dialect's grouped module (mcore-te:
    TEGroupedMLP) and the args say so; None keeps the source's choice where the dialect is the source's.
    Tensors stream one layer at a time, an MoE layer's routed experts one expert at a time (_write_unit).

    Returns its WriteSummary (files, bytes, padded vocab, iteration dir, optimizer state carried). rank_filter(tp, pp, ep) lets a
    distributed run write only its share of the files.
    """
    plan = _plan_target(ckpt, layout, opts, warn)
    it_dir = _make_iteration_dir(Path(out_dir), plan)
    writers = []
    distopt_writers = []  # distrib_optim.pt: flat tensors streamed after the grouped files
    for p, t, e in _target_ranks(layout, rank_filter):
        rank = _RankFile(plan, t, p, e)
        top, param_state = rank.top_entries()
        rank_name = _rank_name(t, p, e, layout.pp, layout.ep)
        (it_dir / rank_name).mkdir(exist_ok=True)
        writers.append(StreamingTorchWriter(it_dir / rank_name / "model_optim_rng.pt", top))
        if param_state is not None:
            distopt_writers.append(StreamingTorchWriter(it_dir / rank_name / megatron_distopt.FILE, param_state))
    return _write_and_summarise(plan, writers, distopt_writers, progress)


@dataclass
class _Target:
    """What every rank file of one write shares: the dialect and its keys, the output's config, version,
    iteration, the (vocab-resized) tensors to cut, the training state and args to store."""
    cfg: GPTConfig  # the source's
    cfg_out: GPTConfig  # the output's: its padded vocabulary
    d: Dialect
    layout: Layout
    dtype: Optional[torch.dtype]  # cast pieces to it (None: as stored)
    version: Optional[float]  # checkpoint_version to store (None: the 2019 flat dialect has none)
    qkv_version: float  # the QKV order written
    release: bool
    iteration: int
    rows: int  # padded vocabulary rows
    tensors: Dict[str, LazyTensor]
    train: object  # megatron_training.TrainingTarget or None
    distributed: object  # megatron_training.DistributedTarget or None
    args: object
    grouped: bool  # experts as the dialect's grouped-GEMM module
    expert_keys: Dict[str, str]
    chunks: list  # layout.chunks: (stage, chunk, first layer, count)
    layer_roles: Tuple[str, ...]  # a layer's roles in the dialect's parameter order

    @property
    def it_name(self) -> str:
        return "release" if self.release else f"iter_{self.iteration:07d}"

    def shard(self, role: str, full: LazyTensor, t: int, names: Tuple[str, ...], cast: bool = True) -> Piece:
        """File t's piece of a role tensor (or of one of its optimizer slots), declaring its placement
        under names; its streaming group follows from that (_unit_of)."""
        piece = rank_piece(full, role, self.cfg_out, self.layout, t, names=names, column=self.d.rule_column)
        if role.startswith("qkv.") and self.qkv_version < 2:
            heads_local, qkv_version = self.cfg.num_attention_heads // self.layout.tp, self.qkv_version
            piece = Piece(Derived(lambda x: qkv_from_grouped(x, qkv_version, heads_local, self.cfg.head_dim), [piece]),
                          piece.placement)
        if cast and self.dtype is not None and piece.dtype != self.dtype:
            piece = piece.to(self.dtype)
        return piece


def _plan_target(ckpt: Checkpoint, layout: Layout, opts: WriteOptions, warn) -> _Target:
    """Check the model fits the dialect and layout, then settle what every rank file shares (see _Target):
    done once, before any file exists, so a refused write leaves nothing behind. The steps, in order:
    the dialect; whether the model and layout fit it; the checkpoint_version written; what every Megatron
    target shares (plan_megatron: iteration, vocabulary padded for the target TP, training state, args);
    the distributed optimizer's buffers; the keys of a layer's roles and experts."""
    cfg = ckpt.config
    d = _target_dialect(ckpt, opts.dialect)
    _check_target_fits(d, cfg, layout)
    grouped = _grouped_gemm(ckpt, d, opts.moe_grouped_gemm)
    version = _target_version(ckpt, d, opts.checkpoint_version)
    qkv_version = _qkv_version(cfg, version)
    release = opts.release if opts.release is not None else (d.name == "flat2019" or ckpt.source.release)
    shared = plan_megatron(ckpt, layout, opts, warn, MegatronArgs(d.has_args, d.legacy_models, d.transformer_impl,
                                                                  version or 3.0, grouped))
    distributed = megatron_training.DistributedTarget.for_target(
        shared.train, opts.distributed_optimizer, opts.dp or 1, shared.args, shared.out_dtype, cfg, layout,
        opts.overlap_grad_reduce, opts.ddp_bucket_size, opts.distrib_optim_era or megatron_distopt.CURRENT.since)
    return _Target(cfg, shared.cfg_out, d, layout, opts.dtype, version, qkv_version, release, shared.iteration,
                   shared.rows, shared.tensors, shared.train, distributed, shared.args, grouped,
                   expert_keys=_expert_keys(d, grouped), chunks=layout.chunks(cfg.num_layers),
                   layer_roles=_layer_roles(d, cfg))


@dataclass(frozen=True)
class MegatronArgs:
    """How a Megatron target's args are written (megatron_args.args_for_target): whether at all (the 2019
    flat dialect stores none), for legacy models or megatron-core with which transformer_impl, at which
    checkpoint_version, with grouped-GEMM experts."""
    stored: bool
    legacy_models: bool
    transformer_impl: Optional[str]
    version: float
    grouped_gemm: bool = False


@dataclass
class MegatronPlan:
    """What every Megatron target (torch: _plan_target, torch_dist: dist.write_torch_dist) settles the same
    way before writing: the iteration, the vocabulary padded for the target TP (the output's config and
    weights), the dtype written, the training state carried and the args stored."""
    cfg_out: GPTConfig
    rows: int  # padded vocabulary rows
    tensors: Dict[str, LazyTensor]  # the weights to write (the fp32 masters when training was fp32)
    out_dtype: torch.dtype
    iteration: int
    train: Optional[megatron_training.TrainingTarget]
    args: object  # None where MegatronArgs.stored is False


def plan_megatron(ckpt: Checkpoint, layout: Layout, opts: WriteOptions, warn, how: MegatronArgs,
                  hint: str = megatron_optim.HINT) -> MegatronPlan:
    """The steps every Megatron writer takes in this order: the iteration (opts', else the source's), the
    vocabulary re-padded for layout.tp (opts.divisible_by, opts.pad_fill), the dtype written, the training
    state when opts.optimizer (its fp32 masters become the weights of an fp32 run), the args `how` says.
    hint: what to do when the source's optimizer state is incomplete (the format's own advice)."""
    iteration = opts.iteration if opts.iteration is not None else (ckpt.source.iteration or 0)
    megatron_args.refuse_biased_experts_cut(ckpt.config, layout)
    cfg_out, tensors = _padded_vocabulary(ckpt, layout, opts.divisible_by, opts.pad_fill, warn)
    rows = cfg_out.padded_vocab_size
    out_dtype = opts.dtype if opts.dtype is not None else next(iter(tensors.values())).dtype
    train = (megatron_training.TrainingTarget.for_target(ckpt, tensors, ckpt.config, rows, out_dtype, hint)
             if opts.optimizer else None)
    if train is not None and train.weights_from_masters:
        tensors = train.slots["master"]  # fp32 training: the fp32 masters are the weights
    args = None
    if how.stored:
        args = megatron_args.args_for_target(ckpt.source.args, cfg_out, layout, rows, out_dtype, how.legacy_models,
                                             how.transformer_impl, how.version, iteration, grouped_gemm=how.grouped_gemm)
        if ckpt.source.hf_experts is not None:  # the Hugging Face source's expert form, for a later to-hf (state.py)
            setattr(args, HF_EXPERTS_ARG, ckpt.source.hf_experts)
    return MegatronPlan(cfg_out, rows, tensors, out_dtype, iteration, train, args)


def _target_dialect(ckpt: Checkpoint, asked: Optional[str]) -> Dialect:
    """The dialect asked for, else the source's when it is a torch-format one, else mcore; of the model's family."""
    dialects = dialects_for(ckpt.config)
    name = asked or default_dialect(ckpt)
    if name not in dialects:
        raise CkptError(f"unknown dialect {name!r}", f"choose one of {', '.join(dialects)}")
    return dialects[name]


def _check_target_fits(d: Dialect, cfg: GPTConfig, layout: Layout) -> None:
    """Refuse a model the dialect cannot hold or a layout Megatron cannot load, before any file exists."""
    check_tensor_parallel(cfg, layout.tp)
    _check_dialect_fits(d, cfg, layout)
    layout.chunks(cfg.num_layers)  # the layers split over the stages and virtual chunks (refused where not)
    if layout.stage_layers and layout.pp > 2:
        mids = set(layout.stage_layers[1:-1])
        require(len(mids) == 1, f"Megatron can only make the first and last stage different "
                f"(--decoder-first/last-pipeline-num-layers); {list(layout.stage_layers)} varies in the middle",
                "give the middle stages equal layer counts")


def _qkv_version(cfg: GPTConfig, version: Optional[float]) -> float:
    """The per-rank QKV order written (checkpoint_version's; the 2019 flat dialect's is version 0's)."""
    qkv_version = 0.0 if version is None else version
    if qkv_version < 2 and cfg.num_query_groups != cfg.num_attention_heads:
        raise CkptError(f"checkpoint_version {version} predates grouped-query attention",
                        "write checkpoint_version 3.0")
    return qkv_version


def _padded_vocabulary(ckpt: Checkpoint, layout: Layout, divisible_by, pad_fill, warn
                       ) -> Tuple[GPTConfig, Dict[str, LazyTensor]]:
    """The output's config and weights with the vocabulary padded as Megatron pads it for the target TP."""
    cfg = ckpt.config
    rows = target_rows(cfg, layout.tp, divisible_by, warn)
    cfg_out = cfg.replace(padded_vocab_size=rows,
                          make_vocab_size_divisible_by=divisible_by or cfg.make_vocab_size_divisible_by)
    return cfg_out, resize_vocab(ckpt.tensors, cfg, rows, pad_fill)


def _expert_keys(d: Dialect, grouped: bool) -> Dict[str, str]:
    """The experts' keys written: the dialect's grouped-GEMM module's, else its first expert form's."""
    return d.grouped_experts if grouped else (d.experts[0] if d.experts else {})


def _layer_roles(d: Dialect, cfg: GPTConfig) -> Tuple[str, ...]:
    """A layer's roles in the dialect's parameter order (an MLA model's where it differs), the roles it does
    not order after them."""
    order = d.layer_param_order(cfg.mla is not None)
    return order + tuple(r for r in tables_for(cfg).layer_roles if r not in order)


def _target_version(ckpt: Checkpoint, d: Dialect, asked: Optional[float]) -> Optional[float]:
    """The checkpoint_version written: the one asked for, else the source's when writing its own dialect,
    else 3.0 (today's); the 2019 flat dialect stores none."""
    if d.name == "flat2019":
        return None
    if asked is not None:
        return float(asked)
    if ckpt.source.dialect == d.name and ckpt.source.checkpoint_version is not None:
        return float(ckpt.source.checkpoint_version)
    return 3.0


def _make_iteration_dir(out_dir: Path, plan: _Target) -> Path:
    """The iteration directory, and the tracker file Megatron-LM reads to find it."""
    it_dir = out_dir / plan.it_name
    it_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TRACKER).write_text("release" if plan.release else str(plan.iteration))
    return it_dir


def _target_ranks(layout: Layout, rank_filter) -> List[Tuple[int, int, int]]:
    """The (pp, tp, ep) of the rank files to write: the (TP, EP) pairs Megatron-LM's ranks load (expert_grid)
    of every stage, in Megatron's order, those rank_filter keeps (a distributed run writes its share)."""
    grid = expert_grid(layout.tp, layout.ep, layout.expert_tp)  # the (TP, EP) pairs Megatron-LM's ranks load
    return [(p, t, e) for p in range(layout.pp) for e in range(layout.ep) for t in range(layout.tp)
            if (t, e) in grid and not (rank_filter and not rank_filter(t, p, e))]


class _RankFile:
    """One rank file's content: its model chunks' entries (pieces declaring their placement, extra state)
    and its parameters in Megatron's parameter order, which its optimizer state follows."""

    def __init__(self, plan: _Target, t: int, p: int, e: int):
        self.plan, self.t, self.p, self.e = plan, t, p, e
        self.params: list = []  # (role, layer, slot -> full tensor, canonical names, key) in parameter order
        self.param_chunks: list = []  # the model chunk of each

    def top_entries(self) -> Tuple[dict, Optional[dict]]:
        """(the file's top-level entries, its distrib_optim.pt content or None): args, version, iteration,
        the model chunks, then the optimizer state of this rank's parameters."""
        plan = self.plan
        file_obj = {}
        vpp = plan.layout.vpp or 1
        for (_, v, first, count) in [c for c in plan.chunks if c[0] == self.p]:
            flat = self.chunk_entries(v, first, count)
            model = unflatten(flat) if plan.d.nested else flat
            file_obj["model" if vpp == 1 else f"model{v}"] = model
        top: dict = {}
        if plan.args is not None:
            top["args"] = plan.args
        if plan.version:  # version 0 checkpoints predate the key
            top["checkpoint_version"] = plan.version
        top["iteration"] = plan.iteration
        top.update(file_obj)
        param_state = None
        if plan.distributed is not None:
            entries, param_state = plan.distributed.rank_entries(plan.train, self.params, self.param_chunks, self.t,
                                                                 self.p, plan.shard, plan.cfg, plan.layout.ep, self.e)
            top.update(entries)
        elif plan.train is not None:
            top.update(plan.train.rank_entries(self.params, self.t, plan.shard, plan.cfg, plan.layout.ep))
        return top, param_state

    def put(self, flat, key, role, layer, full_of, v, names=None):
        """Enter the rank's piece of a role under key, and record it as a parameter (for the optimizer)."""
        names = names or canonical_names(role, layer, self.plan.cfg_out)
        flat[key] = self.plan.shard(role, full_of("weight"), self.t, names)
        if role not in BUFFER_ROLES:  # a module buffer (the router's expert bias) is in no optimizer group
            self.params.append((role, layer, full_of, names, key))
            self.param_chunks.append(v)

    def chunk_entries(self, v: int, first: int, count: int) -> Dict[str, object]:
        """Model chunk v's flat entries: the embeddings on the first stage's first chunk, its layers, the
        final norm and head on the last stage's last chunk."""
        plan, d, tensors, train = self.plan, self.plan.d, self.plan.tensors, self.plan.train
        flat: Dict[str, object] = {}
        if self.p == 0 and v == 0:
            for role in FIRST_STAGE_ROLES:  # the embeddings (a spec trait)
                if global_role_tensor(tensors, role) is not None:
                    self.put(flat, d.globals[role], role, None, megatron_training.global_slots(tensors, train, role), v)
        if self.p == plan.layout.pp - 1 and self.p > 0 and plan.cfg_out.mtp_num_layers:
            # the word embedding's copy MTP keeps on the last stage (see _check_mtp_stages_fit), registered before
            # the decoder; declared as the last stage's output matrix (HEAD_COPY_NAMES) it streams with that stage
            self.put(flat, d.globals["word"], "word", None, megatron_training.global_slots(tensors, train, "word"), v,
                     HEAD_COPY_NAMES)
        for local in range(count):
            self.layer_entries(flat, v, first + local, d.layer_prefix.format(i=local))
        if self.p == plan.layout.pp - 1 and v == (plan.layout.vpp or 1) - 1:
            self.last_stage_entries(flat, v)
        return flat

    def layer_entries(self, flat: Dict[str, object], v: int, g: int, prefix: str) -> None:
        """Global layer g's entries under prefix (its local name): its roles in parameter order, an MoE
        layer's router / experts / shared expert, and the dialect's extra state."""
        plan, d, tensors, train, cfg_out = self.plan, self.plan.d, self.plan.tensors, self.plan.train, self.plan.cfg_out
        moe_layer = cfg_out.is_moe_layer(g)
        mla = cfg_out.mla is not None
        for role in plan.layer_roles:
            if layer_role_tensor(tensors, cfg_out, g, role) is None:
                continue
            key = d.layer_key(role, moe_layer, mla)
            if key is None:
                raise CkptError(f"the {d.name} dialect has no place for {role} tensors",
                                "choose --dialect mcore")
            self.put(flat, prefix + key, role, g, megatron_training.layer_slots(tensors, train, cfg_out, g, role), v)
        if moe_layer:
            self.moe_entries(flat, v, g, prefix)
        for extra in d.extra_state:  # an MoE layer has no dense MLP, nor its extra state
            if not (moe_layer and extra.startswith("mlp.")) and not (mla and ".linear_qkv." in extra):
                flat[prefix + extra] = _extra_state_value(d)
        for role, extra in d.mla_extra_state.items() if mla else ():  # MLA's linears in place of linear_qkv
            if tables_for(cfg_out).spec.has_role(role, cfg_out, g):
                flat[prefix + extra] = _extra_state_value(d)

    def moe_entries(self, flat: Dict[str, object], v: int, g: int, prefix: str) -> None:
        """MoE layer g's router, this EP rank's experts under their local index (fc-major when grouped), the
        shared expert, and their extra state."""
        plan, d, tensors, train, cfg_out = self.plan, self.plan.d, self.plan.tensors, self.plan.train, self.plan.cfg_out
        experts = plan.layout.local_experts(cfg_out.moe.num_experts, self.e)
        roles = moe_layer_roles(cfg_out, experts)
        if plan.grouped:
            roles = fc_major(roles)
        for role in roles:
            if layer_role_tensor(tensors, cfg_out, g, role) is not None:
                self.put(flat, prefix + _moe_key(d, plan.expert_keys, role, experts.start), role, g,
                         megatron_training.layer_slots(tensors, train, cfg_out, g, role), v)
        for extra in (d.grouped_extra_state if plan.grouped else
                      [x.format(j=j) for j in range(len(experts)) for x in d.expert_extra_state]):
            flat[prefix + extra] = _extra_state_value(d)
        if cfg_out.moe.shared_ffn_hidden_size:
            for extra in d.shared_extra_state:
                flat[prefix + extra] = _extra_state_value(d)

    def mtp_entries(self, flat: Dict[str, object], v: int, g: int, prefix: str) -> None:
        """MTP layer g (megatron-core's MultiTokenPredictionLayer) under prefix: its enorm, hnorm and eh_proj, its
        decoder layer (under the dialect's mtp_inner), its final norm, in the order the module registers them."""
        d, tensors, train, cfg_out = self.plan.d, self.plan.tensors, self.plan.train, self.plan.cfg_out
        spec = tables_for(cfg_out).spec
        linear = spec.with_trait("linear")

        def own(roles) -> None:
            for role in roles:
                if layer_role_tensor(tensors, cfg_out, g, role) is None:
                    continue
                key = prefix + d.mtp_layer[role]
                self.put(flat, key, role, g, megatron_training.layer_slots(tensors, train, cfg_out, g, role), v)
                if role in linear:
                    flat[key.rsplit(".", 1)[0] + "._extra_state"] = _extra_state_value(d)
        own(spec.mtp.before)
        self.layer_entries(flat, v, g, prefix + d.mtp_inner)
        own(spec.mtp.after)

    def last_stage_entries(self, flat: Dict[str, object], v: int) -> None:
        """The final norm, the output head (or the tied embedding's last-stage copy) and their extra state."""
        plan, d, tensors, train, cfg = self.plan, self.plan.d, self.plan.tensors, self.plan.train, self.plan.cfg
        for role in ("final_norm.weight", "final_norm.bias"):
            if global_role_tensor(tensors, role) is not None:
                self.put(flat, d.globals[role], role, None, megatron_training.global_slots(tensors, train, role), v)
        for k in range(plan.cfg_out.mtp_num_layers):  # GPTModel registers its MTP block after the decoder
            self.mtp_entries(flat, v, plan.cfg_out.num_layers + k, d.mtp_prefix.format(i=k))
        if not cfg.tied_embeddings:
            self.put(flat, d.globals["output"], "output", None,
                     megatron_training.global_slots(tensors, train, "output"), v)
        elif plan.layout.pp > 1 and d.head_copy:  # a parameter of its own, kept in sync by Megatron; the tied
            # embedding's copy that is the last stage's output matrix, so it streams with the last stage
            self.put(flat, d.head_copy, "word", None, megatron_training.global_slots(tensors, train, "word"), v,
                     HEAD_COPY_NAMES)
        if (not cfg.tied_embeddings or plan.layout.pp > 1):
            for extra in d.global_extra_state:
                flat[extra] = _extra_state_value(d)


def _write_and_summarise(plan: _Target, writers, distopt_writers, progress) -> WriteSummary:
    """Stream every file's tensors, a layer (or an expert) at a time over all files (_unit_of), then the
    distrib_optim.pt files a parameter at a time; return what was written."""
    tensors_written = sum(len(w.pending) for w in writers + distopt_writers)
    total = write_grouped(writers, lambda lazy: _unit_of(lazy.placement, plan.cfg.num_layers), progress)
    total += megatron_distopt.write_files(distopt_writers, progress)  # streamed, a parameter at a time
    carried = None
    if plan.train is not None:
        carried = plan.train.describe()
        if plan.distributed is not None:
            carried["distributed"] = plan.distributed.describe()
    return WriteSummary("torch", len(writers) + len(distopt_writers), total, tensors=tensors_written,
                        optimizer=carried, dialect=plan.d.name, iteration_dir=plan.it_name, padded_vocab_size=plan.rows,
                        checkpoint_version=plan.version)


def rank_piece(full: LazyTensor, role: str, cfg: GPTConfig, layout: Layout, t: int, layer: Optional[int] = None,
               names: Optional[Tuple[str, ...]] = None, column: Optional[str] = None) -> Piece:
    """TP rank t's piece of a merged role tensor, as its Megatron file holds it (write_megatron writes it,
    verify's rank view of a merged source computes with it): routed experts are cut over expert TP, file t
    holding shard t % ETP; the rest over TP; column: the dialect's Dialect.rule_column."""
    if role.startswith("experts."):
        return shard_role(full, role, cfg, layout.expert_tp, layer, names, column)[t % layout.expert_tp]
    return shard_role(full, role, cfg, layout.tp, layer, names, column)[t]


def _moe_key(d: Dialect, expert_keys: Dict[str, str], role: str, first_expert: int) -> str:
    """The layer-relative key of an MoE role: the router's and shared expert's from the dialect, an
    expert's from expert_keys with its index local to the EP rank whose experts start at first_expert."""
    if role in d.moe_layer:
        return d.moe_layer[role]
    mlp, base = scope_of(role)
    e = int(mlp.split(".")[2])
    return expert_keys[base].format(j=e - first_expert)


# the names the tied embedding's last-stage copy declares: it is the output matrix there (as verify's
# rank view calls it), so it streams with the last stage's tensors rather than with the embedding
HEAD_COPY_NAMES = ("output.weight",)
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?")


def _unit_of(placement: Optional[Placement], num_layers: int) -> Optional[Tuple[int, int]]:
    """The streaming group of a piece, from the canonical names it declares: the embeddings (-1, 0), a
    layer's tensors _write_unit, the final norm and output (num_layers, 0); entries that are no piece
    (extra state) go last (None)."""
    if placement is None:
        return None
    m = _LAYER_NAME.match(placement.names[0])
    if m is None:
        return (-1, 0) if placement.names[0].startswith("embed.") else (num_layers, 0)
    return _write_unit(int(m.group(1)), None if m.group(2) is None else int(m.group(2)))


def _write_unit(layer: int, expert: Optional[int]) -> Tuple[int, int]:
    """The streaming group of a layer's tensor: (layer, 0), or (layer, 1 + e) for routed expert e's, so the
    writer holds one expert (all its ranks' pieces and optimizer slots) at a time, not a whole MoE layer,
    whose experts can be many GB (peak about two units in flight: torchfile.write_grouped)."""
    return (layer, 0) if expert is None else (layer, 1 + expert)


def _grouped_gemm(ckpt: Checkpoint, d: Dialect, asked: Optional[bool]) -> bool:
    """Whether the experts are written in the dialect's --moe-grouped-gemm form (see write_megatron)."""
    if ckpt.config.moe is None:
        require(not asked, "--moe-grouped-gemm: the model has no MoE layers", "drop --moe-grouped-gemm")
        return False
    if asked is None:  # keep the source run's form when writing its own dialect
        src = ckpt.source
        return bool(d.grouped_experts) and src.format == "megatron" and src.dialect == d.name and \
            bool(getattr(src.args, "moe_grouped_gemm", False)) and not getattr(src.args, "moe_use_legacy_grouped_gemm", False)
    require(not asked or d.grouped_experts is not None,
            f"--moe-grouped-gemm with the {d.name} dialect means the legacy GroupedMLP (mlp.experts.weight1 / weight2), "
            "which ckptool reads but does not write", "write --dialect mcore-te (TEGroupedMLP), or SequentialMLP experts")
    return bool(asked)


def _extra_state_value(d: Dialect):
    return Const(torch.empty(0, dtype=torch.uint8)) if d.extra_state_value == "empty_bytes" else None
