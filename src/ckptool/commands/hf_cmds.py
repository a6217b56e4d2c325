"""`ckptool to-hf` and `ckptool from-hf`: Hugging Face directories out of and into Megatron checkpoints."""
from __future__ import annotations

import click

from .. import api
from ..formats.megatron.names import DIALECTS
from ..api import DTYPES
from .common import (DROP_MTP, LiveWarnings, Progress, conversion_line, human_bytes, report_conversion,
                     reports_errors, source_options)


@click.command("to-hf")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
              help="Cast tensors to this dtype (default: keep the stored dtype).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file (KB/MB/GB decimal, KiB/MiB/GiB binary, as huggingface_hub).")
@click.option("--tokenizer", type=click.Path(), default=None,
              help="Copy the tokenizer files of this directory into DST.")
@click.option("--experts", type=click.Choice(["fused", "per-expert"]), default=None,
              help="MoE experts as transformers 5's fused 3-D gate_up_proj / down_proj, or per expert under the "
                   "Hub names (default: as the Hugging Face source stored them, else per expert).")
@click.option("--fp8", is_flag=True,
              help="Store the Linear weights in block FP8 as DeepSeek-V3/R1 are released (float8_e4m3fn, a float32 "
                   "weight_scale_inv per 128x128 block, quantization_config in config.json); DeepseekV3ForCausalLM only.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@DROP_MTP
@source_options
@reports_errors
def to_hf_cmd(src, dst, dtype, max_shard_size, tokenizer, experts, fp8, force, **kw):
    """Export any checkpoint ckptool reads as a Hugging Face model directory.

    \b
    GPT-2 style models become GPT2LMHeadModel, Llama style ones LlamaForCausalLM (Qwen2ForCausalLM
    when only QKV has a bias, Qwen3ForCausalLM with q/k norms), MoE models MixtralForCausalLM,
    Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM or (GQA with DeepSeek-style
    biased routing, partial RoPE) Glm4MoeForCausalLM, experts as the source stored them (--experts),
    Gemma's maths Gemma2ForCausalLM or Gemma3ForCausalLM; DST loads with
    AutoModelForCausalLM.from_pretrained(DST). The
    vocabulary is trimmed to its true size; weights go to safetensors shards of at most
    --max-shard-size, written one tensor at a time. A DeepLearningExamples BERT ckpt_N.pt with
    --hf-config bert_config.json becomes BertForPreTraining (vocabulary padding trimmed). A DeepSpeed
    run of any other Hugging Face model (BertForMaskedLM, ...) is consolidated with the model's own
    names and its config.json (--hf-config, or found beside the checkpoint). Multi-token-prediction (MTP)
    layers go back as DeepSeek-V3's model.layers.{num_hidden_layers + k}; a class without them refuses them by
    name (--drop-mtp writes the main model alone).
    """
    live, bar = LiveWarnings(), Progress("to-hf")
    try:
        result = api.to_hf(src, dst, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer, experts=experts,
                           fp8=fp8, force=force, progress=bar, warn=live, **kw)
    finally:
        bar.close()
    s = result.summary
    if result.kind == "bert":
        lines = [f"to-hf: {src} (DeepLearningExamples BERT) -> {dst} (BertForPreTraining, {s['dtype']})",
                 f"  {s.files} safetensors file(s), {human_bytes(s.bytes)}, vocab {s['vocab_size']} "
                 f"(padding rows {s['padded_rows'] - s['vocab_size']} trimmed)"]
    elif result.kind == "deepspeed-hf":
        lines = [f"to-hf: {src} (deepspeed, Hugging Face {s['model_type']} names) "
                 f"-> {dst} ({s['architecture']}, {s['dtype']})",
                 f"  {s.files} safetensors file(s), {s.tensors} tensors, {human_bytes(s.bytes)}"]
    else:
        lines = [conversion_line(result, f"{s['architecture']}, {s['dtype']}"
                                 + (f", {s['quantization']}" if s.get("quantization") else "")),
                 f"  {s.files} safetensors file(s), {human_bytes(s.bytes)}, vocab {s['vocab_size']}"
                 + (f", tokenizer: {', '.join(s['tokenizer_files'])}" if s["tokenizer_files"] else "")]
    report_conversion(result, lines, live)


@click.command("from-hf")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--tp", type=int, default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--vpp", type=int, default=None, help="Virtual pipeline chunks per stage.")
@click.option("--ep", type=int, default=1, show_default=True,
              help="Target expert-parallel size (MoE models, torch format): EP rank r holds experts r*E/EP .. (r+1)*E/EP-1.")
@click.option("--etp", type=int, default=None,
              help="Target expert tensor-parallel size (MoE models, torch format; default --tp; must divide --tp).")
@click.option("--moe-grouped-gemm/--no-moe-grouped-gemm", default=None,
              help="MoE experts for a run with --moe-grouped-gemm (torch format, --dialect mcore-te: TEGroupedMLP); "
                   "default: as the source when it has that dialect, else SequentialMLP.")
@click.option("--pp-layers", default=None, help="Layers per pipeline stage, comma separated, for an uneven split.")
@click.option("--dialect", type=click.Choice(sorted(DIALECTS)), default="mcore", show_default=True,
              help="Megatron key-name dialect to write.")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
              help="Cast tensors to this dtype (default: keep the stored dtype).")
@click.option("--make-vocab-size-divisible-by", type=int, default=None,
              help="Pad the vocabulary to a multiple of this times TP (default 128).")
@click.option("--pad-fill", type=click.Choice(api.PAD_FILLS), default="zero", show_default=True,
              help="How vocabulary padding rows are filled.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@DROP_MTP
@click.option("--true-vocab-size", type=int, default=None,
              help="Override config.json's vocab_size (written into the output's args).")
@reports_errors
def from_hf_cmd(src, dst, **kw):
    """Convert a Hugging Face GPT-2 / Llama / Mistral / Qwen2 / Qwen3 directory into a Megatron checkpoint.

    Gemma 2 / 3 text models (Gemma3ForCausalLM; not the multimodal Gemma3ForConditionalGeneration) keep their
    post norms, soft-caps and sliding windows (megatron-core's window_size / window_attn_skip_freq; the rest in the
    args as docs/formats.md says: --dialect mcore or mcore-te).
    MoE models (Mixtral, Qwen-MoE) are written with megatron-core's SequentialMLP experts at --ep
    expert-parallel ranks; MLA models (DeepSeek-V2/V3, with a q latent or a direct q) as megatron-core's
    MLASelfAttention (--dialect mcore: local spec, mcore-te: Transformer Engine spec; YaRN as megatron-core's
    YaRN args, rope_interleave false as its interleaved pairs). DeepSeek-V3's MTP layers (num_nextn_predict_layers)
    become megatron-core's MTP block (--mtp-num-layers; at PP > 1 on the last stage, with its copy of the
    embedding). The vocabulary is padded for --tp as Megatron would pad it; args are written so Megatron can
    load the result (weights only: use --finetune or --no-load-optim --no-load-rng) and Megatron-LM's validate_args
    accepts them through --use-checkpoint-args: seq_length = max_position_embeddings, a NullTokenizer of the model's
    vocabulary (give yours with --no-use-tokenizer-model-from-checkpoint-args), batch sizes 1.
    """
    live, bar = LiveWarnings(), Progress("from-hf")
    try:
        result = api.from_hf(src, dst, progress=bar, warn=live, **kw)
    finally:
        bar.close()
    s = result.summary
    report_conversion(result, [
        f"from-hf: {src} ({result.checkpoint.source.dialect}) -> {dst} (torch {s.dialect or ''}, "
        f"{result.layout.describe()})",
        f"  {s.files} files, {human_bytes(s.bytes)} of tensors, vocab "
        f"{result.checkpoint.config.vocab_size} padded to {s.padded_vocab_size}"], live)
