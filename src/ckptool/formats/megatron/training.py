"""The training state of Megatron's torch format, between the rank files and the canonical slots.

Reading: each rank's optimizer state (megatron/optim.py for the rank file's own 'optimizer' entry,
megatron/distopt.py for distrib_optim.pt) tied to that rank's parameters, then merged across ranks by
the weights' own table (the reader's `canonical`), with the scalars (step, groups, scheduler) once.
Writing: TrainingTarget re-pads every slot for the target and builds each rank file's optimizer
entries in the target model's parameter order; DistributedTarget lays them out as distrib_optim.pt.
checkpoint.py owns the directory walk, the names and the weights; this module only the optimizer side.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ...config import GPTConfig, Layout
from ...errors import CkptError, require
from ...lazy import LazyTensor
from ...roles import BUFFER_ROLES, HEAD_COPY, canonical_names, global_role_tensor, layer_role_tensor
from ...state import OPTIMIZER_SLOTS, PAD_FILL_BY_SLOT, WEIGHT, Checkpoint, OptimizerState, ParamGroup
from ...vocab import resize_slot_vocab
from . import buffers as megatron_buffers, distopt as megatron_distopt, optim as megatron_optim
from .groups import merge_groups
from .optim import RankParam, role_shards


def read_training_state(src, model_files, params, cfg, canonical, warnings, stacked=None) -> Optional[OptimizerState]:
    """The optimizer state of every rank, tied to the parameters and merged like the weights;
    None (with a warning naming what is dropped) when there is none or its form is not read yet.
    src: the source's rank files (checkpoint._RankFiles: trees, ranks, tp, args, and with expert TP != TP
    grid and etp, megatron.expert_grid: which expert-TP shard each (TP, EP) file holds); model_files: each
    rank's model file. stacked: (stored params per rank, unstack(rk, param, value)) when a file's tensors
    are not one per parameter of params (the legacy GroupedMLP: one tensor for all local experts of an fc);
    the optimizer, which has one entry per stored tensor, is tied to those, then each slot is cut as
    unstack cuts the weight."""
    trees, ranks, tp, args, grid, etp = src.trees, src.ranks, src.tp, src.args, src.grid, src.etp
    if not any("optimizer" in tree for tree in trees.values()):
        return None
    ep = max(e for _, _, e in ranks) + 1
    for rk, tree in trees.items():
        why = megatron_optim.unsupported_form(tree, ep)
        if why:
            warnings.append(f"optimizer state dropped: {why}; the output holds the weights only")
            return None
    pp = max(p for _, p, _ in ranks) + 1
    # module buffers saved among the weights (the router's expert bias) are in no optimizer group
    params = {rk: [p for p in ps if p.role not in BUFFER_ROLES] for rk, ps in params.items()}
    if stacked:
        stacked = ({rk: [p for p in ps if p.role not in BUFFER_ROLES] for rk, ps in stacked[0].items()}, stacked[1])

    def sources(rk):  # the files holding a chained distributed optimizer's [dense, expert] parts for rk
        return [model_files.get((t, rk[1], e)) for t, e in megatron_distopt.chain_sources(rk[0], rk[2], tp, ep, etp or tp)]
    tied_to = stacked[0] if stacked else params
    per_rank = {rk: _read_rank(tree, model_files[rk], tied_to[rk], args, cfg, pp, rk[1], ep, *sources(rk))
                for rk, tree in trees.items()}
    if stacked:
        per_rank = {rk: r and _unstacked(r, rk, stacked[0][rk], stacked[1]) for rk, r in per_rank.items()}
    if all(r is None for r in per_rank.values()):
        return None
    for rk, r in per_rank.items():
        if r is None:
            raise CkptError(f"{model_files[rk]}: no optimizer state, but other ranks have one",
                            "the rank files do not belong to one checkpoint; " + megatron_optim.HINT)
    slot_names = [s for s in OPTIMIZER_SLOTS if all(s in sl for r in per_rank.values() for sl in r.slots)]
    slots = {}
    for slot in slot_names:
        shards, _ = slot_shards({rk: [sl[slot] for sl in r.slots] for rk, r in per_rank.items()}, params, tp, grid, etp)
        slots[slot] = canonical(shards)
    where = str(next(iter(ranks.values())).parent)
    groups = _param_groups(per_rank, params, cfg, where)
    steps = {r.step for r in per_rank.values()}
    require(len(steps) == 1, f"{where}: ranks were stepped {sorted(map(str, steps))} times", megatron_optim.HINT)
    first = trees[(0, 0, 0)]
    distributed = megatron_distopt.uses_distributed_optimizer(ranks[(0, 0, 0)], args)
    return OptimizerState(
        kind="megatron-distributed" if distributed else "megatron" if "master" in slots else "megatron-fp32",
        slots=slots, step=steps.pop(),
        param_groups=groups,
        grad_scaler=per_rank[(0, 0, 0)].grad_scaler,
        scheduler=first.get("opt_param_scheduler", first.get("lr_scheduler")),
        consumed_samples=getattr(args, "consumed_train_samples", None))


def _param_groups(per_rank, params, cfg, where: str) -> List[ParamGroup]:
    """The ranks' param groups merged (merge_groups), each holding the canonical names of its parameters."""
    hypers, local = merge_groups({rk: r.hypers for rk, r in per_rank.items()}, where)
    names: List[List[str]] = [[] for _ in hypers]
    for rk, r in per_rank.items():
        for param, g in zip(params[rk], r.group_of):
            if param.role != HEAD_COPY and not (param.role == "output" and cfg.tied_embeddings):
                group = names[local[rk][g]]
                group += [n for n in canonical_names(param.role, param.layer, cfg) if n not in group]
    return [ParamGroup(n, h) for n, h in zip(names, hypers)]


def _unstacked(r: megatron_optim.RankOptimizer, rk, stored: List[RankParam], unstack) -> megatron_optim.RankOptimizer:
    """A rank's optimizer tied to its stored tensors, with each stacked one's slots cut as its weight is."""
    slots, group_of = [], []
    for param, sl, g in zip(stored, r.slots, r.group_of):
        cut = {slot: [v for _, v in unstack(rk, param, value)] for slot, value in sl.items()}
        for j in range(len(unstack(rk, param, param.weight))):
            slots.append({slot: pieces[j] for slot, pieces in cut.items()})
            group_of.append(g)
    return dataclasses.replace(r, slots=slots, group_of=group_of)


def slot_shards(values, params: Dict[tuple, List[RankParam]], tp: int, grid=None, etp: Optional[int] = None):
    """{(role, layer): [value per TP rank]} of one slot, as the weights are gathered: with expert TP != TP the
    experts' values per expert-TP rank, file (t, p, e) holding shard grid[(t, e)] (Megatron-LM saves each
    rank's optimizer.state_dict() beside its own weights, so its expert optimizer holds the same cut; the
    first file of each shard is taken, as for the dense part)."""
    if grid is None or etp in (None, tp):
        return role_shards(values, params, tp)
    dense_p, dense_v, expert_p, expert_v = {}, {}, {}, {}
    for rk in sorted(params):
        t, p, e = rk
        is_expert = [x.role.startswith("experts.") for x in params[rk]]
        dense_p[rk] = [x for x, ex in zip(params[rk], is_expert) if not ex]
        dense_v[rk] = [v for v, ex in zip(values[rk], is_expert) if not ex]
        if (grid[(t, e)], p, e) not in expert_p:
            expert_p[(grid[(t, e)], p, e)] = [x for x, ex in zip(params[rk], is_expert) if ex]
            expert_v[(grid[(t, e)], p, e)] = [v for v, ex in zip(values[rk], is_expert) if ex]
    shards, head_copy = role_shards(dense_v, dense_p, tp)
    expert_shards, _ = role_shards(expert_v, expert_p, etp)
    return {**shards, **expert_shards}, head_copy


def _read_rank(tree, model_file: Path, params: List[RankParam], args, cfg: GPTConfig, pp: int, pp_rank: int,
               ep: int, dense_file: Optional[Path] = None, expert_file: Optional[Path] = None):
    """One rank's optimizer state: distrib_optim.pt beside the rank file (the distributed optimizer; at
    EP > 1 its dense and expert parts beside dense_file and expert_file, megatron_distopt.chain_sources)
    or the rank file's own 'optimizer' entry (a chained [dense, expert] list at EP > 1)."""
    where, rank_dir = str(model_file), model_file.parent
    if megatron_distopt.uses_distributed_optimizer(rank_dir, args):
        run = megatron_distopt.RankRun(args, cfg.tied_embeddings, pp, pp_rank, mtp=cfg.mtp_num_layers > 0)
        return megatron_distopt.read_rank(tree, rank_dir, params, run, where, ep,
                                          *(f.parent if f is not None else None for f in (dense_file, expert_file)))
    return megatron_optim.read_rank(tree, params, where, megatron_optim.GroupRule.from_args(args), ep)


# --- writing ---------------------------------------------------------------------------------

def global_slots(tensors, train, role):
    """slot name -> the full tensor of a global role in that slot."""
    def full(slot):
        return global_role_tensor(tensors if slot == WEIGHT else train.slots[slot], role)
    return full


def layer_slots(tensors, train, cfg, layer, role):
    """slot name -> the full (fused) tensor of one layer's role in that slot."""
    def full(slot):
        return layer_role_tensor(tensors if slot == WEIGHT else train.slots[slot], cfg, layer, role)
    return full


class TrainingTarget:
    """The optimizer state a Megatron target carries: every slot re-padded like the weights."""

    def __init__(self, opt: OptimizerState, slots: Dict[str, Dict[str, LazyTensor]], mixed: bool):
        self.opt, self.slots, self.mixed = opt, slots, mixed
        self.weights_from_masters = not mixed and "master" in opt.slots

    @classmethod
    def for_target(cls, ckpt: Checkpoint, weights: Dict[str, LazyTensor], cfg: GPTConfig, rows: int,
                   out_dtype: torch.dtype, hint: str = megatron_optim.HINT) -> Optional["TrainingTarget"]:
        """The source's slots re-padded for `rows` (new rows: zero moments, master = weight); None without
        optimizer state. hint: the target format's advice when the state is incomplete."""
        opt = ckpt.optimizer
        if opt is None:
            return None
        require(opt.step is not None, f"{ckpt.source.path}: the optimizer state has no step count", hint)
        slots = {}
        for slot in ("master", "exp_avg", "exp_avg_sq"):
            source = opt.slots.get(slot)
            if source is None and slot == "master":  # fp32 training: the weights were the masters
                source = {n: w.to(torch.float32) for n, w in ckpt.tensors.items()}
            if source is None:
                raise CkptError(f"{ckpt.source.path}: the optimizer state has no {slot}", hint)
            slots[slot] = resize_slot_vocab(source, weights, cfg, rows, PAD_FILL_BY_SLOT[slot])
        return cls(opt, slots, mixed=out_dtype in (torch.float16, torch.bfloat16))

    def param_slots(self, params, t: int, shard, cfg: GPTConfig, slots) -> list:
        """(source group index, {slot: this rank's piece}) per parameter, in the model's order."""
        out = []
        for role, layer, full_of, group, key in params:
            names = canonical_names(role, layer, cfg)
            g = megatron_optim.group_index(self.opt.param_groups, names, key, full_of(WEIGHT).shape)
            out.append((g, {slot: shard(role, full_of(slot), t, group, cast=False) for slot in slots}))
        return out

    @property
    def grad_scaler(self) -> Optional[dict]:
        """A loss scaler's state is only Megatron's to read when it came from Megatron."""
        return self.opt.grad_scaler if self.opt.kind.startswith("megatron") else None

    def with_scheduler(self, entries: dict) -> dict:
        if self.opt.scheduler is not None:
            entries["opt_param_scheduler"] = self.opt.scheduler
        return entries

    def rank_entries(self, params, t: int, shard, cfg: GPTConfig, ep: int = 1) -> dict:
        """The optimizer and scheduler entries of one rank file; params in the model's order. At EP > 1
        with experts the entry is megatron-core's chained [dense, expert] list, the experts' slots
        (this rank's local experts, cut by the weights' table) in the second."""
        slots = [s for s in self.slots if s != "master" or self.mixed]
        entries = [(g, megatron_optim.expert_parallel(param[0], ep), sl)
                   for param, (g, sl) in zip(params, self.param_slots(params, t, shard, cfg, slots))]
        optimizers = megatron_optim.target_groups(self.opt.param_groups, ep)
        return self.with_scheduler({"optimizer": megatron_optim.rank_state(
            entries, self.opt.param_groups, optimizers, self.opt.step, self.mixed, self.grad_scaler)})

    def describe(self) -> dict:
        return {"kind": self.opt.kind, "step": self.opt.step, "slots": sorted(self.slots),
                "groups": len(self.opt.param_groups)}


class DistributedTarget:
    """The distributed optimizer's files for a target: per rank, the 'optimizer' entry without tensors
    and a distrib_optim.pt laid out as megatron-core lays its grad buffers out for data-parallel size dp."""

    def __init__(self, dp: int, tied: bool, pp: int, dtype_key, args=None, era=megatron_distopt.CURRENT, tp: int = 1,
                 etp: Optional[int] = None):
        self.dp, self.tied, self.pp, self.dtype_key, self.tp = dp, tied, pp, dtype_key, tp
        self.etp = etp or tp  # expert TP: the expert grid (and expert-DP size) of the target run
        self.args, self.era = args, era  # the written args say whether (and how) the target run buckets

    @classmethod
    def for_target(cls, train: Optional[TrainingTarget], wanted: bool, dp: int, args, out_dtype: torch.dtype,
                   cfg: GPTConfig, layout: Layout, overlap_grad_reduce: Optional[bool] = None,
                   ddp_bucket_size: Optional[int] = None, era: str = megatron_distopt.CURRENT.since
                   ) -> Optional["DistributedTarget"]:
        """overlap_grad_reduce / ddp_bucket_size: the target run's where given (else the source run's, as
        its args carry them), written into args and followed by the layout; era: the target's
        megatron-core (megatron_buffers.ERAS by `since`), which decides the file's form."""
        require(dp >= 1, f"--dp {dp}: the data-parallel size is at least 1")
        require(not (wanted and train is not None and cfg.moe is not None
                     and (dp * layout.tp) % (layout.ep * layout.expert_tp)),
                f"--dp {dp}: the expert-data-parallel size of the run (DP x TP / (EP x expert TP) = {dp} x "
                f"{layout.tp} / ({layout.ep} x {layout.expert_tp})) is not whole",
                "choose --dp so that DP x TP is a multiple of --ep times the expert TP")
        if args is not None:  # what the target run is: Megatron reads DP from its own flags
            args.use_distributed_optimizer = bool(wanted and train is not None)
            if wanted:
                args.data_parallel_size = dp
                if train is not None:
                    megatron_distopt.set_bucket_args(args, overlap_grad_reduce, ddp_bucket_size)
        if not wanted or train is None:
            return None
        require(args is not None or not overlap_grad_reduce,
                "--overlap-grad-reduce: this dialect writes no args to say so", "choose --dialect mcore")
        require(era in megatron_buffers.ERA_BY_SINCE, f"--distrib-optim-era {era}: not a megatron-core era "
                "ckptool knows", f"choose one of {', '.join(megatron_buffers.ERA_BY_SINCE)}")
        # Megatron-LM reduces bf16 grads in fp32 (--accumulate-allreduce-grads-in-fp32, on by default
        # with --bf16); the buffers' key holds the grad dtype
        fp32_grads = getattr(args, "accumulate_allreduce_grads_in_fp32", out_dtype == torch.bfloat16)
        target = megatron_buffers.ERA_BY_SINCE[era]
        key = megatron_distopt.buffer_key(target, out_dtype, torch.float32 if fp32_grads else out_dtype)
        return cls(dp, cfg.tied_embeddings, layout.pp, key, args, target, layout.tp, layout.expert_tp)

    def describe(self) -> dict:
        """dp, and the bucketing and era where they are not the plain default (for the report)."""
        out: dict = {"dp": self.dp}
        size = megatron_distopt.target_bucket_size(self.args, 0, 0, self.dp)
        if size is not None:
            out["bucket_size"] = size
        if self.era is not megatron_distopt.CURRENT:
            out["era"] = self.era.since
        return out

    def rank_entries(self, train: TrainingTarget, params, chunks, t: int, p: int, shard, cfg: GPTConfig,
                     ep: int = 1, e: int = 0):
        """The rank file's optimizer entries and its distrib_optim.pt state. At EP > 1 with experts, as
        megatron-core's chain [dense, expert]: the expert optimizer's buffers hold the expert-parallel
        parameters, sharded over the expert-data-parallel size (DP x TP / (EP x expert TP)); each part is in
        the file of that optimizer's DP rank 0 only (megatron_distopt.chain_sources; None in the others'):
        with expert TP = TP the dense one in EP rank 0's files, the expert one in every file."""
        # the word embedding and its last-stage copy (written as role word: the tied head's, MTP's) bucketed alone
        entries = [(chunk, g, slots, megatron_buffers.is_shared_embedding(param[0], self.tied, self.pp,
                                                                          cfg.mtp_num_layers > 0) and param[0] == "word",
                    megatron_optim.expert_parallel(param[0], ep))
                   for param, chunk, (g, slots) in zip(params, chunks,
                                                       train.param_slots(params, t, shard, cfg, OPTIMIZER_SLOTS))]
        # megatron-core >= 0.16 lists every group of the model on every rank (megatron_optim.target_groups)
        optimizers = megatron_optim.target_groups(train.opt.param_groups, ep)
        chained = len(optimizers) > 1
        holds = [source == (t, e) for source in megatron_distopt.chain_sources(t, e, self.tp, ep, self.etp)]
        parts = []
        for n, used in enumerate(optimizers):
            expert = chained and n == 1
            groups = [dict(train.opt.param_groups[g].hyper) for g in used]
            for hyper in groups:
                if chained or "is_expert_parallel" in hyper:  # the target layout decides it
                    hyper["is_expert_parallel"] = expert
            mine = [(c, used.index(g), s, shared) for c, g, s, shared, x in entries if x == expert]
            dp = self.dp * self.tp // (ep * self.etp) if expert else self.dp
            optimizer, state = megatron_distopt.rank_files(
                mine, dp, train.opt.step, groups, train.grad_scaler, self.dtype_key,
                # one bucket size for both (its default from the dense DP size), each padded for its own DP
                lambda chunk: megatron_distopt.target_bucket_size(self.args, chunk, p, self.dp), self.era)
            parts.append((optimizer, None if chained and not holds[n] else state))
        if not chained:
            return train.with_scheduler({"optimizer": parts[0][0]}), parts[0][1]
        return train.with_scheduler({"optimizer": [o for o, _ in parts]}), [s for _, s in parts]
