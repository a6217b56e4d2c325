"""Conversions as functions (the CLI is a thin layer over these): reshard/merge Megatron-family
checkpoints, fix the vocabulary padding. Output goes through atomic_output_dir; which writer a
target format needs, and what it can do, is the format table's (formats/registry.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from .config import Layout
from .errors import CkptError, TeamError, exit_status_of, require
from .distributed import Team, current_team
from .formats.megatron.args import mla_rope_args
from .formats.registry import default_output, output_format
from .io.outdir import PartialDir, adopt_digests, known_digests, partial_output
from .rope_order import as_interleaved_pairs
from .state import PAD_FILL_BY_SLOT, Checkpoint, without_mtp
from .summary import WriteSummary
from .vocab import resize_slot_vocab, resize_vocab
from .write_options import WriteOptions, refuse_unwritable

def write_layout(ckpt: Checkpoint, dst, layout: Layout, opts: WriteOptions = WriteOptions(), force: bool = False,
                 progress: Optional[Callable[[int], None]] = None, warn: Callable[[str], None] = print) -> WriteSummary:
    """Write ckpt at layout into dst (atomically) as opts say. opts.format: torch | torch_dist | ds-universal
    (default: the source's Megatron format).

    What the target cannot hold or honour is refused first (write_options.refuse_unwritable, the format
    table's check). opts.optimizer: carry the source's optimizer state where the target format holds one
    (the default); False writes the weights only. Dropping state the user did not ask to drop is warned about."""
    target = output_format(opts.format) if opts.format is not None else default_output(ckpt)
    fmt = target.output
    refuse_unwritable(ckpt, target, opts)
    if opts.drop_mtp:
        ckpt = without_mtp(ckpt, warn)
    if ckpt.config.mla is not None:
        refuse_mla_megatron_core_cannot_compute(ckpt)
    if ckpt.config.mla is not None and not ckpt.config.rotary_interleaved:
        ckpt = as_interleaved_pairs(ckpt)
        warn("rope_interleave false: each head's rope rows of q and the shared rope rows of kv_down are reordered "
             "into the interleaved pairs megatron-core's MLA rotates (same logits; to-hf writes rope_interleave true)")
    if not target.carries_optimizer and opts.optimizer and ckpt.optimizer is not None:
        warn(f"optimizer state dropped: the {fmt} writer holds the weights only "
             "(--no-optimizer says so explicitly; --format torch carries it)")
    src = Path(ckpt.source.path)
    writer = target.write

    def write(tmp: Path, owns) -> WriteSummary:
        if owns is None:
            return writer(ckpt, tmp, layout, opts, progress=progress, warn=warn)
        if target.shares_ranks:  # warnings once, from the rank that owns item 0
            mine = neighbours_together(owns, layout.pp * layout.ep * layout.tp)
            return writer(ckpt, tmp, layout, opts, progress=progress, warn=warn if mine(0) else (lambda m: None),
                          rank_filter=lambda t, p, e: mine((p * layout.ep + e) * layout.tp + t))
        if owns(0):  # a writer that cannot share: one rank writes it all
            return writer(ckpt, tmp, layout, opts, progress=progress, warn=warn)
        return None

    return write_output(dst, [src], force, write, merge=WriteSummary.combined)


def neighbours_together(owns: Callable[[int], bool], files: int) -> Callable[[int], bool]:
    """A team rank's share of `files` target files as one run of neighbours (with 2 ranks and 4
    files: 0-1, 2-3) instead of round-robin. Target files cut from one source shard are neighbours
    (TP2 -> TP4: files 0 and 1 from source rank 0), so one rank reads each source shard and no source
    byte is read by two ranks (its row-parallel weights would be, whole, by each). As even as
    round-robin; file 0 stays with the rank that owns item 0."""
    world = current_team().world
    if world <= 1 or files <= 0:
        return owns
    return lambda i: owns(i * world // files)


def refuse_mla_megatron_core_cannot_compute(ckpt: Checkpoint) -> None:
    """An MLA model megatron-core (the Megatron targets that hold MLA) cannot compute as its source did is
    refused before writing: one norm epsilon for the latent norms and the rest, YaRN settings it knows."""
    mla = ckpt.config.mla
    if mla.latent_norm_eps != ckpt.config.norm_eps:
        raise CkptError(f"Multi-Latent Attention: latent norm epsilon {mla.latent_norm_eps} != norm epsilon "
                        f"{ckpt.config.norm_eps} (megatron-core uses one) is not supported yet",
                        "use to-hf for DeepSeek-style models, or --format torch / torch_dist")
    mla_rope_args(ckpt.config.rope_yarn)


def write_output(dst, sources, force: bool, write: Callable, merge: Callable[[list], dict]) -> dict:
    """Atomically produce dst with write(tmp_dir, owns) -> summary | None.

    Alone, owns is None: write everything. Under torchrun every rank calls write with owns(i) ->
    bool, its round-robin share of the work items 0, 1, 2... (files); owns(0)'s rank also writes
    whatever exists once (configs, indexes). merge combines the ranks' non-None summaries. The
    summary's `replaced` says what an old dst held when force replaced it."""
    team = current_team()
    if not team.distributed:
        with partial_output(dst, sources=sources, force=force) as part:
            summary = write(part.path, None)
        return _with_replaced(summary, part)
    return _write_as_team(team, dst, sources, force, write, merge)


def _with_replaced(summary, part: Optional[PartialDir]):
    if part is not None and part.replaced is not None and hasattr(summary, "replaced"):
        summary.replaced = part.replaced
    return summary


def _write_as_team(team: Team, dst, sources, force: bool, write: Callable, merge: Callable) -> dict:
    """torchrun: rank 0 claims the partial output (the run's lock is rank 0's: the other ranks write
    into the directory it broadcasts), every rank writes its share of the files, rank 0 seals the
    output once all report success. Every rank sees the same outcome. Whatever ends rank 0 (an
    error, a signal from torchrun's agent), its partial output goes with it (PartialDir.release)."""
    part, error = None, None
    if team.leader:
        try:
            part = PartialDir.claim(dst, sources, force)
        except CkptError as e:
            error = e
    try:
        total = _write_shares(team, part, error, write, merge)
        sealed = None
        if team.leader:
            try:
                part.seal()
            except Exception as e:
                sealed = str(e)
        sealed = team.broadcast(sealed)  # nobody returns before the output is in place
        if sealed:
            raise CkptError(f"could not finish {dst}: {sealed}")
    finally:
        if part is not None:
            part.release()
    return _with_replaced(total, part)


def _write_shares(team: Team, part: Optional[PartialDir], error: Optional[CkptError], write: Callable,
                  merge: Callable):
    """Every rank writes its share into the leader's partial output; the merged summary, or the
    first failure raised on every rank (by the failing rank as itself, by the others as TeamError)."""
    tmp, message = team.broadcast((part and part.path, None if error is None else str(error)))
    if message is not None:
        raise error if error is not None else CkptError(message)
    summary, failure = None, None
    try:
        summary = write(tmp, team.owns)
    except Exception as e:  # every rank must hear of it, or the others wait forever
        failure = e
    # each rank's manifest digests, taken while it wrote: rank 0 seals without reading the files back
    report = None if failure is None else (f"rank {team.rank}: {failure}", exit_status_of(failure))
    results = team.gather((summary, report, known_digests(tmp) if failure is None else {}))
    failed = [(rank, r) for rank, (_, r, _) in enumerate(results) if r is not None]
    if failed:
        reporter, (message, status) = failed[0]  # the lowest failing rank says it, for every rank
        if failure is not None and reporter == team.rank:
            failure.reporter = reporter  # read by the CLI's error report (commands/common.py)
            raise failure
        raise TeamError(f"distributed conversion failed on another rank ({message})" if failure is None
                        else str(failure), reporter=reporter, status=status)
    if team.leader:
        for _, _, digests in results:
            adopt_digests(digests)
    return merge([s for s, _, _ in results if s])


def fix_vocab(ckpt: Checkpoint, size: Optional[int] = None, multiple: Optional[int] = None,
              pad_fill: str = "zero") -> Checkpoint:
    """The same checkpoint with the word embedding (and untied output) padded or trimmed."""
    cfg = ckpt.config
    require((size is None) != (multiple is None), "give exactly one of --size or --multiple")
    if multiple is not None:
        base = cfg.vocab_size if cfg.vocab_size is not None else cfg.padded_vocab_size
        require(multiple >= 1, "--multiple must be positive")
        size = -(-base // multiple) * multiple
    require(size >= 1, "--size must be positive")
    if cfg.vocab_size is None and size < cfg.padded_vocab_size:
        # The user is telling us the real vocabulary: rows beyond it are padding.
        ckpt.warn(f"true vocabulary size unknown: taking --size {size} as the true size and cutting "
                  f"{cfg.padded_vocab_size - size} rows")
        cfg = cfg.replace(vocab_size=size, vocab_size_source="fix-vocab --size")
    tensors = resize_vocab(ckpt.tensors, cfg, size, pad_fill)
    optimizer = ckpt.optimizer
    if optimizer is not None:  # every slot resized like the weights (new rows: zero moments, master = weight)
        optimizer = optimizer.with_slots({slot: resize_slot_vocab(ts, tensors, cfg, size, PAD_FILL_BY_SLOT[slot])
                                          for slot, ts in optimizer.slots.items()})
    return Checkpoint(cfg.replace(padded_vocab_size=size), tensors, ckpt.source, ckpt.warnings, optimizer)
