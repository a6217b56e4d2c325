"""Which file of an MoE layer is wrong: a probe run after the parallel forward diverged in that layer.

The per-layer comparison says where the target and the reference part ways, but an MoE layer's
weights are spread over every (TP, EP) rank file of its stage. So rank 0 takes the reference's input
to the diverging layer, runs the reference's attention and norm on it, and hands the result h (the
MoE block's input) to every rank of that stage. Each rank runs on h, with the tensors of its own
file: its router copy, its TP share of each of its experts (no routing: every expert on every
token) and of the shared expert. Rank 0 computes the same pieces from the reference's weights, cut at
the target's TP, and names each piece that differs with the file that holds it. The attention and
norms are not probed: when every MoE piece agrees, the difference is in them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import GPTConfig
from ..lazy import load_scope
from ..state import Checkpoint
from .maths import ONE_PROCESS, attention_part, mlp_partial, rope_frequencies
from .parallel import Ranks


def diverging_layer(first_divergence: Optional[str], ref_ckpt: Optional[Checkpoint],
                    ref_hidden: Optional[Dict[str, torch.Tensor]]) -> int:
    """The first diverging layer when it is one and the reference has weights and that layer's input, else -1:
    the layer a probe (this module's for experts, mla_probe's for attention) can apply the reference's values to."""
    if not first_divergence or not first_divergence.startswith("layer ") or ref_ckpt is None or not ref_hidden:
        return -1
    try:
        i = int(first_divergence.split()[1])
    except (IndexError, ValueError):
        return -1
    return i if ("embedding" if i == 0 else f"layer {i - 1}") in ref_hidden else -1


def probe_layer(first_divergence: Optional[str], cfg: GPTConfig, ref_ckpt: Optional[Checkpoint],
                ref_hidden: Optional[Dict[str, torch.Tensor]]) -> int:
    """The MoE layer to probe (diverging_layer, when it is an MoE layer), else -1."""
    i = diverging_layer(first_divergence, ref_ckpt, ref_hidden)
    return i if i >= 0 and cfg.is_moe_layer(i) else -1


def moe_input(ref_ckpt: Checkpoint, i: int, x: torch.Tensor, dtype, device) -> torch.Tensor:
    """The reference's input to layer i's MoE block (after its attention and mlp_norm), flat [tokens, h]."""
    cfg = ref_ckpt.config
    with load_scope():
        w = {k: v.load().to(device=device, dtype=dtype) for k, v in ref_ckpt.layer_tensors(i).items()}
    x = x.to(device=device, dtype=dtype)
    rope = rope_frequencies(cfg, x.shape[1], device) if cfg.position_embedding == "rope" else None
    _, h = attention_part(x, w, i, cfg, rope, ONE_PROCESS)
    return h.reshape(-1, h.shape[-1])


def rank_pieces(h: torch.Tensor, w, i: int, cfg: GPTConfig, r: Ranks, experts: range) -> Dict[str, torch.Tensor]:
    """This rank's MoE pieces of layer i on h: router logits, each of its experts' expert-TP partial
    output, the shared expert's TP partial (and its gate logits)."""
    p = f"layers.{i}."
    out = {"router": F.linear(h, w[p + "router.weight"], w.get(p + "router.bias")).float()}
    for e in experts:
        out[f"expert {e}"] = r.expert_out(h, w, f"{p}experts.{e}.", cfg).float()
    if cfg.moe.shared_ffn_hidden_size:
        out["shared expert"] = mlp_partial(h, w, p + "shared.", cfg, r, r.tp_rank == 0).float()  # a TP-partial MLP
        if cfg.moe.shared_gate:
            out["shared expert gate"] = F.linear(h, w[p + "shared_gate.weight"]).float()
    return out


def reference_mlp_weights(ref_ckpt: Checkpoint, i: int, dtype, device) -> Dict[str, torch.Tensor]:
    p = f"layers.{i}.mlp."
    with load_scope():
        return {k: v.load().to(device=device, dtype=dtype) for k, v in ref_ckpt.layer_tensors(i).items()
                if k.startswith(p)}


def reference_pieces(cfg: GPTConfig, w: Dict[str, torch.Tensor], i: int, h: torch.Tensor, layout, tp_rank: int,
                     experts: range) -> Dict[str, torch.Tensor]:
    """The same pieces from the reference's merged weights w as file tp_rank of `layout` holds them: each
    routed expert cut to expert-TP rank tp_rank % ETP of ETP, the shared expert to TP rank tp_rank."""
    p = f"layers.{i}.mlp."
    out = {"router": F.linear(h, w[p + "router.weight"], w.get(p + "router.bias")).float()}
    etp = layout.expert_tp
    scopes = [(f"expert {e}", f"{p}experts.{e}.", etp, tp_rank % etp) for e in experts]
    if cfg.moe.shared_ffn_hidden_size:
        scopes.append(("shared expert", p + "shared.", layout.tp, tp_rank))
        if cfg.moe.shared_gate:
            out["shared expert gate"] = F.linear(h, w[p + "shared_gate.weight"]).float()
    for name, q, size, t in scopes:
        out[name] = _tp_share(h, w, q, cfg, size, t).float()
    return out


def _tp_share(h, w, q: str, cfg: GPTConfig, tp: int, t: int) -> torch.Tensor:
    """Rank t of tp's partial output of the MLP whose canonical tensors are q + {gate,up,down}.*: its block
    of the intermediate features (rows of gate/up, columns of down); the down bias on rank 0 only."""
    cut = {q + n: w[q + n].chunk(tp, 0)[t] for n in ("gate.weight", "gate.bias", "up.weight", "up.bias") if q + n in w}
    cut[q + "down.weight"] = w[q + "down.weight"].chunk(tp, 1)[t]
    if q + "down.bias" in w:
        cut[q + "down.bias"] = w[q + "down.bias"]
    return mlp_partial(h, cut, q, cfg, ONE_PROCESS, t == 0)


def probe(layer: int, h: Optional[torch.Tensor], shards, w_loader, r: Ranks, dtype, stage_of_layer: int):
    """Collective: every rank takes part. Rank 0 passes h; the ranks of the layer's stage compute their
    pieces; returns on rank 0 {(tp_rank, ep_rank): pieces}, None elsewhere."""
    box = [h.cpu() if h is not None else None]
    dist.broadcast_object_list(box, src=0)
    mine = None
    if r.pp_rank == stage_of_layer:
        w = w_loader()
        mine = rank_pieces(box[0].to(device=r.device, dtype=dtype), w, layer, shards.config, r, shards.experts)
        mine = {k: v.cpu() for k, v in mine.items()}
    got: List = [None] * r.world if r.rank == 0 else None
    dist.gather_object(((r.tp_rank, r.ep_rank), mine), got, dst=0)
    if r.rank != 0:
        return None
    return {rk: pieces for rk, pieces in got if pieces is not None}


def diagnose(layer: int, got: Dict[Tuple[int, int], Dict[str, torch.Tensor]], ref_ckpt: Checkpoint, h: torch.Tensor,
             layout, dtype, tolerance: float, file_of) -> str:
    """One line naming the MoE pieces of `layer` that differ from the reference's and their files."""
    bad: List[str] = []
    w = reference_mlp_weights(ref_ckpt, layer, dtype, h.device)
    for (t, e), pieces in sorted(got.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        experts = [int(k.split()[1]) for k in pieces if k.startswith("expert ")]
        want = reference_pieces(ref_ckpt.config, w, layer, h, layout, t, range(min(experts), max(experts) + 1)
                                if experts else range(0))
        for name, value in pieces.items():
            ref = want[name].to(value.device)  # pieces come back from every rank on the CPU
            scale = max(ref.abs().max().item(), 1e-6)
            diff = (value - ref).abs().max().item()
            if diff / scale > tolerance:
                local = f", local expert {int(name.split()[1]) - min(experts)}" if name.startswith("expert ") else ""
                bad.append(f"{name} in {file_of(t, e)}{local} (relative diff {diff / scale:.3g})")
    if not bad:
        shared = any("shared expert" in pieces for pieces in got.values())
        probed = "router, experts and shared expert" if shared else "router and experts"
        return (f"its {probed} compute what the reference's do on the reference's input: the difference is in "
                "its attention or norms")
    return "MoE pieces that differ from the reference's on the reference's input: " + "; ".join(bad)
