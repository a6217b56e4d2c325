"""Build a random Hugging Face MoE model with transformers and save it (safetensors), for the GPU
verify runs of scripts/gpu_moe_verify.sh. Nothing is downloaded: transformers builds the model from
a config written here.

  python scripts/make_hf_moe.py OUT --family mixtral --size 16x1024     # 16 experts, hidden 1024
  python scripts/make_hf_moe.py OUT --family qwen3_moe --size tiny       # a CPU smoke-test size
  python scripts/make_hf_moe.py OUT --family deepseek_v3 --size tiny     # MLA + YaRN + group routing

Weights are moved off transformers' init (norms in [0.5, 1.5], the rest normal with std 0.02) so a
wrong expert, gate or half moves the logits far past verify's tolerance.
"""
import argparse
import json
import time

import torch
import transformers

SIZES = {  # hidden, layers, heads, kv heads, experts, top-k, expert ffn, vocab
    "16x1024": dict(hidden=1024, layers=8, heads=16, kv=4, experts=16, top_k=2, ffn=1536, vocab=32000),
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, experts=8, top_k=2, ffn=48, vocab=512),
}


def build(family: str, s: dict):
    common = dict(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["kv"], vocab_size=s["vocab"], max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=s["ffn"], num_local_experts=s["experts"],
                                         num_experts_per_tok=s["top_k"])
        return transformers.MixtralForCausalLM(cfg)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=s["hidden"] // s["heads"], intermediate_size=s["ffn"] * 2,
                                          moe_intermediate_size=s["ffn"], num_experts=s["experts"],
                                          num_experts_per_tok=s["top_k"], norm_topk_prob=True, decoder_sparse_step=1,
                                          mlp_only_layers=[])
        return transformers.Qwen3MoeForCausalLM(cfg)
    if family == "deepseek_v3":  # Multi-Latent Attention with DeepSeek-V3's own YaRN (factor 40, mscales 1), dense
        # layer 0, a shared expert, sigmoid routing from the best 2 of 4 groups (top-4: Megatron's group rule is
        # the same then), as megatron-core computes it; transformers' latent norms have eps 1e-6, and megatron-core
        # one eps for all norms
        head = s["hidden"] // s["heads"]
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        cfg = transformers.DeepseekV3Config(
            **dict(common, num_key_value_heads=s["heads"], rms_norm_eps=1e-6), intermediate_size=s["ffn"] * 2, moe_intermediate_size=s["ffn"],
            n_routed_experts=s["experts"], n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=s["hidden"] * 3 // 8,
            kv_lora_rank=s["hidden"] // 4, qk_nope_head_dim=head, qk_rope_head_dim=head // 2, v_head_dim=head,
            rope_parameters=yarn)
        return transformers.DeepseekV3ForCausalLM(cfg)
    raise SystemExit(f"unknown family {family}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--family", choices=["mixtral", "qwen3_moe", "deepseek_v3"], default="mixtral")
    ap.add_argument("--size", choices=sorted(SIZES), default="16x1024")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype the weights are saved in")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    t0 = time.time()
    model = build(a.family, SIZES[a.size])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.02)
    model = model.to(torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    model.save_pretrained(a.out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"family": a.family, "size": a.size, "params": params, "dtype": a.dtype,
                      "seconds": round(time.time() - t0, 2)}))


if __name__ == "__main__":
    main()
