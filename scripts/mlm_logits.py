"""Megatron-LM's own logits of a checkpoint, computed by Megatron-LM's code (a GPU run under torchrun).

    MLM_LOGITS_OUT=logits.pt PYTHONPATH=<Megatron-LM checkout> torchrun --nproc-per-node N \
        scripts/mlm_logits.py <the run's model and parallel flags> --load CKPT --no-load-optim --no-load-rng

Takes the same flags as the pretrain_gpt.py run that wrote CKPT (leave out --bf16 for an fp32 model:
the stored 16-bit weights are upcast on load, so the logits carry no 16-bit rounding of the compute).
Megatron-LM builds the model (its own argument checks, its own parallel layout), loads CKPT strictly
and runs one forward on fixed tokens; rank 0 writes `tokens` [2, 16] and `logits_fp32` [2, 16, V]
(V: the padded vocabulary; columns past the true vocabulary are padding rows), the form
`ckptool verify --reference-logits FILE:logits_fp32` reads. Pipeline parallelism is not handled (PP 1).

Used by scripts/mlm_gpu_resume.py for the MoE case of issue 19; nothing here is imported by ckptool.
"""
import os
from functools import partial

import torch

from gpt_builders import gpt_builder
from megatron.core import mpu, tensor_parallel
from megatron.training.arguments import parse_and_validate_args
from megatron.training.checkpointing import load_checkpoint
from megatron.training.initialize import initialize_megatron
from megatron.training.training import get_model
from model_provider import model_provider

BATCH, SEQ, TOKEN_SEED = 2, 16, 42


def main():
    out = os.environ["MLM_LOGITS_OUT"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    assert args.pipeline_model_parallel_size == 1, "mlm_logits.py runs PP 1 only"
    initialize_megatron()
    model = get_model(partial(model_provider, gpt_builder), wrap_with_ddp=False)
    iteration = load_checkpoint(model, None, None, strict=True)[0]
    net = model[0]
    net.eval()
    # The same tokens on every rank: the generator is seeded on the CPU, then moved.
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(TOKEN_SEED))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    masked = ~torch.tril(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool))  # True where attention is masked
    with torch.no_grad():
        local = net(tokens.cuda(), position_ids.cuda(), masked.cuda())  # [B, S, V / TP]
        # The output layer keeps its vocabulary shard (parallel_output); gather it unless whole already.
        whole = local.shape[-1] == args.padded_vocab_size
        logits = local if whole else tensor_parallel.gather_from_tensor_model_parallel_region(local)
    if torch.distributed.get_rank() == 0:
        torch.save({"tokens": tokens, "logits_fp32": logits.float().cpu(), "true_vocab_size": args.vocab_size,
                    "padded_vocab_size": args.padded_vocab_size, "iteration": iteration,
                    "tp": mpu.get_tensor_model_parallel_world_size(),
                    "ep": mpu.get_expert_model_parallel_world_size()}, out)
        print(f"wrote {out}: logits {tuple(logits.shape)}")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
