"""The GPT forward as Megatron runs it: tensor- and pipeline-parallel, one process per rank.

Run under torchrun with WORLD_SIZE = PP x the ranks of a stage: TP without experts; for MoE checkpoints
saved with expert parallelism lcm(TP, ETP x EP), the ranks whose files Megatron-LM writes (TP x EP when
expert TP is TP; formats/megatron.expert_grid). Stage-local rank x is what megatron-core's default order
makes of it twice over: for the dense part TP rank x % TP and data-parallel rank x // TP; for the experts
expert-TP rank x % ETP, EP rank (x // ETP) % EP and expert-data-parallel rank x // (ETP x EP). Global rank
= pp x (ranks of a stage) + x, so with ETP = TP: (pp * EP + ep) * TP + tp. Every rank computes with the
tensors of its own checkpoint file, mp_rank_{x % TP}[_PPP][_{EP rank}] (formats/megatron/ranks.py), so
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

Afterwards the per-layer hidden states and the logits are sent to rank 0 for comparison. The maths is
maths.py's; Ranks is its parallel context (this rank's tensors, the collectives over its groups).
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
from ..formats.megatron.ranks import RankShards
from .maths import block, embed, head, mlp_partial, rope_frequencies


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

    # the parallel context of maths.py: this rank's file's tensors and how their partial results combine
    names = {  # maths' roles -> the rank file's tensor names under a layer's prefix (see maths.OneProcess)
        "attn_norm": "attn_norm.weight", "q_norm": "q_norm.", "k_norm": "k_norm.", "attn_out": "proj.",
        "q": "qkv.weight", "q_down": "mla.q_down.weight", "q_down_norm": "mla.q_down_norm.weight",
        "q_up": "mla.q_up.weight", "kv_down": "mla.kv_down.weight", "kv_down_norm": "mla.kv_down_norm.weight",
        "kv_up": "mla.kv_up.weight", "mla_out": "proj.weight", "mlp": "", "mlp_out": "fc2.",
        "attn_post_norm": "attn_post_norm.weight", "mlp_post_norm": "mlp_post_norm.weight", "sinks": "attn.sinks"}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def qkv(self, x: torch.Tensor, w, p: str, cfg: GPTConfig):
        """The fused QKV column-parallel: this rank's q heads and k, v groups, [b, heads, s, hd] each."""
        qkv = F.linear(x, w[p + "qkv.weight"], w.get(p + "qkv.bias"))
        return tuple(t.transpose(1, 2) for t in split_qkv(qkv, cfg, self))

    def fc1(self, x: torch.Tensor, w, p: str, cfg: GPTConfig):
        """(gate or None, up): fc1 column-parallel, [gate_r; up_r] per rank for SwiGLU."""
        h = F.linear(x, w[p + "fc1.weight"], w.get(p + "fc1.bias"))
        return h.chunk(2, dim=-1) if cfg.gated else (None, h)

    def row_out(self, h: torch.Tensor, w, name: str) -> torch.Tensor:
        """Row-parallel: the partial sums all-reduced over TP, then the bias."""
        out = self.all_reduce(F.linear(h, w[name + "weight"]))
        return out + w[name + "bias"] if name + "bias" in w else out

    def expert_out(self, x: torch.Tensor, w, p: str, cfg: GPTConfig) -> torch.Tensor:
        """A routed expert's expert-TP partial output; its fc2 bias is added by expert-TP rank 0."""
        return mlp_partial(x, w, p, cfg, self, self.etp_rank == 0)

    def gather_tokens(self, x: torch.Tensor) -> Tuple[torch.Tensor, int]:
        return gather_dp(x, self)

    def sum_experts(self, out: torch.Tensor) -> torch.Tensor:
        """The expert outputs summed over the stage's ranks (each ran its own experts' share)."""
        dist.all_reduce(out, group=self.stage_group)
        return out

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


def split_qkv(qkv: torch.Tensor, cfg: GPTConfig, r: Ranks):
    """This rank's [b, s, rows] QKV activations -> q [b, s, heads_r, hd], k and v [b, s, groups_r, hd]."""
    b, s, _ = qkv.shape
    hd, nq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    per = nq // ng
    if ng < r.tp:
        # a rank holds part of one group: gather all groups, keep ours, later our share of its heads
        ranks_per_group = r.tp // ng
        qkv = r.all_gather_last(qkv)
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
            x = block(x, w, i, cfg, rope, r, shards.experts)
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
    return logits, names  # on rank 0's device, where the comparison runs (compare.py): no 2 GB round trip to the host
