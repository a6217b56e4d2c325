"""What a user can tell a writer: the output options of merge / reshard / fix-vocab / from-hf / to-hf as ONE
record (ReadOptions' counterpart, options.py), built once by the API and handed to the writers whole.

Which of these options a target format honours, and what it can hold, is the format table's
(formats/registry.py Format.honours / holds); refuse_unwritable (below) checks a record against it
before anything is written. A field at its default (None for most: "not given") is never refused.
Importable without torch, like the table: only with_torch_dtype imports it, to turn a --dtype name into a
torch.dtype once the source is open.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

from .errors import CkptError, require
from .formats.registry import BY_OUTPUT, OUTPUT_FORMATS, Format
from .layout_request import check_sizes
from .state import HF_EXPERT_FORMS, Checkpoint

# --dtype names -> torch dtype names (torch.<name>)
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
               "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
PAD_FILLS = ("zero", "mean", "last")  # vocab.PAD_FILLS's, here without importing torch


@dataclass(frozen=True)
class WriteOptions:
    format: Optional[str] = None  # --format of merge / reshard / fix-vocab (None: the source's; registry.default_output)
    dialect: Optional[str] = None  # Megatron key names (None: the source's, else mcore)
    release: Optional[bool] = None  # under release/ (None: as the source, and for the 2019 dialect)
    dtype: Any = None  # a --dtype name or a torch.dtype (writers get a torch.dtype: with_torch_dtype), None: as stored
    divisible_by: Optional[int] = None  # --make-vocab-size-divisible-by (None: the source's)
    pad_fill: str = "zero"  # new vocabulary rows
    iteration: Optional[int] = None  # the iteration written (None: the source's)
    checkpoint_version: Optional[float] = None  # Megatron's checkpoint_version (None: the dialect's / source's)
    optimizer: bool = True  # carry the source's optimizer state (False: --no-optimizer)
    distributed_optimizer: bool = False  # distrib_optim.pt beside each rank file
    dp: Optional[int] = None  # its data-parallel size (None: 1)
    overlap_grad_reduce: Optional[bool] = None  # its buckets (None: the source run's)
    ddp_bucket_size: Optional[int] = None
    distrib_optim_era: Optional[str] = None  # its megatron-core form (None: today's)
    moe_grouped_gemm: Optional[bool] = None  # experts as the dialect's grouped module (None: as the source)
    max_shard_size: str = "5GB"  # Hugging Face: the largest safetensors file
    tokenizer: Optional[str] = None  # Hugging Face: a directory whose tokenizer files are copied
    experts: Optional[str] = None  # Hugging Face: "fused" or "per-expert" MoE experts (None: as the source stored them)
    fp8: bool = False  # Hugging Face: the Linear weights the family releases in block FP8 stored so (--fp8)
    drop_mtp: bool = False  # write the main model without its multi-token-prediction layers (state.without_mtp)

    def given(self) -> FrozenSet[str]:
        """The options not at their default: what the user asked for (the table check refuses those the
        target does not honour)."""
        return frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)

    def replace(self, **changes) -> "WriteOptions":
        return dataclasses.replace(self, **changes)


# Each option as the CLI spells it (negated by --no- where a flag's default is True or None) and what it
# does, for the table check's refusals.
OPTION_WORDS = {
    "format": ("--format", "chooses the output format"),
    "dialect": ("--dialect", "names the Megatron keys written"),
    "release": ("--release", "chooses Megatron's release/ directory"),
    "dtype": ("--dtype", "casts the tensors"),
    "divisible_by": ("--make-vocab-size-divisible-by", "re-pads the vocabulary"),
    "pad_fill": ("--pad-fill", "fills new vocabulary rows"),
    "iteration": ("iteration", "sets the iteration written"),
    "checkpoint_version": ("checkpoint_version", "sets Megatron's checkpoint_version"),
    "optimizer": ("--optimizer", "chooses whether the optimizer state is carried"),
    "distributed_optimizer": ("--distributed-optimizer", "writes Megatron's distrib_optim.pt files"),
    "dp": ("--dp", "shapes the distributed optimizer's files"),
    "overlap_grad_reduce": ("--overlap-grad-reduce", "shapes the distributed optimizer's files"),
    "ddp_bucket_size": ("--ddp-bucket-size", "shapes the distributed optimizer's files"),
    "distrib_optim_era": ("--distrib-optim-era", "shapes the distributed optimizer's files"),
    "moe_grouped_gemm": ("--moe-grouped-gemm", "chooses the experts' module in Megatron's torch format"),
    "max_shard_size": ("--max-shard-size", "sizes the safetensors files"),
    "tokenizer": ("--tokenizer", "copies tokenizer files"),
    "experts": ("--experts", "chooses how Hugging Face MoE experts are stored"),
    "fp8": ("--fp8", "stores the Linear weights in block FP8"),
    "drop_mtp": ("--drop-mtp", "drops the multi-token-prediction layers"),
}
NEGATABLE = ("release", "optimizer", "overlap_grad_reduce", "moe_grouped_gemm")


def _uses_gemma_maths(cfg) -> bool:
    from .families.gemma import uses_gemma_maths  # every family on use: the CLI's error paths import none of them
    return uses_gemma_maths(cfg)


def flag(name: str, value: Any = True) -> str:
    """How the user gave option `name` with `value`: --release / --no-release, --dp, ..."""
    spelled = OPTION_WORDS[name][0]
    return spelled.replace("--", "--no-", 1) if name in NEGATABLE and value is False else spelled


# The API's keyword names that differ from the record's (the CLI's long names in snake_case).
API_NAMES = {"make_vocab_size_divisible_by": "divisible_by"}
# Options that only shape the distributed optimizer's files.
DISTRIBUTED_OPTIMIZER_OPTIONS = ("dp", "overlap_grad_reduce", "ddp_bucket_size", "distrib_optim_era")


def _api_names() -> set:
    """The API's keyword names of the write options (API_NAMES spells some as the CLI does)."""
    return {f.name for f in dataclasses.fields(WriteOptions)} - set(API_NAMES.values()) | set(API_NAMES)


def write_options_from(arguments: dict) -> WriteOptions:
    """build_write_options from the write options among a command's arguments: merge / reshard / fix_vocab
    hand over their locals(), so the keyword list of each is written once, in its signature."""
    names = _api_names()
    return build_write_options(**{k: v for k, v in arguments.items() if k in names})


def build_write_options(**kw) -> WriteOptions:
    """WriteOptions from the API's keyword arguments (CLI names in snake_case: make_vocab_size_divisible_by,
    dtype as "bf16" / "fp32" / ... or a torch.dtype); None means not given. An unknown name raises TypeError,
    as a wrong keyword does; a value outside its choices, or an option without the one it needs, CkptError."""
    names = _api_names()
    unknown = sorted(k for k in kw if k not in names)
    if unknown:
        raise TypeError(f"unknown write options: {', '.join(unknown)}")
    opts = WriteOptions(**{API_NAMES.get(k, k): v for k, v in kw.items()})
    check_sizes(dp=opts.dp)
    _check(opts)
    return opts


def with_torch_dtype(opts: WriteOptions) -> WriteOptions:
    """opts with its dtype as a torch.dtype, for the writers: the API turns the name into one once the source
    is open, so a command that fails on its input answers without importing torch."""
    return opts.replace(dtype=as_dtype(opts.dtype))


def _check(opts: WriteOptions) -> None:
    """The options checked among themselves (refuse_unwritable checks them against the target's format)."""
    for name in DISTRIBUTED_OPTIMIZER_OPTIONS:
        require(getattr(opts, name) is None or opts.distributed_optimizer,
                f"{flag(name)} shapes the distributed optimizer's files", "give it with --distributed-optimizer")
    require(opts.ddp_bucket_size is None or opts.overlap_grad_reduce, "--ddp-bucket-size: Megatron buckets only with "
            "--overlap-grad-reduce", "add --overlap-grad-reduce")
    require(opts.format is None or opts.format in OUTPUT_FORMATS, f"unknown output format {opts.format!r}",
            f"choose one of {', '.join(OUTPUT_FORMATS)}")
    require(opts.experts is None or opts.experts in HF_EXPERT_FORMS, f"unknown experts form {opts.experts!r}",
            f"choose one of {', '.join(HF_EXPERT_FORMS)}")
    require(opts.pad_fill in PAD_FILLS, f"unknown pad_fill {opts.pad_fill!r}", f"choose one of {', '.join(PAD_FILLS)}")
    require(opts.dtype is None or not isinstance(opts.dtype, str) or opts.dtype in DTYPE_NAMES,
            f"unknown dtype {opts.dtype!r}", f"choose one of {', '.join(sorted(DTYPE_NAMES))}")


def as_dtype(value):
    """A torch.dtype from a --dtype name (or a torch.dtype, or None)."""
    if value is None or not isinstance(value, str):
        return value
    require(value in DTYPE_NAMES, f"unknown dtype {value!r}", f"choose one of {', '.join(sorted(DTYPE_NAMES))}")
    import torch  # here: the record (and the format table that reads it) stays importable without torch
    return getattr(torch, DTYPE_NAMES[value])


# --- the format table's check -------------------------------------------------------------------------
# What a checkpoint holds that some formats cannot (registry.CONTENTS): name -> (whether ckpt holds it,
# the refusal naming it and the target, what to do instead). Optimizer state is not refused: a target
# without it drops it with a warning (convert.write_layout).
def _moe_words(ckpt: Checkpoint, fmt: str) -> str:
    moe = ckpt.config.moe
    return (f"MoE layers ({moe.num_experts} experts, top-{moe.top_k}, in {len(moe.layers)} of "
            f"{ckpt.config.num_layers} layers): Megatron {fmt} output of MoE models is not supported yet")


def _mtp_words(ckpt: Checkpoint, fmt: str) -> str:
    n = ckpt.config.mtp_num_layers
    return (f"multi-token prediction (MTP): {n} MTP layer(s) after the {ckpt.config.num_layers} decoder layers, which "
            f"{fmt} output cannot hold")


REFUSED_CONTENTS: Dict[str, Tuple[Callable[[Checkpoint], bool], Callable[[Checkpoint, str], str], str]] = {
    "mla": (lambda ckpt: ckpt.config.mla is not None,
            lambda ckpt, fmt: f"Multi-Latent Attention: Megatron {fmt} output of MLA models is not supported yet",
            "use to-hf for DeepSeek-style models, or --format torch / torch_dist"),
    "moe": (lambda ckpt: ckpt.config.moe is not None, _moe_words,
            "write --format torch (expert parallelism with --ep), or use to-hf"),
    # Gemma's post norms, windows, soft-caps ... (families/gemma.py): only Megatron-core-named formats hold them
    "gemma": (lambda ckpt: _uses_gemma_maths(ckpt.config),
              lambda ckpt, fmt: f"Gemma's maths (post-attention / post-MLP norms, sliding windows, soft-capping, ...): "
                                f"Megatron {fmt} output of Gemma models is not supported",
              "write --format torch or torch_dist, or use to-hf"),
    # given --drop-mtp, the writers are handed the model without them (state.without_mtp), never silently
    "mtp": (lambda ckpt: ckpt.config.mtp_num_layers > 0, _mtp_words,
            "give --drop-mtp to write the main model without them (its logits do not depend on them), or write "
            "--format torch / torch_dist"),
}


def refuse_unwritable(ckpt: Checkpoint, target: Format, opts: WriteOptions) -> None:
    """THE check of a write against the format table, before anything is written: a content of ckpt
    (MoE layers, MLA) the target cannot hold, or an option the user gave (not at its default) that its
    writer does not honour, is refused by name (CkptError) with what to do instead."""
    for content, (held, words, hint) in REFUSED_CONTENTS.items():
        if content not in target.holds and held(ckpt) and not (content == "mtp" and opts.drop_mtp):
            raise CkptError(words(ckpt, target.output or target.name), hint)
    refuse_unhonoured(target, opts)


def refuse_unhonoured(target: Format, opts: WriteOptions) -> None:
    """The options half of refuse_unwritable, for a write without a canonical state (an export of a source
    that has none): an option the user gave that the target's writer does not honour, refused by name."""
    label = f"--format {target.output}" if target.output else f"{target.name} output"
    for option in sorted(opts.given() - target.honours, key=_FIELD_ORDER.index):
        value = getattr(opts, option)
        said, does = flag(option, value), OPTION_WORDS[option][1]
        others = [other for other in OUTPUT_FORMATS if option in BY_OUTPUT[other].honours]
        raise CkptError(f"{said} {does}; {label} does not honour it",
                        f"leave {said} out" + (f", or write --format {' / '.join(others)}" if others else ""))


_FIELD_ORDER = [f.name for f in dataclasses.fields(WriteOptions)]
