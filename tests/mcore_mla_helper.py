"""torchrun (gloo, CPU) helper: megatron-core 0.16's own GPTModel with Multi-Latent Attention (local spec,
MLASelfAttention, --qk-layernorm for the latent norms) built from the args in a Megatron torch checkpoint
ckptool wrote, loaded strictly (every parameter found, nothing left over), and its logits for TOKENS,
gathered over TP, saved to --out with its parameter names in order and how many MoE layers megatron-core built
from the args. World size = TP x DP (PP 1, dense MLP layers; --tp, default the world size: at DP > 1 every DP rank
loads the same files, as a Megatron-LM run at that DP does, and the first writes --out).

YaRN (--rope-type yarn) is megatron-core's YarnRotaryEmbedding, built from the checkpoint's args.

--save-dist DIR2: then megatron-core's own dist_checkpointing saves that model as torch_dist into DIR2 (with the
args, ckpt_format torch_dist, as Megatron-LM's save does). --dist: DIR is a torch_dist checkpoint (tracker +
iteration dir with common.pt) to build the model from its args and load with dist_checkpointing.load, then
load_state_dict(strict=True) (every sharded tensor and extra-state object found, nothing left over).

megatron-core's MLA asks its core attention for k_channels != v_channels, which only Transformer Engine's
DotProductAttention takes (TE does not install on this CPU machine): HeadDimsAttention below stands in for that
one kernel (causal softmax(q k^T * softmax_scale) v); every projection, norm, rope split and rotation, and the
TP layout are megatron-core's own.

Usage: torchrun --nproc-per-node N tests/mcore_mla_helper.py JOB...: each argument one job
'DIR [--tp T] [--dist] [--save-dist DIR2] --out FILE', run in turn in one gloo process group (one start of
megatron-core for all: importing it is the slow part).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import MLATransformerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_dist_helper import logits, run_jobs  # noqa: E402  (CPU shims: explicit causal mask, TP gather; the job loop)

# megatron-core 0.16's MLA tests isinstance(linear, TELinear); without Transformer Engine the name is None or a
# placeholder object, which isinstance refuses. A class nothing is an instance of says what it means: no TE linear.
from megatron.core.transformer import multi_latent_attention as _mla  # noqa: E402
for _name in ("TELinear", "TEColumnParallelLinear"):
    if not isinstance(getattr(_mla, _name, None), type):
        setattr(_mla, _name, type(f"No{_name}", (), {}))


ROPE_FIELDS = ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
               "beta_fast", "beta_slow")
# (megatron-core 0.16's YarnRotaryEmbedding puts its frequencies on torch.cuda.current_device() in every forward:
# mcore_dist_helper's CPU shims answer "cpu")


class HeadDimsAttention(torch.nn.Module):
    """softmax(q k^T * scale, causal) v per head, for q/k head size k_channels and v head size v_channels."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, **unused):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **unused):
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [b, h, s, dv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def run_job(a) -> None:
    """One job (see the module docstring) in the process group already started."""
    tp = a.tp or dist.get_world_size()
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if a.dist:  # the run's args from the common state; the tensors below, resharded to this TP on load
        it_dir = Path(a.dir) / f"iter_{int((Path(a.dir) / 'latest_checkpointed_iteration.txt').read_text()):07d}"
        args = torch.load(it_dir / "common.pt", weights_only=False)["args"]
        assert args.ckpt_format == "torch_dist" and args.transformer_impl == "local"
    else:
        sd = torch.load(Path(a.dir) / "iter_0000000" / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt",
                        weights_only=False)
        args = sd["args"]
        assert args.tensor_model_parallel_size == tp
    assert args.multi_latent_attention
    cfg = MLATransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, qk_layernorm=args.qk_layernorm,
        rotary_base=args.rotary_base, rotary_interleaved=args.rotary_interleaved,
        # the rotary settings as Megatron-LM's core_transformer_config_from_args takes them: every args attribute
        # named like an MLATransformerConfig field (--rope-type, --rotary-scaling-factor, --mscale, ...)
        **{k: getattr(args, k) for k in ROPE_FIELDS if hasattr(args, k)},
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, apply_rope_fusion=False,
        # the MoE settings as Megatron-LM takes them (--num-experts is the config's num_moe_experts)
        num_moe_experts=getattr(args, "num_experts", None), moe_layer_freq=getattr(args, "moe_layer_freq", 1),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None))
    # the layer spec as Megatron-LM's gpt_builders.py chooses it: the MoE block spec when --num-experts is set,
    # else the one local layer spec every layer shares
    if cfg.num_moe_experts:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
        layers = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=True,
                                        normalization=args.normalization)
        layers = [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = HeadDimsAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    if a.dist:
        sharded = model.sharded_state_dict(prefix="")
        loaded = dist_checkpointing.load(sharded, str(it_dir))  # raises on a tensor the files lack
        for common in ("args", "checkpoint_version", "iteration"):  # the common state comes back merged in
            loaded.pop(common)
        sd = {"model": loaded}
    model.load_state_dict(sd["model"], strict=True)
    out = logits(model.eval())
    if a.save_dist:  # as Megatron-LM saves --ckpt-format torch_dist: the model's sharded state and the run's args
        target = Path(a.save_dist) / "iter_0000003"
        if rank == 0:
            target.mkdir(parents=True)
        dist.barrier()
        args.ckpt_format, args.transformer_impl = "torch_dist", "local"
        dist_checkpointing.save({**model.sharded_state_dict(prefix=""), "args": args, "checkpoint_version": 3.0,
                                 "iteration": 3}, str(target))
        if rank == 0:
            (Path(a.save_dist) / "latest_checkpointed_iteration.txt").write_text("3")
    if rank == 0:  # the logits, and the parameter order (what megatron-core's optimizer groups follow)
        torch.save({"logits": out, "params": [n for n, _ in model.named_parameters()],
                    "moe_layers": sum(isinstance(m, MoELayer) for m in model.modules())}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, help="tensor-parallel size (default: the world size)")
    ap.add_argument("--dist", action="store_true")
    ap.add_argument("--save-dist")
    ap.add_argument("--out", required=True)
    return ap


def main():
    run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
