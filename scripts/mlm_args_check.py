#!/usr/bin/env python3
"""Check that Megatron-LM's own argument code accepts the args of a checkpoint (CPU, one process).

    MEGATRON_LM=<Megatron-LM checkout> python3 scripts/mlm_args_check.py CKPT_DIR [CKPT_DIR ...]

For each checkpoint directory (the one holding latest_checkpointed_iteration.txt) this does what
Megatron-LM's tools/checkpoint loaders do (loader_base.py, parse_megatron_args) and what a training run
with --use-checkpoint-args does (arguments.py, parse_and_validate_args): parse_args() on the loaders'
command line, then Megatron-LM's load_args_from_checkpoint() reading the checkpoint's args from the
files, the loaders' world size (TP x PP) and fp16/bf16 from those args, then validate_args(); last the
fields the loaders' ensure_required_arguments() insists on. Nothing is re-implemented: the args pass
through Megatron-LM's own functions, so the result is theirs.

Prints one line per checkpoint, `ok DIR: ...` or `FAIL DIR: <exception> at <file:line>`, and exits 1
when any failed (2: no checkout). Adjustments for a CPU machine, none of which touches the args:
- CUDA_DEVICE_MAX_CONNECTIONS=1 (validate_args demands it for TP > 1 on GPUs before Blackwell; the
  real runs set it) and RANK=0, WORLD_SIZE=1, LOCAL_RANK=0 where unset;
- validate_args asks the GPU's architecture for TP > 1 (get_device_arch_version): answered 9, the
  H200s the real checkpoints were trained on, as there is no GPU here;
- Python 3.11: typing.override (3.12) is given as the no-op decorator PEP 698 specifies;
- Megatron-LM imports triton at module level; it must be importable (e.g. a triton wheel installed
  with pip --target DIR and DIR on PYTHONPATH; it is not used on this path).
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback
import typing
from pathlib import Path

# The command line of Megatron-LM's checkpoint loaders (tools/checkpoint/loader_base.py build_sys_argv), which
# reads every model argument from the checkpoint.
LOADER_ARGV = ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
               "--use-cpu-initialization", "--micro-batch-size", "1", "--no-load-optim", "--no-load-rng",
               "--no-save-optim", "--no-save-rng", "--no-initialization", "--mock-data",
               "--exit-on-missing-checkpoint", "--use-mp-args-from-checkpoint-args", "--no-one-logger")
# Fields tools/checkpoint/loader_base.py ensure_required_arguments() exits without (those given no default there).
LOADER_REQUIRED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
                   "seq_length", "num_attention_heads", "max_position_embeddings", "position_embedding_type",
                   "tokenizer_type", "iteration", "bert_binary_head", "params_dtype")
GPU_ARCH_OF_THE_REAL_RUNS = 9  # NVIDIA H200 (Hopper), see shared/real-checkpoints/*/CASE.md


def prepare_python(checkout: Path) -> None:
    for name, value in (("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    if not hasattr(typing, "override"):
        def override(method):
            method.__override__ = True
            return method
        typing.override = override
    sys.path.insert(0, str(checkout))  # before any installed megatron-core: the checkout's own code


def checkout_commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%H %cs"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown commit (not a git checkout)"


def megatron_frame(exc: BaseException) -> str:
    """file:line of the innermost frame inside Megatron-LM, where the refusal happened."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron" in f.filename or "tools" in f.filename]
    f = (frames or traceback.extract_tb(exc.__traceback__))[-1]
    return f"{f.filename}:{f.lineno}"


def check_one(ckpt: Path) -> str:
    """Megatron-LM's parse -> load_args_from_checkpoint -> validate_args on ckpt; raises where Megatron-LM refuses."""
    import megatron.training.arguments as mlm_arguments  # lazy: only importable once the checkout is on sys.path
    from megatron.training.checkpointing import load_args_from_checkpoint
    mlm_arguments.get_device_arch_version = lambda: GPU_ARCH_OF_THE_REAL_RUNS
    sys.argv = ["mlm_args_check", *LOADER_ARGV, "--load", str(ckpt)]
    margs = mlm_arguments.parse_args()
    margs, checkpoint_args = load_args_from_checkpoint(margs)
    margs.world_size = margs.tensor_model_parallel_size * margs.pipeline_model_parallel_size
    margs.fp16, margs.bf16 = checkpoint_args.fp16, checkpoint_args.bf16
    margs = mlm_arguments.validate_args(margs) or margs
    absent = [name for name in LOADER_REQUIRED if getattr(margs, name, None) is None]
    if absent:
        raise AssertionError(f"tools/checkpoint's loader would exit: the checkpoint does not specify {absent}")
    return (f"seq_length {margs.seq_length}, max_position_embeddings {margs.max_position_embeddings}, "
            f"tokenizer_type {margs.tokenizer_type}, vocab_size {getattr(checkpoint_args, 'vocab_size', None)}, "
            f"padded_vocab_size {margs.padded_vocab_size}, params_dtype {margs.params_dtype}")


def main(argv) -> int:
    checkout = os.environ.get("MEGATRON_LM")
    if not checkout or not (Path(checkout) / "megatron" / "training" / "arguments.py").is_file() or not argv:
        print("usage: MEGATRON_LM=<Megatron-LM checkout> mlm_args_check.py CKPT_DIR [CKPT_DIR ...]", file=sys.stderr)
        return 2
    prepare_python(Path(checkout))
    print(f"Megatron-LM {checkout_commit(Path(checkout))} at {checkout}")
    failed = 0
    for ckpt in map(Path, argv):
        try:
            print(f"ok {ckpt}: {check_one(ckpt)}", flush=True)
        except (Exception, SystemExit) as exc:  # Megatron-LM refuses with asserts, ValueErrors and sys.exit
            failed += 1
            print(f"FAIL {ckpt}: {type(exc).__name__}: {exc} at {megatron_frame(exc)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
