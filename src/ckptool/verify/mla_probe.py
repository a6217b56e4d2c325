"""Which file of an MLA layer's attention is wrong at tensor parallelism: a probe run after the parallel
forward diverged in that layer.

Under TP every rank file of a stage holds a slice of each MLA linear (verify/parallel.py), so the per-layer
comparison can only name the stage's files. Rank 0 therefore runs the reference's attention of the diverging
layer on the reference's input and hands every value in it to the ranks of that stage: the layer input x,
the normed h, the raw and normed latents, every head's context. Each rank applies its own file's tensors to
those reference values, one tensor at a time (its attention norm to x, its row block of each down projection
to h, its latent-norm copies to the raw latents, its heads of the up projections to the normed latents, its
columns of the output projection to its heads' context), so a wrong tensor shows in its own piece only. Rank 0
computes the same pieces from the reference's weights cut at the target's TP and names each piece that
differs with its file.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import GPTConfig
from ..lazy import load_scope
from ..state import Checkpoint
from .maths import ONE_PROCESS, mla_context, mla_latents, norm, rms_norm, rope_frequencies
from .parallel import Ranks

# piece (megatron-core's module) -> (the tensor's key in maths' names tables: ONE_PROCESS.names gives the
# reference's canonical name, Ranks.names a rank file's; what it is applied to; how TP cuts it: "rows"
# (column-parallel), "cols" (row-parallel) or None (replicated))
PIECES = {
    "input_layernorm": ("attn_norm", "x", None),
    "linear_q_down_proj": ("q_down", "h", "rows"),
    "q_layernorm": ("q_down_norm", "q_latent", None),
    "linear_q_up_proj": ("q_up", "q_normed", "rows"),
    "linear_kv_down_proj": ("kv_down", "h", "rows"),
    "kv_layernorm": ("kv_down_norm", "kv_latent", None),
    "linear_kv_up_proj": ("kv_up", "kv_normed", "rows"),
    "linear_proj": ("mla_out", "context", "cols"),
}


def reference_values(ref_ckpt: Checkpoint, i: int, x: torch.Tensor, dtype, device):
    """(the values of layer i's reference attention on input x, the reference's weights of the layer)."""
    cfg, p = ref_ckpt.config, f"layers.{i}."
    with load_scope():
        w = {k: v.load().to(device=device, dtype=dtype) for k, v in ref_ckpt.layer_tensors(i).items()}
    x = x.to(device=device, dtype=dtype)
    rope = rope_frequencies(cfg, x.shape[1], device)
    h = norm(x, w[p + "attn_norm.weight"], w.get(p + "attn_norm.bias"), cfg)
    latents = mla_latents(h, w, p, cfg, ONE_PROCESS)
    vals = {"x": x, "h": h, "context": mla_context(h, w, p, cfg, rope, ONE_PROCESS, latents), **latents}
    del vals["k_rope"]  # no piece is applied to it: the kv up projection takes the kv latent only
    return vals, w


def _apply(piece: str, weight: torch.Tensor, vals, cfg: GPTConfig, tp: int, t: int, whole: bool) -> torch.Tensor:
    """piece's output from weight (the whole reference tensor when `whole`, else a rank's own slice)."""
    _, on, cut = PIECES[piece]
    x = vals[on]
    if piece == "input_layernorm":
        return norm(x, weight, None, cfg)
    if piece in ("q_layernorm", "kv_layernorm"):
        return rms_norm(x, weight, cfg.mla.latent_norm_eps)
    if whole and cut == "rows":
        weight = weight.chunk(tp, 0)[t]
    if cut == "cols":
        x = x.chunk(tp, -1)[t]  # this rank's heads' context
        if whole:
            weight = weight.chunk(tp, 1)[t]
    return F.linear(x, weight)


def rank_pieces(vals, w, i: int, cfg: GPTConfig, tp: int, t: int) -> Dict[str, torch.Tensor]:
    p = f"layers.{i}."
    return {piece: _apply(piece, w[p + Ranks.names[key]], vals, cfg, tp, t, False).float()
            for piece, (key, on, _) in PIECES.items() if on in vals and p + Ranks.names[key] in w}


def probe(layer: int, vals, shards, w_loader, r, dtype, stage_of_layer: int):
    """Collective: every rank takes part; rank 0 passes the reference values. Returns on rank 0
    {(tp_rank, ep_rank): pieces} of the layer's stage, None elsewhere."""
    box = [{k: v.cpu() for k, v in vals.items()} if vals is not None else None]
    dist.broadcast_object_list(box, src=0)
    mine = None
    if r.pp_rank == stage_of_layer:
        here = {k: v.to(device=r.device, dtype=dtype) for k, v in box[0].items()}
        mine = {k: v.cpu() for k, v in rank_pieces(here, w_loader(), layer, shards.config, r.tp, r.tp_rank).items()}
    got: List = [None] * r.world if r.rank == 0 else None
    dist.gather_object(((r.tp_rank, r.ep_rank), mine), got, dst=0)
    if r.rank != 0:
        return None
    return {rk: pieces for rk, pieces in got if pieces is not None}


def diagnose(layer: int, got: Dict[Tuple[int, int], Dict[str, torch.Tensor]], vals, ref_w, cfg: GPTConfig,
             tp: int, tolerance: float, file_of) -> str:
    """One line naming the attention tensors of `layer` that differ from the reference's, with their files."""
    p, bad = f"layers.{layer}.", []
    for (t, e), pieces in sorted(got.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for piece, value in pieces.items():
            ref = _apply(piece, ref_w[p + ONE_PROCESS.names[PIECES[piece][0]]], vals, cfg, tp, t, True).float().to(value.device)
            scale = max(ref.abs().max().item(), 1e-6)
            diff = (value - ref).abs().max().item()
            if diff / scale > tolerance:
                held = file_of(t, e) or f"TP rank {t}'s slice"  # torch_dist: global tensors, no rank files
                bad.append(f"{piece} in {held} (relative diff {diff / scale:.3g})")
    if not bad:
        return "its attention tensors compute what the reference's do on the reference's values"
    return "attention tensors that differ from the reference's on the reference's values: " + "; ".join(bad)
