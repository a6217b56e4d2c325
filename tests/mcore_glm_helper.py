"""torchrun (gloo, CPU) helper: megatron-core 0.16's own GPTModel for a GLM-4.5-like MoE run (grouped-query attention
with --add-qkv-bias, --qk-layernorm and --rotary-percent; the first layers dense by --moe-layer-freq; sigmoid routing
with --moe-router-enable-expert-bias, --moe-router-num-groups / --moe-router-group-topk and
--moe-router-topk-scaling-factor; a shared expert), built from the args in a checkpoint ckptool wrote, loaded
strictly, and its logits for TOKENS (gathered over TP) saved to --out with the tokens and the number of MoE layers
megatron-core built. World size = TP x EP (local spec: SequentialMLP experts, allgather token dispatcher).

Usage: torchrun --nproc-per-node N tests/mcore_glm_helper.py JOB...: each argument one job
'DIR --tp T --ep E [--dist] --out FILE', run in turn in one gloo process group.
  torch format: this rank's iter_*/mp_rank_TT[_EEE]/model_optim_rng.pt (Megatron-LM's name for its TP and EP rank)
                into the model with load_state_dict(strict=True), after checking the file's args have this layout;
  --dist:       DIR is torch_dist: the args from common.pt, then dist_checkpointing.load of the model's sharded state
                at this TP / EP (raises on a tensor the files lack), then load_state_dict(strict=True).
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
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mcore_dist_helper import TOKENS, logits, run_jobs  # noqa: E402  (CPU shims: explicit causal mask, TP gather)
from megatron.core.transformer.moe import moe_utils  # noqa: E402
if not hasattr(moe_utils, "te_general_gemm"):  # as mcore_moe_helper.py: without Transformer Engine a plain matmul
    moe_utils.te_general_gemm = None

# TransformerConfig field <- the args attribute Megatron-LM's core_transformer_config_from_args copies it from
# (same name unless given here); MoE routing as the run's flags set it
SAME = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "normalization", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "moe_ffn_hidden_size", "moe_router_topk",
        "moe_layer_freq", "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
RENAMED = {"layernorm_epsilon": "norm_epsilon", "gated_linear_unit": "swiglu", "num_moe_experts": "num_experts"}


def model_config(args, tp: int, ep: int) -> TransformerConfig:
    fields = {k: getattr(args, k) for k in SAME if getattr(args, k, None) is not None}
    fields.update({k: getattr(args, a) for k, a in RENAMED.items()})
    return TransformerConfig(use_cpu_initialization=True, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
                             expert_model_parallel_size=ep, activation_func=torch.nn.functional.silu,
                             bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                             moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                             moe_aux_loss_coeff=0.0, **fields)


def run_job(a) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep)
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    it_dir = Path(a.dir) / f"iter_{int((Path(a.dir) / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    if a.dist:
        args = torch.load(it_dir / "common.pt", weights_only=False)["args"]
        assert args.ckpt_format == "torch_dist"
    else:
        name = f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if a.ep > 1 else "")
        sd = torch.load(it_dir / name / "model_optim_rng.pt", weights_only=False)
        args = sd["args"]
        assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (a.tp, a.ep)
    cfg = model_config(args, a.tp, a.ep)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                     rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    if a.dist:
        loaded = dist_checkpointing.load(model.sharded_state_dict(prefix=""), str(it_dir))
        for common in ("args", "checkpoint_version", "iteration"):
            loaded.pop(common, None)
        sd = {"model": loaded}
    model.load_state_dict(sd["model"], strict=True)
    result = {"logits": logits(model.eval()), "tokens": TOKENS,  # every rank takes part in the forward
              "moe_layers": sum(isinstance(m, MoELayer) for m in model.modules())}
    if dist.get_rank() == 0:
        torch.save(result, a.out)
    dist.barrier()  # the files of this job are complete before the next job's model-parallel groups start
    parallel_state.destroy_model_parallel()


OPTIONS = {"--tp": dict(type=int, default=1), "--ep": dict(type=int, default=1), "--dist": dict(action="store_true"),
           "--out": dict(required=True)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    for flag, how in OPTIONS.items():
        ap.add_argument(flag, **how)
    return ap


def main():
    run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
