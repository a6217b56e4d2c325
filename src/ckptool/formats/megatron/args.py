"""Megatron's `args` (argparse.Namespace) <-> GPTConfig.

config_from_args reads the architecture from a training run's args (any Megatron era, Megatron-
DeepSpeed too); args_for_target writes args consistent with a new layout so Megatron's own
checkpoint checks (sizes, parallel sizes, padded vocab) accept the output.
"""
from __future__ import annotations

import argparse
import copy
import math
from typing import TYPE_CHECKING, Any, Dict, Optional

from ...config import MLA, MoE, GPTConfig, Layout, Yarn, moe_layers_megatron, yarn_mscale
from ...errors import CkptError, require
from . import buffers as megatron_buffers
from .buffers import FIRST_STAGE_ARGS, LAST_STAGE_ARGS, virtual_pipeline_size  # noqa: F401 (also this module's interface)

if TYPE_CHECKING:  # config_from_args runs without torch (quick inspect); args_for_target imports it
    import torch  # torch on use: the quick inspect computes configs with this module
# Tokenizers whose vocabulary size is fixed by the tokenizer itself.
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257}

# Megatron-LM's NullTokenizer had --vocab-size + 1 tokens, its end-of-document id being --vocab-size (megatron/core/
# tokenizers/text/libraries/null_tokenizer.py, and _NullTokenizer of megatron/training/tokenizer/tokenizer.py until
# 3257093930 removed that system on 2026-02-09), until Megatron-LM c9dfe34 (2026-04-22, "Enable NullTokenizer for
# pretraining to reduce I/O access", #4057): from there it has exactly --vocab-size tokens, EOD --vocab-size - 1.
# The same commit added --null-tokenizer-eod-id and --null-tokenizer-pad-id (default -1) to arguments.py, and a run
# pickles every parser field into its args: args holding null_tokenizer_pad_id come from c9dfe34 or later, args
# without it from an older run, whose EOD row is a real (trained) row. Megatron-DeepSpeed's NullTokenizer is the old
# one (its runs store universal_checkpoint_info.original_vocab_size = vocab_size + 1 as well).
NULL_TOKENIZER_ERA_FIELD = "null_tokenizer_pad_id"
# What a Megatron-LM run at or after c9dfe34 pickles for a NullTokenizer left at its defaults.
CURRENT_NULL_TOKENIZER = dict(tokenizer_type="NullTokenizer", null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1)


def _get(args, *names, default=None):
    for n in names:
        v = getattr(args, n, None)
        if v is not None:
            return v
    return default


def activation_from_args(args) -> str:
    if _get(args, "swiglu", default=False):
        return "swiglu"
    if _get(args, "quick_geglu", default=False):  # GPT-OSS
        return "quick_geglu"
    if _get(args, "gated_linear_unit", default=False):  # Gemma: GeGLU (see GEMMA_ARGS)
        require(_get(args, "openai_gelu", default=False), "a gated MLP with erf GeLU (gated_linear_unit without "
                "openai_gelu or --swiglu)", "ckptool computes gated SiLU (--swiglu) and Gemma's gated tanh GeLU")
        return "geglu"
    if _get(args, "squared_relu", default=False):
        return "squared_relu"
    if _get(args, "openai_gelu", default=False):
        return "gelu_tanh"
    # Megatron's fused bias-gelu kernel is the tanh approximation; it only runs with biases.
    if _get(args, "bias_gelu_fusion", default=False) and _get(args, "add_bias_linear", default=True):
        return "gelu_tanh"
    return "gelu"


def true_vocab_from_args(args, stored_rows: int, extra: Optional[dict] = None):
    """(true vocab size or None, which source said so), most reliable source first."""
    info = (extra or {}).get("universal_checkpoint_info") or {}
    orig = info.get("original_vocab_size") if isinstance(info, dict) else None
    if orig:
        return int(orig), "universal_checkpoint_info.original_vocab_size"
    tok = _get(args, "tokenizer_type")
    if tok in TOKENIZER_VOCAB:
        return TOKENIZER_VOCAB[tok], f"tokenizer_type {tok}"
    v = _get(args, "vocab_size")
    if v and tokenizer_tokens_beyond_vocab_size(args):
        return int(v) + 1, "args.vocab_size + the EOD row of a NullTokenizer before Megatron-LM c9dfe34"
    if v:
        return int(v), "args.vocab_size"
    return None, "unknown"


def tokenizer_tokens_beyond_vocab_size(args) -> int:
    """Tokens the run's tokenizer had beyond its --vocab-size: the EOD of a NullTokenizer older than Megatron-LM
    c9dfe34, told apart by the args field that commit introduced (see NULL_TOKENIZER_ERA_FIELD)."""
    old_null = _get(args, "tokenizer_type") == "NullTokenizer" and not hasattr(args, NULL_TOKENIZER_ERA_FIELD)
    return 1 if old_null else 0


def vocab_args(args, true_vocab: Optional[int]) -> Dict[str, Any]:
    """The args updates after which true_vocab_from_args reads true_vocab from args (None: no update): --vocab-size
    in the terms of the run's tokenizer (an old-era NullTokenizer counts its EOD beyond it), and for args naming no
    tokenizer (a source without Megatron args) the current NullTokenizer of that size, a neutral choice that
    Megatron-LM pads to the same rows (a run with --use-checkpoint-args takes it unless given
    --no-use-tokenizer-model-from-checkpoint-args and its own tokenizer). A tokenizer of fixed size
    (TOKENIZER_VOCAB) cannot be told another true vocabulary: left as it is."""
    if true_vocab is None or _get(args, "tokenizer_type") in TOKENIZER_VOCAB:
        return {}
    updates: Dict[str, Any] = {} if _get(args, "tokenizer_type") else dict(CURRENT_NULL_TOKENIZER)
    told = argparse.Namespace(**{**vars(args), **updates}) if args is not None else argparse.Namespace(**updates)
    updates["vocab_size"] = true_vocab - tokenizer_tokens_beyond_vocab_size(told)
    return updates


# Fields read as sizes or real numbers: a damaged or hand-edited args must give a clear error,
# not a TypeError deep in the maths. (None means "not set" and is always fine.)
POSITIVE_INT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "ffn_hidden_size", "make_vocab_size_divisible_by")
NONNEGATIVE_INT_ARGS = ("max_position_embeddings", "seq_length", "vocab_size", "padded_vocab_size")
REAL_ARGS = ("norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor")


def run_layout(args, cfg: GPTConfig) -> Layout:
    """The layout a torch_dist checkpoint's run trained at, from its args: TP, PP, its virtual pipeline
    size, EP for MoE models, and an uneven pipeline split where the first / last stage args give one.
    The files hold global tensors, so nothing is read by this layout: it is what inspect reports, what
    verify runs by default, what fix-vocab keeps."""
    tp = _get(args, "tensor_model_parallel_size", default=1) or 1
    pp = _get(args, "pipeline_model_parallel_size", default=1) or 1
    ep = (_get(args, "expert_model_parallel_size", default=1) or 1) if cfg.moe is not None else 1
    vpp = virtual_pipeline_size(args, cfg.num_layers)
    split = None
    if pp > 1 and vpp is None:
        try:
            split = megatron_buffers.stage_layers(args, cfg.num_layers, pp, "")
        except CkptError:  # args that do not fit the layers: the even split, as before they were read
            split = None
        if split is not None and len(set(split)) == 1:
            split = None
    return Layout(tp=int(tp), pp=int(pp), vpp=vpp, ep=int(ep), stage_layers=split)


def check_arg_types(args) -> None:
    def bad(name, value, want):
        return CkptError(f"the checkpoint's args hold {name}={value!r}, not {want}",
                         "the args are damaged; override the architecture with --num-attention-heads etc. "
                         "or restore the file")
    for names, low in ((POSITIVE_INT_ARGS, 1), (NONNEGATIVE_INT_ARGS, 0)):
        for name in names:
            v = getattr(args, name, None)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise bad(name, v, "a positive integer" if low else "a non-negative integer")
    for name in REAL_ARGS:
        v = getattr(args, name, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise bad(name, v, "a finite number")


def config_from_args(args, stored_rows: int, extra: Optional[dict] = None) -> GPTConfig:
    """The GPTConfig a Megatron run describes; stored_rows = word-embedding rows found on disk."""
    check_arg_types(args)
    num_layers = _get(args, "num_layers")
    hidden = _get(args, "hidden_size")
    heads = _get(args, "num_attention_heads")
    if not (num_layers and hidden and heads):
        raise CkptError("the checkpoint's args lack num_layers / hidden_size / num_attention_heads",
                        "give --num-layers, --hidden-size and --num-attention-heads")
    gqa = _get(args, "group_query_attention", default=False)
    groups = _get(args, "num_query_groups") if gqa else None
    pos = _get(args, "position_embedding_type", default="learned_absolute")
    if _get(args, "use_rotary_position_embeddings", default=False):
        pos = "rope"
    gpt_yarn = gpt_yarn_from_args(args) if pos == "yarn" else None  # GPT-OSS: YaRN on plain attention
    pos = {"learned_absolute": "learned", "rope": "rope", "yarn": "rope", "none": "none"}.get(str(pos), None)
    if pos is None:
        raise CkptError(f"unsupported position_embedding_type {args.position_embedding_type!r}",
                        "ckptool handles learned_absolute, rope, yarn and none")
    norm = str(_get(args, "normalization", default="LayerNorm")).lower()
    norm = {"layernorm": "layernorm", "rmsnorm": "rmsnorm"}.get(norm)
    if norm is None:
        raise CkptError(f"unsupported normalization {args.normalization!r}")
    vocab, vsource = true_vocab_from_args(args, stored_rows, extra)
    if vocab is not None and vocab > stored_rows:
        vocab, vsource = None, "unknown"
    mla = mla_from_args(args)
    rope_scaling = _get(args, "rope_scaling_factor") if _get(args, "use_rope_scaling", default=False) else None
    return GPTConfig(
        num_layers=int(num_layers), hidden_size=int(hidden), num_attention_heads=int(heads),
        num_query_groups=int(groups) if groups else None,
        head_dim=int(_get(args, "kv_channels", default=hidden // heads)),
        ffn_hidden_size=int(_get(args, "ffn_hidden_size", default=4 * hidden)),
        padded_vocab_size=int(stored_rows), vocab_size=vocab, vocab_size_source=vsource,
        make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", default=128)),
        max_position_embeddings=int(_get(args, "max_position_embeddings", "seq_length", default=0)),
        position_embedding=pos,
        rotary_base=float(_get(args, "rotary_base", default=10000)),
        rotary_percent=float(_get(args, "rotary_percent", default=1.0)),
        # megatron-core's MLA always rotates the rope part's interleaved pairs (rope_utils de-interleaves them first)
        # and refuses --rotary-interleaved, which is about the GQA rotary embedding
        rotary_interleaved=bool(_get(args, "rotary_interleaved", default=False)) or mla is not None,
        rope_scaling_factor=float(rope_scaling) if rope_scaling else None,
        normalization=norm,
        norm_eps=float(_get(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        activation=activation_from_args(args),
        add_bias_linear=bool(_get(args, "add_bias_linear", default=True)),
        add_qkv_bias=bool(_get(args, "add_qkv_bias", default=False) or _get(args, "add_bias_linear", default=True)),
        tied_embeddings=not _get(args, "untie_embeddings_and_output_weights", default=False),
        apply_layernorm_1p=bool(_get(args, "apply_layernorm_1p", default=False)),
        # under MLA megatron-core's --qk-layernorm builds the latent norms (the spec's mla roles), not q/k norms
        qk_layernorm=bool(_get(args, "qk_layernorm", default=False)) and mla is None,
        mla=mla, rope_yarn=gpt_yarn or yarn_from_args(args, mla),
        post_layernorm_residual=bool(_get(args, "apply_residual_connection_post_layernorm", default=False)),
        moe=moe_from_args(args, int(num_layers), int(_get(args, "ffn_hidden_size", default=4 * hidden))),
        **gemma_from_args(args, int(num_layers)),
        **gpt_oss_from_args(args),
        mtp_num_layers=int(_get(args, "mtp_num_layers", default=0) or 0),  # --mtp-num-layers (default None)
    )


# --- Gemma 2 / 3 (issue 32) -----------------------------------------------------------------------------
# How a run says Gemma's maths. megatron-core 0.16.1 has: layernorm_zero_centered_gamma (--apply-layernorm-1p: the
# stored weight w applied as 1 + w), gated_linear_unit (with openai_gelu: tanh GeLU), softmax_scale (the scores'
# scale), window_size (left, right) and window_attn_skip_freq (transformer/utils.py is_layer_window_attention:
# an int N makes layer_number % N != 0 local, a list gives 1 for each local layer; its mask lets a query see the
# `left` keys before it, so transformers' sliding_window W is window_size (W - 1, 0)). It has no embedding scaling,
# no post norms, no soft-capping, no second RoPE base: Megatron-Bridge's Gemma providers (src/megatron/bridge/
# models/gemma/gemma2_provider.py, gemma3_provider.py) add them as modules and keep query_pre_attn_scalar,
# attn_logit_softcapping and final_logit_softcapping as provider fields, which ckptool writes under those names;
# the rest under its own ckptool_* keys (docs/formats.md). GPTConfig field -> args key:
GEMMA_ARGS = {"query_pre_attn_scalar": "query_pre_attn_scalar", "attn_softcap": "attn_logit_softcapping",
              "final_softcap": "final_logit_softcapping", "embedding_scale": "ckptool_embedding_scale",
              "post_norms": "ckptool_post_norms", "rotary_base_local": "ckptool_rotary_base_local",
              "rope_linear_factor": "ckptool_rope_linear_factor"}


def local_layers_from_args(window, skip_freq, num_layers: int) -> tuple:
    """The 0-based local layers of megatron-core's window_attn_skip_freq (None: every layer)."""
    if skip_freq is None:
        return tuple(range(num_layers))
    if isinstance(skip_freq, int):
        return tuple(i for i in range(num_layers) if (i + 1) % skip_freq != 0)
    flags = list(skip_freq)
    require(len(flags) == num_layers, f"window_attn_skip_freq lists {len(flags)} layers, the model has {num_layers}")
    return tuple(i for i, f in enumerate(flags) if f)


def window_from_args(args, num_layers: int) -> Dict[str, Any]:
    """sliding_window and local_layers from megatron-core's window_size / window_attn_skip_freq."""
    window = _get(args, "window_size")
    if not window or int(window[0]) < 0:  # none, or megatron-core's -1: an infinite window
        return {}
    require(int(window[1]) == 0, f"window_size {tuple(window)} lets a query see {window[1]} later tokens: not causal",
            "ckptool computes causal sliding windows (window_size (left, 0)) only")
    local = local_layers_from_args(window, _get(args, "window_attn_skip_freq"), num_layers)
    return dict(sliding_window=int(window[0]) + 1, local_layers=local) if local else {}


def gemma_from_args(args, num_layers: int) -> Dict[str, Any]:
    """GPTConfig's Gemma fields from a run's args (GEMMA_ARGS); the query scalar from megatron-core's
    softmax_scale when only that is given (softmax_scale = query_pre_attn_scalar ** -0.5; MLA's scale is its own,
    mla_from_args / yarn_from_args)."""
    out = {field: _get(args, key) for field, key in GEMMA_ARGS.items() if _get(args, key) is not None}
    scale = _get(args, "softmax_scale")
    if "query_pre_attn_scalar" not in out and scale is not None and not _get(args, "multi_latent_attention"):
        scalar = 1.0 / float(scale) ** 2
        out["query_pre_attn_scalar"] = float(round(scalar)) if math.isclose(scalar, round(scalar)) else scalar
    out.update(window_from_args(args, num_layers))
    return out


def gemma_args(cfg: GPTConfig) -> Dict[str, Any]:
    """The args of a run computing cfg's Gemma maths (the inverse of gemma_from_args), cleared for a model
    without them (a source's window must not outlive a conversion that dropped it)."""
    out: Dict[str, Any] = {key: getattr(cfg, field) or None for field, key in GEMMA_ARGS.items()}
    out["softmax_scale"] = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
    out["gated_linear_unit"] = cfg.activation == "geglu" or None
    if cfg.sliding_window is None:
        out.update(window_size=None, window_attn_skip_freq=None)
    else:
        out.update(window_size=(cfg.sliding_window - 1, 0),
                   window_attn_skip_freq=[int(cfg.is_local_layer(i)) for i in range(cfg.num_layers)])
    return out


# --- GPT-OSS (issue 32): sinks, sliding windows, clamped GLU, YaRN on plain attention -------------------------
# megatron-core 0.16: TransformerConfig.softmax_type / window_size / window_attn_skip_freq / glu_linear_offset /
# activation_func_clamp_value (Megatron-LM's --softmax-type, --window-size, --window-attn-skip-freq,
# --glu-linear-offset, --activation-func-clamp-value, --quick-geglu). window_size (left, right): query q sees keys
# q - left .. q + right (transformer/utils.py get_sliding_window_causal_mask; TE's rule alike), so transformers'
# sliding_window W (keys q - W < k <= q) is (W - 1, 0). Megatron-LM's GPT-OSS example passes --window-size 128,0,
# which sees 129 keys where the released model sees 128. The windows are read and written with Gemma's
# (window_from_args, gemma_args above: one rule for every windowed model).

def gpt_oss_from_args(args) -> dict:
    """The GPT-OSS fields of GPTConfig a run's args set (none for other runs)."""
    softmax = _get(args, "softmax_type", default="vanilla")
    require(softmax in ("vanilla", "learnable"), f"--softmax-type {softmax} (a fixed sink of zero) is not supported",
            "ckptool computes vanilla and learnable (attention sinks) softmax")
    clamp = _get(args, "activation_func_clamp_value")
    return dict(attn_sinks=softmax == "learnable", glu_clamp=float(clamp) if clamp is not None else None,
                glu_linear_offset=float(_get(args, "glu_linear_offset", default=0.0)))


def gpt_yarn_from_args(args) -> Yarn:
    """YaRN of a GPT (non-MLA) model, from the yarn_* config attributes megatron-core's GPTModel reads (getattr: not
    TransformerConfig fields; Megatron-Bridge's providers set them) for position_embedding_type 'yarn'. It multiplies
    cos/sin by its concentration factor (_yarn_get_concentration_factor: the plain correction unless both mscales
    are set, then their ratio)."""
    factor = float(_get(args, "yarn_rotary_scaling_factor", default=1.0))
    mscale, mscale_all_dim = _get(args, "yarn_mscale"), _get(args, "yarn_mscale_all_dim")
    gain = yarn_mscale(factor) if mscale is None or mscale_all_dim is None else \
        yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return Yarn(factor=factor, original_max_position_embeddings=int(_get(args, "yarn_original_max_position_embeddings",
                                                                         default=4096)),
                beta_fast=float(_get(args, "yarn_beta_fast", default=32.0)),
                beta_slow=float(_get(args, "yarn_beta_slow", default=1.0)),
                attention_factor=None if math.isclose(gain, yarn_mscale(factor), rel_tol=1e-12) else gain,
                truncate=bool(_get(args, "yarn_correction_range_round_to_int", default=True)))


def refuse_biased_experts_cut(cfg: GPTConfig, layout: Layout) -> None:
    """megatron-core 0.16 builds MoE layers with linear biases (GPT-OSS) only at expert tensor-parallel size 1
    (TransformerConfig.__post_init__: "Bias in Moe is only supported when ETP==1")."""
    if cfg.moe is not None and cfg.add_bias_linear and layout.expert_tp != 1:
        raise CkptError(f"expert tensor parallelism {layout.expert_tp} for MoE experts with linear biases "
                        "(--add-bias-linear): megatron-core builds biased experts only at expert TP 1",
                        "give --etp 1 (each expert whole on its EP rank; TP still splits the attention)")


# Megatron-LM's defaults of the GPT-OSS flags (a run without them computes none of it)
GPT_OSS_DEFAULTS = dict(quick_geglu=False, softmax_type="vanilla", glu_linear_offset=0.0,
                        activation_func_clamp_value=None)


def gpt_oss_args(cfg: GPTConfig) -> Dict[str, Any]:
    """The args of a run computing cfg's GPT-OSS maths (the inverse of gpt_oss_from_args and gpt_yarn_from_args), at
    Megatron-LM's defaults for what the model does not use."""
    out: Dict[str, Any] = dict(  # (its windows: gemma_args)
        quick_geglu=cfg.activation == "quick_geglu", softmax_type="learnable" if cfg.attn_sinks else "vanilla",
        glu_linear_offset=cfg.glu_linear_offset, activation_func_clamp_value=cfg.glu_clamp)
    y = cfg.rope_yarn
    if y is not None and cfg.mla is None:
        # attention_gain whatever its source (the plain correction, the mscales' ratio, an explicit factor): the
        # mscales as megatron-core needs them to multiply cos/sin by exactly that
        plain = math.isclose(y.attention_gain, yarn_mscale(y.factor), rel_tol=1e-12)
        require(plain or y.factor > 1, f"YaRN at factor {y.factor} with an attention factor {y.attention_gain}",
                "megatron-core's YaRN has gain 1 at factor <= 1")
        mscale = 1.0 if plain else (y.attention_gain - 1) / (0.1 * math.log(y.factor))
        out.update(position_embedding_type="yarn", yarn_rotary_scaling_factor=y.factor,
                   yarn_original_max_position_embeddings=y.original_max_position_embeddings, yarn_beta_fast=y.beta_fast,
                   yarn_beta_slow=y.beta_slow, yarn_mscale=mscale, yarn_mscale_all_dim=0.0,
                   yarn_correction_range_round_to_int=y.truncate)
    return out


def mla_from_args(args) -> Optional[MLA]:
    """Multi-Latent Attention from megatron-core's flags (--multi-latent-attention); the latent norms use the
    model's norm epsilon there."""
    if not _get(args, "multi_latent_attention", default=False):
        return None
    q_lora = _get(args, "q_lora_rank")
    return MLA(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(_get(args, "kv_lora_rank")),
               qk_nope_head_dim=int(_get(args, "qk_head_dim")), qk_rope_head_dim=int(_get(args, "qk_pos_emb_head_dim")),
               v_head_dim=int(_get(args, "v_head_dim")),
               latent_norm_eps=float(_get(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)))


def mla_args(mla: Optional[MLA], yarn: Optional[Yarn]) -> Dict[str, Any]:
    """The MLA flags of a run that computes mla with yarn (the inverse of mla_from_args and yarn_from_args; yarn
    has no default: leaving it out would write plain RoPE for a YaRN model); megatron-core builds the latent
    norms only under --qk-layernorm, and rotates MLA's rope in interleaved pairs without --rotary-interleaved."""
    if mla is None:
        return {}
    return dict(multi_latent_attention=True, qk_layernorm=True, rotary_interleaved=False, q_lora_rank=mla.q_lora_rank,
                kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
                qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, **mla_rope_args(yarn))


# megatron-core's MLA rotary (MLATransformerConfig; MultiLatentAttention builds RotaryEmbedding or
# YarnRotaryEmbedding from it). --rope-type, --rotary-scaling-factor, --mscale and --mscale-all-dim are
# Megatron-LM flags; original_max_position_embeddings / beta_fast / beta_slow are config fields without a
# flag (Megatron-LM's core_transformer_config_from_args copies every args attribute named like a field):
# their config defaults apply to a run that does not set them.
MCORE_YARN_DEFAULTS = dict(original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)


def _mcore_yarn_gain(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """megatron-core's concentration factor on cos/sin: always the ratio of the two mscales (its flags
    default to 1 and 0, so an unset --mscale-all-dim leaves the plain correction of the factor)."""
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)


def yarn_from_args(args, mla: Optional[MLA]) -> Optional[Yarn]:
    """The YaRN scaling an MLA run computed (None: plain RoPE). megatron-core's MLATransformerConfig defaults
    rope_type to yarn, and Megatron-LM leaves it there when --rope-type is not given; YaRN at factor 1 is
    plain RoPE (the same frequencies, gains of 1). The softmax scale takes --mscale-all-dim under either
    rope type, so plain RoPE with a stretched softmax is refused: no Hugging Face model computes it."""
    if mla is None:
        return None
    rope_type = _get(args, "rope_type") or "yarn"
    factor = float(_get(args, "rotary_scaling_factor", default=1.0))
    mscale = float(_get(args, "mscale", default=1.0))
    mscale_all_dim = float(_get(args, "mscale_all_dim", default=0.0))
    if rope_type not in ("rope", "yarn"):
        raise CkptError(f"Multi-Latent Attention with --rope-type {rope_type!r}", "megatron-core knows rope and yarn")
    if rope_type == "rope" or factor == 1.0:
        require(yarn_mscale(factor, mscale_all_dim) == 1.0,
                f"Multi-Latent Attention with plain RoPE but --rotary-scaling-factor {factor} and --mscale-all-dim "
                f"{mscale_all_dim}: megatron-core scales the softmax by {yarn_mscale(factor, mscale_all_dim) ** 2:.6g} "
                "without YaRN frequencies", "no Hugging Face model computes that; such checkpoints are not supported")
        return None
    kept = {k: type(v)(_get(args, k, default=v)) for k, v in MCORE_YARN_DEFAULTS.items()}
    yarn = Yarn(factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim or None, truncate=True, **kept)
    gain = _mcore_yarn_gain(factor, mscale, mscale_all_dim)
    if not math.isclose(yarn.attention_gain, gain, rel_tol=1e-12):  # e.g. --mscale without --mscale-all-dim
        yarn = Yarn(factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim or None, attention_factor=gain,
                    truncate=True, **kept)
    return yarn


def mla_rope_args(yarn: Optional[Yarn]) -> Dict[str, Any]:
    """The rotary flags of an MLA run computing yarn (None: plain RoPE), refusing what megatron-core cannot."""
    if yarn is None:  # named explicitly: an unset --rope-type means yarn to megatron-core's MLA
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    hint = "use to-hf (transformers computes it), or change the model's rope_scaling"
    require(yarn.truncate, "Multi-Latent Attention with YaRN truncate=false: megatron-core's MLA always rounds the "
            "correction range to whole dimensions", hint)
    mscale_all_dim = yarn.mscale_all_dim or 0.0
    if yarn.attention_factor is None and yarn.mscale and yarn.mscale_all_dim:
        mscale = yarn.mscale  # both take the ratio of the two mscales
    elif yarn.attention_factor is None and not yarn.mscale_all_dim:
        mscale = 1.0  # transformers takes the plain correction of the factor, ignoring mscale
    elif yarn.factor > 1:
        # an explicit attention factor, or mscale_all_dim without mscale (transformers: the plain correction):
        # megatron-core's gain (0.1 mscale ln f + 1) / mscale_all_dim's correction is linear in mscale, so the
        # mscale giving transformers' gain exists (exact up to rounding, about 1e-16)
        mscale = (yarn.attention_gain * yarn_mscale(yarn.factor, mscale_all_dim) - 1) / (0.1 * math.log(yarn.factor))
    else:
        mscale = 1.0  # no stretch: megatron-core's gain is 1 whatever the mscales
    gain = _mcore_yarn_gain(yarn.factor, mscale, mscale_all_dim)
    require(math.isclose(gain, yarn.attention_gain, rel_tol=1e-12),
            f"Multi-Latent Attention with a YaRN attention factor of {yarn.attention_gain:.6g} at factor {yarn.factor}: "
            f"megatron-core's MLA multiplies cos/sin by {gain:.6g} there", hint)
    return dict(rope_type="yarn", rotary_scaling_factor=yarn.factor, mscale=mscale, mscale_all_dim=mscale_all_dim,
                original_max_position_embeddings=yarn.original_max_position_embeddings, beta_fast=yarn.beta_fast,
                beta_slow=yarn.beta_slow)


def moe_from_args(args, num_layers: int, ffn: int) -> Optional[MoE]:
    """The routing maths of Megatron's --num-experts run (None for a dense one).

    Megatron's TopKRouter: softmax scores with --moe-router-pre-softmax are softmax over all experts, then
    the top k (not renormalised); without it the top k LOGITS are chosen and softmaxed among themselves,
    which is softmax, top k, renormalised. Sigmoid scores are renormalised over the chosen ones when
    top-k > 1. Group-limited routing scores a group by the sum of its top (top-k / groups chosen) scores;
    ckptool's MoE has DeepSeek's two, so other ratios are refused."""
    experts = _get(args, "num_experts")
    if isinstance(experts, (list, tuple)):  # Megatron-DeepSpeed: experts per layer group, [1] when dense
        if all(n == 1 for n in experts):
            return None
        raise CkptError(f"Megatron-DeepSpeed MoE (--num-experts {' '.join(map(str, experts))})",
                        "DeepSpeed-MoE checkpoints are not supported; ckptool reads megatron-core MoE")
    if not experts:
        return None
    top_k = int(_get(args, "moe_router_topk", default=2))
    score = str(_get(args, "moe_router_score_function", default="softmax"))
    if score == "softmax":
        topk_norm = not _get(args, "moe_router_pre_softmax", default=False)
    else:
        topk_norm = top_k > 1
    groups = int(_get(args, "moe_router_num_groups", default=1) or 1)
    group_topk = int(_get(args, "moe_router_group_topk", default=1) or 1)
    if groups > 1 and top_k // group_topk != 2:
        raise CkptError(f"group-limited routing scoring each group by its best {top_k // group_topk} experts "
                        f"(--moe-router-topk {top_k} / --moe-router-group-topk {group_topk})",
                        "ckptool computes DeepSeek's rule (a group's two best); such checkpoints are not supported")
    capacity = _get(args, "moe_expert_capacity_factor")
    if capacity is not None:
        raise CkptError(f"--moe-expert-capacity-factor {capacity}: tokens beyond an expert's capacity were dropped",
                        "ckptool converts dropless MoE models only")
    return MoE(num_experts=int(experts), top_k=top_k,
               ffn_hidden_size=int(_get(args, "moe_ffn_hidden_size", default=ffn)),
               layers=moe_layers_megatron(num_layers, _get(args, "moe_layer_freq", default=1)),
               score_function=score, topk_norm=topk_norm,
               scaling_factor=float(_get(args, "moe_router_topk_scaling_factor", default=1.0)),
               # megatron-core's TopKRouter has a bias exactly when every linear has one (--add-bias-linear;
               # there is no router-only flag); such MoE runs are refused by their expert biases' keys
               router_bias=bool(_get(args, "add_bias_linear", default=False)),
               expert_bias=bool(_get(args, "moe_router_enable_expert_bias", default=False)),
               shared_ffn_hidden_size=int(_get(args, "moe_shared_expert_intermediate_size", default=0) or 0),
               shared_gate=bool(_get(args, "moe_shared_expert_gate", default=False)),
               num_groups=groups, group_topk=group_topk)


# How else a run's args may say its pipeline split (Megatron-LM arguments.py): args_for_target writes the target's
# with num_layers_per_virtual_pipeline_stage and the first / last stage sizes, and clears these.
PIPELINE_SPLIT_ARGS = ("num_virtual_stages_per_pipeline_rank", "pipeline_model_parallel_layout") + \
    FIRST_STAGE_ARGS + LAST_STAGE_ARGS


def dense_moe_args(layout: Layout) -> Dict[str, Any]:
    """The flags moe_args writes, as a dense run at layout has them: megatron-core 0.16's TransformerConfig /
    Megatron-LM's defaults (expert TP defaults to TP). A dense model's args must not keep --num-experts:
    Megatron-LM builds the MoE block spec whenever it is set (gpt_builders.py) and counts MoE layers for its
    aux-loss logs by --moe-layer-freq, and a --moe-layer-freq list keys the torch_dist layers one by one
    (transformer_block.py) where a dense model's are stacked."""
    return dict(num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_layer_freq=1,
                moe_router_score_function="softmax", moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_router_num_groups=None,
                moe_router_group_topk=None, moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False,
                expert_model_parallel_size=1, expert_tensor_parallel_size=layout.tp)


def moe_args(moe: Optional[MoE], num_layers: int, layout: Layout, grouped_gemm: bool = False) -> Dict[str, Any]:
    """The MoE flags of a run that computes moe (the inverse of moe_from_args), at layout's EP and expert TP;
    grouped_gemm: the run's experts are TEGroupedMLP (--moe-grouped-gemm), else SequentialMLP."""
    if moe is None:
        return {}
    if moe.score_function == "softmax":
        pre_softmax = not moe.topk_norm
    else:
        if moe.topk_norm != (moe.top_k > 1):
            raise CkptError(f"sigmoid routing {'with' if moe.topk_norm else 'without'} top-k renormalisation at "
                            f"top-k {moe.top_k}", "Megatron renormalises sigmoid scores exactly when top-k > 1")
        pre_softmax = False
    if moe.num_groups > 1 and moe.top_k // moe.group_topk != 2:
        raise CkptError(f"group-limited routing with top-k {moe.top_k} over {moe.group_topk} groups",
                        "Megatron scores a group by its best top-k / group-topk experts; ckptool's rule is two")
    layers = set(moe.layers)
    return dict(num_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.ffn_hidden_size,
                moe_layer_freq=[int(i in layers) for i in range(num_layers)],
                moe_router_score_function=moe.score_function, moe_router_pre_softmax=pre_softmax,
                moe_router_topk_scaling_factor=None if moe.scaling_factor == 1.0 else moe.scaling_factor,
                moe_router_enable_expert_bias=moe.expert_bias,
                moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
                moe_shared_expert_gate=moe.shared_gate,
                moe_router_num_groups=moe.num_groups if moe.num_groups > 1 else None,
                moe_router_group_topk=moe.group_topk if moe.num_groups > 1 else None,
                moe_grouped_gemm=grouped_gemm, moe_use_legacy_grouped_gemm=False, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.expert_tp)


# Megatron-LM (0.16) args that change what a layer computes and that ckptool's maths (the reference forward, to-hf)
# does not have: (arg, whether its value sets it, the flag). Such runs still convert between Megatron layouts (the
# tensors move as they are, the args go along); an export to a model that would compute otherwise is refused.
NOT_COMPUTED_ARGS = (
    ("rotary_seq_len_interpolation_factor", lambda v: v not in (None, 1), "--rotary-seq-len-interpolation-factor"),
    ("no_rope_freq", bool, "--no-rope-freq"),  # layers without rotary embedding
    ("qk_l2_norm", bool, "--qk-l2-norm"),
)


def maths_not_computed(args) -> list:
    """The flags of NOT_COMPUTED_ARGS these args set (none for args None)."""
    return [flag for name, sets, flag in NOT_COMPUTED_ARGS if sets(getattr(args, name, None))]


def as_megatron_core_computes(cfg: GPTConfig):
    """(cfg, note): the maths a run of megatron-core layers did with these args.

    megatron-core's TransformerLayer never reads apply_residual_connection_post_layernorm (only the
    legacy ParallelTransformerLayer does), so such a run computed the plain pre-norm residual even
    with the flag set; honouring it would reproduce a model that never ran.
    """
    if cfg.post_layernorm_residual:
        return cfg.replace(post_layernorm_residual=False), (
            "args set apply_residual_connection_post_layernorm, which megatron-core layers ignore: "
            "read as the pre-norm residual that Megatron computed")
    return cfg, None


def refuse_what_megatron_core_ignores(cfg: GPTConfig, hint: str) -> None:
    """Writing for megatron-core layers (the mcore dialects, every torch_dist checkpoint): a flag
    they ignore would make the written checkpoint run as another model (see above)."""
    if cfg.post_layernorm_residual:
        raise CkptError("the model uses --apply-residual-connection-post-layernorm, which megatron-core "
                        "layers ignore", hint)


# The fields Megatron-LM's validate_args needs and has no default for, that a run resuming with --use-checkpoint-args
# and tools/checkpoint's loaders (loader_base.py parse_megatron_args) take from the checkpoint's args (Megatron-LM
# d98e8a64, 2026-08-22; the files' line numbers there). tests/test_megatron_args_out.py checks written args hold each.
VALIDATE_ARGS_REQUIRED = (
    ("num_layers", "megatron/training/arguments.py:1304-1316 (required_args; copied by checkpointing.py:2272)"),
    ("hidden_size", "megatron/training/arguments.py:1314-1316 (required_args; checkpointing.py:2273)"),
    ("num_attention_heads", "megatron/training/arguments.py:1314-1316 (required_args; checkpointing.py:2276)"),
    ("max_position_embeddings", "megatron/training/arguments.py:1314-1316 (required_args; checkpointing.py:2280)"),
    ("seq_length", "megatron/training/arguments.py:1346-1351 (else encoder_seq_length, which load_args_from_checkpoint "
                   "does not copy: checkpointing.py:2275 copies seq_length only)"),
    ("tokenizer_type", "tools/checkpoint/loader_base.py:121 ensure_required_arguments (checkpointing.py:2347 copies "
                       "it under the default --use-tokenizer-model-from-checkpoint-args)"),
    ("fp16", "tools/checkpoint/loader_base.py:65 copies checkpoint_args.fp16 without a default; validate_args "
             "derives params_dtype from it"),
    ("bf16", "tools/checkpoint/loader_base.py:66 copies checkpoint_args.bf16 without a default"),
)


def run_args_missing(args, cfg: GPTConfig) -> Dict[str, Any]:
    """What a Megatron-LM run records and args lack (a source without Megatron args: from-hf; args older than a field),
    so validate_args accepts the written args (VALIDATE_ARGS_REQUIRED). From the model where it says it: the sequence
    length is its position range (max_position_embeddings, which validate_args requires >= seq_length); the batch
    sizes a run records are the neutral 1 (a run gives its own: load_args_from_checkpoint does not copy them)."""
    seq = getattr(args, "seq_length", None) or cfg.max_position_embeddings or None
    wanted = dict(seq_length=seq, encoder_seq_length=seq, micro_batch_size=1, global_batch_size=1)
    return {k: v for k, v in wanted.items() if getattr(args, k, None) is None and v is not None}


def args_for_target(source_args, cfg: GPTConfig, layout: Layout, padded_rows: int,
                    dtype: torch.dtype, legacy_models: bool, transformer_impl: str,
                    checkpoint_version: float, iteration: Optional[int], grouped_gemm: bool = False) -> argparse.Namespace:
    """args for a written checkpoint: the source's run settings, this layout's sizes (grouped_gemm: see moe_args)."""
    import torch  # torch on use: the quick inspect computes configs with this module
    args = copy.copy(source_args) if source_args is not None else argparse.Namespace()
    vpp = layout.vpp
    per_vstage = cfg.num_layers // (layout.pp * vpp) if vpp else None
    updates: Dict[str, Any] = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.head_dim,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        max_position_embeddings=cfg.max_position_embeddings,
        padded_vocab_size=padded_rows,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=per_vstage,
        position_embedding_type={"learned": "learned_absolute", "rope": "rope", "none": "none"}[
            cfg.position_embedding],
        rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent,
        rotary_interleaved=cfg.rotary_interleaved,
        swiglu=cfg.activation == "swiglu", squared_relu=cfg.activation == "squared_relu",
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.norm_eps, layernorm_epsilon=cfg.norm_eps,
        untie_embeddings_and_output_weights=not cfg.tied_embeddings,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        apply_layernorm_1p=cfg.apply_layernorm_1p, qk_layernorm=cfg.qk_layernorm,
        apply_residual_connection_post_layernorm=cfg.post_layernorm_residual,
        use_legacy_models=legacy_models, transformer_impl=transformer_impl,
        ckpt_format="torch", params_dtype=dtype,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16,
    )
    if cfg.moe is not None:
        updates.update(moe_args(cfg.moe, cfg.num_layers, layout, grouped_gemm))
    else:  # a dense run: the MoE flags the source's args carry (Megatron-LM stores them all) at their defaults
        updates.update({k: v for k, v in dense_moe_args(layout).items() if getattr(args, k, None) is not None})
    updates.update(mla_args(cfg.mla, cfg.rope_yarn))
    updates.update({k: v for k, v in gemma_args(cfg).items() if v is not None or getattr(args, k, None) is not None})
    # --mtp-num-layers: None when the model has no MTP layers (Megatron-LM's default)
    if cfg.mtp_num_layers or getattr(args, "mtp_num_layers", None) is not None:
        updates["mtp_num_layers"] = cfg.mtp_num_layers or None
    # GPT-OSS's flags where the model uses them or the source's args carry them (args of other runs stay as they were)
    updates.update({k: v for k, v in gpt_oss_args(cfg).items()
                    if hasattr(args, k) or k not in GPT_OSS_DEFAULTS or GPT_OSS_DEFAULTS[k] != v})
    # the pipeline said one way, this layout's: the source's other ways of saying it go (Megatron-LM's
    # validate_args refuses args holding two ways of saying the virtual pipeline, and first / last stage sizes
    # the layout does not have would describe other files); uneven stages are set again below
    for k in PIPELINE_SPLIT_ARGS:
        if getattr(args, k, None) is not None:
            updates[k] = None
    updates.update(vocab_args(args, cfg.vocab_size))
    updates.update(run_args_missing(args, cfg))
    updates.update(_written_ways(args, cfg, layout, checkpoint_version, iteration))
    for k, v in updates.items():
        setattr(args, k, v)
    return args


def _written_ways(args, cfg: GPTConfig, layout: Layout, checkpoint_version: float, iteration: Optional[int]) -> dict:
    """The args that say a fact one of several ways (tanh GeLU, RoPE scaling, uneven stages, the pre-3.0
    model-parallel size) as the target says it, and the iteration."""
    updates: Dict[str, Any] = {}
    if cfg.activation == "geglu":  # Gemma: gated_linear_unit (gemma_args) with the tanh GeLU
        updates["openai_gelu"] = True
    if cfg.activation == "gelu_tanh":
        # Keep the source's way of asking for tanh GeLU; default to openai_gelu.
        if not (getattr(args, "bias_gelu_fusion", False) and cfg.add_bias_linear):
            updates["openai_gelu"] = True
    elif cfg.activation == "gelu":
        updates.update(openai_gelu=False, bias_gelu_fusion=False)
    if cfg.rope_scaling_factor:
        updates.update(use_rope_scaling=True, rope_scaling_factor=cfg.rope_scaling_factor)
    if layout.stage_layers:
        first, last = layout.stage_layers[0], layout.stage_layers[-1]
        updates.update(decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    if checkpoint_version < 3:
        updates["model_parallel_size"] = layout.tp
    if iteration is not None:
        updates["iteration"] = iteration
    return updates
