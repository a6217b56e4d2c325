"""A plain-torch GPT forward over the canonical state: the reference semantics, one process.

It loads one layer at a time (inside a load_scope), so memory stays near one layer plus
activations. Covers GPT-2 style (LayerNorm, GeLU erf or tanh, learned positions, tied embeddings)
and Llama style (RMSNorm, SwiGLU, RoPE, GQA, untied output), and the Megatron flags that change the
maths (layernorm 1p, qk layernorm, post-layernorm residual, rotary percent / interleaved / base,
llama3 rope scaling, squared ReLU), and Mixture-of-Experts layers routed exactly as config.MoE
says (dropless: every token reaches its top-k experts, no capacity limit). The maths is maths.py's, in
its one-process context (maths.ONE_PROCESS: the canonical tensors whole, no collectives).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..lazy import LazyTensor, load_scope
from ..state import Checkpoint
from .maths import ONE_PROCESS, block, embed, head, rope_frequencies


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
    x = embed(tokens, emb, cfg, ONE_PROCESS)
    word = emb["embed.word"] if cfg.tied_embeddings else None
    del emb
    rope = rope_frequencies(cfg, s, device) if cfg.position_embedding == "rope" else None
    hidden: List[torch.Tensor] = []
    for i in range(cfg.num_layers):
        with load_scope():
            w = _load(ckpt.layer_tensors(i), dtype, device)
        x = block(x, w, i, cfg, rope, ONE_PROCESS, range(cfg.moe.num_experts if cfg.is_moe_layer(i) else 0))
        if return_hidden:
            hidden.append(x.detach().float().cpu())
        del w
    with load_scope():
        final = _load({k: v for k, v in ckpt.tensors.items() if k.startswith("final_norm.")}, dtype, device)
        out_w = word if cfg.tied_embeddings else _load({"o": ckpt.tensors["output.weight"]}, dtype, device)["o"]
    logits = head(x, {**final, "output.weight": out_w}, cfg, ONE_PROCESS)
    return (logits, hidden) if return_hidden else logits
