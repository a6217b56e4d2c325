"""`ckptool merge`, `ckptool reshard`, `ckptool fix-vocab`: Megatron layouts in, Megatron layouts out.
Each parses its options, calls the function of the same name in ckptool/api.py and prints the report."""
from __future__ import annotations

import click

from .. import api
from ..summary import WriteSummary
from ..formats.megatron.buffers import ERA_BY_SINCE
from ..formats.registry import BY_OUTPUT
from ..formats.dcp.fsdp_files import DIALECTS as DCP_DIALECTS
from ..formats.megatron.names import DIALECTS
from .common import (LiveWarnings, Progress, conversion_line, human_bytes, output_options, report_conversion,
                     reports_errors, source_options)


def _run(convert, verb: str, src, dst, **kw) -> None:
    """Call api.<convert> with a progress bar and live warnings, print its report."""
    live, bar = LiveWarnings(), Progress(verb)
    try:
        result = convert(src, dst, progress=bar, warn=live, **kw)
    finally:
        bar.close()
    s = result.summary
    if result.checkpoint is None:  # a source with no canonical form, written by its reader's export
        report_conversion(result, _export_lines(result), live)
        return
    vocab = result.checkpoint.config.vocab_size
    report_conversion(result, [
        conversion_line(result, f"{s.format} {s.dialect or ''}, {result.layout.describe()}"),
        *([f"  layout: {result.layout.describe()} ({result.layout_note})"] if result.layout_note else []),
        f"  {s.files} files, {human_bytes(s.bytes)} of tensors, vocab "
        f"{vocab if vocab is not None else 'unknown'} padded to {s.padded_vocab_size}, {s.iteration_dir}",
        *_training_state_lines(s, result.checkpoint, kw.get("optimizer", True))],
        live)


def _export_lines(result) -> list:
    s = result.summary
    lines = [f"{result.command}: {result.src} ({result.kind}) -> {result.dst} ({s.format} {s.dialect or ''})",
             f"  {s.files} files, {human_bytes(s.bytes)} of tensors, {s.iteration_dir}"]
    if s.optimizer:
        lines.append(f"  optimizer state carried (step {s.optimizer['step']}, {s.optimizer['groups']} param groups)")
    return lines


def _training_state_lines(summary: WriteSummary, ckpt, optimizer: bool) -> list:
    """What a Megatron output holds beside the weights, and how Megatron resumes from it (for the outputs
    the format table says a Megatron-LM run resumes from; ds-universal is DeepSpeed's)."""
    if not BY_OUTPUT[summary.format].megatron_run:
        return []
    carried = summary.optimizer
    if carried:
        dist = carried.get("distributed")
        where = "non-distributed layout" if not dist else (
            f"distrib_optim.pt files for DP {dist['dp']}"
            + (f", buckets of {dist['bucket_size']} (--overlap-grad-reduce)" if "bucket_size" in dist else "")
            + (f", megatron-core {dist['era']} form" if "era" in dist else ""))
        return [f"  optimizer state carried ({carried['kind']}, step {carried['step']}, {carried['groups']} "
                f"param groups, {where}); RNG state is not: resume with --no-load-rng"]
    if ckpt.source.format != "megatron":
        return []
    why = "--no-optimizer" if ckpt.optimizer is not None and not optimizer else "weights only"
    return [f"  {why}: resume training from this checkpoint with --no-load-optim --no-load-rng, or --finetune"]


def megatron_output_options(fn):
    fn = click.option("--dialect", type=click.Choice(sorted(DIALECTS) + list(DCP_DIALECTS)), default=None,
                      help="Key-name dialect to write (default: the source's; mcore for non-Megatron sources; "
                           "--format dcp: hf, or torchtitan for torchtitan's names).")(fn)
    fn = click.option("--format", type=click.Choice(api.OUTPUT_FORMATS), default=None,
                      help="Format to write (default: the source's): Megatron torch or torch_dist, "
                           "ds-universal (a DeepSpeed universal checkpoint with the optimizer state; merge only), "
                           "or dcp (a torch.distributed.checkpoint folder of the HF-named state dict that "
                           "dcp.load loads into an FSDP2 model at any world size; weights only).")(fn)
    fn = click.option("--optimizer/--no-optimizer", default=True, show_default=True,
                      help="Carry the optimizer state (fp32 masters, Adam moments, step, param groups, LR "
                           "scheduler) when the source has it and the target format holds it, so training "
                           "resumes on the new layout; --no-optimizer writes the weights only.")(fn)
    fn = click.option("--dp", type=int, default=None,  # at least 1: checked with the other sizes (layout_request)
                      help="With --distributed-optimizer: the data-parallel size the resuming run will use "
                           "(default 1).")(fn)
    fn = click.option("--distrib-optim-era", type=click.Choice(list(ERA_BY_SINCE)), default=None,
                      help="With --distributed-optimizer: the megatron-core the resuming run uses, by the month its "
                           "distrib_optim.pt form began (default 2024-07, today's; 2024-02 writes the per-bucket "
                           "list form).")(fn)
    fn = click.option("--ddp-bucket-size", type=click.IntRange(min=1), default=None,
                      help="With --overlap-grad-reduce: the resuming run's --ddp-bucket-size (default: the source "
                           "run's, else Megatron's max(40M, 1M x DP)).")(fn)
    fn = click.option("--overlap-grad-reduce/--no-overlap-grad-reduce", default=None,
                      help="With --distributed-optimizer: whether the resuming run passes --overlap-grad-reduce, "
                           "which cuts its grad buffers into buckets and so moves parameters in distrib_optim.pt "
                           "(default: as the source run's args say).")(fn)
    fn = click.option("--distributed-optimizer", is_flag=True, default=False,
                      help="Write the optimizer state as Megatron's distributed optimizer does "
                           "(--use-distributed-optimizer): a distrib_optim.pt beside each rank file, laid out "
                           "for --dp N; without it the non-distributed layout is written, whatever the source.")(fn)
    fn = click.option("--release/--no-release", default=None,
                      help="Write under release/ with the tracker holding 'release' "
                           "(default: for the 2019 dialect, and when the source was a release).")(fn)
    return fn


@click.command("merge")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--moe-grouped-gemm/--no-moe-grouped-gemm", default=None,
              help="MoE experts for a run with --moe-grouped-gemm (torch format, --dialect mcore-te: TEGroupedMLP); "
                   "default: as the source when it has that dialect, else SequentialMLP.")
@megatron_output_options
@output_options
@source_options
@reports_errors
def merge_cmd(src, dst, **kw):
    """Merge a model-parallel checkpoint into one rank (TP1 PP1): the "mp2 -> mp1" case.

    SRC is any checkpoint ckptool reads; DST (a new directory) gets a Megatron checkpoint in the
    source's dialect with the vocabulary padding redone for one rank. Same as
    `ckptool reshard SRC DST --tp 1 --pp 1`. With --format ds-universal DST gets a DeepSpeed universal
    checkpoint, also from DeepSpeed runs ckptool cannot reshard (a non-GPT Hugging Face model, any
    other module, a save without config.json), under the engine's own parameter names.
    """
    _run(api.merge, "merge", src, dst, **kw)


@click.command("reshard")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--tp", type=int, default=None, help="Target tensor-parallel size (default: the source's).")
@click.option("--pp", type=int, default=None,
              help="Target pipeline-parallel size (default: the source's; with --pp-layers, its number of stages).")
@click.option("--vpp", type=int, default=None,
              help="Virtual pipeline chunks per stage (interleaved schedule; 1: none; default: the source's where "
                   "its layers still split into PP x VPP, else none).")
@click.option("--ep", type=int, default=None,
              help="Target expert-parallel size (MoE models; default: the source's): EP rank r holds experts "
                   "r*E/EP .. (r+1)*E/EP-1 (torch format); torch_dist stores every expert once, so --ep only "
                   "sets the args.")
@click.option("--etp", type=int, default=None,
              help="Target expert tensor-parallel size (MoE models, torch format; must divide --tp; default: the "
                   "source's where it divides --tp, else --tp).")
@click.option("--moe-grouped-gemm/--no-moe-grouped-gemm", default=None,
              help="MoE experts for a run with --moe-grouped-gemm (torch format, --dialect mcore-te: TEGroupedMLP); "
                   "default: as the source when it has that dialect, else SequentialMLP.")
@click.option("--pp-layers", default=None,
              help="Layers per pipeline stage, comma separated (e.g. 3,5), for an uneven split (default: the "
                   "source's split where PP keeps its stage count and there is no VPP, else an even split).")
@megatron_output_options
@output_options
@source_options
@reports_errors
def reshard_cmd(src, dst, tp, pp, vpp, pp_layers, ep, etp, **kw):
    """Rewrite a checkpoint for any tensor/pipeline(/virtual pipeline/expert) layout.

    Reads any layout and dialect ckptool knows, writes Megatron's layout for --tp/--pp/--vpp with
    args and checkpoint_version that Megatron itself accepts. Each layout option left out keeps the
    source's value (the report's "layout:" line says which); with none given the checkpoint is
    rewritten at its own layout. Every size is at least 1. Layers are split evenly across
    stages; an uneven split needs --pp-layers (each stage at least 1 layer). MoE models (torch
    format, mcore dialect) spread their experts over --ep expert-parallel ranks, cut over --etp
    expert tensor-parallel ranks; with --format torch_dist megatron-core loads the stacked experts
    at any EP.
    """
    _run(api.reshard, "reshard", src, dst, tp=tp, pp=pp, vpp=vpp, pp_layers=pp_layers, ep=ep, etp=etp, **kw)


@click.command("fix-vocab")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--size", type=int, default=None, help="Exact number of embedding rows to keep/make.")
@click.option("--multiple", type=int, default=None,
              help="Pad the true vocabulary up to a multiple of this (e.g. 128 for TP1 Megatron).")
@megatron_output_options
@output_options
@source_options
@reports_errors
def fix_vocab_cmd(src, dst, size, multiple, **kw):
    """Pad or trim the word embedding (and an untied output layer) to a given size or multiple.

    The fix for "size mismatch for word_embeddings.weight: [50304, h] vs [50257, h]": e.g.
    `ckptool fix-vocab SRC DST --size 50257` cuts padding rows, `--multiple 128` pads. The layout
    (TP/PP) stays the source's; the size must divide evenly across its TP ranks. Real rows are never
    cut: asking for fewer rows than the true vocabulary is refused.
    """
    kw.pop("make_vocab_size_divisible_by")  # the size decides the padding
    _run(api.fix_vocab, "fix-vocab", src, dst, size=size, multiple=multiple, **kw)
