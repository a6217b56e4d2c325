"""A real DeepSpeed ZeRO-2 bf16 checkpoint of GPT-2 small (124M parameters) for the benchmark's
zero_to_fp32 comparison. Written by the real deepspeed package on CPU under torchrun (2 data-parallel
ranks, gloo), after one optimizer step so the Adam moments exist as in a training checkpoint.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 scripts/ds_zero_case.py OUT_DIR [N_LAYER]

OUT_DIR gets global_step1/ (mp_rank_00_model_states.pt, bf16_zero_pp_rank_{0,1}_mp_rank_00_optim_states.pt),
latest and config.json (the HF config, which ckptool needs to name the architecture).
"""
import sys
from pathlib import Path

import torch
import deepspeed
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ds_train_cases import skip_shm_build  # noqa: E402  (no JIT build of a CPU all-reduce)


def main():
    out = sys.argv[1]
    n_layer = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=768, n_head=12, n_layer=n_layer, vocab_size=50257, n_positions=1024)
    model = transformers.GPT2LMHeadModel(config)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out)
    if torch.distributed.get_rank() == 0:
        config.save_pretrained(out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
