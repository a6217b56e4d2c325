"""`ckptool merge`, `ckptool reshard`, `ckptool fix-vocab`: Megatron layouts in, Megatron layouts out."""
from __future__ import annotations

import click

from ..config import Layout, parse_stage_layers
from ..convert import fix_vocab, write_layout
from ..formats.megatron_names import DIALECTS
from ..formats.registry import open_checkpoint
from .common import (DTYPES, conversion_line, human_bytes, output_options, read_options, reports_errors,
                     source_options, warn, write_reported)


def _run(src, dst, layout: Layout, kw: dict, verb: str, transform=None):
    fmt = kw.pop("out_format", None)
    dialect = kw.pop("dialect", None)
    dtype = DTYPES[kw.pop("dtype")] if kw.get("dtype") else kw.pop("dtype", None)
    force = kw.pop("force")
    divisible_by = kw.pop("divisible_by")
    pad_fill = kw.pop("pad_fill")
    release = kw.pop("release", None)
    optimizer = kw.pop("optimizer", True)
    dp = kw.pop("dp", None)
    distributed = {"distributed_optimizer": True, "dp": dp or 1} if kw.pop("distributed_optimizer", False) else {}
    if dp is not None and not distributed:
        from ..errors import CkptError
        raise CkptError("--dp sizes the distributed optimizer's files", "give it with --distributed-optimizer")
    opts = read_options(kw)
    opts.optimizer = optimizer  # --no-optimizer: the source's optimizer state is not even read
    ckpt = open_checkpoint(src, opts)
    if transform is not None:
        ckpt = transform(ckpt)
    summary = write_reported(ckpt, verb, lambda bar: write_layout(
        ckpt, dst, layout, fmt=fmt, force=force, progress=bar, warn=warn, dialect=dialect, dtype=dtype,
        divisible_by=divisible_by, pad_fill=pad_fill, release=release, optimizer=optimizer, **distributed))
    if summary is None:
        return
    click.echo(conversion_line(verb, src, ckpt, dst,
                               f"{summary['format']} {summary.get('dialect', '')}, {layout.describe()}"))
    vocab = ckpt.config.vocab_size
    click.echo(f"  {summary['files']} files, {human_bytes(summary['bytes'])} of tensors, vocab "
               f"{vocab if vocab is not None else 'unknown'} padded to {summary['padded_vocab_size']}, "
               f"{summary['iteration_dir']}")
    carried = summary.get("optimizer")
    if carried:
        where = (f"distrib_optim.pt files for DP {carried['distributed']['dp']}" if carried.get("distributed")
                 else "non-distributed layout")
        click.echo(f"  optimizer state carried ({carried['kind']}, step {carried['step']}, "
                   f"{carried['groups']} param groups, {where}); RNG state is not: resume with --no-load-rng")
    elif ckpt.source.format == "megatron":
        why = "--no-optimizer" if ckpt.optimizer is not None and not optimizer else "weights only"
        click.echo(f"  {why}: resume training from this checkpoint with --no-load-optim --no-load-rng, "
                   "or --finetune")


def megatron_output_options(fn):
    fn = click.option("--dialect", type=click.Choice(sorted(DIALECTS)), default=None,
                      help="Key-name dialect to write (default: the source's; mcore for non-Megatron sources).")(fn)
    fn = click.option("--format", "out_format", type=click.Choice(["torch", "torch_dist"]), default=None,
                      help="Megatron checkpoint format to write (default: the source's).")(fn)
    fn = click.option("--optimizer/--no-optimizer", default=True, show_default=True,
                      help="Carry the optimizer state (fp32 masters, Adam moments, step, param groups, LR "
                           "scheduler) when the source has it and the target format holds it, so training "
                           "resumes on the new layout; --no-optimizer writes the weights only.")(fn)
    fn = click.option("--dp", type=click.IntRange(min=1), default=None,
                      help="With --distributed-optimizer: the data-parallel size the resuming run will use "
                           "(default 1).")(fn)
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
@megatron_output_options
@output_options
@source_options
@reports_errors
def merge_cmd(src, dst, **kw):
    """Merge a model-parallel checkpoint into one rank (TP1 PP1): the "mp2 -> mp1" case.

    SRC is any checkpoint ckptool reads; DST (a new directory) gets a Megatron checkpoint in the
    source's dialect with the vocabulary padding redone for one rank. Same as
    `ckptool reshard SRC DST --tp 1 --pp 1`.
    """
    _run(src, dst, Layout(1, 1), kw, "merge")


@click.command("reshard")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--tp", type=int, required=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", type=int, default=None, help="Virtual pipeline chunks per stage (interleaved schedule).")
@click.option("--pp-layers", default=None,
              help="Layers per pipeline stage, comma separated (e.g. 3,5), for an uneven split.")
@megatron_output_options
@output_options
@source_options
@reports_errors
def reshard_cmd(src, dst, tp, pp, vpp, pp_layers, **kw):
    """Rewrite a checkpoint for any tensor/pipeline(/virtual pipeline) layout.

    Reads any layout and dialect ckptool knows, writes Megatron's layout for --tp/--pp/--vpp with
    args and checkpoint_version that Megatron itself accepts. Layers are split evenly across
    stages; an uneven split needs --pp-layers.
    """
    if vpp is not None and vpp < 2:
        vpp = None
    layout = Layout(tp=tp, pp=pp, vpp=vpp, stage_layers=parse_stage_layers(pp_layers))
    _run(src, dst, layout, kw, "reshard")


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
    pad_fill = kw["pad_fill"]
    holder = {}

    def transform(ckpt):
        out = fix_vocab(ckpt, size=size, multiple=multiple, pad_fill=pad_fill)
        holder["rows"] = out.config.padded_vocab_size
        return out

    # Keep the source layout; tell the writer the exact row count (divisor 1, true size = rows).
    from ..formats.registry import open_checkpoint as _open
    lay = None
    kw_copy = dict(kw)
    probe_opts = read_options(kw_copy)
    probe_opts.optimizer = False  # the probe only needs the layout and vocabulary
    probe = _open(src, probe_opts)
    lay = probe.source.layout
    rows = fix_vocab(probe, size=size, multiple=multiple).config.padded_vocab_size
    if rows % lay.tp:
        from ..errors import CkptError
        raise CkptError(f"{rows} rows cannot be split evenly across the checkpoint's {lay.tp} TP ranks",
                        f"choose a size that is a multiple of {lay.tp}")

    def exact(ckpt):
        out = transform(ckpt)
        return out.with_tensors(out.tensors, vocab_size=out.config.padded_vocab_size,
                                vocab_size_source="fix-vocab")

    kw["divisible_by"] = 1
    layout = Layout(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, stage_layers=lay.stage_layers)
    _run(src, dst, layout, kw, "fix-vocab", transform=exact)
