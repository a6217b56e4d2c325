"""`ckptool verify`: run a checkpoint and compare its logits with a reference.

Under torchrun (WORLD_SIZE = TP * PP of the target; with expert parallelism see verify/parallel.py)
every rank loads its own shard and the model runs tensor-, pipeline- (and expert-) parallel as the
framework ran it (verify/parallel.py). Without torchrun the merged target runs in one process.
`--files DST` checks that DST's files are whole instead (integrity.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

# torch, and ckptool.verify's compare and inputs (which import it), are imported by the functions that
# run a forward: `--files` and the errors about the input answer without paying torch's import.
from ..api import COMPUTE_DTYPES
from ..errors import EXIT, CkptError, require
from ..verify import hints  # torch-free: a FAIL's hints
from .common import print_warnings, reports_errors, source_options

if TYPE_CHECKING:  # annotations only
    from ..verify import compare as cmp


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@click.command("verify")
@click.argument("target", required=False)
@click.option("--reference", "ref", default=None,
              help="Checkpoint to compare with (any format ckptool reads, or a Hugging Face model dir). "
                   "Default: the target's own merged state, run in one process.")
@click.option("--reference-logits", default=None, metavar="FILE[:KEY]",
              help="A .pt/.safetensors with `tokens` [B,S] and logits [B,S,V] under KEY (default `logits`) "
                   "recorded from the training framework; verify runs those tokens.")
@click.option("--files", "files_dir", default=None, metavar="DST",
              help="Instead: check that DST's files are whole: a ckptool output directory against its "
                   "manifest, any other checkpoint by its format's own checks (torch zip records' CRC-32, "
                   "safetensors headers, DCP index against its .distcp files, DeepSpeed/Megatron rank files).")
@click.option("--tokens", default=None, help='Token ids "1,2,3;4,5,6", a file of them, or a text file with --tokenizer.')
@click.option("--tokenizer", default=None, metavar="DIR", help="Tokenizer directory for a text --tokens file.")
@click.option("--batch", type=int, default=2, show_default=True, help="Rows of random tokens.")
@click.option("--seq-len", type=int, default=16, show_default=True, help="Length of random token rows.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random tokens.")
@click.option("--dtype", type=click.Choice(sorted(COMPUTE_DTYPES)), default="fp32", show_default=True,
              help="Compute dtype for both forwards.")
@click.option("--tolerance", type=float, default=None,
              help="Largest max-abs logits error that passes (default 1e-4 fp32; in fp16/bf16 2e-2/1e-1 "
                   "or 3x the reference's own 16-bit error against its fp32 run, whichever is larger); "
                   "also the relative bound for per-layer hidden states.")
@click.option("--tp", type=int, default=None,
              help="torch_dist targets under torchrun: tensor-parallel size to run (any works: the files hold "
                   "global tensors). Default: the stored args' TP/PP/VPP, else TP = WORLD_SIZE, PP 1; with only one "
                   "of --tp/--pp the other fills WORLD_SIZE. Torch-format targets run at their files' layout.")
@click.option("--pp", type=int, default=None, help="torch_dist targets under torchrun: pipeline-parallel size (see --tp).")
@click.option("--vpp", type=int, default=None,
              help="torch_dist targets under torchrun: virtual pipeline chunks per stage (interleaved "
                   "schedule; needs --pp > 1 and layers divisible by PP x VPP). Torch-format targets run "
                   "the chunks their files hold.")
@source_options
@reports_errors
def verify_cmd(target, ref, reference_logits, files_dir, tokens, tokenizer, batch, seq_len, seed, dtype,
               tolerance, tp, pp, vpp, **kw):
    """Check that TARGET computes what the reference computes (exit status 1 when it does not).

    Under torchrun, TARGET is a Megatron checkpoint (torch format, VPP included, or torch_dist) or a
    DeepSpeed save (Megatron-DeepSpeed pipeline files, ZeRO runs of Megatron models with TP), and
    WORLD_SIZE must be TP * PP of the layout it runs at (for MoE checkpoints saved with expert
    parallelism, mp_rank_TT[_PPP]_EEE: PP x TP x EP, or PP x lcm(TP, ETP x EP) at an expert TP ETP
    other than TP); each rank reads only its own shard.

    \b
    Examples:
      torchrun --nproc-per-node 4 -m ckptool verify ckpts/run1                # TP2 PP2 vs merged
      torchrun --nproc-per-node 4 -m ckptool verify out --reference ckpts/run1
      torchrun --nproc-per-node 4 -m ckptool verify ckpts/run1 --reference-logits ref.pt:logits_fp32
      torchrun --nproc-per-node 4 -m ckptool verify moe_tp2ep2 --reference hf_dir  # MoE at TP2 EP2
      torchrun --nproc-per-node 2 -m ckptool verify moe_tp2ep2etp1            # ... expert TP 1: 2 files
      torchrun --nproc-per-node 2 -m ckptool verify dist_ckpt --tp 1 --pp 2  # torch_dist at TP1 PP2
      torchrun --nproc-per-node 2 -m ckptool verify dist_ckpt --pp 2 --vpp 2  # ... interleaved
      ckptool verify out --reference hf_model_dir                             # one process
      ckptool verify --files out                                              # manifest check
      ckptool verify --files ckpts/run1                                       # CRCs, sizes, rank files
    """
    from ..api import verify
    result = verify(target, reference=ref, reference_logits=reference_logits, files=files_dir or None,
                    tokens=tokens, tokenizer=tokenizer, batch=batch, seq_len=seq_len, seed=seed, dtype=dtype,
                    tolerance=tolerance, tp=tp, pp=pp, vpp=vpp, **kw)
    if not result.ok:
        from ..distributed import fail_as_team, torchrun_rank
        if torchrun_rank() is not None:  # rank 0 printed the report: it exits first, every rank with status 1
            fail_as_team("result=FAIL (see the report above)", EXIT["mismatch"], 0, lambda line: None, agreed=True)
        sys.exit(EXIT["mismatch"])


def verify_files(dst: Path) -> bool:
    """Check the files of DST against its manifest, or by its format's own checksums and sizes
    (integrity.py, torch-free), printing each problem; True when they hold."""
    from ..integrity import verify_files as check
    return check(dst)


def _tokens_for(reference_logits, token_args, vocab):
    from ..verify import inputs
    if reference_logits:
        return inputs.load_reference_logits(reference_logits)
    return inputs.make_tokens(*token_args, vocab=vocab), None


def _reference(ref, recorded, target_ckpt, tokens, dtype, device, opts):
    """(logits, hidden or None, true vocab or None) of whatever the target is compared with."""
    from ..verify import inputs
    if recorded is not None:
        return recorded, None, None
    if ref is None:
        return inputs.checkpoint_forward(target_ckpt, tokens, dtype, device)
    if inputs.is_hf_dir(ref):
        return inputs.hf_forward(ref, tokens, dtype, device)
    from ..formats.registry import open_checkpoint
    ckpt = open_checkpoint(ref, opts)
    print_warnings(ckpt)
    return inputs.checkpoint_forward(ckpt, tokens, dtype, device)


def _tolerance(given, dtype, ref_logits, cols, recorded, reference_in):
    """(tolerance, noise floor or None). --tolerance wins. Otherwise the dtype's default, and in
    16-bit compute also NOISE_MARGIN x the reference's own 16-bit error (the reference run again in
    fp32): rounding error grows with depth and logit scale, so a fixed bound that suits a 4-layer
    model fails an exact conversion of a 1B one, while a wrong tensor moves logits by far more."""
    import torch
    from ..verify import compare as cmp
    if given is not None:
        return given, None
    base = cmp.DEFAULT_TOLERANCE[dtype]
    if dtype == torch.float32 or recorded is not None:
        return base, None
    floor = cmp.max_abs_error(ref_logits, reference_in(torch.float32), cols)
    return max(base, cmp.NOISE_MARGIN * floor), floor


def _report(report: cmp.Report, where=None) -> bool:
    for line in report.lines(where):
        click.echo(line)
    return report.ok


def run_single(target, ref, reference_logits, opts, dtype, tol, token_args) -> bool:
    from ..formats.registry import open_checkpoint
    from ..verify import compare as cmp
    from ..verify import inputs
    ckpt = open_checkpoint(target, opts)
    cfg = ckpt.config
    tokens, recorded = _tokens_for(reference_logits, token_args, cfg.true_or_padded_vocab)
    logits, hidden, _ = inputs.checkpoint_forward(ckpt, tokens, dtype)
    ref_logits, ref_hidden, ref_vocab = _reference(ref, recorded, ckpt, tokens, dtype, "cpu", opts)
    print_warnings(ckpt)  # replica checks happen as tensors load, so only now are they all known
    cols = cmp.true_columns(logits.shape[-1], cfg.vocab_size, ref_logits.shape[-1], ref_vocab)
    tol, floor = _tolerance(tol, dtype, ref_logits, cols, recorded,
                            lambda dt: _reference(ref, recorded, ckpt, tokens, dt, "cpu", opts)[0])
    report = cmp.compare(logits, ref_logits, cols, tol, hidden, ref_hidden, noise_floor=floor)
    report.hints += hints.weights_hint(ckpt, ref is None and recorded is None)
    ok = _report(report)
    layout = ckpt.source.layout
    n = layout.pp * _ranks_per_stage(layout)
    if n > 1:
        click.echo(f"note: this ran the merged target in one process; for the {layout.describe()} "
                   f"parallel forward run: torchrun --nproc-per-node {n} -m ckptool verify {target} ...")
    return ok


def run_parallel(target, ref, reference_logits, opts, dtype, tol, token_args, tp=None, pp=None,
                 vpp=None) -> bool:
    import torch
    import torch.distributed as dist
    from ..verify import compare as cmp
    from ..verify import parallel

    world = int(os.environ["WORLD_SIZE"])
    target_kind = parallel_target(target, opts, tp, pp, world, vpp)
    cfg, layout, ckpt = target_kind.config, target_kind.layout, target_kind.ckpt
    need = layout.pp * _ranks_per_stage(layout)
    require(world == need,
            f"torchrun started {world} processes but {target} is {layout.describe()}: it needs {need}",
            f"run torchrun --nproc-per-node {need} -m ckptool verify ..."
            + (" (or give --tp/--pp whose product is the process count)" if target_kind.any_layout else ""))
    tokens, recorded = _tokens_for(reference_logits, token_args, cfg.true_or_padded_vocab)
    r = parallel.init_ranks(layout.tp, layout.pp, layout.ep, layout.expert_tp)
    finished = False
    try:
        shards = target_kind.rank_shards(r.tp_rank, r.pp_rank, r.ep_rank)
        start = time.perf_counter()
        with torch.no_grad():
            logits, hidden = parallel.stage_forward(tokens, shards, r, dtype)
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)
        seconds = time.perf_counter() - start
        got = parallel.gather_to_rank0(logits, hidden, shards, r, tuple(tokens.shape))
        ok, report, where, layer_probe = True, None, None, None
        if r.rank == 0:
            click.echo(f"parallel forward: {layout.describe()}, {world} processes, {dtype}, "
                       f"tokens {tuple(tokens.shape)}, {target_kind.format} target")
            click.echo(f"forward_seconds={seconds:.4f}")
            logits, hidden = got
            ref_logits, ref_hidden, ref_vocab = _reference(ref, recorded, ckpt, tokens, dtype, r.device, opts)
            print_warnings(ckpt)
            cols = cmp.true_columns(logits.shape[-1], cfg.vocab_size, ref_logits.shape[-1], ref_vocab)
            where = _where(layout, cfg, target_kind.files)
            tol, floor = _tolerance(tol, dtype, ref_logits, cols, recorded,
                                    lambda dt: _reference(ref, recorded, ckpt, tokens, dt, r.device, opts)[0])
            report = cmp.compare(logits, ref_logits.cpu(), cols, tol, hidden, ref_hidden, noise_floor=floor)
            report.hints += hints.weights_hint(ckpt, ref is None and recorded is None)
            if (cfg.moe is not None or _mla_at_tp(cfg, layout)) and report.first_divergence:
                layer_probe = (_reference_weights(ref, recorded, ckpt, opts), ref_hidden)
        if cfg.moe is not None:  # every rank knows: all take part in the probe of a diverging MoE layer
            _probe_moe_layer(layer_probe, report, where, shards, layout, r, dtype, tol, target_kind.files)
        if _mla_at_tp(cfg, layout):  # and of a diverging MLA layer's attention, whose tensors every TP file slices
            _probe_mla_layer(layer_probe, report, where, shards, layout, r, dtype, tol, target_kind.files)
        if r.rank == 0:
            ok = _report(report, where)
        status = torch.tensor([1 if ok else 0], dtype=torch.int32, device=r.device)
        dist.broadcast(status, src=0)
        finished = True
        return bool(status.item())
    finally:
        # After an error on one rank the others wait in a collective: tearing the group down would wait
        # with them (NCCL), so a failing rank just exits and torchrun stops the rest.
        if r.owns_group and finished:
            dist.destroy_process_group()


def _reference_weights(ref, recorded, target_ckpt, opts):
    """The reference as canonical weights (for probing an MoE layer), or None for recorded logits."""
    if recorded is not None:
        return None
    if ref is None:
        return target_ckpt
    from ..formats.registry import open_checkpoint
    return open_checkpoint(ref, opts)


def _probe_layer(probe_of, report, where, shards, layout, r, dtype, files, choose, reference, probe, diagnose) -> None:
    """When the first divergence is a layer `choose` picks (-1: none) and the reference has weights, apply
    each rank file's tensors of that layer to the reference's values of it and add what differs, with its
    files, to the layer's `where`. Collective: every rank calls it; rank 0 decides whether there is a probe.
    The probe's parts: choose(first divergence, ref checkpoint, ref hidden states) -> layer;
    reference(ref checkpoint, layer, the layer's input, dtype, device) -> values (rank 0); probe(layer,
    values or None, shards, own weights, ranks, dtype, stage) -> per rank pieces (rank 0); diagnose(layer,
    pieces, values, file_of) -> one line."""
    import torch.distributed as dist
    layer = choose(report.first_divergence, *probe_of) if r.rank == 0 and probe_of is not None else -1
    box = [layer]
    dist.broadcast_object_list(box, src=0)
    layer = box[0]
    if layer < 0:
        return
    stage = next(p for p, _, first, count in layout.chunks(shards.config.num_layers) if first <= layer < first + count)
    values = None
    if r.rank == 0:
        ref_ckpt, ref_hidden = probe_of
        before = ref_hidden["embedding" if layer == 0 else f"layer {layer - 1}"]
        values = reference(ref_ckpt, layer, before, dtype, r.device)

    def own_weights():
        return {k: v.load().to(device=r.device, dtype=dtype) for k, v in shards.tensors.items()
                if k.startswith(f"layers.{layer}.")}
    got = probe(layer, values, shards, own_weights, r, dtype, stage)
    if r.rank == 0:
        file_of = (lambda t, e: files(t, stage, e)) if layout.ep > 1 else (lambda t, e: files(t, stage))
        line = diagnose(layer, got, values, file_of)
        # the name: "layer i", or "layer i or the output layer (...)" without its hidden state, of which an
        # earlier probe (MoE before MLA) may have said something already
        name = report.first_divergence
        where[name] = "; ".join(x for x in (where.get(name, where.get(f"layer {layer}")), f"layer {layer}: {line}") if x)


def _probe_moe_layer(probe_of, report, where, shards, layout, r, dtype, tol, files) -> None:
    """A diverging MoE layer: which rank files' router / experts / shared expert differ (verify/experts.py)."""
    from ..verify import compare as cmp
    from ..verify import experts
    cfg = shards.config  # (tol is rank 0's: the diagnosis runs there only)
    _probe_layer(probe_of, report, where, shards, layout, r, dtype, files,
                 choose=lambda first, ref_ckpt, hidden: experts.probe_layer(first, cfg, ref_ckpt, hidden),
                 reference=experts.moe_input, probe=experts.probe,
                 diagnose=lambda layer, got, h, file_of: experts.diagnose(layer, got, probe_of[0], h, layout, dtype,
                                                                         cmp.relative_tolerance(tol), file_of))


def _mla_at_tp(cfg, layout) -> bool:
    return cfg.mla is not None and layout.tp > 1


def _probe_mla_layer(probe_of, report, where, shards, layout, r, dtype, tol, files) -> None:
    """A diverging layer of an MLA model at TP: which attention tensors of which rank files differ
    (verify/mla_probe.py; every TP file slices them)."""
    from ..verify import compare as cmp
    from ..verify import experts, mla_probe
    cfg = shards.config  # (tol is rank 0's: the diagnosis runs there only)
    _probe_layer(probe_of, report, where, shards, layout, r, dtype, files, choose=experts.diverging_layer,
                 reference=mla_probe.reference_values,  # (values the ranks apply their tensors to, reference weights)
                 probe=lambda layer, values, *rest: mla_probe.probe(layer, values and values[0], *rest),
                 diagnose=lambda layer, got, values, file_of: mla_probe.diagnose(layer, got, *values, cfg, layout.tp,
                                                                                cmp.relative_tolerance(tol), file_of))


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
    from ..formats import dist as dist_format
    from ..formats.megatron_ranks import rank_dir_name, read_layout, read_rank_shards, slice_rank_shards
    from ..formats.registry import detect_format

    fmt = detect_format(target)  # the format table decides, as for every command
    if fmt == "deepspeed":
        return deepspeed_target(target, opts, tp, pp, vpp)
    if fmt == "megatron":
        meta = read_layout(target, opts)
        cfg, layout, ckpt = meta
        require(tp in (None, layout.tp) and pp in (None, layout.pp) and vpp in (None, layout.vpp),
                f"{target} is stored at {layout.describe()}; a torch-format checkpoint runs at the layout of "
                "its files", f"drop --tp/--pp/--vpp, or reshard it first: ckptool reshard {target} DST --tp N --pp M")
        return ParallelTarget("megatron torch", ckpt, layout,
                              lambda t, p, e=0: read_rank_shards(target, t, p, opts, meta, e),
                              lambda t, p, e=0: rank_dir_name(t, p, layout.pp, e, layout.ep), False)
    if fmt == "torch_dist":
        ckpt = dist_format.read(target, opts)  # metadata only: tensors are read per rank, sliced
        layout = dist_layout(ckpt, tp, pp, world, vpp)
        return ParallelTarget("torch_dist", ckpt, layout,
                              lambda t, p, e=0: slice_rank_shards(ckpt, layout, t, p, e), lambda t, p, e=0: None, True)
    raise CkptError(f"{target}: the parallel verify runs Megatron checkpoints (torch format mp_rank_* files "
                    "or torch_dist) and DeepSpeed saves", "run `ckptool verify` without torchrun for other formats")


def deepspeed_target(target, opts, tp, pp, vpp) -> ParallelTarget:
    """A DeepSpeed save runs at the layout of its files, each rank on its own files
    (formats/deepspeed_ranks.py); the merged read supplies the architecture and the reference."""
    from ..formats import deepspeed as ds_format
    from ..formats.deepspeed_ranks import DeepSpeedRanks
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
    import dataclasses
    from ..config import Layout
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


def _ranks_per_stage(layout) -> int:
    from ..verify.parallel import ranks_per_stage
    return ranks_per_stage(layout.tp, layout.ep, layout.expert_tp)


def _where(layout, cfg, files) -> dict:
    """'layer i' -> which stage and files hold it, so a divergence points at files."""
    def held(p):  # the stage's ranks in order: rank x has TP rank x % TP, EP rank (x // ETP) % EP
        names = [files(x % layout.tp, p, (x // layout.expert_tp) % layout.ep) if layout.ep > 1 else files(x, p)
                 for x in range(_ranks_per_stage(layout))]
        return f": {', '.join(names)}" if all(names) else f" (TP ranks 0-{layout.tp - 1})"

    out = {}
    for p, v, first, count in layout.chunks(cfg.num_layers):
        chunk = f" virtual chunk {v}" if layout.vpp else ""
        for i in range(first, first + count):
            out[f"layer {i}"] = f"pipeline stage {p}{chunk}{held(p)}"
    out["embedding"] = f"embed.word/embed.pos in pipeline stage 0{held(0)}"
    out["output layer (logits)"] = f"final norm/output in pipeline stage {layout.pp - 1}{held(layout.pp - 1)}"
    return out
