"""Helper run under `torchrun --nproc-per-node N` (gloo, CPU) with the real megatron-core package: loads a torch_dist
checkpoint that ckptool wrote from an FSDP2 save (a Llama or a Qwen3-MoE) into a GPTModel built from the args the
checkpoint stores, as Megatron-LM builds one (local layer spec; the MoE block spec when --num-experts is set).

  "load-dist DIR --tp T [--ep E] --out FILE"   dist_checkpointing.load of DIR's iteration into the fresh model at
        TP x EP, then load_state_dict(strict=True) (every parameter found, nothing left over; only the empty extra
        states megatron-core's local modules do not hold may be absent); FILE gets the logits for TOKENS.
  "load DIR OUT.pt --model M [--titan]"   tests/fsdp2_helper.py's load (torch's dcp.load into an FSDP2 model at this
        world size), run here so the 2-process loads of both helpers share one launch.
Several quoted jobs may follow one another on the command line.
"""
import argparse
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from mcore_dist_helper import TOKENS, logits  # noqa: E402  (its CPU shims come with it)
import fsdp2_helper  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 without Transformer Engine: a plain matmul
    moe_utils.te_general_gemm = None


def moe_config(args) -> dict:
    """The MoE settings as Megatron-LM takes them from its args (--num-experts is num_moe_experts)."""
    if not getattr(args, "num_experts", None):
        return {}
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_layer_freq=args.moe_layer_freq,
                moe_router_pre_softmax=args.moe_router_pre_softmax,
                moe_router_score_function=args.moe_router_score_function,
                moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def build(args, tp: int, ep: int):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, **moe_config(args))
    if cfg.num_moe_experts:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=args.rotary_base,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def load_dist(root: Path, tp: int, ep: int, out: Path) -> None:
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    d = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    args = torch.load(d / "common.pt", weights_only=False)["args"]
    assert args.ckpt_format == "torch_dist" and args.transformer_impl == "local", args
    model = build(args, tp, ep)
    loaded = dist_checkpointing.load(model.sharded_state_dict(prefix=""), str(d))  # raises on a missing tensor
    # the common state comes back merged in (the run's args; the optimizer's entries ckptool carried)
    for k in ("args", "iteration", "checkpoint_version", "optimizer", "content_metadata"):
        loaded.pop(k, None)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    result = logits(model.eval())
    if dist.get_rank() == 0:
        torch.save({"tokens": TOKENS, "logits": result}, out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main() -> None:
    dist.init_process_group("gloo")
    for job in sys.argv[1:]:
        if shlex.split(job)[0] == "load":
            fsdp2_helper.run_job(job)
            continue
        p = argparse.ArgumentParser()
        p.add_argument("mode", choices=["load-dist"])
        p.add_argument("dir")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1)
        p.add_argument("--out", required=True)
        a = p.parse_args(shlex.split(job))
        load_dist(Path(a.dir), a.tp, a.ep, Path(a.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
