"""Helper run under `torchrun --nproc-per-node N` (gloo, CPU) with torch's own FSDP2 and DCP.

  "save OUT"   writes every FSDP2 input the DCP tests read, from two tiny transformers models (LlamaForCausalLM,
        Qwen3MoeForCausalLM) sharded with `fully_shard` and trained 2 AdamW steps:
        OUT/llama/step-2/               torchtitan's trainer layout (torchtitan/components/checkpoint.py: the
                                        ModelWrapper's model state flattened to the top level, the optimizer
                                        under "optimizer" in get_optimizer_state_dict's flattened form),
                                        HF parameter names; config.json in OUT/llama/huggingface/
        OUT/llama_titan/step-2/         the same run under torchtitan's Llama3 names, wq / wk rows in
                                        torchtitan's interleaved RoPE order (its state_dict_adapter from_hf), the
                                        AdamW moments renamed and permuted the same way; config.json beside it
        OUT/accelerate/pytorch_model_fsdp_0/   accelerate's save_fsdp_model (utils/fsdp_utils.py) for a
                                        SHARDED_STATE_DICT: {"model": model state} -> keys "model.<fqn>"; config.json
                                        in OUT/accelerate/; OUT/accelerate/optimizer_0/ its save_fsdp_optimizer (FSDP2:
                                        {"optimizer": get_optimizer_state_dict's nested form})
        OUT/qwen3moe/step-2/            Qwen3-MoE as NeMo-RL-style {"model": ..., "optimizer": ...}: "model." prefix,
                                        no config.json anywhere (the tests pass --hf-config)
        OUT/qwen3moe_config/config.json
        OUT/<model>.pt                  {"state": full HF state dict after the steps, "tokens", "logits",
                                        "exp_avg": AdamW's first moment by HF name} (rank 0)
  "load DIR OUT.pt --model llama|qwen3moe [--titan]"   a fresh FSDP2-sharded model at this world size loads DIR
        with dcp.load (its model keys, HF names or torchtitan's with --titan), then writes the logits for TOKENS
        and the full state dict (rank 0).
"""
import argparse
import os
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _flatten_optim_state_dict, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
import transformers

TOKENS = torch.tensor([[1, 5, 9, 33, 2, 70, 99, 4, 8, 15, 16, 23, 42, 7, 0, 3],
                       [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]])
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(intermediate_size=96, **COMMON),
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                                    num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                                                    mlp_only_layers=[], **COMMON),
}
# torchtitan's Llama3 names (pytorch/torchtitan b5bcd76 torchtitan/models/llama3/state_dict_adapter.py, from_hf_map)
# for this helper's renaming, written independently of ckptool's table
TITAN = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
         "lm_head.weight": "lm_head.weight"}
TITAN_LAYER = {"self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
               "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
               "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
               "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
               "mlp.down_proj.weight": "feed_forward.w2.weight", "input_layernorm.weight": "attention_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight"}


def titan_name(hf: str) -> str:
    if hf in TITAN:
        return TITAN[hf]
    parts = hf.split(".")  # model.layers.{i}.<rest>
    return f"layers.{parts[2]}." + TITAN_LAYER[".".join(parts[3:])]


def titan_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half rows of each head -> torchtitan's interleaved pairs (its adapter's _reverse_permute)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    conf = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    return conf, model


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def train(model, steps: int = 2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        loss = model(TOKENS, labels=TOKENS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def full_state(model) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(out: Path) -> None:
    rank = dist.get_rank()
    for name in ("llama", "qwen3moe"):
        conf, model = build(name)
        model = shard(model)
        opt = train(model)
        msd = get_model_state_dict(model)
        # the default (nested) form accelerate saves, and torchtitan's flattened form made from it by the function
        # flatten_optimizer_state_dict=True runs (a second get_optimizer_state_dict call fails)
        nested = get_optimizer_state_dict(model, opt)
        osd = _flatten_optim_state_dict({"state": dict(nested["state"]), "param_groups": [dict(g) for g in nested["param_groups"]]})
        full, lg = full_state(model), logits(model)
        # the first moments gathered from the flattened state (a second get_optimizer_state_dict call fails)
        exp_avg = {k[len("state."):-len(".exp_avg")]: v.full_tensor() for k, v in osd.items()
                   if k.startswith("state.") and k.endswith(".exp_avg")}
        if name == "llama":
            dcp.save({**msd, "optimizer": osd}, checkpoint_id=str(out / "llama" / "step-2"))
            dcp.save({"model": msd}, checkpoint_id=str(out / "accelerate" / "pytorch_model_fsdp_0"))
            dcp.save({"optimizer": nested}, checkpoint_id=str(out / "accelerate" / "optimizer_0"))
            save_titan(out / "llama_titan" / "step-2", conf, msd, osd)
            cfg_dirs = [out / "llama" / "huggingface", out / "llama_titan" / "step-2", out / "accelerate"]
        else:
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out / "qwen3moe" / "step-2"))
            cfg_dirs = [out / "qwen3moe_config"]
        if rank == 0:
            for d in cfg_dirs:
                d.mkdir(parents=True, exist_ok=True)
                conf.save_pretrained(d)
            torch.save({"state": full, "tokens": TOKENS, "logits": lg, "exp_avg": exp_avg}, out / f"{name}.pt")
        dist.barrier()


def save_titan(where: Path, conf, msd: dict, osd: dict) -> None:
    """msd / osd under torchtitan's names, q / k rows (weights and moments) in its RoPE order."""
    heads = {"qkv_linear.wq.weight": conf.num_attention_heads, "qkv_linear.wk.weight": conf.num_key_value_heads}

    def titan(hf: str, t):
        name = titan_name(hf)
        h = next((n for k, n in heads.items() if name.endswith(k)), None)
        if h is not None and isinstance(t, DTensor):
            t = distribute_tensor(titan_rows(t.full_tensor(), h), t.device_mesh, [Shard(0)])
        return name, t

    model = dict(titan(k, v) for k, v in msd.items())
    optim = {}
    for k, v in osd.items():
        kind, rest = k.split(".", 1)  # state.<fqn>.<slot> / param_groups.<fqn>.<hyper>
        fqn, what = rest.rsplit(".", 1)
        name, t = titan(fqn, v) if kind == "state" and what != "step" else (titan_name(fqn), v)
        optim[f"{kind}.{name}.{what}"] = t
    dcp.save({**model, "optimizer": optim}, checkpoint_id=str(where))


def load(src: Path, out: Path, name: str, titan: bool) -> None:
    conf, model = build(name, seed=1)  # other weights than the saved ones: the load must replace every one
    model = shard(model)
    msd = get_model_state_dict(model)
    if titan:
        names = {titan_name(k): k for k in msd}
        state = {t: msd[k] for t, k in names.items()}
        dcp.load(state, checkpoint_id=str(src))
        heads = {"qkv_linear.wq.weight": conf.num_attention_heads, "qkv_linear.wk.weight": conf.num_key_value_heads}
        for t, k in names.items():  # back to HF's row order for the HF model
            h = next((n for s, n in heads.items() if t.endswith(s)), None)
            v = state[t]
            if h is not None:
                full = v.full_tensor()
                rows, cols = full.shape
                hf = full.view(h, rows // h // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
                v = distribute_tensor(hf, v.device_mesh, v.placements)
            msd[k] = v
    else:
        dcp.load(msd, checkpoint_id=str(src))
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(model, msd)
    lg = logits(model)
    full = full_state(model)
    if dist.get_rank() == 0:
        torch.save({"state": full, "logits": lg, "world": dist.get_world_size()}, out)


def run_job(job: str) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("paths", nargs="+")
    p.add_argument("--model", default="llama")
    p.add_argument("--titan", action="store_true")
    a = p.parse_args(shlex.split(job))
    if a.mode == "save":
        save(Path(a.paths[0]))
    else:
        load(Path(a.paths[0]), Path(a.paths[1]), a.model, a.titan)
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for job in sys.argv[1:]:
        run_job(job)
    # every job's files are written and closed (each ends on a barrier): end without the interpreter's teardown,
    # where FSDP2's and gloo's threads once ended a rank in std::terminate ("terminate called without an active
    # exception", SIGABRT) after its work was done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
