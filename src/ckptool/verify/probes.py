"""After the parallel forward diverged in a layer: which rank file's tensors of that layer are wrong.

Two probes, each applying every rank file's tensors of the diverging layer to the reference's values of it:
the MoE pieces of an MoE layer (experts.py) and the attention tensors of an MLA layer at tensor parallelism
(mla_probe.py, since every TP file slices them). What a probe finds is added, with its files, to the
layer's line of the report's `where`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch.distributed as dist

from . import compare as cmp
from . import experts, mla_probe


@dataclass
class RankRun:
    """One rank's part of the parallel verify, as a probe needs it."""
    shards: object  # RankShards: this rank's tensors
    layout: object  # the target's Layout
    ranks: object  # parallel.Ranks
    dtype: object  # compute dtype
    files: Callable  # (tp_rank, pp_rank[, ep_rank]) -> the file that holds it, or None


@dataclass
class Probe:
    """A probe's parts. choose(first divergence, ref checkpoint, ref hidden states) -> layer (-1: none);
    reference(ref checkpoint, layer, the layer's input, dtype, device) -> values (rank 0); probe(layer, values or
    None, shards, own weights, ranks, dtype, stage) -> per rank pieces (rank 0); diagnose(layer, pieces, values,
    file_of) -> one line."""
    choose: Callable
    reference: Callable
    probe: Callable
    diagnose: Callable


def probe_layer(probe_of, report: Optional[cmp.Report], where: Dict[str, str], run: RankRun, parts: Probe) -> None:
    """When the first divergence is a layer parts.choose picks and the reference has weights, apply each rank
    file's tensors of that layer to the reference's values of it and add what differs, with its files, to the
    layer's `where`. Collective: every rank calls it; rank 0 decides whether there is a probe."""
    r = run.ranks
    layer = parts.choose(report.first_divergence, *probe_of) if r.rank == 0 and probe_of is not None else -1
    box = [layer]
    dist.broadcast_object_list(box, src=0)
    layer = box[0]
    if layer < 0:
        return
    chunks = run.layout.chunks(run.shards.config.num_layers)
    stage = next(p for p, _, first, count in chunks if first <= layer < first + count)
    values = None
    if r.rank == 0:
        ref_ckpt, ref_hidden = probe_of
        before = ref_hidden["embedding" if layer == 0 else f"layer {layer - 1}"]
        values = parts.reference(ref_ckpt, layer, before, run.dtype, r.device)

    def own_weights():
        return {k: v.load().to(device=r.device, dtype=run.dtype) for k, v in run.shards.tensors.items()
                if k.startswith(f"layers.{layer}.")}
    got = parts.probe(layer, values, run.shards, own_weights, r, run.dtype, stage)
    if r.rank == 0:
        files = run.files
        file_of = (lambda t, e: files(t, stage, e)) if run.layout.ep > 1 else (lambda t, e: files(t, stage))
        line = parts.diagnose(layer, got, values, file_of)
        # the name: "layer i", or "layer i or the output layer (...)" without its hidden state, of which an
        # earlier probe (MoE before MLA) may have said something already
        name = report.first_divergence
        where[name] = "; ".join(x for x in (where.get(name, where.get(f"layer {layer}")), f"layer {layer}: {line}") if x)


def probe_moe_layer(probe_of, report, where, run: RankRun, tol) -> None:
    """A diverging MoE layer: which rank files' router / experts / shared expert differ (experts.py)."""
    cfg, layout, dtype = run.shards.config, run.layout, run.dtype  # (tol is rank 0's: the diagnosis runs there only)
    probe_layer(probe_of, report, where, run, Probe(
        choose=lambda first, ref_ckpt, hidden: experts.probe_layer(first, cfg, ref_ckpt, hidden),
        reference=experts.moe_input, probe=experts.probe,
        diagnose=lambda layer, got, h, file_of: experts.diagnose(layer, got, probe_of[0], h, layout, dtype,
                                                                 cmp.relative_tolerance(tol), file_of)))


def mla_at_tp(cfg, layout) -> bool:
    return cfg.mla is not None and layout.tp > 1


def probe_mla_layer(probe_of, report, where, run: RankRun, tol) -> None:
    """A diverging layer of an MLA model at TP: which attention tensors of which rank files differ
    (mla_probe.py; every TP file slices them)."""
    cfg, tp = run.shards.config, run.layout.tp  # (tol is rank 0's: the diagnosis runs there only)
    probe_layer(probe_of, report, where, run, Probe(
        choose=experts.diverging_layer,
        reference=mla_probe.reference_values,  # (values the ranks apply their tensors to, reference weights)
        probe=lambda layer, values, *rest: mla_probe.probe(layer, values and values[0], *rest),
        diagnose=lambda layer, got, values, file_of: mla_probe.diagnose(layer, got, *values, cfg, tp,
                                                                        cmp.relative_tolerance(tol), file_of)))
