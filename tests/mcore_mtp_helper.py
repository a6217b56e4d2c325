"""torchrun (gloo, CPU) helper: megatron-core 0.16's own GPTModel of a DeepSeek-style model (Multi-Latent
Attention, MoE layers with megatron-core's routing, and its multi-token-prediction block, --mtp-num-layers) built
from the args of a checkpoint ckptool wrote, loaded strictly (every parameter found, nothing left over), its main
logits for TOKENS (gathered over TP) saved to --out with its parameter names in order.

The model as Megatron-LM's gpt_builders.py builds it for these args: get_gpt_decoder_block_spec (local spec), and
get_gpt_mtp_block_spec over that block spec (the MTP layer takes the decoder's last layer spec); the config from
every args attribute named like a TransformerConfig field of the MoE / MTP families (as core_transformer_config_
from_args copies them), --num-experts as num_moe_experts. MLA's core attention is mcore_mla_helper's stand-in
(Transformer Engine's DotProductAttention does not install on this CPU machine). The main logits are computed with
the MTP block switched off for that forward (GPTModel runs it only to add its loss, which needs labels): MTP does
not change them.

Usage: torchrun --nproc-per-node N tests/mcore_mtp_helper.py JOB...: each 'DIR [--tp T] [--ep E] [--pp P] [--dist]
--out FILE' (world size = TP x PP x EP x DP; torch format: rank file mp_rank_TT[_PPP][_EEE]; --dist: torch_dist,
loaded with dist_checkpointing.load then load_state_dict(strict=True)). With --pp each rank builds its stage (the
MTP block and its copy of the word embedding on the last), the logits run through the stages by point-to-point
send (mcore_dist_helper.logits); FILE comes from the last stage, its parameter names those of that stage.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from mcore_dist_helper import is_writer, logits, rank_name, run_jobs  # noqa: E402  (CPU shims: causal mask, TP / PP; the job loop)
from mcore_mla_helper import ROPE_FIELDS, HeadDimsAttention  # noqa: E402  (also: no-TE linear classes for MLA)

# megatron-core 0.16's router linear tests `te_general_gemm is not None`; without Transformer Engine the name is
# never bound (mcore_moe_helper.py does the same): None is what it means, a plain matmul
from megatron.core.transformer.moe import moe_utils  # noqa: E402
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

FIELDS = {f.name for f in dataclasses.fields(MLATransformerConfig)}


def config(args, tp: int, ep: int, pp: int = 1) -> MLATransformerConfig:
    from_args = {k: getattr(args, k) for k in FIELDS if k.startswith(("moe_", "mtp_")) and hasattr(args, k)}
    from_args.pop("moe_grouped_gemm", None)  # the local spec's SequentialMLP (ckptool writes it by default)
    # an uneven first stage as Megatron-LM's --decoder-first-pipeline-num-layers gives it: the torch format's args
    # say it; a torch_dist load (its layout the loading run's own) puts the extra layers first, as mcore_dist_helper
    n = args.num_layers
    first = getattr(args, "decoder_first_pipeline_num_layers", None) or (n - n // pp * (pp - 1) if n % pp else None)
    return MLATransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=first if pp > 1 else None,
        use_cpu_initialization=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        qk_layernorm=args.qk_layernorm, rotary_base=args.rotary_base, rotary_interleaved=args.rotary_interleaved,
        **{k: getattr(args, k) for k in ROPE_FIELDS if hasattr(args, k)},
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, apply_rope_fusion=False,
        num_moe_experts=args.num_experts, moe_token_dispatcher_type="allgather", **from_args)


def build(args, tp: int, ep: int, pp: int) -> GPTModel:
    """This stage's GPTModel for args, as Megatron-LM's gpt_builders.py builds it: the MTP block spec over this
    stage's decoder block spec (None on the stages before the last: megatron-core 0.16.1 puts MTP on the last)."""
    cfg = config(args, tp, ep, pp)
    assert cfg.mtp_num_layers, "the args carry no --mtp-num-layers"
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
    for layer in spec.layer_specs:  # the MTP layer spec is the last of these (the same object)
        layer.submodules.self_attention.submodules.core_attention = HeadDimsAttention
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))


def run_job(a) -> None:
    tp, ep, pp = a.tp, a.ep, a.pp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             pipeline_model_parallel_size=pp)
    if a.dist:
        it_dir = Path(a.dir) / f"iter_{int((Path(a.dir) / 'latest_checkpointed_iteration.txt').read_text()):07d}"
        args = torch.load(it_dir / "common.pt", weights_only=False)["args"]
    else:
        sd = torch.load(Path(a.dir) / "iter_0000000" / rank_name(pp, ep) / "model_optim_rng.pt",
                        weights_only=False)
        args = sd["args"]
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.expert_model_parallel_size) == (tp, pp, ep)
    model = build(args, tp, ep, pp)
    if a.dist:  # the last stage's word embedding copy is tied to the first stage's key (GPTModel.sharded_state_dict,
        # which reads the DP group from the metadata Megatron-LM's checkpointing passes it: dp_cp_group is what
        # megatron-core's ensure_metadata_has_dp_cp_group fills in)
        metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        loaded = dist_checkpointing.load(model.sharded_state_dict(prefix="", metadata=metadata), str(it_dir))
        for common in ("args", "checkpoint_version", "iteration"):
            loaded.pop(common)
        sd = {"model": loaded}
    model.load_state_dict(sd["model"], strict=True)
    mtp_layers = model.config.mtp_num_layers
    model.mtp_process = False  # the main logits (see the module docstring)
    model.config.mtp_num_layers = None
    out = logits(model.eval())
    if is_writer():  # the last stage's first TP rank: the logits, and the parameters of the stage holding MTP
        # with PP, that stage's own copy of the word embedding (its MTP layers embed the tokens again)
        copy = model.embedding.word_embeddings.weight.detach().clone() if not model.pre_process else None
        torch.save({"logits": out, "params": [n for n, _ in model.named_parameters()], "mtp_layers": mtp_layers,
                    "embedding_copy": copy}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dist", action="store_true")
    ap.add_argument("--out", required=True)
    return ap


def main():
    run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
