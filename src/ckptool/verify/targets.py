"""What the parallel verify runs: the target's layout and how each rank gets its shard and names its files.

A Megatron torch-format checkpoint and a DeepSpeed save run at the layout of their files, each rank on its own
file; a torch_dist checkpoint holds global tensors, so any TP x PP (x VPP) can run it, each rank on its slices.
"""
from __future__ import annotations

import dataclasses

from ..config import Layout
from ..errors import CkptError, require
from ..formats.deepspeed import checkpoint as ds_format
from ..formats.dcp import torch_dist as dist_format
from ..formats.deepspeed.ranks import DeepSpeedRanks
from ..formats.megatron.ranks import rank_dir_name, read_layout, read_rank_shards, slice_rank_shards
from ..formats.registry import resolve, source_format
from .parallel import ranks_per_stage


class ParallelTarget:
    """What the parallel forward runs: the layout and how a rank gets its shard."""

    def __init__(self, fmt, ckpt, layout, shards, files, any_layout):
        self.format, self.ckpt, self.layout = fmt, ckpt, layout
        self.config = ckpt.config
        self.shards = shards  # (tp_rank, pp_rank[, ep_rank]) -> RankShards (ep_rank only with EP > 1)
        self.files = files  # (tp_rank, pp_rank[, ep_rank]) -> the file that holds it, or None
        self.any_layout = any_layout  # True when --tp/--pp may choose the layout

    def rank_shards(self, tp_rank: int, pp_rank: int, ep_rank: int = 0):
        return self.shards(tp_rank, pp_rank, ep_rank) if self.layout.ep > 1 else self.shards(tp_rank, pp_rank)


def parallel_target(target, opts, tp, pp, world, vpp=None) -> ParallelTarget:
    """The target's ParallelTarget, built as its entry in the format table says (Format.parallel_ref)."""
    build = resolve(source_format(target).parallel_ref)  # the format table decides, as for every command
    if build is None:
        raise CkptError(f"{target}: the parallel verify runs Megatron checkpoints (torch format mp_rank_* files "
                        "or torch_dist) and DeepSpeed saves", "run `ckptool verify` without torchrun for other formats")
    return build(target, opts, tp, pp, world, vpp)


def megatron_target(target, opts, tp, pp, world, vpp) -> ParallelTarget:
    """A torch-format checkpoint runs at the layout of its files, each rank on its own rank file."""
    meta = read_layout(target, opts)
    cfg, layout, ckpt = meta
    require(tp in (None, layout.tp) and pp in (None, layout.pp) and vpp in (None, layout.vpp),
            f"{target} is stored at {layout.describe()}; a torch-format checkpoint runs at the layout of "
            "its files", f"drop --tp/--pp/--vpp, or reshard it first: ckptool reshard {target} DST --tp N --pp M")
    return ParallelTarget("megatron torch", ckpt, layout,
                          lambda t, p, e=0: read_rank_shards(target, t, p, opts, meta, e),
                          lambda t, p, e=0: rank_dir_name(t, p, layout.pp, e, layout.ep), False)


def dist_target(target, opts, tp, pp, world, vpp) -> ParallelTarget:
    """A torch_dist checkpoint holds global tensors: any layout runs it, each rank slicing its shard."""
    ckpt = dist_format.read(target, opts)  # metadata only: tensors are read per rank, sliced
    layout = dist_layout(ckpt, tp, pp, world, vpp)
    return ParallelTarget("torch_dist", ckpt, layout,
                          lambda t, p, e=0: slice_rank_shards(ckpt, layout, t, p, e), lambda t, p, e=0: None, True)


def deepspeed_target(target, opts, tp, pp, world, vpp) -> ParallelTarget:
    """A DeepSpeed save runs at the layout of its files, each rank on its own files
    (formats/deepspeed/ranks.py); the merged read supplies the architecture and the reference."""
    ckpt = ds_format.read(target, opts)  # metadata and lazy tensors: no tensor bytes read here
    layout = ckpt.source.layout
    require(tp in (None, layout.tp) and pp in (None, layout.pp) and vpp is None,
            f"{target} is stored at {layout.describe()}; a DeepSpeed checkpoint runs at the layout of its files",
            f"drop --tp/--pp/--vpp, or reshard it first: ckptool reshard {target} DST --tp N --pp M")
    ranks = DeepSpeedRanks(target, opts, ckpt)
    return ParallelTarget(f"deepspeed ({ckpt.source.variant})", ckpt, layout, ranks.shards, ranks.files, False)


def dist_layout(ckpt, tp, pp, world, vpp=None):
    """A torch_dist checkpoint holds global tensors, so any TP x PP (x VPP) can run it. Chosen in
    order: --tp/--pp (one of them given: the other fills WORLD_SIZE), the TP/PP/VPP in the stored args,
    and for checkpoints without args TP = WORLD_SIZE, PP 1; --vpp splits each stage into chunks."""
    if tp or pp:
        given = tp or pp
        require(world % given == 0, f"--{'tp' if tp else 'pp'} {given} does not divide the {world} processes "
                "torchrun started", "give --tp and --pp whose product is the process count")
        layout = Layout(tp=tp or world // pp, pp=pp or world // tp)
    elif ckpt.source.args is not None:
        layout = ckpt.source.layout
    else:
        layout = Layout(tp=world, pp=1)
    if vpp is None:
        return layout
    require(vpp >= 1 and layout.pp > 1, f"--vpp {vpp} needs a pipeline of more than one stage "
            f"(this run is {layout.describe()})", "give --pp 2 or more with --vpp")
    layout = dataclasses.replace(layout, vpp=vpp if vpp > 1 else None, stage_layers=None)
    layout.chunks(ckpt.config.num_layers)  # layers that do not split evenly: the one-line error now
    return layout


def stage_ranks(layout) -> int:
    """The processes one pipeline stage of `layout` runs on (verify/parallel.ranks_per_stage)."""
    return ranks_per_stage(layout.tp, layout.ep, layout.expert_tp)


def where_held(layout, cfg, files) -> dict:
    """'layer i' -> which stage and files hold it, so a divergence points at files."""
    def held(p):  # the stage's ranks in order: rank x has TP rank x % TP, EP rank (x // ETP) % EP
        names = [files(x % layout.tp, p, (x // layout.expert_tp) % layout.ep) if layout.ep > 1 else files(x, p)
                 for x in range(stage_ranks(layout))]
        return f": {', '.join(names)}" if all(names) else f" (TP ranks 0-{layout.tp - 1})"

    out = {}
    for p, v, first, count in layout.chunks(cfg.num_layers):
        chunk = f" virtual chunk {v}" if layout.vpp else ""
        for i in range(first, first + count):
            out[f"layer {i}"] = f"pipeline stage {p}{chunk}{held(p)}"
    out["embedding"] = f"embed.word/embed.pos in pipeline stage 0{held(0)}"
    out["output layer (logits)"] = f"final norm/output in pipeline stage {layout.pp - 1}{held(layout.pp - 1)}"
    return out
