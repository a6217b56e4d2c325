"""Write REAL DeepSpeed checkpoints on CPU for tests/test_deepspeed.py (run under torchrun, 2 ranks).

Usage: DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 tests/ds_train_cases.py OUT_DIR CASE [CASE ...]
A case is MODEL-STAGE-DTYPE, e.g. gpt2-3-bf16 or bert-3-fp16. All cases run in one launch so the
DeepSpeed import and process-group start are paid once (tests/conftest.py runs these cases through
ds_universal_cases.py's train mode, in the launch that makes the ds-universal saves too). For each
case OUT_DIR/CASE/ gets the checkpoint (ckpt/global_step2/...), the HF config (ckpt/config.json) and, from the live engine,
truth.pt = {name: fp32 master (safe_get_full_fp32_param), or the 16-bit value for frozen params}.
"""
import os
import sys
from types import SimpleNamespace

import torch
import deepspeed
import transformers
from deepspeed.utils import safe_get_full_fp32_param

# Odd sizes on purpose: ZeRO-3 pads every partition and ZeRO-1/2 pad the flat groups.
GPT2 = dict(n_embd=63, n_head=7, n_layer=2, vocab_size=1001, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
BERT = dict(hidden_size=63, num_attention_heads=7, num_hidden_layers=2, intermediate_size=101,
            vocab_size=1001, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
LLAMA = dict(hidden_size=56, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=97, vocab_size=1001, max_position_embeddings=32, tie_word_embeddings=False)
FROZEN = {"gpt2": "transformer.wpe.weight", "bert": "bert.embeddings.token_type_embeddings.weight",
          "llama": "model.layers.0.input_layernorm.weight", "plain": "shift"}


class PlainLM(torch.nn.Module):
    """A model of its own (no transformers class, no config.json): a tied head, a persistent buffer, a
    frozen parameter and odd sizes (ZeRO pads every partition). Called like the HF models."""

    def __init__(self, vocab=1001, hidden=37, inner=53):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Sequential(torch.nn.Linear(hidden, inner), torch.nn.GELU(), torch.nn.Linear(inner, hidden))
        self.norm = torch.nn.LayerNorm(hidden)
        self.shift = torch.nn.Parameter(0.1 * torch.randn(hidden))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, input_ids, labels):
        h = self.embed(input_ids) + self.shift
        h = self.norm(h + self.scale * self.mix(h))
        logits = self.head(h).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss)


MODELS = {"gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),
          "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
          "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**BERT)),
          "plain": PlainLM}


def build(model_name):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    model.get_parameter(FROZEN[model_name]).requires_grad_(False)
    return model


def ds_config(stage, dtype):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def run_case(out_dir, case):
    model_name, stage, dtype = case.split("-")
    stage = int(stage)
    model = build(model_name)
    frozen_init = model.get_parameter(FROZEN[model_name]).detach().clone()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                       if p.requires_grad],
                                      config=ds_config(stage, dtype))
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2):
        ids = torch.randint(0, 1001, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    ckpt = os.path.join(out_dir, case, "ckpt")
    engine.save_checkpoint(ckpt)
    truth = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            truth[name] = safe_get_full_fp32_param(p).detach().clone().cpu()  # collective for ZeRO-3
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    truth[FROZEN[model_name]] = frozen_init.to(half)
    if torch.distributed.get_rank() == 0:
        torch.save(truth, os.path.join(out_dir, case, "truth.pt"))
        model.config.save_pretrained(ckpt)
    torch.distributed.barrier()


def allow_cpu_fp16():
    """DeepSpeed's CPU accelerator reports fp16 support only when oneDNN has fp16 kernels for this
    CPU; torch still runs fp16 on CPU without them (slowly), which is all a 2-step run needs. The
    checkpoint files are written by DeepSpeed's unmodified fp16 ZeRO code paths."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    type(acc).is_fp16_supported = lambda self: True
    if torch.half not in acc.supported_dtypes():
        orig = type(acc).supported_dtypes
        type(acc).supported_dtypes = lambda self: orig(self) + [torch.half]


def skip_shm_build():
    """DeepSpeed JIT-compiles a shared-memory all-reduce for CPU runs (minutes on a 2-core CI box);
    it is only a speed-up over gloo and plays no part in what a checkpoint contains."""
    # `import deepspeed.comm.torch as m` would bind the torch package (deepspeed.comm has an
    # attribute named torch), so the module is taken from sys.modules
    import deepspeed.comm.torch  # noqa: F401
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def main():
    allow_cpu_fp16()
    skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    out_dir, cases = sys.argv[1], sys.argv[2:]
    for case in cases:
        run_case(out_dir, case)
    # shut the process group down before the interpreter exits: left to exit-time destructors,
    # gloo's threads have aborted a rank now and then ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
