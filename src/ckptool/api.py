"""ckptool as a library: open a checkpoint, run each command as a function.

    import ckptool
    ckpt = ckptool.open("ckpts/run1")                  # canonical state, tensors read lazily
    ckptool.reshard("ckpts/run1", "out", tp=2, pp=2)   # -> ConversionResult
    assert ckptool.verify("out", reference="ckpts/run1").ok

Every function takes the CLI's options as keyword arguments under the CLI's long names in snake_case
(`--true-vocab-size` -> true_vocab_size, `--make-vocab-size-divisible-by` ->
make_vocab_size_divisible_by), raises CkptError (ckptool.errors) for anything the caller can fix, and
returns what happened instead of printing it. The CLI (ckptool/commands/) is a layer over these that
parses, calls and prints. Under torchrun every rank calls the same function; each rank returns the
result (`.leader` is True on the rank that reports for the team).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .config import Layout
from .describe import describe
from .distributed import current_team
from .errors import CkptError, NoCanonicalForm, require
from .formats import registry
from .integrity import verify_files
from .io.outdir import partial_output
from .layout_request import LayoutRequest, check_sizes
from .options import ReadOptions, pop_read_options
from .quick_inspect import quick_open
from .state import Checkpoint, without_mtp
from .summary import WriteSummary
from .verify.request import Request, check_request
from .write_options import (DTYPE_NAMES, PAD_FILLS, WriteOptions, build_write_options,  # noqa: F401 (PAD_FILLS: the CLI's)
                            refuse_unhonoured, refuse_unwritable, with_torch_dtype, write_options_from)

# dtype names -> torch's names for them. Names, not torch dtypes: this module imports no torch at its
# top, so a command that fails on its input (a source path that does not exist) answers at once.
DTYPES = DTYPE_NAMES
OUTPUT_FORMATS = registry.OUTPUT_FORMATS

Progress = Callable[[int, Optional[int]], None]  # progress(bytes just written, total bytes or None)
Warn = Callable[[str], None]


@dataclass
class ConversionResult:
    """What a conversion wrote: `summary` is the writer's own report (summary.WriteSummary: files, tensors,
    bytes, the optimizer state carried, the warnings of the write; padded_vocab_size, dialect, iteration_dir
    for Megatron outputs; architecture, vocab_size, dtype, ... for Hugging Face ones in its details);
    `result["files"]` reads it directly. `checkpoint` is the canonical state that
    was written (None for the exports of sources without one, which bypass it); `warnings` everything
    ckptool warned about, in order."""
    command: str
    src: str
    dst: str
    summary: WriteSummary
    checkpoint: Optional[Checkpoint] = None
    layout: Optional[Layout] = None
    # "gpt" (the canonical state), or an export's source: "bert" (DeepLearningExamples), "deepspeed-hf"
    # (a non-GPT Hugging Face model), "deepspeed-module" (names of its own, no config.json)
    kind: str = "gpt"
    warnings: List[str] = field(default_factory=list)
    leader: bool = True  # False on the torchrun ranks that do not report for the team
    # tensor-parallel replicas that differed in the source: name -> largest abs difference (sharding.ReplicaPolicy)
    replica_divergences: Dict[str, float] = field(default_factory=dict)
    # reshard: which layout options were kept from the source ("PP kept from the source"; "as given")
    layout_note: str = ""

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]


def replica_divergences(ckpt: Checkpoint) -> Dict[str, float]:
    """The source's tensor-parallel replicas that differed, as far as its tensors have been read: name ->
    largest absolute difference (empty when every copy agreed, or the format keeps no replicas)."""
    policy = ckpt.source.extra.get("replica_policy")
    return dict(policy.divergences) if policy is not None else {}


@dataclass
class VerifyResult:
    """verify's verdict: ok (result=PASS), and the report lines it printed (or would have, with
    quiet=True). Under torchrun every rank gets the same ok; the lines are rank 0's."""
    ok: bool
    lines: List[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok


# --- reading --------------------------------------------------------------------------------------
def _parse_read_options(**options) -> ReadOptions:
    """ReadOptions from the CLI's reading options as keyword arguments (iteration, true_vocab_size,
    replicas, weights, qkv_layout, hf_config, args_from, num_attention_heads, num_query_groups,
    activation, num_layers, hidden_size, ffn_hidden_size, max_position_embeddings, vocab_size,
    normalization, rotary_base); None means not given. Unknown names raise TypeError, as a wrong
    keyword does."""
    opts = pop_read_options(options)
    _no_leftovers("read options", options)
    return opts


def open(path: Union[str, Path], **read_options) -> Checkpoint:  # noqa: A001 (ckptool.open reads well)
    """Read any checkpoint ckptool knows (Megatron torch / torch_dist, DeepSpeed, Hugging Face) into
    the canonical state, lazily: nothing but metadata is read until a tensor's .load().

    Returns a Checkpoint: .config (GPTConfig: sizes, vocab_size = the true vocabulary when known,
    padded_vocab_size = stored rows, vocab_size_source), .source (format, dialect, layout, iteration),
    .tensors (canonical name -> LazyTensor of the full shape), .optimizer (OptimizerState, or None
    for weights only) and .warnings. read_options are the CLI's reading options by their snake_case
    names: iteration, true_vocab_size, replicas, weights, qkv_layout, hf_config, args_from, and for
    checkpoints that store no args num_attention_heads, num_query_groups, activation, num_layers,
    hidden_size, ffn_hidden_size, max_position_embeddings, vocab_size, normalization, rotary_base.
    Raises CkptError for a path that is not a readable checkpoint (errors.NoCanonicalForm for one ckptool
    recognises but cannot read as a GPT: a DeepLearningExamples BERT file, a DeepSpeed run of another
    Hugging Face model; to_hf exports those), TypeError for an unknown option."""
    return registry.open_checkpoint(path, _parse_read_options(**read_options))


def inspect(path: Union[str, Path], **read_options) -> dict:
    """What `ckptool inspect PATH --json` prints, as a dict (schema in docs/inspect-json.md): format,
    dialect, layout, config, vocabulary, tensors, optimizer state and warnings. Nothing is converted
    and no tensor is read. Where the format's metadata says everything (and no reading option is
    given) it is read without loading any tensor bytes (quick_inspect.py); otherwise through open().
    read_options as for open(); raises CkptError as open() does."""
    _parse_read_options(**read_options)  # an unknown option is a TypeError on either path
    ckpt = quick_open(path, read_options)
    return describe(ckpt if ckpt is not None else open(path, **read_options))


# --- Megatron outputs: merge, reshard, fix_vocab ---------------------------------------------------
def merge(src, dst, *, format: Optional[str] = None, dialect: Optional[str] = None,  # noqa: A002
          release: Optional[bool] = None, dtype=None, make_vocab_size_divisible_by: Optional[int] = None,
          pad_fill: str = "zero", optimizer: bool = True, distributed_optimizer: bool = False,
          dp: Optional[int] = None, overlap_grad_reduce: Optional[bool] = None, ddp_bucket_size: Optional[int] = None,
          distrib_optim_era: Optional[str] = None, force: bool = False, progress: Optional[Progress] = None,
          warn: Optional[Warn] = None, moe_grouped_gemm: Optional[bool] = None, drop_mtp: bool = False,
          **read_options) -> ConversionResult:
    """Merge a model-parallel checkpoint into one rank (TP1 PP1), as `ckptool merge SRC DST`.

    format: "torch" or "torch_dist" (default: the source's); dialect: Megatron key names to write
    (default: the source's); release: write under release/; dtype: "fp32"/"bf16"/"fp16" or a
    torch.dtype (default: as stored); make_vocab_size_divisible_by and pad_fill: vocabulary padding;
    optimizer: carry the source's optimizer state where the target format holds it (default; False
    writes the weights only, without reading the source's optimizer state; summary["optimizer"] says what
    was carried); distributed_optimizer: write it as Megatron's distributed optimizer does
    (distrib_optim.pt beside each rank file) for a resuming run with dp data-parallel ranks (default
    1), overlap_grad_reduce and ddp_bucket_size (its buckets; default: the source run's) and the
    megatron-core of distrib_optim_era ("2024-07": today's form, the default; "2024-05", "2024-04",
    "2024-02"); force: replace dst; moe_grouped_gemm: MoE experts for a run with --moe-grouped-gemm
    (torch format, mcore-te dialect: TEGroupedMLP; default: as the source when it is that dialect,
    else SequentialMLP).
    progress(bytes, total) and warn(message) are called as the write goes on.
    A source with no canonical GPT form (a DeepSpeed run of a non-GPT Hugging Face model or of any
    other module) is written where its reader can write the format asked for: format="ds-universal"
    under the engine's own parameter names (ConversionResult.checkpoint is None, kind the source's).
    read_options as for open(). Returns the ConversionResult; raises CkptError."""
    opts = write_options_from(locals())
    return _layout_conversion("merge", src, dst, lambda ckpt: (Layout(1, 1), None), opts, force, progress, warn,
                              read_options)


def _layout_conversion(command, src, dst, target: Callable, opts: WriteOptions, force, progress, warn,
                       read_options: dict) -> ConversionResult:
    """Open src and write it at target(ckpt) -> (layout, note on what was kept from the source) (merge,
    reshard); a source with no canonical form goes to its reader's export for the target format instead
    (_export_layout; target(None))."""
    try:
        ckpt = _open_source(src, opts.optimizer, read_options)
    except NoCanonicalForm as source:
        layout, note = target(None)
        result = _export_layout(command, source, src, dst, layout, opts, force, progress, warn)
    else:
        layout, note = target(ckpt)
        result = _write_megatron_family(command, src, dst, ckpt, layout, opts, force, progress, warn)
    result.layout_note = note or ""
    return result


def _export_layout(command, source: NoCanonicalForm, src, dst, layout: Layout, opts: WriteOptions, force,
                   progress, warn) -> ConversionResult:
    """Write a source that has no canonical form with its reader's export for the --format asked for
    (the format table's entry finds it, Format.exporter); without one, the source's own error stands."""
    from .convert import write_output  # imports torch: only once the request and its source are checked
    if opts.format is None:  # the default output is the source's own Megatron format, which it has not
        raise source
    target = registry.output_format(opts.format)
    export = target.exporter(source)
    refuse_unhonoured(target, opts)  # no canonical state: the options' half of the table's check
    opts = with_torch_dtype(opts)
    warnings: List[str] = []
    bar = (lambda n: progress(n, None)) if progress is not None else None  # total unknown before reading

    def write_into(tmp, owns):  # one rank writes it all: the export cannot share its files
        if owns is None or owns(0):
            return export(tmp, layout=layout, opts=opts, progress=bar, warn=_collecting(warnings, warn))
        return None

    summary = write_output(dst, [Path(src)], force, write_into, merge=WriteSummary.combined)
    summary.warnings = list(warnings)
    return ConversionResult(command, str(src), str(dst), summary, layout=layout, kind=source.kind,
                            warnings=warnings, leader=current_team().leader)


def reshard(src, dst, *, tp: Optional[int] = None, pp: Optional[int] = None, vpp: Optional[int] = None,
            ep: Optional[int] = None, etp: Optional[int] = None, pp_layers: Union[str, Sequence[int], None] = None,
            format: Optional[str] = None,  # noqa: A002
            dialect: Optional[str] = None, release: Optional[bool] = None, dtype=None,
            make_vocab_size_divisible_by: Optional[int] = None, pad_fill: str = "zero", optimizer: bool = True,
            distributed_optimizer: bool = False, dp: Optional[int] = None, overlap_grad_reduce: Optional[bool] = None,
            ddp_bucket_size: Optional[int] = None, distrib_optim_era: Optional[str] = None, force: bool = False,
            progress: Optional[Progress] = None, warn: Optional[Warn] = None,
            moe_grouped_gemm: Optional[bool] = None, drop_mtp: bool = False, **read_options) -> ConversionResult:
    """Rewrite any checkpoint ckptool reads at Megatron's layout for tp / pp (/ vpp), as
    `ckptool reshard SRC DST --tp N`. pp_layers: layers per pipeline stage ("3,5" or [3, 5]) for an
    uneven split; vpp 1 means no virtual pipeline; ep: expert-parallel ranks of an MoE model's
    experts (torch format); etp: their expert tensor-parallel size (it must divide tp).
    Each of them left out (None) keeps the source's value (pp: the number of pp_layers stages when those
    are given; vpp, etp and the source's uneven split only where they still fit); with none given the
    checkpoint is rewritten at its own layout. Every size is at least 1 and every stage holds a layer
    (CkptError naming the option, before anything is read or written). result.layout_note says what was
    kept. Other options as for merge()."""
    request = LayoutRequest.of(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, pp_layers=pp_layers)
    opts = write_options_from(locals())

    def target(ckpt: Optional[Checkpoint]):  # a source without a canonical form has one data-parallel rank
        if ckpt is None:
            return request.completed(Layout(1, 1), 0)
        return request.completed(ckpt.source.layout, ckpt.config.num_layers)

    return _layout_conversion("reshard", src, dst, target, opts, force, progress, warn, read_options)


def fix_vocab(src, dst, *, size: Optional[int] = None, multiple: Optional[int] = None,
              format: Optional[str] = None, dialect: Optional[str] = None,  # noqa: A002
              release: Optional[bool] = None, dtype=None, pad_fill: str = "zero", optimizer: bool = True,
              distributed_optimizer: bool = False, dp: Optional[int] = None, overlap_grad_reduce: Optional[bool] = None,
              ddp_bucket_size: Optional[int] = None, distrib_optim_era: Optional[str] = None, force: bool = False,
              progress: Optional[Progress] = None, warn: Optional[Warn] = None, drop_mtp: bool = False,
              **read_options) -> ConversionResult:
    """Pad or trim the word embedding (and an untied output layer) to exactly `size` rows, or to the
    true vocabulary rounded up to a `multiple`, keeping the source's layout, as `ckptool fix-vocab`.

    Real rows are never cut (CkptError). The true vocabulary size read from the source is kept (the
    output's args.make_vocab_size_divisible_by is chosen so Megatron's own padding rule gives the
    written rows). Other options as for merge()."""
    opts = write_options_from(locals())
    ckpt = _open_source(src, optimizer, read_options)
    from .convert import fix_vocab as resize  # imports torch: only once the source is open
    fixed = resize(ckpt, size=size, multiple=multiple, pad_fill=pad_fill)
    rows, lay = fixed.config.padded_vocab_size, ckpt.source.layout
    if rows % lay.tp:
        raise CkptError(f"{rows} rows cannot be split evenly across the checkpoint's {lay.tp} TP ranks",
                        f"choose a size that is a multiple of {lay.tp}")
    layout = Layout(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, stage_layers=lay.stage_layers, ep=lay.ep, etp=lay.etp)
    # Megatron pads the true vocabulary to a multiple of divisible_by x TP: rows / TP gives `rows`. The fixed
    # checkpoint's own padding rule says so (not an option the user gave, which a target might not honour).
    fixed = Checkpoint(fixed.config.replace(make_vocab_size_divisible_by=rows // lay.tp), fixed.tensors,
                       fixed.source, fixed.warnings, fixed.optimizer)
    return _write_megatron_family("fix-vocab", src, dst, fixed, layout, opts, force, progress, warn)


def _open_source(src, optimizer: bool, read_options: dict) -> Checkpoint:
    """open() for a conversion: with optimizer=False the source's optimizer state is left unread."""
    opts = _parse_read_options(**read_options)
    opts.optimizer = optimizer
    return registry.open_checkpoint(src, opts)


def _write_megatron_family(command, src, dst, ckpt: Checkpoint, layout: Layout, opts: WriteOptions, force, progress,
                           warn) -> ConversionResult:
    """Write ckpt at layout as opts say (convert.write_layout) and report."""
    from .convert import write_layout  # imports torch: only once the request and its source are checked
    opts = with_torch_dtype(opts)
    warnings: List[str] = []
    told = _tell_reader_warnings(ckpt, warn, told=set())
    summary = write_layout(ckpt, dst, layout, opts, force=force, progress=_bytes_progress(progress, ckpt),
                           warn=_collecting(warnings, warn))
    summary.warnings = list(warnings)  # what the write warned about (the reader's follow)
    _tell_reader_warnings(ckpt, warn, told | set(warnings))
    warnings += [w for w in ckpt.warnings if w not in warnings]
    return ConversionResult(command, str(src), str(dst), summary, ckpt, layout, warnings=warnings,
                            replica_divergences=replica_divergences(ckpt),
                            leader=current_team().leader)


# --- Hugging Face ---------------------------------------------------------------------------------
def to_hf(src, dst, *, dtype=None, max_shard_size: str = "5GB", tokenizer: Optional[str] = None,
          experts: Optional[str] = None, fp8: bool = False, force: bool = False,
          progress: Optional[Progress] = None, warn: Optional[Warn] = None, drop_mtp: bool = False,
          **read_options) -> ConversionResult:
    """Export any checkpoint ckptool reads as a Hugging Face model directory, as `ckptool to-hf`.

    GPT-2 style models become GPT2LMHeadModel, Llama style ones LlamaForCausalLM (Qwen2ForCausalLM when
    only QKV has a bias), MoE ones their family's class (Mixtral, Qwen-MoE, DeepSeek-V3, GLM-4.5), Gemma's maths Gemma2ForCausalLM / Gemma3ForCausalLM (q/k norms); a DeepLearningExamples BERT ckpt_N.pt (with hf_config=bert_config.json)
    BertForPreTraining (kind "bert"); a DeepSpeed run of another Hugging Face model keeps the model's
    own names (kind "deepspeed-hf"). max_shard_size: largest safetensors file ("5GB", "500MiB");
    tokenizer: a directory whose tokenizer files are copied into dst. experts: "fused" (transformers 5's 3-D
    gate_up_proj / down_proj) or "per-expert" (the Hub names) for MoE models; None: as the Hugging Face source
    stored them (kept through Megatron checkpoints ckptool wrote), else per expert. fp8: store the Linear
    weights in block FP8 as DeepSeek-V3 / R1 are released (float8_e4m3fn, a float32 weight_scale_inv per
    128x128 block, config.json's quantization_config; refused for families not released so). drop_mtp: write
    the main model without its multi-token-prediction layers (a family without them refuses them otherwise).
    read_options as for open()."""
    opts = build_write_options(dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer, experts=experts,
                               fp8=fp8, drop_mtp=drop_mtp)
    try:
        ckpt = registry.open_checkpoint(src, _parse_read_options(**read_options))
    except NoCanonicalForm as source:  # no GPT state, but the reader can export what it opened
        require(experts is None, f"--experts {experts}: {src} is exported under its model's own names, experts "
                "as they are stored", "leave --experts out")
        # the export keeps the model's own tensors: none is a family's released-FP8 weight
        require(not fp8, f"--fp8 stores a GPT family's Linear weights in block FP8; {src} has no GPT form",
                "leave --fp8 out")
        return _export_to_hf(source, src, dst, with_torch_dtype(opts).dtype, max_shard_size, tokenizer, force,
                             progress)
    refuse_unwritable(ckpt, registry.BY_NAME["hf"], opts)
    ckpt = without_mtp(ckpt, warn or print) if opts.drop_mtp else ckpt
    opts = with_torch_dtype(opts)
    from .convert import write_output  # imports torch: after the source was found (see DTYPES)
    write_hf = registry.BY_NAME["hf"].write
    warnings: List[str] = []
    bar = _bytes_progress(progress, ckpt)

    def write_into(tmp, owns):  # under torchrun, owns(i) picks this rank's safetensors shards
        return write_hf(ckpt, tmp, opts, progress=bar, warn=_collecting(warnings, warn), owns=owns)

    told = _tell_reader_warnings(ckpt, warn, told=set())
    summary = write_output(dst, [Path(src)], force, write_into, merge=WriteSummary.combined)
    summary.warnings = list(warnings)
    _tell_reader_warnings(ckpt, warn, told | set(warnings))
    warnings += [w for w in ckpt.warnings if w not in warnings]
    return ConversionResult("to-hf", str(src), str(dst), summary, ckpt, warnings=warnings,
                            replica_divergences=replica_divergences(ckpt),
                            leader=current_team().leader)


def _export_to_hf(source: NoCanonicalForm, src, dst, dtype, max_shard_size, tokenizer, force,
                  progress) -> ConversionResult:
    """to-hf of a source without a canonical form (a DeepLearningExamples BERT file, a DeepSpeed run of
    another Hugging Face model): its reader's export writes it under the model's own names."""
    from .formats.hf.writer import copy_tokenizer  # imports torch: only once the source is open
    bar = (lambda n: progress(n, None)) if progress is not None else None  # total unknown before reading
    export = registry.BY_NAME["hf"].exporter(source)
    with partial_output(dst, sources=[Path(src)], force=force) as part:
        summary = export(part.path, dtype=dtype, max_shard_size=max_shard_size, progress=bar)
        if tokenizer:
            copy_tokenizer(tokenizer, part.path)
    summary.replaced = part.replaced
    return ConversionResult("to-hf", str(src), str(dst), summary, kind=source.kind)


def from_hf(src, dst, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1, etp: Optional[int] = None,
            pp_layers: Union[str, Sequence[int], None] = None, dialect: str = "mcore", dtype=None,
            make_vocab_size_divisible_by: Optional[int] = None, pad_fill: str = "zero", force: bool = False,
            true_vocab_size: Optional[int] = None, progress: Optional[Progress] = None,
            warn: Optional[Warn] = None, moe_grouped_gemm: Optional[bool] = None,
            drop_mtp: bool = False) -> ConversionResult:
    """Convert a Hugging Face GPT-2 / Llama / Mistral / Qwen2 / Qwen3 (MoE, DeepSeek-V3 with its MTP layers,
    GLM-4.5, Gemma 2 / 3 text: the families/ registry) directory into a Megatron torch-format
    checkpoint at tp / pp (/ vpp, pp_layers; ep and etp for MoE models), as `ckptool from-hf`. The vocabulary is padded for tp
    as Megatron pads it (make_vocab_size_divisible_by, default 128); true_vocab_size overrides
    config.json's vocab_size. Every size is at least 1 and every stage holds a layer (CkptError naming the
    option). Other options as for merge()."""
    layout = LayoutRequest.of(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, pp_layers=pp_layers).as_given()
    try:
        fmt = registry.source_format(src)
    except CkptError:
        fmt = None
    if fmt is None or fmt.name != "hf":
        raise CkptError(f"{src}: not a Hugging Face GPT-2/Llama/Mistral/Qwen2/Qwen3 (or Mixtral/Qwen-MoE) directory"
                        + (f" but a {fmt.name} checkpoint" if fmt is not None else ""),
                        "expected a directory with config.json and model.safetensors or pytorch_model.bin")
    ckpt = fmt.read(src, ReadOptions(true_vocab_size=true_vocab_size))
    opts = build_write_options(format="torch", dialect=dialect, dtype=dtype, pad_fill=pad_fill,
                               make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               moe_grouped_gemm=moe_grouped_gemm, drop_mtp=drop_mtp)
    return _write_megatron_family("from-hf", src, dst, ckpt, layout, opts, force, progress, warn)


# --- verify ---------------------------------------------------------------------------------------
def verify(target=None, *, reference=None, reference_logits: Optional[str] = None, files=None,
           tokens: Optional[str] = None, tokenizer: Optional[str] = None, batch: int = 2, seq_len: Optional[int] = None,
           seed: int = 0, dtype: str = "fp32", tolerance: Optional[float] = None, tp: Optional[int] = None,
           pp: Optional[int] = None, vpp: Optional[int] = None, quiet: bool = False,
           on_line: Optional[Callable[[str], None]] = None, warn: Optional[Warn] = None,
           **read_options) -> VerifyResult:
    """Check that `target` computes what the reference computes, as `ckptool verify`.

    reference: another checkpoint or Hugging Face directory (default: the target's own merged state);
    reference_logits: "FILE[:KEY]" of recorded tokens and logits; files: instead, check that a
    checkpoint's files are whole (an output directory against its manifest, any other checkpoint by its
    format's CRCs and sizes: integrity.py). tokens/tokenizer/batch/seq_len/seed choose the input (seq_len None: 16,
    or past a sliding window: the longer of 16 past it and twice it plus 8), dtype
    ("fp32", "bf16", "fp16") the compute dtype, tolerance the largest max-abs logits error that
    passes. Under torchrun the forward runs tensor/pipeline-parallel (tp/pp/vpp for torch_dist).
    Returns VerifyResult (ok, report lines); each line is also printed as it comes unless quiet, and
    passed to on_line(line) when given. warn(message) is told how a checkpoint was read (default: a
    `warning:` line on stderr). A mismatch is ok=False, not an exception; bad input raises CkptError."""
    check_sizes(tp=tp, pp=pp, vpp=vpp)
    say = _each(on_line, None if quiet else _print_line)
    if files is not None:
        lines: List[str] = []
        ok = verify_files(Path(files), _each(lines.append, say))  # torch-free (integrity.py)
        return VerifyResult(ok, lines)
    opts = _parse_read_options(**read_options)
    check_request(target, reference, reference_logits, dtype)  # torch-free: a bad request answers at once
    from .verify import run as verify_run  # imports torch: only once a forward will run
    request = Request(target, reference, reference_logits, opts, dtype, tolerance,
                      (tokens, tokenizer, batch, seq_len, seed), tp, pp, vpp)
    outcome = verify_run.verify(request, say, warn or _print_warning)
    return VerifyResult(outcome.ok, outcome.lines)


def _print_line(line: str) -> None:
    print(line, flush=True)


def _print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _each(*calls: Optional[Callable[[str], None]]) -> Callable[[str], None]:
    """One callback that passes its line to every one of calls given."""
    given = [c for c in calls if c is not None]

    def say(line: str) -> None:
        for call in given:
            call(line)
    return say


# --- small helpers --------------------------------------------------------------------------------
def _bytes_progress(progress: Optional[Progress], ckpt: Checkpoint) -> Optional[Callable[[int], None]]:
    if progress is None:
        return None
    total = ckpt.total_bytes
    return lambda n: progress(n, total)


def _collecting(into: List[str], warn: Optional[Warn]) -> Warn:
    def record(message: str) -> None:
        into.append(message)
        if warn is not None:
            warn(message)
    return record


def _tell_reader_warnings(ckpt: Checkpoint, warn: Optional[Warn], told: set) -> set:
    """Pass the reader's warnings that warn has not been told yet (those given when the source was
    opened, then those the read added while the write loaded tensors) to warn; returns what it has
    been told. Under torchrun only the rank that reports for the team tells them: every rank read the
    same source, so the others would repeat its lines."""
    leader = current_team().leader
    for message in ckpt.warnings:
        if message not in told:
            told.add(message)
            if warn is not None and leader:
                warn(message)
    return told


def _no_leftovers(what: str, kw: dict) -> None:
    if kw:
        raise TypeError(f"unknown {what}: {', '.join(sorted(kw))}")


__all__ = ["open", "inspect", "merge", "reshard", "fix_vocab", "to_hf", "from_hf", "verify", "ConversionResult",
           "VerifyResult"]
