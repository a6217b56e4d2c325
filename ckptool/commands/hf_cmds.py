"""`ckptool to-hf` and `ckptool from-hf`: Hugging Face directories out of and into Megatron checkpoints."""
from __future__ import annotations

from pathlib import Path

import click

from ..config import Layout, parse_stage_layers
from ..convert import write_layout, write_output
from ..formats import deepspeed_hf_export, dle_bert, hf as hf_reader
from ..formats.hf_writer import write_hf
from ..formats.megatron_names import DIALECTS
from ..formats.registry import open_checkpoint
from ..io.outdir import atomic_output_dir
from .common import (DTYPES, Progress, conversion_line, human_bytes, read_options, reports_errors,
                     source_options, warn, write_reported)


@click.command("to-hf")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
              help="Cast tensors to this dtype (default: keep the stored dtype).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file (KB/MB/GB decimal, KiB/MiB/GiB binary, as huggingface_hub).")
@click.option("--tokenizer", type=click.Path(), default=None,
              help="Copy the tokenizer files of this directory into DST.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@source_options
@reports_errors
def to_hf_cmd(src, dst, dtype, max_shard_size, tokenizer, force, **kw):
    """Export any checkpoint ckptool reads as a Hugging Face model directory.

    \b
    GPT-2 style models become GPT2LMHeadModel, Llama style ones LlamaForCausalLM (Qwen2ForCausalLM
    when only QKV has a bias, Qwen3ForCausalLM with q/k norms), MoE models MixtralForCausalLM,
    Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM; DST loads with AutoModelForCausalLM.from_pretrained(DST). The
    vocabulary is trimmed to its true size; weights go to safetensors shards of at most
    --max-shard-size, written one tensor at a time. A DeepLearningExamples BERT ckpt_N.pt with
    --hf-config bert_config.json becomes BertForPreTraining (vocabulary padding trimmed). A DeepSpeed
    run of any other Hugging Face model (BertForMaskedLM, ...) is consolidated with the model's own
    names and its config.json (--hf-config, or found beside the checkpoint).
    """
    hf_config = kw.get("hf_config")  # --hf-config comes with source_options
    if dle_bert.looks_like(src):
        return _bert_to_hf(src, dst, dtype, max_shard_size, tokenizer, hf_config, force)
    opts = read_options(kw)
    model_type = deepspeed_hf_export.non_gpt_hf_model(src, opts)
    if model_type is not None:
        return _deepspeed_hf_to_hf(src, dst, dtype, max_shard_size, tokenizer, opts, model_type, force)
    ckpt = open_checkpoint(src, opts)
    def write(bar):
        def write_into(tmp, owns):  # under torchrun, owns(i) picks this rank's safetensors shards
            return write_hf(ckpt, tmp, dtype=DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size,
                            tokenizer=tokenizer, progress=bar, warn=warn, owns=owns)
        return write_output(dst, [Path(src)], force, write_into, merge=_merge_hf_summaries)

    summary = write_reported(ckpt, "to-hf", write)
    if summary is None:
        return
    click.echo(conversion_line("to-hf", src, ckpt, dst, f"{summary['architecture']}, {summary['dtype']}"))
    click.echo(f"  {len(summary['files'])} safetensors file(s), {human_bytes(summary['bytes'])}, "
               f"vocab {summary['vocab_size']}"
               + (f", tokenizer: {', '.join(summary['tokenizer_files'])}" if summary["tokenizer_files"] else ""))


def _merge_hf_summaries(parts: list) -> dict:
    """The ranks' write_hf summaries as one: shard 0's owner has the metadata, all have bytes."""
    first = next(p for p in parts if p.get("architecture"))
    return dict(first, bytes=sum(p["bytes"] for p in parts))


def _bert_to_hf(src, dst, dtype, max_shard_size, tokenizer, hf_config, force):
    from ..errors import require
    from ..formats.hf_writer import copy_tokenizer
    require(hf_config is not None, f"{src} is a DeepLearningExamples BERT checkpoint, which stores no config",
            "pass --hf-config bert_config.json (the file the run trained with)")
    with atomic_output_dir(dst, sources=[Path(src)], force=force) as tmp:
        summary = dle_bert.write_hf_bert(Path(src), hf_config, tmp, dtype=DTYPES[dtype] if dtype else None,
                                         max_shard_size=max_shard_size)
        if tokenizer:
            copy_tokenizer(tokenizer, tmp)
    click.echo(f"to-hf: {src} (DeepLearningExamples BERT) -> {dst} (BertForPreTraining, {summary['dtype']})")
    click.echo(f"  {len(summary['files'])} safetensors file(s), {human_bytes(summary['bytes'])}, vocab "
               f"{summary['vocab_size']} (padding rows {summary['padded_rows'] - summary['vocab_size']} trimmed)")


def _deepspeed_hf_to_hf(src, dst, dtype, max_shard_size, tokenizer, opts, model_type, force):
    from ..formats.hf_writer import copy_tokenizer
    bar = Progress(None, "to-hf")
    try:
        with atomic_output_dir(dst, sources=[Path(src)], force=force) as tmp:
            summary = deepspeed_hf_export.write_hf_consolidated(
                src, tmp, opts, dtype=DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size, progress=bar)
            if tokenizer:
                copy_tokenizer(tokenizer, tmp)
    finally:
        bar.close()
    click.echo(f"to-hf: {src} (deepspeed, Hugging Face {model_type} names) "
               f"-> {dst} ({summary['architecture']}, {summary['dtype']})")
    click.echo(f"  {len(summary['files'])} safetensors file(s), {summary['tensors']} tensors, "
               f"{human_bytes(summary['bytes'])}")


@click.command("from-hf")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--tp", type=int, default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", type=int, default=None, help="Virtual pipeline chunks per stage.")
@click.option("--pp-layers", default=None, help="Layers per pipeline stage, comma separated, for an uneven split.")
@click.option("--dialect", type=click.Choice(sorted(DIALECTS)), default="mcore", show_default=True,
              help="Megatron key-name dialect to write.")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
              help="Cast tensors to this dtype (default: keep the stored dtype).")
@click.option("--make-vocab-size-divisible-by", "divisible_by", type=int, default=None,
              help="Pad the vocabulary to a multiple of this times TP (default 128).")
@click.option("--pad-fill", type=click.Choice(["zero", "mean", "last"]), default="zero", show_default=True,
              help="How vocabulary padding rows are filled.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--true-vocab-size", type=int, default=None, help="Override config.json's vocab_size.")
@reports_errors
def from_hf_cmd(src, dst, tp, pp, vpp, pp_layers, dialect, dtype, divisible_by, pad_fill, force, true_vocab_size):
    """Convert a Hugging Face GPT-2 / Llama / Mistral / Qwen2 / Qwen3 directory into a Megatron checkpoint.

    MoE and MLA models (Mixtral, Qwen-MoE, DeepSeek-V3) are refused: no expert-parallel Megatron
    output yet (use to-hf). The vocabulary is padded for --tp as Megatron would pad it; args are written so Megatron can
    load the result (weights only: use --finetune or --no-load-optim --no-load-rng).
    """
    from ..errors import CkptError
    from ..options import ReadOptions
    if not hf_reader.looks_like(Path(src)):
        raise CkptError(f"{src}: not a Hugging Face GPT-2/Llama/Mistral/Qwen2/Qwen3 directory",
                        "expected a directory with config.json and model.safetensors or pytorch_model.bin")
    ckpt = hf_reader.read(Path(src), ReadOptions(true_vocab_size=true_vocab_size))
    layout = Layout(tp=tp, pp=pp, vpp=vpp if vpp and vpp > 1 else None, stage_layers=parse_stage_layers(pp_layers))
    summary = write_reported(ckpt, "from-hf", lambda bar: write_layout(
        ckpt, dst, layout, fmt="torch", force=force, progress=bar, warn=warn, dialect=dialect,
        dtype=DTYPES[dtype] if dtype else None, divisible_by=divisible_by, pad_fill=pad_fill))
    if summary is None:
        return
    click.echo(f"from-hf: {src} ({ckpt.source.dialect}) -> {dst} (torch {summary.get('dialect', '')}, "
               f"{layout.describe()})")
    click.echo(f"  {summary['files']} files, {human_bytes(summary['bytes'])} of tensors, vocab "
               f"{ckpt.config.vocab_size} padded to {summary['padded_vocab_size']}")
