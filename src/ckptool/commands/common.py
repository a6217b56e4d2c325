"""Options and plumbing shared by the CLI commands: reading options, output options, progress,
error reporting."""
from __future__ import annotations

import functools
import sys
import traceback
from typing import Callable, Optional
import os

import click
from tqdm import tqdm

from ..errors import EXIT, CkptError, TeamError, exit_status_of
from ..options import CHOICES, ReadOptions, pop_read_options
from ..stopping import as_stop, stop_words
from ..io.outdir import translate_os_error
from ..io.outdir import stop_outcome
from ..distributed import fail_as_team, stop_as_team, torchrun_rank


def source_options(fn: Callable) -> Callable:
    """Flags that tell a reader what the checkpoint itself may not say."""
    opts = [
        click.option("--iteration", type=int, default=None,
                     help="Read iter_XXXXXXX of this iteration instead of the tracker's (Megatron)."),
        click.option("--true-vocab-size", type=int, default=None,
                     help="The real vocabulary size; rows beyond it are padding. Overrides what the checkpoint says; "
                          "Megatron outputs' args say it too."),
        click.option("--replicas", type=click.Choice(CHOICES["replicas"]), default="first",
                     show_default=True,
                     help="Tensors that should be identical on every TP rank but differ: take rank 0's copy, "
                          "average them, or fail."),
        click.option("--num-attention-heads", type=int, default=None,
                     help="Attention heads, for checkpoints that store no args (2019 Megatron files)."),
        click.option("--num-query-groups", type=int, default=None,
                     help="Query groups (GQA), for checkpoints that store no args."),
        click.option("--weights", type=click.Choice(CHOICES["weights"]), default=None,
                     help="DeepSpeed: fp32 master weights from the ZeRO optimizer shards (default where present) "
                          "or the 16-bit module weights the engine saved."),
        click.option("--qkv-layout", type=click.Choice(CHOICES["qkv_layout"]), default=None,
                     help="Megatron-DeepSpeed fused QKV packing per TP rank: per group/head [q,k,v] "
                          "(before 2024-12, default) or [all q | all k | all v] (since 2024-12)."),
        click.option("--hf-config", type=click.Path(), default=None,
                     help="The model's config.json (or its directory) for a source that keeps none of its own: "
                          "DeepSpeed runs of Hugging Face models, FSDP / torchtitan / accelerate DCP saves, "
                          "torch_dist saves without args or a trainer's config sidecar, verl FSDP folders "
                          "without huggingface/ (found automatically beside the checkpoint where it is; DCP: "
                          "also in a huggingface/ folder beside it or above)."),
        click.option("--activation", type=click.Choice(CHOICES["activation"]),
                     default=None, help="Override the MLP activation read from the checkpoint."),
        # Checkpoints without args (bare dist_checkpointing / DCP saves): sizes shapes cannot tell.
        click.option("--num-layers", type=int, default=None, help="Layers, for checkpoints that store no args."),
        click.option("--hidden-size", type=int, default=None, help="Hidden size, for checkpoints that store no args."),
        click.option("--ffn-hidden-size", type=int, default=None,
                     help="MLP size, for checkpoints that store no args."),
        click.option("--max-position-embeddings", type=int, default=None,
                     help="Sequence length of rotary models, for checkpoints that store no args."),
        click.option("--vocab-size", type=int, default=None,
                     help="True vocabulary size, for checkpoints that store no args (rows beyond it are padding)."),
        click.option("--normalization", type=click.Choice(CHOICES["normalization"]), default=None,
                     help="Norm type, for checkpoints that store no args."),
        click.option("--rotary-base", type=float, default=None, help="RoPE base, for checkpoints that store no args."),
        click.option("--args-from", type=click.Path(exists=True), default=None,
                     help="Take the architecture from another checkpoint of the same run (one that stores args)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def read_options(kw: dict) -> ReadOptions:
    """The reading options of source_options, taken out of a command's keyword arguments."""
    return pop_read_options(kw)


# A model's multi-token-prediction layers go wherever the target holds them; a target that cannot refuses by name
# unless this is given (write_options.REFUSED_CONTENTS "mtp")
DROP_MTP = click.option("--drop-mtp", is_flag=True, default=False,
                        help="Write the model without its multi-token-prediction (MTP) layers, saying what was "
                             "dropped (for a target that cannot hold them; the main model's logits do not change).")


def output_options(fn: Callable) -> Callable:
    from ..api import DTYPES, PAD_FILLS  # here, not at the top: inspect uses this module without torch
    opts = [
        click.option("--force", is_flag=True, help="Replace DST if it exists."),
        click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
                     help="Cast tensors to this dtype (default: keep the stored dtype)."),
        click.option("--make-vocab-size-divisible-by", type=int, default=None,
                     help="Pad the vocabulary to a multiple of this times TP (default: the source's, else 128)."),
        click.option("--pad-fill", type=click.Choice(PAD_FILLS), default="zero", show_default=True,
                     help="How new vocabulary padding rows are filled."),
        DROP_MTP,
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


class Progress:
    """A byte-counting tqdm bar on stderr (silent when stderr is not a terminal unless forced)."""

    def __init__(self, desc: str, total: Optional[int] = None):
        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        file=sys.stderr, leave=False, disable=None)

    def __call__(self, n: int, total: Optional[int] = None) -> None:
        """n more bytes written (the API's progress(bytes, total) hook)."""
        if total and self.bar.total != total:
            self.bar.total = total
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def warn(message: str) -> None:
    tqdm.write(f"warning: {message}", file=sys.stderr)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def reports_errors(fn: Callable) -> Callable:
    """Turn CkptError into one line on stderr and EXIT["bad_input"]; other failures into EXIT["internal"]
    (statuses: errors.EXIT_STATUSES). Under torchrun the line is printed once, by the rank that found
    the error (rank 0 when every rank did), and every rank exits with the same status."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool((click.get_current_context().find_root().obj or {}).get("debug"))
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows up here rather than at interpreter exit
            return result
        except BrokenPipeError:
            _quiet_broken_pipe()
        except (KeyboardInterrupt, Exception) as e:
            if debug and not isinstance(e, KeyboardInterrupt):
                traceback.print_exc()
            try:
                _end_with(as_stop(e))
            except KeyboardInterrupt as stop:  # a stop signal's handler ran only while the error was said
                _end_with(stop)

    return wrapper


def _end_with(e: BaseException) -> None:
    """Say e's one line and exit with its status (as the team, under torchrun)."""
    _fail(error_line(e), exit_status_of(e), getattr(e, "reporter", 0), isinstance(e, TeamError),
          stopped=isinstance(e, KeyboardInterrupt))


def error_line(e: BaseException) -> str:
    """The one line a failed command prints."""
    if isinstance(e, CkptError):
        return f"error: {e}"
    if isinstance(e, OSError):
        return f"error: {translate_os_error(e, getattr(e, 'filename', '') or 'the output')}"
    if isinstance(e, KeyboardInterrupt):  # Ctrl-C, SIGTERM, SIGHUP (stopping.py)
        return f"{stop_words(e)}: {stop_outcome()}"
    return f"internal error: {type(e).__name__}: {e} (rerun with `ckptool --debug ...` and report it)"


def _fail(line: str, status: int, reporter: int, agreed: bool = False, stopped: bool = False) -> None:
    if stopped:
        stop_as_team(line, status, _say)
    if torchrun_rank() is None:
        _say(line)
        sys.exit(status)
    fail_as_team(line, status, reporter, _say, agreed=agreed)


def _say(line: str) -> None:
    try:
        click.echo(line, err=True)
    except OSError:
        pass  # stderr is gone (SIGHUP: the terminal closed); the status still says what happened


def _quiet_broken_pipe() -> None:
    """`ckptool inspect X | head`: the reader went away; stop without a message, like cat does.
    stdout is pointed at /dev/null so the interpreter's final flush cannot complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(EXIT["broken_pipe"])  # the status a process killed by SIGPIPE reports through the shell (128 + 13)


def print_warnings(ckpt) -> None:
    for w in ckpt.warnings:
        warn(w)


class LiveWarnings:
    """The API's warn hook for a command: prints each warning as it arises, remembers which."""

    def __init__(self):
        self.printed = set()

    def __call__(self, message: str) -> None:
        self.printed.add(message)
        warn(message)


def report_conversion(result, lines: list, live: LiveWarnings) -> None:
    """A conversion's report, on the rank that reports for the team: lines on stdout, then the warnings
    not printed as they arose (the source's replica checks run as tensors load, so only now are they
    all known)."""
    if not result.leader:
        return
    for line in lines:
        click.echo(line)
    replaced = getattr(result.summary, "replaced", None)
    if replaced:  # --force: say what the old output held, now gone
        click.echo(f"  replaced {result.dst}: {replaced[0]} files, {replaced[1]} bytes ({human_bytes(replaced[1])})")
    if result.replica_divergences:  # the source's replicas that differed (ReplicaPolicy)
        from ..sharding import divergence_report  # imports torch: only after a conversion, which imported it
        click.echo(f"  {divergence_report(result.replica_divergences)}")
    for w in result.warnings:
        if w not in live.printed:
            warn(w)


def conversion_line(result, target: str) -> str:
    """First line of a conversion's report: what was read, where it went, as what."""
    s = result.checkpoint.source
    return f"{result.command}: {result.src} ({s.format} {s.variant}, {s.layout.describe()}) -> {result.dst} ({target})"
