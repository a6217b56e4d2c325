"""An MLA model that rotates RoPE halves, rewritten as one that rotates interleaved pairs (same logits).

megatron-core's MLA always takes a head's rope features y as interleaved pairs: it reorders them to
[y0 y2 y4 ... | y1 y3 y5 ...] and rotates those halves (rope_utils._apply_rotary_pos_emb_bshd under
multi_latent_attention). Hugging Face's DeepSeek with rope_interleave false rotates the halves of y as
they come. With the rope rows of every projection that makes y (q_up or the direct q per head, kv_down's
shared rope rows) put in the order [y0 y_{r/2} y1 y_{r/2+1} ...], megatron-core's reordering gives back
y, so it rotates exactly what the halves model rotates: a row permutation, bit-exact, no arithmetic.
Megatron checkpoints are always the interleaved kind, so nothing maps the other way.
"""
from __future__ import annotations

from typing import Dict

import torch

from .lazy import Derived, LazyTensor
from .errors import require
from .state import Checkpoint

# canonical tensors whose rows hold rope features, and how: per head ([nope | rope] each) or one block at the end
PER_HEAD = ("attn.q_up.weight", "attn.q.weight")
SHARED_AT_END = ("attn.kv_down.weight",)


def halves_to_pairs(rope: int) -> torch.Tensor:
    """Row order taking halves [a | b] to pairs [a0 b0 a1 b1 ...]."""
    half = torch.arange(rope // 2)
    return torch.stack([half, half + rope // 2], dim=-1).flatten()


def _rows(weight: torch.Tensor, heads: int, head_rows: int, rope: int) -> torch.Tensor:
    """weight with the last `rope` rows of each of `heads` blocks of head_rows rows reordered."""
    order = torch.arange(heads * head_rows).view(heads, head_rows)
    order[:, head_rows - rope:] = order[:, head_rows - rope:][:, halves_to_pairs(rope)]
    return weight[order.flatten()]


def as_interleaved_pairs(ckpt: Checkpoint) -> Checkpoint:
    """ckpt (MLA, rotary_interleaved False) as the interleaved-pairs model that computes the same logits."""
    cfg = ckpt.config
    m = cfg.mla
    assert m is not None and not cfg.rotary_interleaved
    r, nq = m.qk_rope_head_dim, cfg.num_attention_heads
    require(ckpt.optimizer is None, "an MLA checkpoint rotating RoPE halves with optimizer state",
            "Megatron checkpoints rotate interleaved pairs; convert the weights only (--no-optimizer)")

    def permuted(name: str, t: LazyTensor) -> LazyTensor:
        base = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if base in PER_HEAD:
            return Derived(lambda w: _rows(w, nq, m.qk_head_dim, r), [t])
        if base in SHARED_AT_END:
            return Derived(lambda w: _rows(w, 1, m.kv_lora_rank + r, r), [t])
        return t

    tensors: Dict[str, LazyTensor] = {k: permuted(k, v) for k, v in ckpt.tensors.items()}
    return ckpt.with_tensors(tensors, rotary_interleaved=True)
