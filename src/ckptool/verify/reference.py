"""A plain-torch GPT forward over the canonical state: the reference semantics, one process.

It loads one layer at a time (inside a load_scope), so memory stays near one layer plus
activations. Covers GPT-2 style (LayerNorm, GeLU erf or tanh, learned positions, tied embeddings)
and Llama style (RMSNorm, SwiGLU, RoPE, GQA, untied output), and the Megatron flags that change the
maths (layernorm 1p, qk layernorm, post-layernorm residual, rotary percent / interleaved / base,
llama3 rope scaling, squared ReLU), and Mixture-of-Experts layers routed exactly as config.MoE
says (dropless: every token reaches its top-k experts, no capacity limit).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import GPTConfig
from ..lazy import LazyTensor, load_scope
from ..state import Checkpoint


def norm(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], cfg: GPTConfig) -> torch.Tensor:
    w = w + 1 if cfg.apply_layernorm_1p else w
    if cfg.normalization == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, cfg.norm_eps)
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + cfg.norm_eps)).to(x.dtype) * w


def activation(x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    if cfg.activation == "gelu":
        return F.gelu(x)
    if cfg.activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if cfg.activation == "squared_relu":
        return F.relu(x).pow(2)
    raise ValueError(cfg.activation)


def rope_frequencies(cfg: GPTConfig, seq: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, rot_dim/2] for the rotated part of each head (MLA: its rope part)."""
    rot = cfg.mla.qk_rope_head_dim if cfg.mla is not None else int(cfg.head_dim * cfg.rotary_percent)
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot))
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


def attention(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig,
              rope: Optional[Tuple[torch.Tensor, torch.Tensor]], p: str) -> torch.Tensor:
    b, s, _ = x.shape
    hd, nq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    q = F.linear(x, w[p + "attn.q.weight"], w.get(p + "attn.q.bias"))
    k = F.linear(x, w[p + "attn.k.weight"], w.get(p + "attn.k.bias"))
    v = F.linear(x, w[p + "attn.v.weight"], w.get(p + "attn.v.bias"))
    q = q.view(b, s, nq, hd).transpose(1, 2)
    k = k.view(b, s, ng, hd).transpose(1, 2)
    v = v.view(b, s, ng, hd).transpose(1, 2)
    if cfg.qk_layernorm:
        q = norm(q, w[p + "attn.q_norm.weight"], w.get(p + "attn.q_norm.bias"), cfg)
        k = norm(k, w[p + "attn.k_norm.weight"], w.get(p + "attn.k_norm.bias"), cfg)
    if rope is not None:
        q, k = apply_rope(q, *rope, cfg), apply_rope(k, *rope, cfg)
    if ng != nq:
        k = k.repeat_interleave(nq // ng, dim=1)
        v = v.repeat_interleave(nq // ng, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    scores = scores.float().masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, nq * hd)
    return F.linear(ctx, w[p + "attn.out.weight"], w.get(p + "attn.out.bias"))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * w


def mla_attention(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig,
                  rope: Tuple[torch.Tensor, torch.Tensor], p: str) -> torch.Tensor:
    """Multi-Latent Attention: per head q = [q_nope | q_rope], k = [k_nope | k_rope shared by all
    heads], v from the kv latent; only the rope parts rotate; scores scaled by 1/sqrt(nope + rope)."""
    return F.linear(mla_context(x, w, cfg, rope, p), w[p + "attn.out.weight"])


def mla_context(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig,
                rope: Tuple[torch.Tensor, torch.Tensor], p: str) -> torch.Tensor:
    """mla_attention before its output projection: every head's context [b, s, heads * v_head_dim]."""
    m, (b, s, _) = cfg.mla, x.shape
    nq, nope, r, vd = cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank:
        latent = rms_norm(F.linear(x, w[p + "attn.q_down.weight"]), w[p + "attn.q_down_norm.weight"], m.latent_norm_eps)
        q = F.linear(latent, w[p + "attn.q_up.weight"])
    else:
        q = F.linear(x, w[p + "attn.q.weight"])
    q_nope, q_rope = q.view(b, s, nq, nope + r).transpose(1, 2).split([nope, r], dim=-1)
    kv_latent, k_rope = F.linear(x, w[p + "attn.kv_down.weight"]).split([m.kv_lora_rank, r], dim=-1)
    kv_latent = rms_norm(kv_latent, w[p + "attn.kv_down_norm.weight"], m.latent_norm_eps)
    kv = F.linear(kv_latent, w[p + "attn.kv_up.weight"]).view(b, s, nq, nope + vd).transpose(1, 2)
    k_nope, v = kv.split([nope, vd], dim=-1)
    q_rope = apply_rope(q_rope, *rope, cfg)
    k_rope = apply_rope(k_rope.view(b, 1, s, r), *rope, cfg).expand(b, nq, s, r)
    q, k = torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1)
    scale = 1 / math.sqrt(nope + r) * (cfg.rope_yarn.softmax_gain if cfg.rope_yarn is not None else 1.0)
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
    return (probs @ v).transpose(1, 2).reshape(b, s, nq * vd)


def mlp(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, p: str) -> torch.Tensor:
    """The dense MLP whose tensors are p + {gate,up,down}.*: a layer's (p = layers.i.mlp.), an
    expert's (layers.i.mlp.experts.e.) or the shared expert's (layers.i.mlp.shared.)."""
    up = F.linear(x, w[p + "up.weight"], w.get(p + "up.bias"))
    if cfg.gated:
        gate = F.linear(x, w[p + "gate.weight"], w.get(p + "gate.bias"))
        h = F.silu(gate) * up
    else:
        h = activation(up, cfg)
    return F.linear(h, w[p + "down.weight"], w.get(p + "down.bias"))


def route(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, p: str) -> Tuple[torch.Tensor, torch.Tensor]:
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


def moe_mlp(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, p: str) -> torch.Tensor:
    """Each token through its top-k experts, weighted, summed in expert order; plus the shared expert."""
    flat = x.reshape(-1, x.shape[-1])
    chosen, weights = route(flat, w, cfg, p)
    out = torch.zeros_like(flat)
    for e in range(cfg.moe.num_experts):
        token, slot = torch.where(chosen == e)
        if token.numel():
            y = mlp(flat[token], w, cfg, f"{p}experts.{e}.") * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    if cfg.moe.shared_ffn_hidden_size:
        shared = mlp(flat, w, cfg, p + "shared.")
        if cfg.moe.shared_gate:
            shared = torch.sigmoid(F.linear(flat, w[p + "shared_gate.weight"])) * shared
        out = out + shared
    return out.reshape(x.shape)


def block(x: torch.Tensor, w: Dict[str, torch.Tensor], cfg: GPTConfig, rope, i: int) -> torch.Tensor:
    p = f"layers.{i}."
    h = norm(x, w[p + "attn_norm.weight"], w.get(p + "attn_norm.bias"), cfg)
    a = (mla_attention if cfg.mla is not None else attention)(h, w, cfg, rope, p)
    x = (h if cfg.post_layernorm_residual else x) + a
    h = norm(x, w[p + "mlp_norm.weight"], w.get(p + "mlp_norm.bias"), cfg)
    ffn = moe_mlp if cfg.is_moe_layer(i) else mlp
    return (h if cfg.post_layernorm_residual else x) + ffn(h, w, cfg, p + "mlp.")


def _load(group: Dict[str, LazyTensor], dtype: torch.dtype, device) -> Dict[str, torch.Tensor]:
    return {k: v.load().to(device=device, dtype=dtype) for k, v in group.items()}


def forward(ckpt: Checkpoint, tokens: torch.Tensor, dtype: torch.dtype = torch.float32,
            device: str = "cpu", return_hidden: bool = False):
    """Logits [b, s, V_rows] (and the hidden state after each layer when return_hidden)."""
    cfg = ckpt.config
    tokens = tokens.to(device)
    b, s = tokens.shape
    with load_scope():
        emb = _load({k: v for k, v in ckpt.tensors.items() if k.startswith("embed.")}, dtype, device)
    x = F.embedding(tokens, emb["embed.word"])
    if cfg.position_embedding == "learned":
        x = x + emb["embed.pos"][:s]
    word = emb["embed.word"] if cfg.tied_embeddings else None
    del emb
    rope = rope_frequencies(cfg, s, device) if cfg.position_embedding == "rope" else None
    hidden: List[torch.Tensor] = []
    for i in range(cfg.num_layers):
        with load_scope():
            w = _load(ckpt.layer_tensors(i), dtype, device)
        x = block(x, w, cfg, rope, i)
        if return_hidden:
            hidden.append(x.detach().float().cpu())
        del w
    with load_scope():
        head = _load({k: v for k, v in ckpt.tensors.items()
                      if k.startswith("final_norm.") or k == "output.weight"}, dtype, device)
    x = norm(x, head["final_norm.weight"], head.get("final_norm.bias"), cfg)
    out_w = word if cfg.tied_embeddings else head["output.weight"]
    logits = F.linear(x, out_w).float()
    return (logits, hidden) if return_hidden else logits
