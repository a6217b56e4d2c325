"""The GPT maths, written once: norms, RoPE, attention (GQA and MLA), the MLP, MoE routing and experts.

Every function computes with the weights this process holds plus a parallel context that says how they are
laid out and how partial results combine. Two contexts exist:

  ONE_PROCESS     the reference forward (reference.py) and the probes' reference side: the canonical tensors
                  whole (q, k, v and gate, up apart), no collectives
  parallel.Ranks  one rank of the tensor/pipeline/expert-parallel forward (parallel.py): the tensors of its
                  own file (fused QKV, [gate_r; up_r] fc1), all-reduce / all-gather over its groups

A context has names (a role -> the tensor name under a layer's prefix), tp and tp_rank, all_reduce and
all_gather_last (over TP), qkv (the projected q, k, v heads), fc1 (an MLP's gate and up), row_out (a
row-parallel output projection: its sum over TP and its bias), expert_out (a routed expert's contribution
on this process), gather_tokens / sum_experts (the tokens routed together and the sum of their expert
outputs) and edp / edp_rank (replicas that split an expert's tokens).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import GPTConfig


# --- elementwise ---------------------------------------------------------------------------------

def norm(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], cfg: GPTConfig) -> torch.Tensor:
    if cfg.apply_layernorm_1p and cfg.normalization == "rmsnorm":
        return rms_norm_1p(x, w, cfg.norm_eps)
    w = w + 1 if cfg.apply_layernorm_1p else w
    if cfg.normalization == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, cfg.norm_eps)
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + cfg.norm_eps)).to(x.dtype) * w


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * w


def rms_norm_1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of zero-centred weights: x normed times (1 + w), both in fp32, then cast to x's dtype
    (transformers 5 Gemma2RMSNorm / Gemma3RMSNorm; Transformer Engine's zero_centered_gamma also adds the 1 in
    fp32)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps) * (1.0 + w.float())).to(x.dtype)


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """Gemma's soft-capping cap * tanh(x / cap) (attention scores, final logits); x itself when cap is None."""
    return x if not cap else torch.tanh(x / cap) * cap


def activation(x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    if cfg.activation == "gelu":
        return F.gelu(x)
    if cfg.activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if cfg.activation == "squared_relu":
        return F.relu(x).pow(2)
    raise ValueError(cfg.activation)


# --- rotary positions ----------------------------------------------------------------------------

def rope_frequencies(cfg: GPTConfig, seq: int, device=None, local: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, rot_dim/2] for the rotated part of each head (MLA: its rope part); local: for a
    sliding-window layer of a model whose local layers have their own RoPE (Gemma 3: rotary_base_local, unscaled)."""
    rot = cfg.mla.qk_rope_head_dim if cfg.mla is not None else int(cfg.head_dim * cfg.rotary_percent)
    base = cfg.rotary_base_local if local and cfg.rotary_base_local else cfg.rotary_base
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot))
    if cfg.rope_linear_factor and not local:  # Gemma 3's global layers (transformers' "linear" rope type)
        inv = inv / cfg.rope_linear_factor
    if cfg.rope_scaling_factor:
        inv = _llama3_scale(inv, cfg.rope_scaling_factor)
    if cfg.rope_yarn is not None:
        inv = _yarn_scale(inv, cfg.rope_yarn, rot, cfg.rotary_base)
    pos = torch.arange(seq, dtype=torch.float64, device=device)
    ang = torch.outer(pos, inv)
    gain = cfg.rope_yarn.attention_gain if cfg.rope_yarn is not None else 1.0
    return (ang.cos() * gain).float(), (ang.sin() * gain).float()


def _yarn_scale(inv: torch.Tensor, y, dim: int, base: float) -> torch.Tensor:
    """Blend interpolated (inv / factor) and original frequencies over the YaRN correction range."""
    def correction_dim(rotations):
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return inv / y.factor * (1 - keep) + inv * keep


def _llama3_scale(inv: torch.Tensor, factor: float, low: float = 1.0, high: float = 4.0,
                  original: int = 8192) -> torch.Tensor:
    # megatron-core defaults for use_rope_scaling (low 1, high 4, original context 8192)
    low_wl, high_wl = original / low, original / high
    wl = 2 * math.pi / inv
    smooth = (original / wl - low) / (high - low)
    scaled = torch.where(wl > low_wl, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wl <= low_wl) & (wl >= high_wl)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """x [b, heads, s, hd]; rotate the first rot_dim features of each head."""
    rot = cos.shape[-1] * 2
    xr, xp = x[..., :rot], x[..., rot:]
    if cfg.rotary_interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        out = torch.stack([o1, o2], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        out = xr * c + torch.cat([-x2, x1], -1) * s
    return torch.cat([out.to(x.dtype), xp], dim=-1)


# --- attention -----------------------------------------------------------------------------------

def causal_context(scores: torch.Tensor, v: torch.Tensor, window: Optional[int] = None,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal softmax (in fp32) of the scores [b, heads, s, s] over v [b, heads, s, d]: the context
    [b, s, heads * d]. window: each query sees itself and the window - 1 keys before it (transformers'
    sliding_window; megatron-core's window_size (window - 1, 0)); sinks (GPT-OSS) [heads] adds one logit per
    head to each softmax's denominator, a column whose weight is then dropped."""
    b, heads, s, _ = scores.shape
    mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    if window is not None:
        mask = mask | torch.ones(s, s, dtype=torch.bool, device=scores.device).tril(-window)
    logits = scores.float().masked_fill(mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.float().view(1, heads, 1, 1).expand(b, heads, s, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :s].to(v.dtype)
    return (probs @ v).transpose(1, 2).reshape(b, s, heads * v.shape[-1])  # sizes given: a rank may have no rows


def attention(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, rope, ctx,
              local: bool = False) -> torch.Tensor:
    """Grouped-query attention on this process's heads (ctx.qkv), then the output projection; local: a
    sliding-window layer (its own RoPE where the model has one, the window on its mask); GPT-OSS: with the
    heads' softmax sinks when the model has them."""
    q, k, v = ctx.qkv(x, w, p, cfg)  # [b, heads, s, hd]
    if cfg.qk_layernorm:
        q = norm(q, w[p + ctx.names["q_norm"] + "weight"], w.get(p + ctx.names["q_norm"] + "bias"), cfg)
        k = norm(k, w[p + ctx.names["k_norm"] + "weight"], w.get(p + ctx.names["k_norm"] + "bias"), cfg)
    if rope is not None:
        if local and (cfg.rotary_base_local or cfg.rope_linear_factor):  # Gemma 3: the local layers' own RoPE
            rope = rope_frequencies(cfg, x.shape[1], x.device, local=True)
        q, k = apply_rope(q, *rope, cfg), apply_rope(k, *rope, cfg)
    if k.shape[1] != q.shape[1]:  # grouped queries: each group's k and v serve its heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if cfg.query_pre_attn_scalar:  # Gemma: scores times query_pre_attn_scalar ** -0.5, as transformers does
        scores = (q @ k.transpose(-1, -2)) * cfg.query_pre_attn_scalar ** -0.5
    else:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
    sinks = w[p + ctx.names["sinks"]] if cfg.attn_sinks else None
    context = causal_context(softcap(scores, cfg.attn_softcap), v, cfg.sliding_window if local else None, sinks)
    return ctx.row_out(context, w, p + ctx.names["attn_out"])


def mla_latents(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, ctx) -> Dict[str, torch.Tensor]:
    """MLA's down projections of x, gathered over TP, and their latents normed whole: q_latent and q_normed
    (with a q latent), kv_latent, kv_normed and k_rope (the rope key all heads share)."""
    m, n = cfg.mla, ctx.names
    out = {}
    if m.q_lora_rank:
        out["q_latent"] = ctx.all_gather_last(F.linear(x, w[p + n["q_down"]]))
        out["q_normed"] = rms_norm(out["q_latent"], w[p + n["q_down_norm"]], m.latent_norm_eps)
    kv = ctx.all_gather_last(F.linear(x, w[p + n["kv_down"]]))
    out["kv_latent"], out["k_rope"] = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
    out["kv_normed"] = rms_norm(out["kv_latent"], w[p + n["kv_down_norm"]], m.latent_norm_eps)
    return out


def mla_context(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, rope, ctx,
                latents: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """Multi-Latent Attention before its output projection: per head q = [q_nope | q_rope], k = [k_nope | k_rope
    shared by all heads], v from the kv latent; only the rope parts rotate; scores scaled by 1/sqrt(nope + rope).
    The up projections of the latents (mla_latents, unless given) give this process's heads. Returns their
    context [b, s, heads * v_head_dim]."""
    m, n, (b, s, _) = cfg.mla, ctx.names, x.shape
    nope, rot, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    lat = mla_latents(x, w, p, cfg, ctx) if latents is None else latents
    q = F.linear(lat["q_normed"], w[p + n["q_up"]]) if m.q_lora_rank else F.linear(x, w[p + n["q"]])
    heads = q.shape[-1] // (nope + rot)  # this process's
    q_nope, q_rope = q.view(b, s, heads, nope + rot).transpose(1, 2).split([nope, rot], dim=-1)
    kv = F.linear(lat["kv_normed"], w[p + n["kv_up"]]).view(b, s, heads, nope + vd).transpose(1, 2)
    k_nope, v = kv.split([nope, vd], dim=-1)
    q_rope = apply_rope(q_rope, *rope, cfg)
    k_rope = apply_rope(lat["k_rope"].reshape(b, 1, s, rot), *rope, cfg).expand(b, heads, s, rot)
    q, k = torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1)
    scale = (cfg.rope_yarn.softmax_gain if cfg.rope_yarn is not None else 1.0) / math.sqrt(nope + rot)
    return causal_context((q @ k.transpose(-1, -2)) * scale, v)


def mla_attention(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, rope, ctx) -> torch.Tensor:
    """mla_context, then the output projection (no bias)."""
    return ctx.all_reduce(F.linear(mla_context(x, w, p, cfg, rope, ctx), w[p + ctx.names["mla_out"]]))


# --- the MLP and the experts ---------------------------------------------------------------------

def mlp_hidden(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, ctx) -> torch.Tensor:
    """The MLP's intermediate features on this process: silu(gate) * up (SwiGLU), else activation(up)."""
    gate, up = ctx.fc1(x, w, p, cfg)
    return glu(gate, up, cfg) if cfg.gated else activation(up, cfg)


# a gated MLP's activation of its gate half (cfg.activation): SwiGLU's silu, Gemma's tanh GeLU, GPT-OSS's quick GeLU
# (gate * sigmoid(1.702 gate): megatron-core activations.quick_gelu, transformers GptOssExperts' alpha)
GATE_ACTIVATIONS = {"swiglu": F.silu, "geglu": lambda g: F.gelu(g, approximate="tanh"),
                    "quick_geglu": lambda g: g * torch.sigmoid(1.702 * g)}


def glu(gate: torch.Tensor, up: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """A gated MLP's features: act(gate) * up. GPT-OSS: the gate clamped from above and up on both sides at
    glu_clamp first, and up + glu_linear_offset (GPT-OSS: 1) after."""
    if cfg.glu_clamp is not None:
        gate, up = gate.clamp(max=cfg.glu_clamp), up.clamp(-cfg.glu_clamp, cfg.glu_clamp)
    act = GATE_ACTIVATIONS[cfg.activation](gate)
    return act * (up + cfg.glu_linear_offset if cfg.glu_linear_offset else up)


def mlp(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, ctx) -> torch.Tensor:
    """The dense MLP whose tensors are under p: a layer's, or the shared expert's (p + 'shared.')."""
    return ctx.row_out(mlp_hidden(x, w, p, cfg, ctx), w, p + ctx.names["mlp_out"])


def mlp_partial(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, ctx, adds_bias: bool):
    """This process's partial sum of the MLP under p (its intermediate features, its columns of the output
    projection), not summed over TP; the output bias, replicated, counted once: by the process that says
    adds_bias."""
    out = F.linear(mlp_hidden(x, w, p, cfg, ctx), w[p + ctx.names["mlp_out"] + "weight"])
    bias = p + ctx.names["mlp_out"] + "bias"
    return out + w[bias] if bias in w and adds_bias else out


def route(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """(expert index [tokens, k], weight [tokens, k]) for flat tokens x: scores in fp32, chosen by
    score (+ expert bias, which steers the choice only), renormalised and scaled as cfg.moe says."""
    moe = cfg.moe
    logits = F.linear(x, w[p + "router.weight"], w.get(p + "router.bias")).float()
    scores = torch.softmax(logits, dim=-1) if moe.score_function == "softmax" else torch.sigmoid(logits)
    bias = w.get(p + "router.expert_bias")
    choice = scores if bias is None else scores + bias.float()
    if moe.num_groups > 1:  # only experts of the group_topk groups whose two best scores sum highest
        grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), moe.group_topk, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    chosen = torch.topk(choice, moe.top_k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    if moe.topk_norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights * moe.scaling_factor


def moe_mlp(x: torch.Tensor, w: Dict[str, torch.Tensor], p: str, cfg: GPTConfig, ctx, experts: range) -> torch.Tensor:
    """Dropless MoE: each token through its top-k experts, weighted, summed in expert order; plus the shared
    expert. The router runs on this process's tokens; the tokens routed together (ctx.gather_tokens) go
    through this process's `experts`, each (token, slot) once among ctx.edp replicas, and the outputs summed
    over the processes (ctx.sum_experts); each keeps its own tokens."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    chosen, weights = route(flat, w, p, cfg)
    every, start = ctx.gather_tokens(flat)
    every_chosen, _ = ctx.gather_tokens(chosen)
    every_weights, _ = ctx.gather_tokens(weights)
    out = torch.zeros_like(every)
    for e in experts:
        token, slot = torch.where(every_chosen == e)
        if ctx.edp > 1:  # the replicas split the work: each (token, slot) is computed once
            token, slot = token[ctx.edp_rank::ctx.edp], slot[ctx.edp_rank::ctx.edp]
        if token.numel():
            y = ctx.expert_out(every[token], w, f"{p}experts.{e}.", cfg) * every_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    out = ctx.sum_experts(out)[start:start + flat.shape[0]]
    if cfg.moe.shared_ffn_hidden_size:
        shared = mlp(flat, w, p + "shared.", cfg, ctx)
        if cfg.moe.shared_gate:
            shared = torch.sigmoid(F.linear(flat, w[p + "shared_gate.weight"])) * shared
        out = out + shared
    return out.reshape(shape)


# --- the model -----------------------------------------------------------------------------------

def embed(tokens: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, ctx) -> torch.Tensor:
    """Vocab-parallel lookup: this process's row block of the word embeddings (the tokens outside it give
    zeros, summed over TP), then the learned positions."""
    word = w["embed.word"]
    rows = word.shape[0]
    local = tokens - ctx.tp_rank * rows
    outside = (local < 0) | (local >= rows)
    x = F.embedding(local.masked_fill(outside, 0), word)
    x = ctx.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))
    if cfg.embedding_scale:
        x = scale_embedding(x, cfg)
    if cfg.position_embedding == "learned":
        x = x + w["embed.pos"][: tokens.shape[1]]
    return x


def scale_embedding(x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Gemma's embedding times sqrt(hidden_size), the factor first made an fp32 tensor and cast to the embedding's
    dtype (transformers 5 Gemma2TextScaledWordEmbedding: embed_scale buffer .to(weight.dtype))."""
    return x * torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(x.dtype)


def attention_part(x: torch.Tensor, w: Dict[str, torch.Tensor], i: int, cfg: GPTConfig, rope, ctx):
    """Layer i up to its MLP: (the residual stream after attention, the MLP's normed input)."""
    p = f"layers.{i}."
    h = norm(x, w[p + "attn_norm.weight"], w.get(p + "attn_norm.bias"), cfg)
    if cfg.mla is not None:
        out = mla_attention(h, w, p, cfg, rope, ctx)
    else:
        out = attention(h, w, p, cfg, rope, ctx, cfg.is_local_layer(i))
    if cfg.post_norms:  # Gemma: the attention output normed before the residual add
        out = norm(out, w[p + ctx.names["attn_post_norm"]], None, cfg)
    x = (h if cfg.post_layernorm_residual else x) + out
    return x, norm(x, w[p + "mlp_norm.weight"], w.get(p + "mlp_norm.bias"), cfg)


def block(x: torch.Tensor, w: Dict[str, torch.Tensor], i: int, cfg: GPTConfig, rope, ctx,
          experts: range = range(0)) -> torch.Tensor:
    """Transformer layer i; `experts`: the routed experts this process runs (MoE layers)."""
    x, h = attention_part(x, w, i, cfg, rope, ctx)
    p = f"layers.{i}." + ctx.names["mlp"]
    ffn = moe_mlp(h, w, p, cfg, ctx, experts) if cfg.is_moe_layer(i) else mlp(h, w, p, cfg, ctx)
    if cfg.post_norms:  # Gemma: the MLP output normed before the residual add
        ffn = norm(ffn, w[f"layers.{i}." + ctx.names["mlp_post_norm"]], None, cfg)
    return (h if cfg.post_layernorm_residual else x) + ffn


def head(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, ctx) -> torch.Tensor:
    """Final norm and the logits (vocab-parallel: gathered over TP), fp32."""
    x = norm(x, w["final_norm.weight"], w.get("final_norm.bias"), cfg)
    out_w = w["output.weight"] if "output.weight" in w else w["embed.word"]  # tied, one stage
    return softcap(ctx.all_gather_last(F.linear(x, out_w)).float(), cfg.final_softcap)


# --- one process, the canonical tensors ----------------------------------------------------------

class OneProcess:
    """The context of the reference forward: the canonical tensors whole, nothing to combine."""
    tp, tp_rank, edp, edp_rank = 1, 0, 1, 0
    # maths' roles -> the canonical tensor names under a layer's prefix ("layers.i."); a name ending in "."
    # takes weight / bias; "mlp" is the prefix of a layer's MLP (its router, experts, shared expert)
    names = {"attn_norm": "attn_norm.weight", "q_norm": "attn.q_norm.", "k_norm": "attn.k_norm.",
             "attn_out": "attn.out.", "q": "attn.q.weight", "q_down": "attn.q_down.weight",
             "q_down_norm": "attn.q_down_norm.weight", "q_up": "attn.q_up.weight", "kv_down": "attn.kv_down.weight",
             "kv_down_norm": "attn.kv_down_norm.weight", "kv_up": "attn.kv_up.weight", "mla_out": "attn.out.weight",
             "mlp": "mlp.", "mlp_out": "down.", "attn_post_norm": "attn_post_norm.weight",
             "mlp_post_norm": "mlp_post_norm.weight", "sinks": "attn.sinks"}

    @staticmethod
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def all_gather_last(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def qkv(x: torch.Tensor, w, p: str, cfg: GPTConfig):
        b, s, _ = x.shape
        hd, nq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
        q = F.linear(x, w[p + "attn.q.weight"], w.get(p + "attn.q.bias"))
        k = F.linear(x, w[p + "attn.k.weight"], w.get(p + "attn.k.bias"))
        v = F.linear(x, w[p + "attn.v.weight"], w.get(p + "attn.v.bias"))
        return q.view(b, s, nq, hd).transpose(1, 2), k.view(b, s, ng, hd).transpose(1, 2), \
            v.view(b, s, ng, hd).transpose(1, 2)

    @staticmethod
    def fc1(x: torch.Tensor, w, p: str, cfg: GPTConfig):
        """(gate or None, up): the MLP's p + {gate,up}.* apart."""
        up = F.linear(x, w[p + "up.weight"], w.get(p + "up.bias"))
        return (F.linear(x, w[p + "gate.weight"], w.get(p + "gate.bias")) if cfg.gated else None), up

    @staticmethod
    def row_out(h: torch.Tensor, w, name: str) -> torch.Tensor:
        return F.linear(h, w[name + "weight"], w.get(name + "bias"))

    @staticmethod
    def expert_out(x: torch.Tensor, w, p: str, cfg: GPTConfig) -> torch.Tensor:
        return mlp(x, w, p, cfg, ONE_PROCESS)

    @staticmethod
    def gather_tokens(x: torch.Tensor):
        return x, 0

    @staticmethod
    def sum_experts(out: torch.Tensor) -> torch.Tensor:
        return out


ONE_PROCESS = OneProcess()
