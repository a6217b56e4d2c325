"""Helper run as a plain subprocess (one process, gloo) with the real megatron-core package.

  python tests/mcore_flags_helper.py OUT VARIANT [VARIANT ...]

For each VARIANT (see VARIANTS: one Megatron argument that changes the maths) it builds a tiny
megatron-core GPTModel (local layer spec, CPU) with that setting, runs it on TOKENS and writes

  OUT/VARIANT/checkpoint/   a Megatron-LM torch-format checkpoint as Megatron-LM saves it
                            (latest_checkpointed_iteration.txt, iter_0000001/mp_rank_00/
                            model_optim_rng.pt holding args, checkpoint_version 3.0, iteration,
                            model = the model's state dict) with the args Megatron-LM's argument
                            parser gives for that flag (shared/reference/megatron.md section 2)
  OUT/VARIANT/logits.pt     {"tokens", "logits"} as megatron-core computed them.

apply_layernorm_1p is the one flag the CPU norm of megatron-core refuses (torch LayerNorm has no
zero-centred gamma); that variant is built as the plain model and stored with gamma - 1, which is
what Megatron stores for the same function (shared/reference/megatron.md: the norm uses 1 + w).
"""
import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

VOCAB, PADDED, SEQ = 100, 128, 16
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 70, 99, 4, 8, 15, 16, 23, 42, 7, 0, 3],
                       [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]])

GPT2 = dict(cfg=dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
            model=dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True),
            # Megatron-LM passes args.bias_gelu_fusion as config.bias_activation_fusion: off here, as
            # in the TransformerConfig above, unless a variant turns both on
            args=dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                      add_bias_linear=True, untie_embeddings_and_output_weights=False, bias_gelu_fusion=False))
LLAMA = dict(cfg=dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                      add_bias_linear=False, bias_activation_fusion=False),
             model=dict(position_embedding_type="rope", share_embeddings_and_output_weights=False),
             args=dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, group_query_attention=True, num_query_groups=2))

# variant -> (base, TransformerConfig changes, GPTModel changes, spec changes, args changes)
VARIANTS = {
    "gelu_exact": (GPT2, {}, {}, {}, {}),
    "bias_gelu_fusion": (GPT2, dict(bias_activation_fusion=True), {}, {}, dict(bias_gelu_fusion=True)),
    "openai_gelu": (GPT2, dict(activation_func=openai_gelu), {}, {}, dict(openai_gelu=True)),
    "squared_relu": (GPT2, dict(activation_func=squared_relu), {}, {}, dict(squared_relu=True)),
    "post_ln_residual": (GPT2, dict(apply_residual_connection_post_layernorm=True), {}, {},
                         dict(apply_residual_connection_post_layernorm=True)),
    "layernorm_eps": (GPT2, dict(layernorm_epsilon=0.5), {}, {}, dict(norm_epsilon=0.5)),
    "layernorm_1p": (GPT2, {}, {}, {}, dict(apply_layernorm_1p=True)),
    "qk_layernorm": (LLAMA, {}, {}, dict(qk_layernorm=True), dict(qk_layernorm=True)),
    "add_qkv_bias": (LLAMA, dict(add_qkv_bias=True), {}, {}, dict(add_qkv_bias=True)),
    "rotary_base": (LLAMA, {}, dict(rotary_base=37), {}, dict(rotary_base=37)),
    "rotary_percent": (LLAMA, {}, dict(rotary_percent=0.5), {}, dict(rotary_percent=0.5)),
    "rotary_interleaved": (LLAMA, dict(rotary_interleaved=True), {}, {}, dict(rotary_interleaved=True)),
    "rope_scaling": (LLAMA, {}, dict(rotary_base=1000000, rope_scaling=True, rope_scaling_factor=8.0), {},
                     dict(rotary_base=1000000, use_rope_scaling=True, rope_scaling_factor=8.0)),
    # several at once, for the tensor-parallel verify (one torchrun each)
    "combo_llama": (LLAMA, dict(add_qkv_bias=True, rotary_interleaved=True), dict(rotary_percent=0.5, rotary_base=37),
                    dict(qk_layernorm=True), dict(add_qkv_bias=True, rotary_interleaved=True, rotary_percent=0.5,
                                                  rotary_base=37, qk_layernorm=True)),
    "combo_gpt2": (GPT2, dict(activation_func=squared_relu, layernorm_epsilon=0.5), {}, {},
                   dict(squared_relu=True, norm_epsilon=0.5)),
}


def build(variant):
    base, cfg_ch, model_ch, spec_ch, _ = VARIANTS[variant]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(1234)
    cfg = TransformerConfig(use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, **{**base["cfg"], **cfg_ch})
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization, **spec_ch)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=PADDED, max_sequence_length=SEQ,
                     **{**base["model"], **model_ch})
    with torch.no_grad():  # weights large enough that a wrong activation or norm detail moves the logits
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15 if p.dim() > 1 else 0.3)
    model.eval()
    return model, cfg


def logits(model):
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model(TOKENS, pos, attention_mask=mask).float()


def megatron_args(variant, cfg):
    base, _, _, _, flags = VARIANTS[variant]
    args = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
                num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels,
                group_query_attention=False, num_query_groups=1, max_position_embeddings=SEQ, seq_length=SEQ,
                norm_epsilon=1e-5, vocab_size=VOCAB, padded_vocab_size=PADDED, make_vocab_size_divisible_by=128,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch",
                use_legacy_models=False, transformer_impl="local", tokenizer_type="NullTokenizer",
                # the NullTokenizer of Megatron-LM c9dfe34 (2026-04) on: vocab_size tokens, no EOD beyond them
                null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1,
                # Megatron-LM's parser defaults (arguments.py): fused bias-gelu on, the rest off
                bias_gelu_fusion=True, openai_gelu=False, squared_relu=False, apply_layernorm_1p=False,
                qk_layernorm=False, add_qkv_bias=False, rotary_base=10000, rotary_percent=1.0,
                rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0,
                apply_residual_connection_post_layernorm=False)
    args.update(base["args"])
    args.update(flags)
    return argparse.Namespace(**args)


def save(variant, out: Path):
    model, cfg = build(variant)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": TOKENS, "logits": logits(model)}, out / "logits.pt")
    sd = model.state_dict()
    if variant == "layernorm_1p":  # see the module docstring
        sd = {k: (v - 1 if k.endswith("layernorm.weight") else v) for k, v in sd.items()}
    ck = out / "checkpoint"
    (ck / "iter_0000001" / "mp_rank_00").mkdir(parents=True, exist_ok=True)
    torch.save({"args": megatron_args(variant, cfg), "checkpoint_version": 3.0, "iteration": 1, "model": sd},
               ck / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    (ck / "latest_checkpointed_iteration.txt").write_text("1")
    parallel_state.destroy_model_parallel()


def main():
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[1].split(":")[1] if ":" in sys.argv[1] else "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = Path(sys.argv[1].split(":")[0])
    for variant in sys.argv[2:]:
        save(variant, root / variant)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
