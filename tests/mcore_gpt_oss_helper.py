"""Helper run under `torchrun --nproc-per-node N` (gloo, CPU) with the real megatron-core package: a tiny GPT-OSS
GPTModel (local spec, SequentialMLP experts) loads ckptool's output strictly and computes its logits.

  "load-torch DIR --tp T --ep E [--pp P] --out FILE"   this rank's Megatron-LM torch-format file into a fresh model with
        load_state_dict(strict=True)
  "train DIR --tp T --ep E --save OUT --out FILE"   as load-torch, then one Adam step of megatron-core's optimizer
        (mcore_moe_helper.make_optimizer: DDP + get_megatron_optimizer, at EP > 1 a chain [dense, expert]) and a
        save of model and optimizer state in Megatron-LM's torch format into OUT (iteration 8); FILE.moments gets
        every rank's (TP rank, EP rank, {parameter name: live exp_avg}) at the save, FILE.losses the losses of
        the two steps after it (`next`: what a resumed run must reproduce)
  "resume DIR --tp T --ep E --out FILE"   load-torch with the optimizer state loaded too, then those two steps
        (FILE.losses `next`)
  "load-dist DIR --tp T --ep E [--pp P] --out FILE"   dist_checkpointing.load of the torch_dist DIR at this layout, then
        load_state_dict: every parameter found, nothing left over

The model is built from the checkpoint's own args (ckptool wrote them) the way Megatron-LM's arguments.py turns
them into a TransformerConfig for GPT-OSS: --quick-geglu (activation_func quick_gelu, gated_linear_unit),
--glu-linear-offset, --activation-func-clamp-value, --softmax-type learnable, --window-size,
--window-attn-skip-freq, and the yarn_* fields GPTModel reads for position_embedding_type 'yarn'. FILE gets the
logits for TOKENS (longer than the tiny model's window), gathered over TP, from the last stage.

megatron-core 0.16 on CPU: DotProductAttention puts softmax_offset, YarnRotaryEmbedding its frequencies and the
sliding-window mask (transformer/utils.get_sliding_window_causal_mask) on torch.cuda.current_device() / "cuda";
here that device is the CPU (the maths is unchanged)."""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.activations import quick_gelu  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import utils as mcore_utils  # noqa: E402
from megatron.core.fusions import fused_softmax  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mcore_dist_helper import logits, run_jobs  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):  # see mcore_moe_helper.py
    moe_utils.te_general_gemm = None
torch.cuda.current_device = lambda: torch.device("cpu")  # the CPU stands in for the GPU (module docstring)


def _cpu_window_mask(sq, skv, window_size):
    """megatron-core's get_sliding_window_causal_mask, its same two triangles, on the CPU."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


mcore_utils.get_sliding_window_causal_mask = _cpu_window_mask
fused_softmax.get_sliding_window_causal_mask = _cpu_window_mask

# 20 tokens: longer than the window (4) of the tiny model tests/test_gpt_oss.py builds
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 70, 99, 4, 8, 15, 16, 23, 42, 7, 0, 3, 61, 62, 17, 88],
                       [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]])


def config_of(args, tp, ep, pp) -> TransformerConfig:
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear,
        gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value, softmax_type=args.softmax_type,
        window_size=tuple(args.window_size), window_attn_skip_freq=args.window_attn_skip_freq,
        bias_activation_fusion=False, masked_softmax_fusion=False, num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq,  # a list keys torch_dist layers one by one (transformer_block.py)
        moe_router_pre_softmax=args.moe_router_pre_softmax, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        hidden_dropout=0.0, attention_dropout=0.0)
    for k in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
              "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int"):
        setattr(cfg, k, getattr(args, k))  # what GPTModel reads with getattr for 'yarn'
    return cfg


def rank_file_named(root: Path, it_dir: str, pp: int, ep: int) -> Path:
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if pp > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if ep > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    return root / it_dir / name / "model_optim_rng.pt"


def rank_file(root: Path, pp: int, ep: int) -> Path:
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    return rank_file_named(root, "release" if tracker == "release" else f"iter_{int(tracker):07d}", pp, ep)


def dist_args(root: Path):
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    d = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    return d, dist_checkpointing.load_common_state_dict(str(d))["args"]


def save_trained(model, opt, args, out: Path, pp: int, ep: int) -> None:
    """Megatron-LM's save_checkpoint, torch format: one file per (TP, PP, EP) name, from the ranks that write."""
    from mcore_moe_helper import writes_file
    out.mkdir(parents=True, exist_ok=True)
    f = rank_file_named(out, "iter_0000008", pp, ep)
    if writes_file():
        f.parent.mkdir(parents=True, exist_ok=True)
        args.iteration = 8
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 8,
                    "model": model.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict()}, f)
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("8")


def live_moments(model, opt, out: str) -> None:
    """Every rank's live Adam first moments by parameter name, with its (TP rank, EP rank), to rank 0's out."""
    live = {id(p): st["exp_avg"].detach().clone() for sub in opt.chained_optimizers
            for p, st in sub.optimizer.state.items()}
    mine = {n: live[id(p)] for n, p in model.named_parameters() if id(p) in live}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (parallel_state.get_tensor_model_parallel_rank(),
                                   parallel_state.get_expert_model_parallel_rank(), mine))
    if dist.get_rank() == 0:
        torch.save(every, out)


def train_or_resume(a, model, cfg, state) -> dict:
    """train: a step, the save, two more steps; resume: the loaded optimizer state, those two steps."""
    from mcore_moe_helper import adam_step, make_optimizer
    ddp, opt = make_optimizer(model, cfg)
    if a.mode == "train":
        adam_step(ddp, opt, 5)
        save_trained(model, opt, state["args"], Path(a.save), a.pp, a.ep)
        live_moments(model, opt, a.out + ".moments")
    else:
        opt.load_state_dict(state["optimizer"])
    losses = {"next": [adam_step(ddp, opt, 6), adam_step(ddp, opt, 7)]}
    model.eval()
    return losses


def run_job(a):
    root = Path(a.dir)
    # biased experts: expert TP 1, whatever the TP (megatron-core's rule; ckptool writes no other)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                                             expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1)
    if a.mode == "load-dist":
        it_dir, args = dist_args(root)
    else:
        state = torch.load(rank_file(root, a.pp, a.ep), map_location="cpu", weights_only=False)
        args = state["args"]
    assert args.position_embedding_type == "yarn" and args.quick_geglu and args.softmax_type == "learnable"
    cfg = config_of(args, a.tp, a.ep, a.pp)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), position_embedding_type="yarn",
                     rotary_base=int(args.rotary_base), share_embeddings_and_output_weights=False)
    losses = None
    if a.mode != "load-dist":
        model.load_state_dict(state["model"], strict=True)
        if a.mode in ("train", "resume"):
            losses = train_or_resume(a, model, cfg, state)
    else:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(it_dir))
        for k in ("args", "iteration", "checkpoint_version"):  # the run's common state, not weights
            loaded.pop(k, None)
        # strict but for the linears' extra state (None in the local spec: nothing to load), as mcore_moe_helper
        missing, unexpected = model.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        assert not missing and not unexpected, (missing, unexpected)
    model.eval()
    out = logits(model, TOKENS)
    if (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0):
        torch.save({"tokens": TOKENS, "logits": out}, a.out)
    if losses is not None and dist.get_rank() == 0:
        torch.save(losses, a.out + ".losses")
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["load-torch", "load-dist", "train", "resume"])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save")
    return ap


def main():
    run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
