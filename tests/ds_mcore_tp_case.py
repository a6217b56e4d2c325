"""Write REAL DeepSpeed ZeRO checkpoints of a megatron-core GPT at TP 2, DP 2 (torchrun, 4 ranks, gloo, CPU).

Usage: DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 tests/ds_mcore_tp_case.py OUT_DIR [STAGE ...]

What Megatron-DeepSpeed does without its pipeline engine: megatron-core's parallel state is the
DeepSpeed engine's mpu (model parallel = tensor parallel, ZeRO partitions over the data-parallel
group), bf16 with fp32 masters, and engine.save_checkpoint(client_state=) stores Megatron's args,
iteration and checkpoint_version beside the module. Hidden dropout is on with a different seed on
each TP rank, so the replicated tensors (layer norms, row-parallel biases) of the two TP ranks
receive different gradients and drift apart, as in a run with dropout on.

OUT_DIR/zeroSTAGE/ckpt is the save dir (`latest` + Megatron's latest_checkpointed_iteration.txt);
OUT_DIR/zeroSTAGE/reference.pt holds `tokens` and what the framework's own model computes for them in
fp32 (eval, no dropout, logits gathered over TP): `logits_master` with the fp32 masters
(safe_get_full_fp32_param), and but for ZeRO-3 `logits_model` with the saved 16-bit weights; each
rank computes with its own copies.
"""
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_dist_helper as H  # noqa: E402  (CPU shims for megatron-core; the tiny GPT-2 and its args)

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from ds_train_cases import skip_shm_build  # noqa: E402

TP, STEPS = 2, 3


class Mpu:
    """The mpu interface DeepSpeed asks for, answered by megatron-core's parallel state (model
    parallel = tensor parallel here: no pipeline)."""
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)

    @staticmethod
    def get_data_parallel_group_ranks():
        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


def gpt(dtype, hidden_dropout=0.0):
    a = H.ARCHS["gpt2"]
    cfg = TransformerConfig(use_cpu_initialization=True, hidden_dropout=hidden_dropout, attention_dropout=0.0,
                            bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype, **a["cfg"])
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=H.PADDED,
                     max_sequence_length=H.SEQ, **a["model"])
    return model, cfg


def build():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    torch.manual_seed(1234)  # the same initial weights on every rank
    model, cfg = gpt(torch.bfloat16, hidden_dropout=0.1)
    # attention dropout is 0; its RNG-tracker fork asks for CUDA RNG state, so make it a no-op
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return model, cfg


def batch(step):
    g = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, H.VOCAB, (2, H.SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(engine):
    pos = torch.arange(H.SEQ).unsqueeze(0).expand(2, H.SEQ)
    mask = torch.triu(torch.ones(1, 1, H.SEQ, H.SEQ, dtype=torch.bool), diagonal=1)
    # hidden dropout draws from the default generator: a different stream per TP rank makes the
    # replicas' gradients differ, as dropout does in practice
    torch.manual_seed(7 + parallel_state.get_tensor_model_parallel_rank())
    engine.train()
    for step in range(STEPS):
        tokens, labels = batch(step)
        loss = engine(tokens, pos, attention_mask=mask, labels=labels).float().mean()
        engine.backward(loss)
        engine.step()


def fp32_logits(values):
    """The framework's forward in fp32 (eval: no dropout) of the same model holding values
    {parameter name: this rank's tensor}."""
    ref, _ = gpt(torch.float32)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(values[name])
    return H.logits(ref.eval())


def run(out: Path, stage: int):
    model, cfg = build()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                      mpu=Mpu)
    train(engine)
    args = H.megatron_args("gpt2", cfg, TP)
    args.ckpt_format, args.bf16, args.iteration, args.deepspeed = "torch", True, STEPS, True
    engine.save_checkpoint(str(out / "ckpt"), tag=f"global_step{STEPS}",
                           client_state={"args": args, "iteration": STEPS, "checkpoint_version": 3.0})
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}  # collective
    reference = {"tokens": H.TOKENS, "logits_master": fp32_logits(masters)}
    if stage < 3:  # ZeRO-3 saves no 16-bit module weights
        reference["logits_model"] = fp32_logits(dict(engine.module.named_parameters()))
    if dist.get_rank() == 0:
        (out / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(STEPS))  # as Megatron-DeepSpeed does
        torch.save(reference, out / "reference.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main():
    """OUT_DIR [STAGE ...]: one run per ZeRO stage (default 1) into OUT_DIR/zeroSTAGE/."""
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in sys.argv[2:] or ["1"]:
        run(Path(sys.argv[1]) / f"zero{stage}", int(stage))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
