"""The table of formats: for each, how a path is recognised, read and written. Every command asks
this table, and only this table, which format a source is and which writer a target needs.

A format's functions are named as "module:function" and imported on first use, so consulting the
table costs no import of the formats it does not pick; the looks_like functions of directory formats
live in torch-free modules (*_files.py, hf/config.py), so naming a directory's format imports no
torch (the quick inspect relies on it). Each entry may have:

  looks_like(path) -> bool                 claims a path (asked in table order; see ORDER below)
  read(path, ReadOptions) -> Checkpoint    the canonical state, lazily
  write(ckpt, out_dir, layout, WriteOptions, progress=, warn=) -> summary   the format's writer, handed the
                                           options whole (hf's takes no layout)
  output                                   the name `--format` gives the writer of merge / reshard /
                                           fix-vocab (Megatron layouts), None where another command
                                           writes it (to-hf) or nothing does
  shares_ranks                             the layout writer lets torchrun ranks share one output
  honours                                  the write options (write_options.WriteOptions fields) its writer
                                           acts on; one given for a format that does not is refused by
                                           name before anything is written (write_options.refuse_unwritable)
  holds                                    what of a checkpoint its writer can hold (CONTENTS: MoE layers,
                                           Multi-Latent Attention, Gemma's maths, optimizer state, MTP layers);
                                           MoE, MLA, Gemma or MTP it cannot hold is refused (MTP unless
                                           --drop-mtp), optimizer state it cannot hold dropped with a warning
  megatron_run                             Megatron-LM resumes training from what its writer writes
  megatron_layout                          its writer writes Megatron layouts: merge / reshard / fix-vocab of a
                                           source of it write it by default (else Megatron's torch format)
  quick_read(path) -> Checkpoint | None    metadata only, without torch, for inspect (quick/)
  command                                  the command line that writes the format (for hints)
  parallel_ref                             how verify under torchrun gives each rank its own shard of a
                                           checkpoint of this format (verify/targets.py), None: not run in parallel

A source with no canonical GPT form (a DeepLearningExamples BERT file, a DeepSpeed run of a non-GPT
Hugging Face model or of any other module) is still claimed here; its reader raises
errors.NoCanonicalForm, whose exports are keyed by the names of this table's formats it can still be
written as. A command that writes a format asks that format's entry for the export
(Format.exporter: to-hf's Hugging Face directory, merge --format ds-universal's universal checkpoint
from the engine's own names); where there is none the source's error stands, its hint naming the
commands that do write it (ways_out).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, FrozenSet, Optional, Tuple

from ..errors import CkptError, NoCanonicalForm
from ..options import ReadOptions
from ..state import Checkpoint
from ..io import profile


def resolve(ref: Optional[str]) -> Optional[Callable]:
    """The function a "module:function" reference names (imported now), or None for None."""
    if ref is None:
        return None
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Format:
    name: str  # SourceInfo.format of what it reads (and of what its writer wrote)
    looks_like_ref: Optional[str] = None
    read_ref: Optional[str] = None
    write_ref: Optional[str] = None
    output: Optional[str] = None  # `--format` name of its Megatron-layout writer
    shares_ranks: bool = False  # the writer takes rank_filter(tp, pp, ep): torchrun ranks share one output
    honours: FrozenSet[str] = frozenset()  # WriteOptions fields its writer acts on
    holds: FrozenSet[str] = frozenset()  # CONTENTS its writer writes (the rest is refused or dropped)
    megatron_run: bool = False  # a Megatron-LM training run resumes from its output
    megatron_layout: bool = True  # its writer writes Megatron layouts (a source of it is rewritten in it by default)
    quick_ref: Optional[str] = None  # torch-free metadata reader for inspect (quick_inspect.py)
    command: Optional[str] = None  # the command line that writes this format, for hints
    # verify under torchrun: how each rank gets its own shard of a checkpoint of this format
    # (target, read options, --tp, --pp, world size, --vpp) -> verify.targets.ParallelTarget; None: not run in parallel
    parallel_ref: Optional[str] = None

    @property
    def reads(self) -> bool:
        return self.read_ref is not None

    @property
    def writes(self) -> bool:
        return self.write_ref is not None

    @property
    def carries_optimizer(self) -> bool:
        """The writer takes WriteOptions.optimizer and writes the source's optimizer state."""
        return "optimizer" in self.holds

    @property
    def writes_moe(self) -> bool:
        """The writer places MoE routers and experts (others would drop them)."""
        return "moe" in self.holds

    def looks_like(self, path) -> bool:
        fn = resolve(self.looks_like_ref)
        return fn is not None and bool(fn(Path(path)))

    def read(self, path, opts: ReadOptions) -> Checkpoint:
        fn = resolve(self.read_ref)
        if fn is None:  # pragma: no cover - every entry with looks_like has a reader
            raise CkptError(f"internal: no reader for {self.name}")
        return fn(Path(path), opts)

    def quick_read(self, path) -> Optional[Checkpoint]:
        """The checkpoint with TensorMeta records for tensors, read without torch; None where only
        the full reader can say (or the format has no quick reader)."""
        fn = resolve(self.quick_ref)
        return fn(Path(path), self.name) if fn is not None else None

    def exporter(self, source: NoCanonicalForm) -> Callable:
        """The export that writes this format from a source with no canonical form (its reader's);
        the source's own error where its reader has none for this format."""
        export = source.exports.get(self.name)
        if export is None:
            raise source
        return export

    @property
    def write(self) -> Callable:
        fn = resolve(self.write_ref)
        if fn is None:
            raise CkptError(f"ckptool does not write {self.name} checkpoints")
        return fn


# What a checkpoint may hold that not every writer can (Format.holds).
CONTENTS = ("moe", "mla", "gemma", "optimizer", "mtp")  # gemma: Gemma 2 / 3 maths (issue 32); mtp: multi-token-prediction layers
# The write options (write_options.WriteOptions fields) each writer acts on (Format.honours).
_VOCABULARY = frozenset({"divisible_by", "pad_fill"})  # re-padding the vocabulary for the target TP
_DISTRIBUTED_OPTIMIZER = frozenset({"distributed_optimizer", "dp", "overlap_grad_reduce", "ddp_bucket_size",
                                    "distrib_optim_era"})
_CONTENT = frozenset({"drop_mtp"})  # what the model written holds: every writer is handed it (state.without_mtp)
TORCH_DIST_HONOURS = frozenset({"format", "dialect", "dtype", "iteration", "optimizer"}) | _VOCABULARY | _CONTENT
MEGATRON_HONOURS = (TORCH_DIST_HONOURS | _DISTRIBUTED_OPTIMIZER
                    | frozenset({"release", "checkpoint_version", "moe_grouped_gemm"}))
# a universal checkpoint is fp32 training state at the source's names, vocabulary and layout: its writer
# checks the values of these two itself (fp32 only, the optimizer state required)
DS_UNIVERSAL_HONOURS = frozenset({"format", "dtype", "optimizer"}) | _CONTENT
HF_HONOURS = frozenset({"dtype", "max_shard_size", "tokenizer", "experts", "fp8"}) | _CONTENT  # fp8: for families released so (hf/writer.py)
DCP_HONOURS = frozenset({"format", "dialect", "dtype"}) | _CONTENT  # dialect: torchtitan's names instead of HF's

# Order matters: a torch_dist iteration directory also has Megatron's tracker file, and a DeepSpeed
# save directory may have one too, so the more specific formats are asked first. The BERT file
# check opens the file, so it comes last (every other format is a directory).
FORMATS: Tuple[Format, ...] = (
    # FSDP / FSDP2 / torchtitan / accelerate DCP saves of HF-named models: asked before torch_dist, which claims every
    # folder with a DCP index (this one claims only those whose keys are a Hugging Face family's or torchtitan's)
    Format("dcp", "ckptool.formats.dcp.fsdp_files:looks_like", "ckptool.formats.dcp.fsdp:read",
           "ckptool.formats.dcp.fsdp_writer:write_dcp", output="dcp", honours=DCP_HONOURS, holds=frozenset({"moe"}),
           megatron_layout=False, quick_ref="ckptool.formats.dcp.fsdp_quick:read",
           command="ckptool merge SRC DST --format dcp"),
    Format("torch_dist", "ckptool.formats.dcp.files:looks_like", "ckptool.formats.dcp.torch_dist:read",
           "ckptool.formats.dcp.torch_dist:write_torch_dist", output="torch_dist", honours=TORCH_DIST_HONOURS,
           holds=frozenset({"moe", "mla", "gemma", "optimizer", "mtp"}), megatron_run=True,
           quick_ref="ckptool.formats.dcp.quick:read",
           command="ckptool merge SRC DST --format torch_dist", parallel_ref="ckptool.verify.targets:dist_target"),
    Format("deepspeed", "ckptool.formats.deepspeed.files:looks_like_deepspeed", "ckptool.formats.deepspeed.checkpoint:read",
           quick_ref="ckptool.formats.deepspeed.quick:read", parallel_ref="ckptool.verify.targets:deepspeed_target"),
    Format("verl-fsdp", "ckptool.formats.verl.files:looks_like", "ckptool.formats.verl.fsdp:read"),
    Format("hf", "ckptool.formats.hf.config:looks_like", "ckptool.formats.hf.reader:read",
           "ckptool.formats.hf.writer:write_hf", honours=HF_HONOURS, holds=frozenset({"moe", "mla", "gemma", "mtp"}),
           quick_ref="ckptool.formats.hf.quick:read", command="ckptool to-hf SRC DST"),
    Format("megatron", "ckptool.formats.megatron.files:looks_like_megatron", "ckptool.formats.megatron.checkpoint:read_megatron",
           "ckptool.formats.megatron.checkpoint:write_megatron", output="torch", shares_ranks=True,
           honours=MEGATRON_HONOURS, holds=frozenset({"moe", "mla", "gemma", "optimizer", "mtp"}), megatron_run=True,
           quick_ref="ckptool.formats.megatron.quick:read", command="ckptool merge SRC DST --format torch",
           parallel_ref="ckptool.verify.targets:megatron_target"),
    Format("ds-universal", write_ref="ckptool.formats.deepspeed.universal:write_ds_universal", output="ds-universal",
           honours=DS_UNIVERSAL_HONOURS, holds=frozenset({"optimizer"}),
           command="ckptool merge SRC DST --format ds-universal"),
    Format("dle-bert", "ckptool.formats.dle_bert:looks_like", "ckptool.formats.dle_bert:read"),
)
BY_NAME = {f.name: f for f in FORMATS}
BY_OUTPUT = {f.output: f for f in FORMATS if f.output}
# what merge / reshard / fix-vocab write (--format), the default for most sources first
OUTPUT_FORMATS = ("torch",) + tuple(n for n in BY_OUTPUT if n != "torch")


def source_format(path) -> Format:
    """The table's entry for the checkpoint at path (CkptError if none claims it)."""
    path = Path(path)
    if not path.exists():
        raise CkptError(f"{path}: no such file or directory")
    if path.is_dir() and not any(path.iterdir()):
        raise CkptError(f"{path} is an empty directory", "pass the directory the training run saved to")
    for fmt in FORMATS:
        if fmt.looks_like(path):
            return fmt
    raise CkptError(f"{path}: not a checkpoint ckptool recognises",
                    "expected a Megatron save dir (mp_rank_*), a torch_dist/DCP dir, a DeepSpeed "
                    "global_step dir, a verl FSDP actor dir or a Hugging Face model dir")


def ways_out(exports) -> str:
    """The commands that write the formats named (a NoCanonicalForm's exports), for its hint."""
    return " or ".join(f"`{BY_NAME[name].command}`" for name in exports)


def detect_format(path) -> str:
    return source_format(path).name


def output_format(name: str) -> Format:
    """The writer `--format name` means."""
    if name not in BY_OUTPUT:
        raise CkptError(f"unknown output format {name!r}", f"choose one of {', '.join(sorted(BY_OUTPUT))}")
    return BY_OUTPUT[name]


def default_output(ckpt: Checkpoint) -> Format:
    """What merge / reshard / fix-vocab write when --format is not given: the source's own format
    where the table writes Megatron layouts of it, else Megatron's torch format."""
    own = BY_NAME.get(ckpt.source.format)
    return own if own is not None and own.output is not None and own.looks_like_ref and own.megatron_layout \
        else BY_OUTPUT["torch"]


def open_checkpoint(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    """Read any supported checkpoint into the canonical state (lazily)."""
    opts = opts or ReadOptions()
    fmt = source_format(path)
    with profile.stage("plan"):
        return fmt.read(path, opts)
