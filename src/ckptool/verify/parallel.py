"""The GPT forward as Megatron runs it: tensor- and pipeline-parallel, one process per rank.

Run under torchrun with WORLD_SIZE = PP x the ranks of a stage: TP without experts; for MoE checkpoints
saved with expert parallelism lcm(TP, ETP x EP), the ranks whose files Megatron-LM writes (TP x EP when
expert TP is TP; formats/megatron.expert_grid). Stage-local rank x is what megatron-core's default order
makes of it twice over: for the dense part TP rank x % TP and data-parallel rank x // TP; for the experts
expert-TP rank x % ETP, EP rank (x // ETP) % EP and expert-data-parallel rank x // (ETP x EP). Global rank
= pp x (ranks of a stage) + x, so with ETP = TP: (pp * EP + ep) * TP + tp. Every rank computes with the
tensors of its own checkpoint file, mp_rank_{x % TP}[_PPP][_{EP rank}] (formats/megatron_ranks.py), so
replicated tensors that drifted apart in training give the same numbers here as they did there.

  embedding      vocab-parallel: each rank looks up the tokens in its row block, zeros the rest,
                 all-reduce over TP; then positions (learned) are added
  MLA            (Multi-Latent Attention) every linear column-parallel as megatron-core's local spec has
                 it: the down projections' output blocks all-gathered and the latents normed whole, the up
                 projections give the rank's heads; output projection row-parallel + all-reduce
  attention      fused QKV column-parallel (whole query groups per rank; when TP > groups every
                 rank all-gathers the grouped rows, keeps its group and then its share of the
                 query heads, as megatron-core does), core attention on the local heads,
                 output projection row-parallel + all-reduce, then the bias
  mlp            fc1 column-parallel ([gate_r; up_r] per rank for SwiGLU), fc2 row-parallel +
                 all-reduce, then the bias
  moe            (MoE layers) the data-parallel ranks of the dense part (EP ranks when ETP = TP) each run
                 their share of the batch rows; the router (replicated) picks each token's top-k
                 experts; tokens, choices and weights are all-gathered over the stage's data-parallel
                 ranks; every rank runs its own experts (its expert-TP share of each: [gate_r; up_r]
                 rows, down columns, cut at ETP) on the tokens routed to them (expert-data-parallel
                 replicas of the same experts split those tokens), weighted; the partial outputs are
                 summed over the stage's ranks and each keeps its own rows (dropless: no capacity);
                 the shared expert runs like a dense MLP at TP
  head           final norm, vocab-parallel logits, all-gathered over TP on the last stage
  pipeline       the hidden state goes stage to stage with send/recv between equal TP ranks;
                 with virtual chunks it goes round all stages once per chunk (interleaved order)

Afterwards the per-layer hidden states and the logits are sent to rank 0 for comparison.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import GPTConfig
from ..formats.megatron_ranks import RankShards
from .reference import activation, apply_rope, norm, rms_norm, route, rope_frequencies


# --- process groups -------------------------------------------------------------------------

@dataclass
class Ranks:
    rank: int
    world: int
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    tp_group: object
    device: torch.device
    owns_group: bool = True  # False when a caller joined the job first (and will leave it)
    ep: int = 1
    ep_rank: int = 0
    dp_group: object = None  # this stage's ranks of the same TP rank: the dense part's data-parallel peers
    stage_group: object = None  # this stage's ranks: the ones whose expert outputs add up
    dp: int = 1  # data-parallel ranks of the dense part per stage (each runs its share of the batch rows)
    dp_rank: int = 0
    etp: int = 1  # expert tensor parallelism
    etp_rank: int = 0
    edp: int = 1  # expert-data-parallel replicas per stage (ranks holding the same expert shard)
    edp_rank: int = 0

    def global_rank(self, tp_rank: int, pp_rank: int, dp_rank: Optional[int] = None) -> int:
        """megatron-core's default order (tp-cp-ep-dp-pp for the dense part): TP fastest, then the data-
        parallel rank (the EP rank when ETP = TP), then the stage."""
        return (pp_rank * self.dp + (self.dp_rank if dp_rank is None else dp_rank)) * self.tp + tp_rank


def ranks_per_stage(tp: int, ep: int = 1, etp: Optional[int] = None) -> int:
    """The ranks of one pipeline stage: TP, or for experts lcm(TP, ETP x EP), the period after which
    megatron-core's dense (TP rank) and expert (expert-TP rank, EP rank) coordinates of a rank repeat;
    each of these ranks has its own file (formats/megatron.expert_grid)."""
    etp = etp or tp
    return tp * ep * etp // math.gcd(tp, ep * etp)


def stage_coordinates(x: int, tp: int, ep: int, etp: int) -> Tuple[int, int, int, int, int]:
    """Stage-local rank x as megatron-core's default order reads it twice over: (TP rank, data-parallel
    rank) for the dense part and (expert-TP rank, EP rank, expert-data-parallel rank) for the experts."""
    return x % tp, x // tp, x % etp, (x // etp) % ep, x // (etp * ep)


def init_ranks(tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> Ranks:
    """Join the torchrun job (NCCL on GPUs, gloo otherwise) and build the TP (and expert) groups."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        # fp32 means fp32: TF32 matmuls would add ~1e-3 relative noise to what verify compares
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    etp = etp or tp
    per = ranks_per_stage(tp, ep, etp)
    dp = per // tp
    at = lambda t, p, d: p * per + d * tp + t  # noqa: E731  (Ranks.global_rank before a Ranks exists)
    p = rank // per
    t, d, et, e, ed = stage_coordinates(rank % per, tp, ep, etp)
    # every rank makes every group, in the same order (new_group is collective)
    tp_groups = {(pp_, d_): dist.new_group([at(t_, pp_, d_) for t_ in range(tp)]) for pp_ in range(pp) for d_ in range(dp)}
    dp_groups, stage_groups = {}, {}
    if dp > 1:
        dp_groups = {(pp_, t_): dist.new_group([at(t_, pp_, d_) for d_ in range(dp)]) for pp_ in range(pp) for t_ in range(tp)}
        stage_groups = {pp_: dist.new_group(list(range(pp_ * per, (pp_ + 1) * per))) for pp_ in range(pp)}
    return Ranks(rank, world, tp, pp, t, p, tp_groups[(p, d)], device, owns, ep, e,
                 dp_groups.get((p, t)), stage_groups.get(p, tp_groups[(p, d)]), dp, d, etp, et, per // (etp * ep), ed)


def batch_rows(batch: int, dp: int, dp_rank: int) -> range:
    """The token rows data-parallel rank dp_rank runs: its share, as in training (with experts the EP
    ranks, or the ranks of a stage beyond TP, are data-parallel ranks of the dense part); as even as
    the batch allows (a rank may get none)."""
    per, extra = divmod(batch, dp)
    start = dp_rank * per + min(dp_rank, extra)
    return range(start, start + per + (dp_rank < extra))


def all_reduce(x: torch.Tensor, r: Ranks) -> torch.Tensor:
    if r.tp > 1:
        dist.all_reduce(x, group=r.tp_group)
    return x


def all_gather_last(x: torch.Tensor, r: Ranks) -> torch.Tensor:
    if r.tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(r.tp)]
    dist.all_gather(parts, x.contiguous(), group=r.tp_group)
    return torch.cat(parts, dim=-1)


# --- the model, one rank's share ------------------------------------------------------------

def embed(tokens: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, r: Ranks) -> torch.Tensor:
    word = w["embed.word"]
    rows = word.shape[0]
    local = tokens - r.tp_rank * rows
    outside = (local < 0) | (local >= rows)
    x = F.embedding(local.masked_fill(outside, 0), word)
    x = all_reduce(x.masked_fill(outside.unsqueeze(-1), 0), r)
    if cfg.position_embedding == "learned":
        x = x + w["embed.pos"][: tokens.shape[1]]
    return x


def split_qkv(qkv: torch.Tensor, cfg: GPTConfig, r: Ranks):
    """This rank's [b, s, rows] QKV activations -> q [b, s, heads_r, hd], k and v [b, s, groups_r, hd]."""
    b, s, _ = qkv.shape
    hd, nq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    per = nq // ng
    if ng < r.tp:
        # a rank holds part of one group: gather all groups, keep ours, later our share of its heads
        ranks_per_group = r.tp // ng
        qkv = all_gather_last(qkv, r)
        size = qkv.shape[-1] // ng
        group = r.tp_rank // ranks_per_group
        qkv = qkv[..., group * size:(group + 1) * size]
        groups_r = 1
    else:
        groups_r = ng // r.tp
    qkv = qkv.reshape(b, s, groups_r, (per + 2) * hd)
    q, k, v = torch.split(qkv, [per * hd, hd, hd], dim=-1)
    q = q.reshape(b, s, groups_r * per, hd)
    if ng < r.tp:
        heads_r = nq // r.tp
        j = r.tp_rank % ranks_per_group
        q = q[:, :, j * heads_r:(j + 1) * heads_r]
    return q, k, v


def attention(x: torch.Tensor, w, p: str, cfg: GPTConfig, r: Ranks, rope) -> torch.Tensor:
    b, s, _ = x.shape
    qkv = F.linear(x, w[p + "qkv.weight"], w.get(p + "qkv.bias"))
    q, k, v = (t.transpose(1, 2) for t in split_qkv(qkv, cfg, r))  # [b, heads, s, hd]
    if cfg.qk_layernorm:
        q = norm(q, w[p + "q_norm.weight"], w.get(p + "q_norm.bias"), cfg)
        k = norm(k, w[p + "k_norm.weight"], w.get(p + "k_norm.bias"), cfg)
    if rope is not None:
        q, k = apply_rope(q, *rope, cfg), apply_rope(k, *rope, cfg)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
    ctx = (probs @ v).transpose(1, 2)
    ctx = ctx.reshape(b, s, ctx.shape[2] * ctx.shape[3])  # sizes given: a data-parallel rank may have no rows
    out = all_reduce(F.linear(ctx, w[p + "proj.weight"]), r)
    return out + w[p + "proj.bias"] if p + "proj.bias" in w else out


def mla_attention(x: torch.Tensor, w, p: str, cfg: GPTConfig, r: Ranks, rope) -> torch.Tensor:
    """megatron-core's MLASelfAttention as its local spec splits it: every MLA linear is column-parallel. Each
    rank's block of the down projections' outputs (q latent, kv latent + the shared rope key) is all-gathered
    over TP and RMS-normed whole; the up projections then give the rank's own heads, core attention runs on
    them, and the output projection is row-parallel + all-reduce. A direct q (no q latent) is the spec's
    qkv.weight role holding q rows only, column-parallel by heads."""
    m, (b, s, _) = cfg.mla, x.shape
    nope, rot, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank:
        latent = all_gather_last(F.linear(x, w[p + "mla.q_down.weight"]), r)
        q = F.linear(rms_norm(latent, w[p + "mla.q_down_norm.weight"], m.latent_norm_eps), w[p + "mla.q_up.weight"])
    else:
        q = F.linear(x, w[p + "qkv.weight"])
    heads = q.shape[-1] // (nope + rot)  # this rank's
    q_nope, q_rope = q.view(b, s, heads, nope + rot).transpose(1, 2).split([nope, rot], dim=-1)
    kv_latent, k_rope = all_gather_last(F.linear(x, w[p + "mla.kv_down.weight"]), r).split([m.kv_lora_rank, rot], -1)
    kv_latent = rms_norm(kv_latent, w[p + "mla.kv_down_norm.weight"], m.latent_norm_eps)
    kv = F.linear(kv_latent, w[p + "mla.kv_up.weight"]).view(b, s, heads, nope + vd).transpose(1, 2)
    k_nope, v = kv.split([nope, vd], dim=-1)
    q_rope = apply_rope(q_rope, *rope, cfg)
    k_rope = apply_rope(k_rope.reshape(b, 1, s, rot), *rope, cfg).expand(b, heads, s, rot)
    q, k = torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1)
    scale = (cfg.rope_yarn.softmax_gain if cfg.rope_yarn is not None else 1.0) / math.sqrt(nope + rot)
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, heads * vd)
    return all_reduce(F.linear(ctx, w[p + "proj.weight"]), r)


def mlp(x: torch.Tensor, w, p: str, cfg: GPTConfig, r: Ranks) -> torch.Tensor:
    h = F.linear(x, w[p + "fc1.weight"], w.get(p + "fc1.bias"))
    if cfg.gated:
        gate, up = h.chunk(2, dim=-1)  # this rank's [gate_r; up_r]
        h = F.silu(gate) * up
    else:
        h = activation(h, cfg)
    out = all_reduce(F.linear(h, w[p + "fc2.weight"]), r)
    return out + w[p + "fc2.bias"] if p + "fc2.bias" in w else out


def gather_dp(x: torch.Tensor, r: Ranks) -> Tuple[torch.Tensor, int]:
    """(every data-parallel rank's rows of x concatenated in rank order, where this rank's rows start).
    Ranks may hold different numbers of rows (an uneven batch), so each pads to the largest and the
    padding is cut."""
    if r.dp == 1:
        return x, 0
    counts = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(r.dp)]
    dist.all_gather(counts, torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), group=r.dp_group)
    counts = [int(c.item()) for c in counts]
    most = max(counts)
    padded = torch.zeros(most, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(r.dp)]
    dist.all_gather(parts, padded, group=r.dp_group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]), sum(counts[: r.dp_rank])


def expert_partial(x: torch.Tensor, w, p: str, cfg: GPTConfig, adds_bias: bool) -> torch.Tensor:
    """One expert's MLP on this rank: its fc1 rows ([gate_r; up_r] when gated) and fc2 columns, so the
    output is this rank's partial sum. The fc2 bias, replicated, is counted once: by the rank that says
    adds_bias (expert-TP rank 0 for routed experts, TP rank 0 for the shared expert)."""
    h = F.linear(x, w[p + "fc1.weight"], w.get(p + "fc1.bias"))
    if cfg.gated:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = activation(h, cfg)
    out = F.linear(h, w[p + "fc2.weight"])
    return out + w[p + "fc2.bias"] if p + "fc2.bias" in w and adds_bias else out


def moe_mlp(x: torch.Tensor, w, p: str, cfg: GPTConfig, r: Ranks, experts: range) -> torch.Tensor:
    """Dropless MoE, all-gather dispatch: every rank routes its own tokens (the router is replicated);
    the data-parallel ranks of this stage all-gather tokens, choices and weights; each rank runs its
    experts (its expert-TP share of each) on the tokens routed to them, weighted, where expert-data-
    parallel replicas of the same shard take every edp-th of those tokens; the partial outputs are
    summed over the stage's ranks and each rank keeps its own tokens. Then the shared expert,
    tensor-parallel like a dense MLP, on the rank's own tokens."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    chosen, weights = route(flat, w, cfg, p)
    every, start = gather_dp(flat, r)
    every_chosen, _ = gather_dp(chosen, r)
    every_weights, _ = gather_dp(weights, r)
    out = torch.zeros_like(every)
    for e in experts:
        token, slot = torch.where(every_chosen == e)
        if r.edp > 1:  # the replicas split the work: each (token, slot) is computed once in the stage
            token, slot = token[r.edp_rank::r.edp], slot[r.edp_rank::r.edp]
        if token.numel():
            y = expert_partial(every[token], w, f"{p}experts.{e}.", cfg, r.etp_rank == 0)
            y = y * every_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    dist.all_reduce(out, group=r.stage_group)
    out = out[start:start + flat.shape[0]]
    if cfg.moe.shared_ffn_hidden_size:
        shared = mlp(flat, w, p + "shared.", cfg, r)
        if cfg.moe.shared_gate:
            shared = torch.sigmoid(F.linear(flat, w[p + "shared_gate.weight"])) * shared
        out = out + shared
    return out.reshape(shape)


def block(x: torch.Tensor, w, i: int, cfg: GPTConfig, r: Ranks, rope, experts: range = range(0)) -> torch.Tensor:
    p = f"layers.{i}."
    h = norm(x, w[p + "attn_norm.weight"], w.get(p + "attn_norm.bias"), cfg)
    x = (h if cfg.post_layernorm_residual else x) + (mla_attention if cfg.mla is not None else attention)(
        h, w, p, cfg, r, rope)
    h = norm(x, w[p + "mlp_norm.weight"], w.get(p + "mlp_norm.bias"), cfg)
    ffn = moe_mlp(h, w, p, cfg, r, experts) if cfg.is_moe_layer(i) else mlp(h, w, p, cfg, r)
    return (h if cfg.post_layernorm_residual else x) + ffn


def head(x: torch.Tensor, w, cfg: GPTConfig, r: Ranks) -> torch.Tensor:
    x = norm(x, w["final_norm.weight"], w.get("final_norm.bias"), cfg)
    out_w = w["output.weight"] if "output.weight" in w else w["embed.word"]  # tied, one stage
    return all_gather_last(F.linear(x, out_w), r).float()


# --- the pipeline ---------------------------------------------------------------------------

def stage_forward(tokens: torch.Tensor, shards: RankShards, r: Ranks, dtype: torch.dtype):
    """Run this rank's stage on its rows of tokens (all of them without expert parallelism; with it,
    its data-parallel rank's share). Returns (logits or None, [(name, hidden)] of this stage).

    With virtual pipeline chunks the hidden state goes round the ring once per chunk: stage 0
    chunk 0, stage 1 chunk 0, ..., the last stage's chunk 0 back to stage 0 for chunk 1, and so on.
    """
    cfg = shards.config
    w = {k: v.load().to(device=r.device, dtype=dtype) for k, v in shards.tensors.items()}
    rows = batch_rows(tokens.shape[0], r.dp, r.dp_rank)
    tokens = tokens[rows.start:rows.stop].to(r.device)
    b, s = tokens.shape
    rope = None
    if cfg.position_embedding == "rope":
        rope = tuple(t.to(r.device) for t in rope_frequencies(cfg, s, r.device))
    hidden: List[Tuple[str, torch.Tensor]] = []
    last_chunk = len(shards.chunks) - 1
    prev = r.global_rank(r.tp_rank, (r.pp_rank - 1) % r.pp)
    nxt = r.global_rank(r.tp_rank, (r.pp_rank + 1) % r.pp)
    for v, (first, count) in enumerate(shards.chunks):
        if r.pp_rank == 0 and v == 0:
            x = embed(tokens, w, cfg, r)
            hidden.append(("embedding", x))
        elif r.pp > 1:
            x = torch.empty(b, s, cfg.hidden_size, dtype=dtype, device=r.device)
            if b:  # a data-parallel rank without rows (batch < DP) still joins every layer's collectives
                dist.recv(x, src=prev)
        for i in range(first, first + count):
            x = block(x, w, i, cfg, r, rope, shards.experts)
            hidden.append((f"layer {i}", x))
        if r.pp_rank == r.pp - 1 and v == last_chunk:
            return head(x, w, cfg, r), hidden
        if r.pp > 1 and b:
            dist.send(x.contiguous(), dst=nxt)
    return None, hidden


def stage_labels(layout, num_layers: int, pp_rank: int) -> List[str]:
    """The hidden states stage pp_rank produces, in the order it produces them."""
    return (["embedding"] if pp_rank == 0 else []) + [
        f"layer {i}" for p, _, first, count in layout.chunks(num_layers) if p == pp_rank
        for i in range(first, first + count)]


def gather_to_rank0(logits: Optional[torch.Tensor], hidden, shards: RankShards, r: Ranks,
                    shape: Tuple[int, int]):
    """On rank 0: (logits [b, s, V], {name: hidden} in layer order) from TP rank 0 of every stage and
    data-parallel rank (whose rows are concatenated in rank order); None elsewhere."""
    b, s = shape
    cfg = shards.config
    h, vocab_cols = cfg.hidden_size, cfg.padded_vocab_size
    mine = len(batch_rows(b, r.dp, r.dp_rank))
    if r.tp_rank == 0 and r.rank != 0 and mine:
        dist.send(torch.stack([t for _, t in hidden]).float().contiguous(), dst=0)
        if logits is not None:
            dist.send(logits.contiguous(), dst=0)
    if r.rank != 0:
        return None
    rows = [len(batch_rows(b, r.dp, d)) for d in range(r.dp)]
    got: Dict[str, torch.Tensor] = {}
    for p in range(r.pp):
        labels = stage_labels(shards.layout, cfg.num_layers, p)
        parts = []
        for d in range(r.dp):
            if (p, d) == (0, 0):
                parts.append(torch.stack([t.float() for _, t in hidden]) if hidden else None)
            elif rows[d]:
                buf = torch.empty(len(labels), rows[d], s, h, dtype=torch.float32, device=r.device)
                dist.recv(buf, src=r.global_rank(0, p, d))
                parts.append(buf)
        states = torch.cat([x for x in parts if x is not None and x.shape[1]], dim=1).cpu()
        got.update(zip(labels, states))
    order = ["embedding"] + [f"layer {i}" for i in range(cfg.num_layers)]
    names = {n: got[n] for n in order if n in got}  # compare.py finds the FIRST divergence in this order
    last = r.pp - 1
    parts = []
    for d in range(r.dp):
        if (last, d) == (0, 0):
            parts.append(logits)
        elif rows[d]:
            buf = torch.empty(rows[d], s, vocab_cols, dtype=torch.float32, device=r.device)
            dist.recv(buf, src=r.global_rank(0, last, d))
            parts.append(buf)
    logits = torch.cat([x for x in parts if x is not None and x.shape[0]])
    return logits.cpu(), names
