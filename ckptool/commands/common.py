"""Options and plumbing shared by the CLI commands: reading options, output options, progress,
error reporting."""
from __future__ import annotations

import functools
import sys
import traceback
from typing import Callable, Optional

import click
import torch
from tqdm import tqdm

from ..errors import CkptError
from ..options import ReadOptions

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def source_options(fn: Callable) -> Callable:
    """Flags that tell a reader what the checkpoint itself may not say."""
    opts = [
        click.option("--iteration", type=int, default=None,
                     help="Read iter_XXXXXXX of this iteration instead of the tracker's (Megatron)."),
        click.option("--true-vocab-size", type=int, default=None,
                     help="The real vocabulary size; rows beyond it are padding. Overrides what the checkpoint says."),
        click.option("--replicas", type=click.Choice(["first", "mean", "strict"]), default="first",
                     show_default=True,
                     help="Tensors that should be identical on every TP rank but differ: take rank 0's copy, "
                          "average them, or fail."),
        click.option("--num-attention-heads", type=int, default=None,
                     help="Attention heads, for checkpoints that store no args (2019 Megatron files)."),
        click.option("--num-query-groups", type=int, default=None,
                     help="Query groups (GQA), for checkpoints that store no args."),
        click.option("--weights", type=click.Choice(["master", "model"]), default=None,
                     help="DeepSpeed: fp32 master weights from the ZeRO optimizer shards (default where present) "
                          "or the 16-bit module weights the engine saved."),
        click.option("--qkv-layout", type=click.Choice(["grouped", "split"]), default=None,
                     help="Megatron-DeepSpeed fused QKV packing per TP rank: per group/head [q,k,v] "
                          "(before 2024-12, default) or [all q | all k | all v] (since 2024-12)."),
        click.option("--hf-config", type=click.Path(), default=None,
                     help="DeepSpeed runs of Hugging Face models: the model's config.json (or its directory); "
                          "found automatically beside the checkpoint."),
        click.option("--activation", type=click.Choice(["gelu", "gelu_tanh", "swiglu", "squared_relu"]),
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
        click.option("--normalization", type=click.Choice(["layernorm", "rmsnorm"]), default=None,
                     help="Norm type, for checkpoints that store no args."),
        click.option("--rotary-base", type=float, default=None, help="RoPE base, for checkpoints that store no args."),
        click.option("--args-from", type=click.Path(exists=True), default=None,
                     help="Take the architecture from another checkpoint of the same run (one that stores args)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def read_options(kw: dict) -> ReadOptions:
    overrides = {k: kw.pop(k, None) for k in ("num_attention_heads", "num_query_groups", "activation",
                                             "num_layers", "hidden_size", "ffn_hidden_size",
                                             "max_position_embeddings", "vocab_size", "normalization",
                                             "rotary_base")}
    return ReadOptions(iteration=kw.pop("iteration", None), true_vocab_size=kw.pop("true_vocab_size", None),
                       replicas=kw.pop("replicas", "first"), weights=kw.pop("weights", None),
                       qkv_layout=kw.pop("qkv_layout", None), hf_config=kw.pop("hf_config", None),
                       args_from=kw.pop("args_from", None),
                       overrides={k: v for k, v in overrides.items() if v is not None})


def output_options(fn: Callable) -> Callable:
    opts = [
        click.option("--force", is_flag=True, help="Replace DST if it exists."),
        click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
                     help="Cast tensors to this dtype (default: keep the stored dtype)."),
        click.option("--make-vocab-size-divisible-by", "divisible_by", type=int, default=None,
                     help="Pad the vocabulary to a multiple of this times TP (default: the source's, else 128)."),
        click.option("--pad-fill", type=click.Choice(["zero", "mean", "last"]), default="zero", show_default=True,
                     help="How new vocabulary padding rows are filled."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


class Progress:
    """A byte-counting tqdm bar on stderr (silent when stderr is not a terminal unless forced)."""

    def __init__(self, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        file=sys.stderr, leave=False, disable=None)

    def __call__(self, n: int) -> None:
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
    """Turn CkptError into one line on stderr and exit status 2; other failures into exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool((click.get_current_context().find_root().obj or {}).get("debug"))
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows up here rather than at interpreter exit
            return result
        except BrokenPipeError:
            _quiet_broken_pipe()
        except CkptError as e:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except OSError as e:
            if debug:
                traceback.print_exc()
            from ..io.outdir import translate_os_error
            click.echo(f"error: {translate_os_error(e, getattr(e, 'filename', '') or 'the output')}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was written to the output", err=True)
            sys.exit(130)
        except Exception as e:  # a bug: say so, keep the traceback for --debug
            if debug:
                traceback.print_exc()
            click.echo(f"internal error: {type(e).__name__}: {e} (rerun with `ckptool --debug ...` "
                       "and report it)", err=True)
            sys.exit(1)

    return wrapper


def _quiet_broken_pipe() -> None:
    """`ckptool inspect X | head`: the reader went away; stop without a message, like cat does.
    stdout is pointed at /dev/null so the interpreter's final flush cannot complain again."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(141)  # the status a process killed by SIGPIPE reports through the shell (128 + 13)


def print_warnings(ckpt) -> None:
    for w in ckpt.warnings:
        warn(w)


def write_reported(ckpt, verb: str, write: Callable) -> Optional[dict]:
    """write(progress) under a byte progress bar named verb. Returns its summary on the rank that
    reports (with the source's warnings printed: replica checks run as tensors load, so only now are
    they all known), None on the other ranks of a torchrun team."""
    from ..distributed import current_team
    bar = Progress(ckpt.total_bytes, verb)
    try:
        summary = write(bar)
    finally:
        bar.close()
    if not current_team().leader:  # under torchrun, rank 0 reports for everyone
        return None
    print_warnings(ckpt)
    return summary


def conversion_line(verb: str, src, ckpt, dst, target: str) -> str:
    """First line of a conversion's report: what was read, where it went, as what."""
    s = ckpt.source
    return f"{verb}: {src} ({s.format} {s.dialect}, {s.layout.describe()}) -> {dst} ({target})"
