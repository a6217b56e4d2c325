"""Tensors as inspect shows them, without torch: TensorMeta (shape, dtype name), and the canonical
tensors' shapes a GPTConfig implies (state.py's table of names and shapes, as data)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..config import GPTConfig
from ..spec import GPT, schema
from ..state import expected_names

ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
            "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
            "float8_e4m3fn": 1, "float8_e5m2": 1}
# torch's typed storage classes as a torch.save pickle names them -> the dtype's name
STORAGE_DTYPES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
                  "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32",
                  "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


# Roles that are module buffers, not parameters (the spec's "buffer" trait: the router's expert bias, which
# megatron-core keeps in fp32 beside bf16 / fp16 weights): their own dtype, no optimizer state
BUFFER_ROLES = GPT.with_trait("buffer")


@dataclass(frozen=True)
class TensorMeta:
    """What inspect shows of a tensor, without the tensor: describe() prints str(dtype), so the
    dtype is torch's name for it ("bfloat16")."""
    shape: Tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def canonical_shapes(cfg: GPTConfig) -> Dict[str, Tuple[int, ...]]:
    """Every canonical tensor of a model with cfg and its full shape, in expected_names order (shapes as
    state.py documents them: an MoE layer's router, routed experts and shared expert too, and an MLA
    model's latent projections and norms in place of q/k/v)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    # an MLP's intermediate size by its scope in the name: a dense layer's, a routed expert's, the shared expert's
    ffn = {"mlp": cfg.ffn_hidden_size}
    if cfg.moe is not None:
        ffn.update(experts=cfg.moe.ffn_hidden_size, shared=cfg.moe.shared_ffn_hidden_size)
        n = cfg.moe.num_experts
        moe = {"router.weight": (n, h), "router.bias": (n,), "router.expert_bias": (n,), "shared_gate.weight": (1, h)}
    # what a name ends with -> (weight shape, bias shape)
    by_part = {"attn_norm": ((h,), (h,)), "mlp_norm": ((h,), (h,)), "final_norm": ((h,), (h,)),
               "q": ((q, h), (q,)), "k": ((kv, h), (kv,)), "v": ((kv, h), (kv,)),
               "q_norm": ((hd,), (hd,)), "k_norm": ((hd,), (hd,)), "out": ((h, q), (h,)),
               # an MTP layer's own (its final norm is final_norm's shape): eh_proj maps [embedding | hidden] to h
               "enorm": ((h,), (h,)), "hnorm": ((h,), (h,)), "eh_proj": ((h, 2 * h), None),
               # issue 32: Gemma's norms of the attention and MLP outputs
               "attn_post_norm": ((h,), (h,)), "mlp_post_norm": ((h,), (h,))}
    if cfg.mla is not None:  # Multi-Latent Attention (no biases): state.py's shapes, r the shared rotary key part
        m, n = cfg.mla, cfg.num_attention_heads
        ql, kvl, r = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        by_part.update(q=((n * m.qk_head_dim, h), None), q_down=((ql, h), None), q_down_norm=((ql,), None),
                       q_up=((n * m.qk_head_dim, ql), None), kv_down=((kvl + r, h), None),
                       kv_down_norm=((kvl,), None), kv_up=((n * (m.qk_nope_head_dim + m.v_head_dim), kvl), None),
                       out=((h, n * m.v_head_dim), None))
    whole = {"embed.word": (cfg.padded_vocab_size, h), "embed.pos": (cfg.max_position_embeddings, h),
             "output.weight": (cfg.padded_vocab_size, h)}
    own = {"attn.sinks": (cfg.num_attention_heads,)}  # issue 32: GPT-OSS's softmax sink logit per head
    shapes = {}
    for name in expected_names(cfg):
        parts = name.split(".")
        if name in whole:
            shapes[name] = whole[name]
        elif ".".join(parts[-2:]) in own:
            shapes[name] = own[".".join(parts[-2:])]
        elif cfg.moe is not None and ".".join(parts[-2:]) in moe and parts[-3] == "mlp":
            shapes[name] = moe[".".join(parts[-2:])]
        elif parts[-2] in ("gate", "up", "down"):
            f = ffn[parts[3] if parts[3] in ("experts", "shared") else "mlp"]  # layers.{i}.mlp.<scope>...
            shapes[name] = ((f, h), (f,)) if parts[-2] != "down" else ((h, f), (h,))
            shapes[name] = shapes[name][parts[-1] != "weight"]
        else:
            weight, bias = by_part[parts[-2]]
            shapes[name] = weight if parts[-1] == "weight" else bias
    return shapes


EXPERT_ROLE = re.compile(r"^experts\.(\d+)\.(.+)$")


def rank_shape(role: str, layer: Optional[int], cfg: GPTConfig, shapes: Dict[str, Tuple[int, ...]], tp: int,
               column: Optional[str] = None) -> Optional[Tuple[int, ...]]:
    """The shape one tensor-parallel rank stores of a Megatron role, from the canonical shapes: its
    canonical parts stacked (a fused QKV or [gate; up]), then cut by the role's TP rule in the dialect's name
    column (Role.rule_in: Transformer Engine keeps MLA's down projections whole); a routed expert's role
    (experts.<global index>.fc1.weight) by its base role's rule, tp then the expert TP size. None where the model has no
    such tensor or TP does not cut it evenly (the full reader's to report)."""
    expert = EXPERT_ROLE.match(role)  # a routed expert's role names its global index
    name, index = ("experts.{expert}." + expert.group(2), int(expert.group(1))) if expert else (role, None)
    spec_role = GPT.roles[name]
    names = [t.format(layer, index) for t in GPT.parts("word" if role == schema.HEAD_COPY else name, cfg, layer)]
    if not names or any(n not in shapes for n in names):
        return None
    first = shapes[names[0]]
    whole = (sum(shapes[n][0] for n in names),) + first[1:]
    rule = GPT.roles[spec_role.base].rule_in(column) if spec_role.rule is None else spec_role.rule_in(column)
    if rule == "replicated":
        return whole
    dim = 1 if rule == "row" else 0
    if whole[dim] % tp:
        return None
    return whole[:dim] + (whole[dim] // tp,) + whole[dim + 1:]


def is_buffer(name: str, cfg: GPTConfig) -> bool:
    """Whether a canonical tensor is a module buffer (BUFFER_ROLES)."""
    hit = GPT.match(name, cfg)
    return hit is not None and hit[0].role in BUFFER_ROLES


def canonical_meta(shapes: Dict[str, Tuple[int, ...]], cfg: GPTConfig, dtype: str,
                   buffer_dtype: Optional[str]) -> Dict[str, TensorMeta]:
    """The canonical tensors as TensorMeta: the weights' dtype, a module buffer's its own (buffer_dtype, as
    stored; None: the weights')."""
    return {n: TensorMeta(s, buffer_dtype if buffer_dtype and is_buffer(n, cfg) else dtype) for n, s in shapes.items()}


def split_dtypes(dtypes_by_role: Dict[str, set]) -> Tuple[str, Optional[str]]:
    """(the parameters' one dtype, the buffers' one dtype or None) from {role: dtypes stored}; ValueError where
    either kind is stored in several dtypes (the quick readers then leave it to the full reader)."""
    params = set().union(*(d for r, d in dtypes_by_role.items() if r not in BUFFER_ROLES))
    buffers = set().union(*(d for r, d in dtypes_by_role.items() if r in BUFFER_ROLES))
    if len(params) != 1 or len(buffers) > 1:
        raise ValueError("tensors of several dtypes")
    return params.pop(), buffers.pop() if buffers else None
