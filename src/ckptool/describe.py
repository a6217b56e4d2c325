"""The `inspect` document of a checkpoint: what it is, as plain data (schema in docs/inspect-json.md).

Shared by `ckptool inspect` (which prints it, as JSON or text) and `ckptool.inspect()` (which returns
it). Torch-free: the quick readers' Checkpoints (quick_inspect.py) describe the same way as the full
readers' ones.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # only for the annotations: the full Checkpoint's module imports torch
    from .state import Checkpoint

INSPECT_SCHEMA_VERSION = 1


def _moe(moe) -> Optional[dict]:
    if moe is None:
        return None
    doc = dataclasses.asdict(moe)
    doc["layers"] = list(moe.layers)
    return doc


GEMMA_FIELDS = ("embedding_scale", "post_norms", "query_pre_attn_scalar", "attn_softcap", "final_softcap",
                "sliding_window", "local_layers", "rotary_base_local", "rope_linear_factor")


def _gemma(cfg) -> Optional[dict]:
    """Gemma's maths (issue 32; config.py's Gemma block), None when the model computes none of it."""
    out = {k: getattr(cfg, k) for k in GEMMA_FIELDS}
    if not any(out.values()):
        return None
    return dict(out, local_layers=list(cfg.local_layers))


# Issue 32's maths beside plain GPT that GPT-OSS and Gemma 2/3 compute (and a megatron-core run may ask for, e.g. a
# Llama with --window-size), each a GPTConfig field shown under its own name in every document: attention sinks, the
# sliding window and its layers, soft-capping of scores and logits, the clamped GLU. (apply_layernorm_1p, the (1 + w)
# norm, is a config key of its own already.) `gemma` keeps the window and soft-caps too: schema 1 only adds fields.
MATHS_FIELDS = ("attn_sinks", "sliding_window", "local_layers", "attn_softcap", "final_softcap", "glu_clamp",
                "glu_linear_offset")


def _maths(cfg) -> dict:
    return dict({k: getattr(cfg, k) for k in MATHS_FIELDS}, local_layers=list(cfg.local_layers))


def describe(ckpt: Checkpoint) -> dict:
    """The stable `inspect --json` document (schema in docs/inspect-json.md)."""
    cfg, src = ckpt.config, ckpt.source
    return {
        "schema_version": INSPECT_SCHEMA_VERSION,
        "path": src.path,
        "format": src.format,
        "dialect": src.dialect,
        "storage": src.storage,
        "iteration": src.iteration,
        "release": src.release,
        "checkpoint_version": src.checkpoint_version,
        "layout": {"tp": src.layout.tp, "pp": src.layout.pp, "vpp": src.layout.vpp,
                   "dp": src.layout.dp, "ep": src.layout.ep, "stage_layers": list(src.layout.stage_layers) if src.layout.stage_layers else None},
        "config": {
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_query_groups": cfg.num_query_groups,
            "head_dim": cfg.head_dim, "ffn_hidden_size": cfg.ffn_hidden_size,
            "vocab_size": cfg.vocab_size, "padded_vocab_size": cfg.padded_vocab_size,
            "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
            "max_position_embeddings": cfg.max_position_embeddings,
            "normalization": cfg.normalization, "norm_eps": cfg.norm_eps,
            "activation": cfg.activation, "position_embedding": cfg.position_embedding,
            "rotary_base": cfg.rotary_base, "rotary_percent": cfg.rotary_percent,
            "rotary_interleaved": cfg.rotary_interleaved,
            "tied_embeddings": cfg.tied_embeddings, "add_bias_linear": cfg.add_bias_linear,
            "add_qkv_bias": cfg.add_qkv_bias, "qk_layernorm": cfg.qk_layernorm,
            "apply_layernorm_1p": cfg.apply_layernorm_1p,
            "moe": _moe(cfg.moe),
            "mla": dataclasses.asdict(cfg.mla) if cfg.mla is not None else None,
            "rope_yarn": dataclasses.asdict(cfg.rope_yarn) if cfg.rope_yarn is not None else None,
            "gemma": _gemma(cfg),
            **_maths(cfg),
            "mtp_num_layers": cfg.mtp_num_layers,  # multi-token prediction: layers num_layers .. after the decoder's
        },
        "vocab_size_source": cfg.vocab_size_source,
        "total_bytes": ckpt.total_bytes,
        "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                    for n, t in ckpt.tensors.items()],
        "optimizer": describe_optimizer(ckpt),
        # block-FP8 weights as stored (formats/hf/quant.py BlockFP8.describe); None for unquantized ones
        "quantization": src.extra.get("quantization"),
        "warnings": list(ckpt.warnings),
    }


def describe_optimizer(ckpt: Checkpoint):
    """The training state beside the weights, or None for a weights-only checkpoint."""
    opt = ckpt.optimizer
    if opt is None:
        return None
    dtypes = {slot: sorted({str(t.dtype).replace("torch.", "") for t in ts.values()}) for slot, ts in opt.slots.items()}
    return {"kind": opt.kind, "step": opt.step, "slots": opt.slot_names(), "dtypes": dtypes,
            "bytes": opt.total_bytes, "consumed_samples": opt.consumed_samples,
            "scheduler": opt.scheduler is not None, "grad_scaler": opt.grad_scaler is not None,
            "param_groups": [{"tensors": len(g.names),
                              **{k: g.hyper[k] for k in ("lr", "weight_decay", "wd_mult", "lr_mult", "max_lr", "min_lr")
                                 if k in g.hyper and isinstance(g.hyper[k], (int, float))}}
                             for g in opt.param_groups]}
