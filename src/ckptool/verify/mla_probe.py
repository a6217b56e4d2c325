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
from . import reference as ref_fwd

# piece -> (megatron-core module, canonical tensor of the reference, rank-shard role, what it is applied to,
#           how TP cuts it: "rows" (column-parallel), "cols" (row-parallel) or None (replicated))
PIECES = {
    "input_layernorm": ("attn_norm.weight", "attn_norm.weight", "x", None),
    "linear_q_down_proj": ("attn.q_down.weight", "mla.q_down.weight", "h", "rows"),
    "q_layernorm": ("attn.q_down_norm.weight", "mla.q_down_norm.weight", "q_latent", None),
    "linear_q_up_proj": ("attn.q_up.weight", "mla.q_up.weight", "q_normed", "rows"),
    "linear_kv_down_proj": ("attn.kv_down.weight", "mla.kv_down.weight", "h", "rows"),
    "kv_layernorm": ("attn.kv_down_norm.weight", "mla.kv_down_norm.weight", "kv_latent", None),
    "linear_kv_up_proj": ("attn.kv_up.weight", "mla.kv_up.weight", "kv_normed", "rows"),
    "linear_proj": ("attn.out.weight", "proj.weight", "context", "cols"),
}


def reference_values(ref_ckpt: Checkpoint, i: int, x: torch.Tensor, dtype, device):
    """(the values of layer i's reference attention on input x, the reference's weights of the layer)."""
    cfg, p = ref_ckpt.config, f"layers.{i}."
    with load_scope():
        w = {k: v.load().to(device=device, dtype=dtype) for k, v in ref_ckpt.layer_tensors(i).items()}
    m, x = cfg.mla, x.to(device=device, dtype=dtype)
    rope = ref_fwd.rope_frequencies(cfg, x.shape[1], device)
    h = ref_fwd.norm(x, w[p + "attn_norm.weight"], w.get(p + "attn_norm.bias"), cfg)
    vals = {"x": x, "h": h, "context": ref_fwd.mla_context(h, w, cfg, rope, p)}
    if m.q_lora_rank:
        vals["q_latent"] = F.linear(h, w[p + "attn.q_down.weight"])
        vals["q_normed"] = ref_fwd.rms_norm(vals["q_latent"], w[p + "attn.q_down_norm.weight"], m.latent_norm_eps)
    latent = F.linear(h, w[p + "attn.kv_down.weight"])[..., : m.kv_lora_rank]
    vals["kv_latent"] = latent
    vals["kv_normed"] = ref_fwd.rms_norm(latent, w[p + "attn.kv_down_norm.weight"], m.latent_norm_eps)
    return vals, w


def _apply(piece: str, weight: torch.Tensor, vals, cfg: GPTConfig, tp: int, t: int, whole: bool) -> torch.Tensor:
    """piece's output from weight (the whole reference tensor when `whole`, else a rank's own slice)."""
    _, _, on, cut = PIECES[piece]
    x = vals[on]
    if piece == "input_layernorm":
        return ref_fwd.norm(x, weight, None, cfg)
    if piece in ("q_layernorm", "kv_layernorm"):
        return ref_fwd.rms_norm(x, weight, cfg.mla.latent_norm_eps)
    if whole and cut == "rows":
        weight = weight.chunk(tp, 0)[t]
    if cut == "cols":
        x = x.chunk(tp, -1)[t]  # this rank's heads' context
        if whole:
            weight = weight.chunk(tp, 1)[t]
    return F.linear(x, weight)


def rank_pieces(vals, w, i: int, cfg: GPTConfig, tp: int, t: int) -> Dict[str, torch.Tensor]:
    p = f"layers.{i}."
    return {piece: _apply(piece, w[p + role], vals, cfg, tp, t, False).float()
            for piece, (_, role, on, _) in PIECES.items() if on in vals and p + role in w}


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
            ref = _apply(piece, ref_w[p + PIECES[piece][0]], vals, cfg, tp, t, True).float().to(value.device)
            scale = max(ref.abs().max().item(), 1e-6)
            diff = (value - ref).abs().max().item()
            if diff / scale > tolerance:
                held = file_of(t, e) or f"TP rank {t}'s slice"  # torch_dist: global tensors, no rank files
                bad.append(f"{piece} in {held} (relative diff {diff / scale:.3g})")
    if not bad:
        return "its attention tensors compute what the reference's do on the reference's values"
    return "attention tensors that differ from the reference's on the reference's values: " + "; ".join(bad)
