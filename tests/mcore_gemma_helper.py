"""torchrun (gloo, CPU) helper: a megatron-core 0.16 GPTModel with Gemma's structure, built from the args of a
Megatron checkpoint ckptool wrote, loaded strictly (every parameter found, nothing left over); its parameter
names in order go to --out (what megatron-core's optimizer groups follow).

megatron-core 0.16.1 has no Gemma model: its TransformerLayer has no norms of the attention / MLP outputs, its
embedding no sqrt(hidden) scaling, its output layer no soft-capping, and its CPU norm (WrappedTorchNorm) refuses
zero-centred gamma. Megatron-Bridge builds Gemma 2 / 3 on megatron-core by giving linear_proj and linear_fc2 a
`post_layernorm` submodule (TERowParallelLinearLayerNorm in src/megatron/bridge/models/gemma/gemma2_provider.py
and gemma3_provider.py; Transformer Engine does not install on this CPU machine). RowParallelLinearPostNorm below
is that module on megatron-core's local RowParallelLinear; everything else (the local layer spec, q/k layernorms,
the gated MLP, the window and softmax-scale config fields read from the args, the sharded state dict and
dist_checkpointing) is megatron-core's own. No forward is run: the maths megatron-core lacks would all be stand-ins.

Usage: torchrun --nproc-per-node N tests/mcore_gemma_helper.py JOB...: each argument one job
'DIR [--dist] --out FILE' (torch format: this TP rank's mp_rank_XX/model_optim_rng.pt at the world size as TP;
--dist: a torch_dist checkpoint loaded with dist_checkpointing.load at that TP).
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
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

import mcore_dist_helper  # noqa: E402,F401  (its CPU shims for megatron-core's CUDA calls)


class RowParallelLinearPostNorm(RowParallelLinear):
    """A row-parallel linear whose output goes through post_layernorm (Megatron-Bridge's Gemma layout)."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = WrappedTorchNorm(config, output_size, eps=config.layernorm_epsilon)


def build(args, tp: int) -> GPTModel:
    assert args.ckptool_post_norms and args.gated_linear_unit and args.openai_gelu and args.apply_layernorm_1p
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, gated_linear_unit=True, activation_func=openai_gelu,
        add_bias_linear=args.add_bias_linear, bias_activation_fusion=False, qk_layernorm=args.qk_layernorm,
        window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_scale=args.softmax_scale, hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    spec.submodules.self_attention.submodules.linear_proj = RowParallelLinearPostNorm
    spec.submodules.mlp.submodules.linear_fc2 = RowParallelLinearPostNorm
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def run_job(a) -> None:
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    rank = parallel_state.get_tensor_model_parallel_rank()
    it_dir = Path(a.dir) / f"iter_{int((Path(a.dir) / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    if a.dist:
        args = torch.load(it_dir / "common.pt", weights_only=False)["args"]
        model = build(args, tp)
        loaded = dist_checkpointing.load(model.sharded_state_dict(prefix=""), str(it_dir))  # raises on a missing tensor
        for common in ("args", "checkpoint_version", "iteration"):
            loaded.pop(common, None)
        state = loaded
    else:
        sd = torch.load(it_dir / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=False)
        args = sd["args"]
        assert args.tensor_model_parallel_size == tp
        model = build(args, tp)
        state = sd["model"]
    model.load_state_dict(state, strict=True)
    if dist.get_rank() == 0:
        torch.save({"params": [n for n, _ in model.named_parameters()], "keys": list(state)}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--dist", action="store_true")
    ap.add_argument("--out", required=True)
    jobs = [ap.parse_args(job.split()) for job in sys.argv[1:]]
    dist.init_process_group("gloo")
    for job in jobs:
        run_job(job)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
