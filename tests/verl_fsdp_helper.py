"""Helper run under `torchrun --nproc-per-node N` (gloo, CPU): a tiny Hugging Face model sharded with torch's FSDP2
(fully_shard per decoder layer and at the root), one AdamW step, saved the way verl's FSDPCheckpointManager
saves it (verl/utils/checkpoint/fsdp_checkpoint_manager.py save_checkpoint, volcengine/verl b178a3c): every rank
torch.save()s model.state_dict() (DTensors, Shard(0) over the ranks) to model_world_size_{N}_rank_{R}.pt,
optimizer.state_dict() to optim_world_size_{N}_rank_{R}.pt and {lr_scheduler, rng} to extra_state_...pt; rank 0
writes huggingface/ (the model's config.json, save_pretrained) and fsdp_config.json ({FSDP_version, world_size}).

  "save DIR --arch llama|qwen2|gpt2 --out FILE"   FILE: the full weights (DTensor.full_tensor(), by name), AdamW's
        first moments (by parameter name) and the logits of the full model for TOKENS, computed on rank 0 after the step.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchrun_jobs import run_jobs  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 33, 2, 70, 99, 4], [11, 12, 13, 14, 15, 16, 17, 18]])
VOCAB = 128


def config(arch):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    if arch == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           tie_word_embeddings=False)
    if arch == "qwen2":  # tied embeddings, q/k/v biases
        return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           tie_word_embeddings=True)
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)


def layers(model):
    base = getattr(model, "model", None) or model.transformer
    return base.layers if hasattr(base, "layers") else base.h


def run_job(a):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(a.arch), dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(TOKENS, labels=TOKENS).loss
    loss.backward()
    opt.step()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), root / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(opt.state_dict(), root / f"optim_world_size_{world}_rank_{rank}.pt")
    torch.save({"lr_scheduler": None, "rng": {"cpu": torch.get_rng_state()}},
               root / f"extra_state_world_size_{world}_rank_{rank}.pt")
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    exp_avg = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        model.config.save_pretrained(root / "huggingface")
        (root / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
        plain = AutoModelForCausalLM.from_config(config(a.arch), dtype=torch.float32)
        plain.load_state_dict(full)
        with torch.no_grad():
            logits = plain.eval()(TOKENS).logits
        torch.save({"tokens": TOKENS, "logits": logits, "weights": full, "exp_avg": exp_avg}, a.out)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save"])
    ap.add_argument("dir")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--out", required=True)
    run_jobs(ap, run_job)


if __name__ == "__main__":
    main()
