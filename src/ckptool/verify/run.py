"""verify from start to verdict: run the target, run (or read) the reference, compare, report.

Under torchrun (WORLD_SIZE = TP * PP of the target; with expert parallelism see parallel.py) every rank loads
its own shard and the model runs tensor-, pipeline- (and expert-) parallel as the framework ran it
(parallel.py); rank 0 compares and reports. Without torchrun the merged target runs in one process
(reference.py). Nothing here prints: each report line goes to `say` as it comes (and into Outcome.lines), each
warning about how a checkpoint was read to `warn`; the CLI and the API decide what to show.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import require
from ..formats.registry import open_checkpoint
from . import compare as cmp
from . import hints, inputs, parallel
from .probes import RankRun, mla_at_tp, probe_mla_layer, probe_moe_layer
from .request import Request
from .targets import ParallelTarget, parallel_target, stage_ranks, where_held

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Say = Callable[[str], None]


@dataclass
class Outcome:
    """verify's verdict (ok: result=PASS), the report lines (rank 0's under torchrun) and the numbers
    (the comparison's Report; None for a manifest check and on ranks other than 0)."""
    ok: bool
    lines: List[str]
    report: Optional[cmp.Report] = None


class Lines:
    """The report as it is written: each line kept and passed to `say`."""

    def __init__(self, say: Optional[Say], warn: Say):
        self.lines: List[str] = []
        self.say, self.warn = say, warn

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self.say is not None:
            self.say(line)

    def warnings_of(self, ckpt) -> None:
        for message in ckpt.warnings:
            self.warn(message)


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def verify(req: Request, say: Optional[Say], warn: Say) -> Outcome:
    """Run the check: the parallel forward under torchrun, else the one-process one. The request was checked
    by its maker (api.verify: request.check_request, torch-free, before this module was imported)."""
    out = Lines(say, warn)
    ok, report = (run_parallel if under_torchrun() else run_single)(req, out)
    return Outcome(bool(ok), out.lines, report)


# --- the pieces both forwards use -----------------------------------------------------------------

def _tokens_for(req: Request, cfg):
    if req.reference_logits:
        return inputs.load_reference_logits(req.reference_logits)
    tokens, tokenizer, batch, seq_len, seed = req.token_args
    return inputs.make_tokens(tokens, tokenizer, batch, inputs.default_seq_len(seq_len, cfg), seed,
                              vocab=cfg.true_or_padded_vocab), None


def _reference(req: Request, recorded, target_ckpt, tokens, dtype, device, out: Lines, held=None, hidden=True):
    """(logits, hidden or None, true vocab or None) of whatever the target is compared with (held: see
    inputs.hf_forward; hidden=False: an HF reference leaves its hidden states out)."""
    if recorded is not None:
        return recorded, None, None
    if req.reference is None:
        return inputs.checkpoint_forward(target_ckpt, tokens, dtype, device)
    if inputs.is_hf_dir(req.reference):
        return inputs.hf_forward(req.reference, tokens, dtype, device, held, hidden)
    ckpt = open_checkpoint(req.reference, req.opts)
    out.warnings_of(ckpt)
    return inputs.checkpoint_forward(ckpt, tokens, dtype, device)


def _tolerance(given, dtype, ref_logits, cols, recorded, reference_in, device="cpu"):
    """(tolerance, noise floor or None, per-layer relative bound or None: relative_tolerance(tolerance)).
    --tolerance wins. Otherwise the dtype's default, and in 16-bit compute also NOISE_MARGIN x the
    reference's own 16-bit error (the reference run again in fp32): rounding error grows with depth and
    logit scale, so a fixed bound that suits a 4-layer model fails an exact conversion of a 1B one, while a
    wrong tensor moves logits by far more. In fp32 the bound grows with the logits' scale
    (compare.FP32_RELATIVE), the per-layer bound staying the fixed default."""
    if given is not None:
        return given, None, None
    base = cmp.DEFAULT_TOLERANCE[dtype]
    if recorded is not None:
        return base, None, None
    if dtype == torch.float32:
        return max(base, cmp.FP32_RELATIVE * cmp.max_abs(ref_logits, cols, device)), None, base
    floor = cmp.max_abs_error(ref_logits, reference_in(torch.float32), cols, device)
    return max(base, cmp.NOISE_MARGIN * floor), floor, None


def _compare(req: Request, ckpt, tokens, recorded, logits, hidden, device, out: Lines, timed: bool = False,
             held: Optional[dict] = None):
    """(the comparison's Report, the tolerance it used, the reference's hidden states) of the target's logits
    and hidden states with the reference's; timed: say reference_seconds= and compare_seconds= (the
    parallel report, beside its forward_seconds=); held: {"preload": inputs.Preload} when the reference was
    made ready while the target ran."""
    cfg, dtype = ckpt.config, COMPUTE_DTYPES[req.dtype]
    start = time.perf_counter()
    held = {} if held is None else held  # a transformers reference is loaded once for both its forwards
    ref_logits, ref_hidden, ref_vocab = _reference(req, recorded, ckpt, tokens, dtype, device, out, held)
    out.warnings_of(ckpt)  # replica checks happen as tensors load, so only now are they all known
    cols = cmp.true_columns(logits.shape[-1], cfg.vocab_size, ref_logits.shape[-1], ref_vocab)
    tol, floor, relative = _tolerance(req.tolerance, dtype, ref_logits, cols, recorded,
                                      lambda dt: _reference(req, recorded, ckpt, tokens, dt, device, out, held,
                                                            hidden=False)[0],
                                      device)
    held.clear()
    if timed:
        out(f"reference_seconds={time.perf_counter() - start:.4f}")
    start = time.perf_counter()
    report = cmp.compare(logits, ref_logits, cols, tol, hidden, ref_hidden, noise_floor=floor, device=device,
                         relative=relative)
    if timed:
        out(f"compare_seconds={time.perf_counter() - start:.4f}")
    report.hints += hints.weights_hint(ckpt, req.reference is None and recorded is None)
    return report, tol, ref_hidden


def _write(report: cmp.Report, out: Lines, where=None) -> bool:
    for line in report.lines(where):
        out(line)
    return report.ok


# --- one process ------------------------------------------------------------------------------------

def run_single(req: Request, out: Lines) -> Tuple[bool, cmp.Report]:
    # transformers imported beside the target's forward; the weights load after it (both forwards run on
    # these same cores, and the target's forward holds one layer at a time)
    preload = _preload(req)
    try:
        ckpt = open_checkpoint(req.target, req.opts)
        tokens, recorded = _tokens_for(req, ckpt.config)
        logits, hidden, _ = inputs.checkpoint_forward(ckpt, tokens, COMPUTE_DTYPES[req.dtype])
        report, _, _ = _compare(req, ckpt, tokens, recorded, logits, hidden, "cpu", out, held=_held(preload))
    finally:
        if preload is not None:
            preload.cancel()
    ok = _write(report, out)
    layout = ckpt.source.layout
    n = layout.pp * stage_ranks(layout)
    if n > 1:
        out(f"note: this ran the merged target in one process; for the {layout.describe()} "
            f"parallel forward run: torchrun --nproc-per-node {n} -m ckptool verify {req.target} ...")
    return ok, report


# --- under torchrun ---------------------------------------------------------------------------------

def _preload(req: Request) -> Optional[inputs.Preload]:
    """An HF-directory reference made ready on a thread from the start (inputs.Preload), on the process that
    computes the reference (rank 0 under torchrun); None otherwise."""
    if req.reference_logits or os.environ.get("RANK", "0") != "0":
        return None
    return inputs.preload(req.reference, COMPUTE_DTYPES[req.dtype])


def _held(preload: Optional[inputs.Preload]) -> dict:
    return {} if preload is None else {"preload": preload}


def run_parallel(req: Request, out: Lines) -> Tuple[bool, Optional[cmp.Report]]:
    preload = _preload(req)
    try:
        return _run_parallel(req, out, preload)
    finally:
        if preload is not None:
            preload.cancel()  # a verify stopped early: nothing more is loaded


def _run_parallel(req: Request, out: Lines, preload) -> Tuple[bool, Optional[cmp.Report]]:
    world = int(os.environ["WORLD_SIZE"])
    tgt = parallel_target(req.target, req.opts, req.tp, req.pp, world, req.vpp)
    layout = tgt.layout
    need = layout.pp * stage_ranks(layout)
    require(world == need,
            f"torchrun started {world} processes but {req.target} is {layout.describe()}: it needs {need}",
            f"run torchrun --nproc-per-node {need} -m ckptool verify ..."
            + (" (or give --tp/--pp whose product is the process count)" if tgt.any_layout else ""))
    tokens, recorded = _tokens_for(req, tgt.config)
    r = parallel.init_ranks(layout.tp, layout.pp, layout.ep, layout.expert_tp)
    if preload is not None:
        preload.load_on(r.device)  # onto rank 0's GPU while the target is read and run
    finished = False
    try:
        result = _run_ranks(req, out, tgt, tokens, recorded, r, _held(preload))
        finished = True
        return result
    finally:
        # After an error on one rank the others wait in a collective: tearing the group down would wait
        # with them (NCCL), so a failing rank just exits and torchrun stops the rest.
        if r.owns_group and finished:
            dist.destroy_process_group()


def _run_ranks(req: Request, out: Lines, tgt: ParallelTarget, tokens, recorded, r,
               held: dict) -> Tuple[bool, Optional[cmp.Report]]:
    """Every rank: its stage's forward, the gather to rank 0, the probes of a diverging layer; rank 0 compares
    and reports; every rank returns rank 0's verdict."""
    cfg, layout, dtype = tgt.config, tgt.layout, COMPUTE_DTYPES[req.dtype]
    shards = tgt.rank_shards(r.tp_rank, r.pp_rank, r.ep_rank)
    start = time.perf_counter()
    with torch.no_grad():
        logits, hidden = parallel.stage_forward(tokens, shards, r, dtype)
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)
    seconds = time.perf_counter() - start
    got = parallel.gather_to_rank0(logits, hidden, shards, r, tuple(tokens.shape))
    ok, report, where, layer_probe, tol = True, None, None, None, req.tolerance
    if r.rank == 0:
        out(f"parallel forward: {layout.describe()}, {r.world} processes, {dtype}, "
            f"tokens {tuple(tokens.shape)}, {tgt.format} target")
        out(f"forward_seconds={seconds:.4f}")
        report, tol, ref_hidden = _compare(req, tgt.ckpt, tokens, recorded, *got, r.device, out, timed=True,
                                           held=held)
        where = where_held(layout, cfg, tgt.files)
        if (cfg.moe is not None or mla_at_tp(cfg, layout)) and report.first_divergence:
            layer_probe = (_reference_weights(req, recorded, tgt.ckpt), ref_hidden)
    run = RankRun(shards, layout, r, dtype, tgt.files)
    if cfg.moe is not None:  # every rank knows: all take part in the probe of a diverging MoE layer
        probe_moe_layer(layer_probe, report, where, run, tol)
    if mla_at_tp(cfg, layout):  # and of a diverging MLA layer's attention, whose tensors every TP file slices
        probe_mla_layer(layer_probe, report, where, run, tol)
    if r.rank == 0:
        ok = _write(report, out, where)
    status = torch.tensor([1 if ok else 0], dtype=torch.int32, device=r.device)
    dist.broadcast(status, src=0)
    return bool(status.item()), report


def _reference_weights(req: Request, recorded, target_ckpt):
    """The reference as canonical weights (for probing a layer), or None for recorded logits."""
    if recorded is not None:
        return None
    if req.reference is None:
        return target_ckpt
    return open_checkpoint(req.reference, req.opts)
