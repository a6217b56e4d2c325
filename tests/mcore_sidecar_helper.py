"""Jobs of tests/mcore_dist_helper.py (modes bridge, nemo, verl; run under `torchrun --nproc-per-node 2`, gloo,
CPU, with the real megatron-core package; also runnable on its own): a tiny GPTModel (tests/mcore_dist_helper.py's build) saved with dist_checkpointing.save the way a trainer other than
Megatron-LM does, with no Megatron-LM `args` in its common state and the config in that trainer's sidecar,
written from the very TransformerConfig the model was built with:

  "bridge DIR --tp T --arch A --out FILE"   Megatron-Bridge (training/checkpointing.py save_checkpoint):
        DIR/iter_0000007/ (torch_dist, common state checkpoint_version + iteration, train_state.pt,
        run_config.yaml whose `model:` section is the provider's fields as Bridge's to_dict + yaml.safe_dump
        write them: functions as {_target_, _call_: false}, enums by value) and DIR/latest_train_state.pt.
  "nemo DIR ..."    NeMo 2 (lightning/io/pl.py, io/mixin.py): DIR/weights/ (torch_dist, model keys under
        `module.`, the Lightning common state), DIR/context/model.yaml (the model's config under `config:`)
        and io.json.
  "verl DIR ..."    verl's Megatron backend (utils/checkpoint/megatron_checkpoint_manager.py): DIR/dist_ckpt/
        (torch_dist of model.sharded_state_dict()), DIR/huggingface/config.json (transformers'
        save_pretrained of the matching config) and DIR/transformer_config.json.

  "fsdp_dtensor DIR --arch A [--experts sequential|grouped] [--optim] --out FILE"   Megatron-LM's --ckpt-format fsdp_dtensor as its source lays it out
        (megatron/training/checkpointing.py save_checkpoint + preprocess_fsdp_dtensor_state_dict, generate_state_dict,
        megatron/core/transformer/fsdp_dtensor_checkpoint.py handle_swiglu_in_state_dict; Megatron-LM d98e8a64):
        DIR/iter_0000007/ a plain torch.distributed.checkpoint save of {"model": the Megatron-FSDP-wrapped model's
        state_dict_for_save_checkpoint() (keys under "module."), "args", "checkpoint_version", "iteration"}, a
        SwiGLU fc1 as its gate and up halves (linear_fc1.weight_w / _v), and the tracker. Megatron-FSDP itself
        (CUDA) does not run here: the model is megatron-core's GPTModel at TP1, its tensors whole on every rank
        (DCP keeps one copy) where Megatron-FSDP would store DTensor chunks.
        --arch mixtral: tests/mcore_moe_helper.py's MoE model (SequentialMLP experts, stored by global index;
        --experts grouped names them as Transformer Engine's grouped experts, linear_fc1.weight{e}).
        --optim: one step of megatron-core's own optimizer first, its torch Adam state saved per parameter as
        Megatron-FSDP's DistributedOptimizer.sharded_param_state_fsdp_dtensor gives it (megatron-core 0.16.1), the
        GLU halves split like the weights; DIR_live/<slot>/ gets the live master and moments (torch format).

Each job writes the model's logits for TOKENS to FILE, as mcore_dist_helper's save does.
"""
import argparse
import dataclasses
import enum
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore_dist_helper as base  # noqa: E402 (imports megatron-core eagerly, before anything else of it)
from megatron.core import dist_checkpointing  # noqa: E402

ITERATION = 7


def _plain(value):
    """A config value as Bridge's yaml holds it: functions / classes / dtypes as {_target_, _call_: false},
    enums by value, containers element-wise; what safe_dump cannot hold (process groups, modules) left out."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, torch.dtype):
        return {"_target_": str(value), "_call_": False}
    if callable(value) and hasattr(value, "__qualname__"):
        return {"_target_": f"{value.__module__}.{value.__qualname__}", "_call_": False}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return items if all(i is not _SKIP for i in items) else _SKIP
    return _SKIP


_SKIP = object()


def transformer_config_fields(cfg) -> dict:
    """Every field of the model's TransformerConfig that yaml can hold, by its own name."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = _plain(getattr(cfg, f.name))
        if v is not _SKIP and not f.name.startswith("_"):
            out[f.name] = v
    return out


def provider_fields(arch, cfg, tp) -> dict:
    """The GPTModelProvider's own fields beside the TransformerConfig's (gpt_provider.py), as this model has them;
    the provider holds the run's parallel sizes (this helper gives them to parallel_state only)."""
    model = base.ARCHS[arch]["model"]
    return {**transformer_config_fields(cfg), "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
            "tensor_model_parallel_size": tp,
            "share_embeddings_and_output_weights": model["share_embeddings_and_output_weights"],
            "position_embedding_type": model["position_embedding_type"], "rotary_base": 10000, "rotary_percent": 1.0,
            "seq_length": base.SEQ, "vocab_size": base.VOCAB, "make_vocab_size_divisible_by": 64,
            "should_pad_vocab": True,
            "transformer_layer_spec": {"_target_": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec",
                                       "_call_": False}}


def hf_config(arch, cfg):
    """The transformers config of the same model (what verl's actor saves under huggingface/)."""
    from transformers import GPT2Config, LlamaConfig
    if arch == "llama":
        return LlamaConfig(vocab_size=base.VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                           num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                           num_key_value_heads=cfg.num_query_groups, max_position_embeddings=base.SEQ,
                           rms_norm_eps=cfg.layernorm_epsilon, rope_theta=10000.0, tie_word_embeddings=False,
                           hidden_act="silu", attention_bias=False, mlp_bias=False)
    return GPT2Config(vocab_size=base.VOCAB, n_positions=base.SEQ, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                      n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size, activation_function="gelu",
                      layer_norm_epsilon=cfg.layernorm_epsilon, tie_word_embeddings=True)


def write_yaml(path: Path, data: dict) -> None:
    import yaml
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, default_flow_style=False))


def write_sidecars(a, cfg, root: Path) -> None:
    """Rank 0: the trainer's files beside its torch_dist folder."""
    if a.mode == "bridge":
        it = root / f"iter_{ITERATION:07d}"
        write_yaml(it / "run_config.yaml", {"_target_": "megatron.bridge.training.config.ConfigContainer",
                                       "model": provider_fields(a.arch, cfg, a.tp),
                                       "checkpoint": {"ckpt_format": "torch_dist", "save": str(root)}})
        state = {"step": torch.tensor(ITERATION), "consumed_train_samples": torch.tensor(ITERATION * 4)}
        torch.save(state, it / "train_state.pt")
        torch.save(state, root / "latest_train_state.pt")
    elif a.mode == "nemo":
        model = {"_target_": "nemo.collections.llm.gpt.model.base.GPTModel",
                 "config": {**provider_fields(a.arch, cfg, a.tp), "_target_": "nemo.collections.llm.gpt.model.base.GPTConfig"}}
        write_yaml(root / "context" / "model.yaml", model)
        (root / "context" / "io.json").write_text(json.dumps({"root": {"type": "ref", "key": "trainer_context_1"}}))
    else:
        hf_config(a.arch, cfg).save_pretrained(root / "huggingface")
        (root / "transformer_config.json").write_text(json.dumps(transformer_config_fields(cfg), indent=2))


# Where each trainer puts the torch_dist files, the model keys' prefix and its common state beside them.
LAYOUTS = {
    "bridge": (f"iter_{ITERATION:07d}", "", {"checkpoint_version": 3.0, "iteration": ITERATION}),
    "nemo": ("weights", "module.", {"global_step": ITERATION, "epoch": 0, "pytorch-lightning_version": "2.5.0"}),
    "verl": ("dist_ckpt", "", {}),
}


# --- fsdp_dtensor MoE and optimizer state (issue 31) ---
# handle_swiglu_in_state_dict's GLU fc1 names (megatron-core 0.16.1 transformer/fsdp_dtensor_checkpoint.py is_swiglu_key)
SWIGLU_FC1 = re.compile(r"(\.mlp\.linear_fc1\.weight|\.mlp\.experts\.linear_fc1\.weight\d+|"
                        r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight|\.mlp\.shared_experts\.linear_fc1\.weight)$")
# Megatron-FSDP's DistributedOptimizer names a parameter by the wrapped model's named_parameters(): the prefix Megatron-LM
# d98e8a64 tools/checkpoint/checkpoint_inspector.py convert_checkpoint gives the optimizer state (optimizer_state_prefix)
OPTIM_NAME_PREFIX = "module.module.module."


def grouped_name(name: str) -> str:
    """A SequentialMLP expert's name as Transformer Engine's grouped experts have it (linear_fc1.weight{e}), the
    name checkpoint_inspector.py split_expert_weights gives each expert of a torch_dist experts tensor."""
    m = re.match(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$", name)
    return f"{m.group(1)}.{m.group(3)}.{m.group(4)}{m.group(2)}" if m else name


def split_glu(name: str, value, out: dict) -> None:
    """out[name] = value, or its gate / up halves under name_w / name_v for a GLU fc1 (handle_swiglu_in_state_dict)."""
    if SWIGLU_FC1.search(name):
        gate, up = value.chunk(2, dim=0)  # TP1: the whole [gate; up]
        out[f"{name}_w"], out[f"{name}_v"] = gate.clone(), up.clone()
    else:
        out[name] = value


def fsdp_dtensor_optimizer(a, model, opt) -> dict:
    """The optimizer entry sharded_param_state_fsdp_dtensor gives after handle_swiglu_in_state_dict: per-parameter torch
    Adam state (moments split like the weights, `step` copied to both halves) and each parameter's group without
    "params" (param_to_group_meta, under the unsplit name)."""
    rename = grouped_name if a.experts == "grouped" else (lambda n: n)
    names = {id(p): OPTIM_NAME_PREFIX + rename(n) for n, p in model.named_parameters()}
    state, metas = {}, {}
    for group in opt.param_groups:
        meta = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            metas[names[id(p)]] = meta
            st = opt.state[p]
            if SWIGLU_FC1.search(names[id(p)]):
                for half in ("_w", "_v"):
                    state[names[id(p)] + half] = _glu_state(st, half)
            else:
                state[names[id(p)]] = {k: v.clone() for k, v in st.items()}
    return {"state": state, "param_to_group_meta": metas}


def _glu_state(st: dict, half: str) -> dict:
    out = {"step": st["step"].clone()}
    for slot in ("exp_avg", "exp_avg_sq"):
        gate, up = st[slot].chunk(2, dim=0)
        out[slot] = (gate if half == "_w" else up).clone()
    return out


def fsdp_dtensor_state(a, model, cfg, opt=None) -> dict:
    """The state dict Megatron-LM's fsdp_dtensor format hands torch.distributed.checkpoint.save."""
    sd = {}
    rename = grouped_name if a.experts == "grouped" else (lambda n: n)
    for k, v in model.state_dict().items():
        if k.endswith("_extra_state"):
            continue
        if cfg.gated_linear_unit:
            split_glu(f"module.{rename(k)}", v, sd)
        else:
            sd[f"module.{rename(k)}"] = v
    if a.arch == "mixtral":
        import mcore_moe_helper
        args = mcore_moe_helper.run_args(cfg, a.tp, 1, 1)
        args.moe_grouped_gemm = a.experts == "grouped"
    else:
        args = base.megatron_args(a.arch, cfg, a.tp)
    args.ckpt_format = "fsdp_dtensor"
    out = {"model": sd, "args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if opt is not None:
        args.use_distributed_optimizer, args.use_megatron_fsdp = True, True
        out["optimizer"] = fsdp_dtensor_optimizer(a, model, opt)
    return out


def trained_optimizer(model, cfg):
    """megatron-core's own optimizer (get_megatron_optimizer, fp32, as tests/mcore_moe_helper.py builds it) after
    one step: the torch Adam inside it, whose state and groups Megatron-FSDP's checkpoint holds per parameter."""
    import mcore_moe_helper
    ddp, opt = mcore_moe_helper.make_optimizer(model, cfg)
    mcore_moe_helper.adam_step(ddp, opt, 5)
    model.eval()
    return opt.chained_optimizers[0].optimizer


def save_fsdp_dtensor(a, model, cfg, root: Path) -> dict:
    """The save; returns {slot: {model key: live tensor}} of the optimizer (empty without --optim)."""
    import torch.distributed.checkpoint as dcp
    opt = trained_optimizer(model, cfg) if a.optim else None
    it = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        it.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(fsdp_dtensor_state(a, model, cfg, opt), checkpoint_id=str(it))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    if opt is None:
        return {}
    live = {slot: {n: opt.state[p][slot].clone() for n, p in model.named_parameters()} for slot in ("exp_avg", "exp_avg_sq")}
    live["master"] = {n: p.detach().clone() for n, p in model.named_parameters()}  # fp32: Adam steps the weights
    return live


def save_live(live: dict, cfg, a, root: Path) -> None:
    """Rank 0: each live slot as a Megatron-LM torch-format checkpoint (weights only), read back by ckptool's torch
    reader as the slot's canonical tensors (tests/test_dist_optim.py live)."""
    import mcore_moe_helper
    args = mcore_moe_helper.run_args(cfg, a.tp, 1, 1)
    for slot, tensors in live.items():
        d = root / slot / f"iter_{ITERATION:07d}" / "mp_rank_00"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": tensors},
                   d / "model_optim_rng.pt")
        (root / slot / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def build_for(a):
    if a.arch == "mixtral":  # MoE: SequentialMLP experts (local spec), megatron-core's MoE helper's model at EP 1
        import mcore_moe_helper
        mcore_moe_helper.configure("mixtral")  # fp32, megatron-core's plain optimizer
        return mcore_moe_helper.build(a.tp, 1)
    return base.build(a.arch, a.tp)


def run_job(a):
    model, cfg = build_for(a)
    if a.mode == "fsdp_dtensor":
        live = save_fsdp_dtensor(a, model, cfg, Path(a.dir))
        if live and dist.get_rank() == 0:
            save_live(live, cfg, a, Path(f"{a.dir}_live"))
        return _finish(model, a.out)
    root = Path(a.dir)
    sub, prefix, common = LAYOUTS[a.mode]
    sd = model.sharded_state_dict(prefix=prefix)
    sd.update(common)
    if dist.get_rank() == 0:
        (root / sub).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(root / sub))
    if dist.get_rank() == 0:
        write_sidecars(a, cfg, root)
    _finish(model, a.out)


def _finish(model, out_file) -> None:
    """The model's logits to out_file, then the next job's fresh start."""
    out = base.logits(model)
    if base.is_writer():
        torch.save({"tokens": base.TOKENS, "logits": out}, out_file)
    dist.barrier()
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=sorted(LAYOUTS) + ["fsdp_dtensor"])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", choices=["sequential", "grouped"], default="sequential")
    ap.add_argument("--optim", action="store_true")
    return ap


def main():
    base.run_jobs(parser(), run_job)


if __name__ == "__main__":
    main()
