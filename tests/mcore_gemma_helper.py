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

Optimizer state (--train SAVE, --resume): megatron-core's own DDP, fp32 Adam and LR scheduler (the CPU shims and
the training step of tests/mcore_train_helper.py) on the loaded model. --train takes one step, saves SAVE as
Megatron-LM writes --ckpt-format torch (args as loaded, model, optimizer.state_dict(), scheduler) and takes two
more; --resume loads DIR's model (strict), optimizer and scheduler as Megatron-LM's load_checkpoint does and takes
those two. The forward is megatron-core's plain GPT maths on Gemma's parameters (the Gemma maths it lacks
are not stood in for): what is tested is that the optimizer state of every parameter, the post norms' too, goes
to the parameter it belongs to, the third step's loss depending on it.

Usage: torchrun --nproc-per-node N tests/mcore_gemma_helper.py JOB...: each argument one job
'DIR [--tp T] [--dist | --train SAVE | --resume] --out FILE' (torch format: this TP rank's
mp_rank_XX/model_optim_rng.pt at TP T, default the world size, the other ranks data-parallel; --dist: a torch_dist
checkpoint loaded with dist_checkpointing.load at that TP).
"""
import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mcore_eager import import_megatron_core_eager  # noqa: E402
import_megatron_core_eager()  # before megatron.core: its fused kernels uncompiled, a faster start
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

import mcore_train_helper as T  # noqa: E402  (its CPU shims and megatron-core training step; mcore_dist_helper's too)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402


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


def trainer(model):
    """megatron-core's DDP, fp32 Adam and scheduler on the model, as tests/mcore_train_helper.py builds them."""
    model.train()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=T.LR, min_lr=T.MIN_LR, weight_decay=T.WD,
                                                 adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.0), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=T.LR, max_lr=T.LR, min_lr=T.MIN_LR, lr_warmup_steps=0,
                                    lr_decay_steps=100, lr_decay_style="cosine", start_wd=T.WD, end_wd=T.WD,
                                    wd_incr_steps=100, wd_incr_style="constant")
    # attention dropout is 0: no CUDA RNG state to fork (as mcore_train_helper.build does)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return ddp, opt, sched


def train(a, model, args, state) -> list:
    """--train: step 0, save, steps 1 and 2; --resume: the loaded optimizer and scheduler, steps 1 and 2. The losses
    (each before its step's update: step 2's is the first that the saved optimizer state moves)."""
    ddp, opt, sched = trainer(model)
    if a.resume:
        if "optimizer" in state:
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["opt_param_scheduler"])
        else:  # weights only (--no-load-optim): fresh Adam moments, the scheduler at the checkpoint's iteration
            sched.step(increment=state["iteration"])
        return [T.train_step(ddp, opt, sched, step) for step in (1, 2)]
    losses = [T.train_step(ddp, opt, sched, 0)]
    d = Path(a.train) / "iter_0000001" / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_data_parallel_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
        args.iteration, args.ckpt_format = 1, "torch"
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model.state_dict(),
                    "optimizer": opt.state_dict(), "opt_param_scheduler": sched.state_dict()}, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(a.train) / "latest_checkpointed_iteration.txt").write_text("1")
    return losses + [T.train_step(ddp, opt, sched, step) for step in (1, 2)]


def run_job(a) -> None:
    tp = a.tp or dist.get_world_size()
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
    losses = train(a, model, args, sd) if a.train or a.resume else []
    if dist.get_rank() == 0:
        torch.save({"params": [n for n, _ in model.named_parameters()], "keys": list(state), "losses": losses}, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--dist", action="store_true")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--train")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", required=True)
    return ap


def main():
    T.H.run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
