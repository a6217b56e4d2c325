"""`ckptool verify`: run a checkpoint and compare its logits with a reference.

This module parses the options and prints the report as it comes; the API (api.verify) checks them and
the verify package runs the check (verify/run.py): under torchrun the parallel forward, every rank on its own
shard (verify/parallel.py), else the merged target in one process. `--files DST` checks that DST's files
are whole instead (a manifest, or the format's own CRCs and sizes: integrity.py).
"""
from __future__ import annotations

import sys

import click

from ..errors import EXIT
from ..options import CHOICES
from .common import reports_errors, source_options, warn
from ..distributed import fail_as_team, torchrun_rank


@click.command("verify")
@click.argument("target", required=False)
@click.option("--reference", "ref", default=None,
              help="Checkpoint to compare with (any format ckptool reads, or a Hugging Face model dir). "
                   "Default: the target's own merged state, run in one process.")
@click.option("--reference-logits", default=None, metavar="FILE[:KEY]",
              help="A .pt/.safetensors with `tokens` [B,S] and logits [B,S,V] under KEY (default `logits`) "
                   "recorded from the training framework; verify runs those tokens.")
@click.option("--files", "files_dir", default=None, metavar="DST",
              help="Instead: check a ckptool output directory against its manifest.")
@click.option("--tokens", default=None, help='Token ids "1,2,3;4,5,6", a file of them, or a text file with --tokenizer.')
@click.option("--tokenizer", default=None, metavar="DIR", help="Tokenizer directory for a text --tokens file.")
@click.option("--batch", type=int, default=2, show_default=True, help="Rows of random tokens.")
@click.option("--seq-len", type=int, default=None,
              help="Length of random token rows [default: 16, or past the model's sliding window: the longer of 16 "
                   "past it and twice it plus 8].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random tokens.")
@click.option("--dtype", type=click.Choice(sorted(CHOICES["compute_dtype"])), default="fp32", show_default=True,
              help="Compute dtype for both forwards.")
@click.option("--tolerance", type=float, default=None,
              help="Largest max-abs logits error that passes (default in fp32 1e-4 or 2e-4 of the reference logits' "
                   "largest |value|; in fp16/bf16 2e-2/1e-1 or 3x the reference's own 16-bit error against its "
                   "fp32 run; whichever is larger); also the relative bound for per-layer hidden states "
                   "(by default 1e-4 in fp32).")
@click.option("--tp", type=int, default=None,
              help="torch_dist targets under torchrun: tensor-parallel size to run (any works: the files hold "
                   "global tensors). Default: the stored args' TP/PP/VPP, else TP = WORLD_SIZE, PP 1; with only one "
                   "of --tp/--pp the other fills WORLD_SIZE. Torch-format targets run at their files' layout.")
@click.option("--pp", type=int, default=None, help="torch_dist targets under torchrun: pipeline-parallel size (see --tp).")
@click.option("--vpp", type=int, default=None,
              help="torch_dist targets under torchrun: virtual pipeline chunks per stage (interleaved "
                   "schedule; needs --pp > 1 and layers divisible by PP x VPP). Torch-format targets run "
                   "the chunks their files hold.")
@source_options
@reports_errors
def verify_cmd(target, ref, reference_logits, files_dir, tokens, tokenizer, batch, seq_len, seed, dtype,
               tolerance, tp, pp, vpp, **kw):
    """Check that TARGET computes what the reference computes (exit status 1 when it does not).

    Under torchrun, TARGET is a Megatron checkpoint (torch format, VPP included, or torch_dist) or a
    DeepSpeed save (Megatron-DeepSpeed pipeline files, ZeRO runs of Megatron models with TP), and
    WORLD_SIZE must be TP * PP of the layout it runs at (for MoE checkpoints saved with expert
    parallelism, mp_rank_TT[_PPP]_EEE: PP x TP x EP, or PP x lcm(TP, ETP x EP) at an expert TP ETP
    other than TP); each rank reads only its own shard.

    \b
    Examples:
      torchrun --nproc-per-node 4 -m ckptool verify ckpts/run1                # TP2 PP2 vs merged
      torchrun --nproc-per-node 4 -m ckptool verify out --reference ckpts/run1
      torchrun --nproc-per-node 4 -m ckptool verify ckpts/run1 --reference-logits ref.pt:logits_fp32
      torchrun --nproc-per-node 4 -m ckptool verify moe_tp2ep2 --reference hf_dir  # MoE at TP2 EP2
      torchrun --nproc-per-node 2 -m ckptool verify moe_tp2ep2etp1            # ... expert TP 1: 2 files
      torchrun --nproc-per-node 2 -m ckptool verify dist_ckpt --tp 1 --pp 2  # torch_dist at TP1 PP2
      torchrun --nproc-per-node 2 -m ckptool verify dist_ckpt --pp 2 --vpp 2  # ... interleaved
      ckptool verify out --reference hf_model_dir                             # one process
      ckptool verify --files out                                              # manifest check
      ckptool verify --files ckpts/run1                                       # CRCs, sizes, rank files
    """
    from ..api import verify  # here, not at the top: the API imports torch, `ckptool --help` should not
    result = verify(target, reference=ref, reference_logits=reference_logits, files=files_dir or None,
                    tokens=tokens, tokenizer=tokenizer, batch=batch, seq_len=seq_len, seed=seed, dtype=dtype,
                    tolerance=tolerance, tp=tp, pp=pp, vpp=vpp, quiet=True, on_line=click.echo, warn=warn, **kw)
    if not result.ok:
        if torchrun_rank() is not None:  # rank 0 printed the report: it exits first, every rank with status 1
            fail_as_team("result=FAIL (see the report above)", EXIT["mismatch"], 0, lambda line: None, agreed=True)
        sys.exit(EXIT["mismatch"])
