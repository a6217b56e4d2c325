"""The config of a megatron-core torch_dist checkpoint whose common state holds no Megatron-LM `args`: the
sidecar file its trainer wrote beside it, read without torch (the quick inspect asks here too).

Trainers other than Megatron-LM save the model with megatron-core's dist_checkpointing and keep the
architecture elsewhere (SIDECARS, tried in order from the directory holding the DCP index):

- Megatron-Bridge (src/megatron/bridge/training/checkpointing.py save_checkpoint, NVIDIA-NeMo/Megatron-Bridge
  067f987, 2026-08): `<save>/iter_XXXXXXX/` holds the torch_dist files, `train_state.pt` and `run_config.yaml`,
  the whole ConfigContainer as yaml.safe_dump writes its to_dict(); its `model:` section is the model
  provider, a megatron-core TransformerConfig subclass (gpt_provider.py GPTModelProvider), by field name.
  Functions (activation_func, transformer_layer_spec) are written as {_target_: module.name, _call_: false}
  (megatron/training/config yaml representers), enums by value. The save dir's tracker is
  `latest_train_state.pt` (no latest_checkpointed_iteration.txt): the newest iter_* directory is read.
- NeMo 2 (nemo/lightning/io/pl.py ckpt_to_weights_subdir and io/mixin.py IOMixin.io_dump, NVIDIA/NeMo
  8cfedd7, 2025-09): `<ckpt>/weights/` holds the torch_dist files (model keys under `module.`), `<ckpt>/context/`
  io.json (fiddle) and model.yaml, the model's config under `config:` with the same TransformerConfig fields.
- verl's Megatron backend (verl/utils/checkpoint/megatron_checkpoint_manager.py and megatron_utils.py
  get_*_checkpoint_path, volcengine/verl b178a3c, 2026-01): `<global_step_N>/actor/dist_ckpt/` holds the
  torch_dist files (model.sharded_state_dict() keys, no prefix), `actor/huggingface/` the model's Hugging
  Face config.json (AutoConfig.save_pretrained) and `actor/transformer_config.json`.

A TransformerConfig's fields are mapped onto the Megatron-LM args they mirror (TRANSFORMER_CONFIG_ARGS), so
megatron/args.py turns them into a GPTConfig as it does a Megatron-LM run's; a config.json goes through its
Hugging Face family (families/). `--hf-config DIR` gives a config.json where no sidecar is found.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import yaml

from ... import families
from ...config import GPTConfig
from ...errors import CkptError, require
from ..megatron import args as megatron_args

# TransformerConfig / model-provider fields whose Megatron-LM arg has the same name and meaning.
SAME_NAME_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
    "normalization", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "position_embedding_type", "rotary_base",
    "rotary_percent", "rotary_interleaved", "seq_length", "max_position_embeddings", "vocab_size",
    "make_vocab_size_divisible_by", "apply_residual_connection_post_layernorm", "rope_scaling_factor",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "fp16", "bf16",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_layer_freq", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_num_groups",
    "moe_router_group_topk", "moe_expert_capacity_factor", "moe_grouped_gemm",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "window_size", "qk_l2_norm", "no_rope_freq",
)
# Fields named otherwise in Megatron-LM's args: field -> (arg, value -> arg value).
RENAMED_FIELDS: Dict[str, Tuple[str, Callable[[Any], Any]]] = {
    "layernorm_epsilon": ("norm_epsilon", float),
    "num_moe_experts": ("num_experts", lambda v: v),
    "share_embeddings_and_output_weights": ("untie_embeddings_and_output_weights", lambda v: not v),
    "layernorm_zero_centered_gamma": ("apply_layernorm_1p", bool),
    "rope_scaling": ("use_rope_scaling", bool),
}
# megatron-core activation functions (TransformerConfig.activation_func, by the name its yaml gives) ->
# the activation ckptool computes, gated (gated_linear_unit) or not; megatron-core's openai_gelu / fast_gelu
# (megatron/core/fusions, transformer/utils) are the tanh approximation, torch's gelu the exact one.
ACTIVATIONS = {("silu", True): "swiglu", ("gelu", False): "gelu", ("openai_gelu", False): "gelu_tanh",
               ("fast_gelu", False): "gelu_tanh", ("squared_relu", False): "squared_relu"}
ACTIVATION_ARGS = {"swiglu": dict(swiglu=True), "gelu": dict(openai_gelu=False, bias_gelu_fusion=False),
                   "gelu_tanh": dict(openai_gelu=True), "squared_relu": dict(squared_relu=True)}


# Megatron-Bridge's other run_config.yaml sections (megatron-core DistributedDataParallelConfig, OptimizerConfig,
# Megatron-LM CheckpointConfig fields) -> the Megatron-LM args the distributed optimizer's state layout reads
# (formats/megatron/buffers.py: bucket sizes, reduce dtype; groups.py: the decoupled-lr group).
RUN_SECTION_ARGS = {
    "ddp": {"use_distributed_optimizer": "use_distributed_optimizer", "overlap_grad_reduce": "overlap_grad_reduce",
            "bucket_size": "ddp_bucket_size", "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32"},
    "optimizer": {"use_distributed_optimizer": "use_distributed_optimizer", "decoupled_lr": "decoupled_lr",
                  "decoupled_min_lr": "decoupled_min_lr"},
    "checkpoint": {"dist_ckpt_optim_fully_reshardable": "dist_ckpt_optim_fully_reshardable"},
}


@dataclass(frozen=True)
class Found:
    """A sidecar's config: args (a Megatron-LM-style Namespace) or hf (a config.json dict); what: its words."""
    what: str
    args: Optional[argparse.Namespace] = None
    hf: Optional[dict] = None

    def config(self, stored_rows: int) -> GPTConfig:
        """The GPTConfig it describes (hf: through the config.json's family) for stored_rows embedding rows."""
        if self.args is not None:
            return megatron_args.config_from_args(self.args, stored_rows)
        family = families.of_hf_config(self.hf)
        require(family is not None, f"{self.what}: model_type {self.hf.get('model_type')!r} is not one ckptool converts",
                f"supported: {', '.join(families.BY_MODEL_TYPE)}")
        return family.read_config(self.hf, stored_rows)


def _name_of(value) -> str:
    """The last dotted part of a function a yaml names ({_target_: a.b.silu, _call_: false} or 'a.b.silu')."""
    target = value.get("_target_") if isinstance(value, dict) else value
    return str(target or "").rsplit(".", 1)[-1]


def _activation(model: dict, where: str) -> Dict[str, Any]:
    gated = bool(model.get("gated_linear_unit", False))
    fn = _name_of(model.get("activation_func")) or "gelu"  # TransformerConfig's default is F.gelu
    kind = ACTIVATIONS.get((fn, gated))
    require(kind is not None, f"{where}: activation_func {fn}{' with gated_linear_unit' if gated else ''} is not "
            "one ckptool computes", "ckptool converts GeLU (exact or tanh), SwiGLU and squared ReLU models")
    return ACTIVATION_ARGS[kind]


def args_from_transformer_config(model: dict, where: str) -> argparse.Namespace:
    """The Megatron-LM args a megatron-core TransformerConfig (as a dict of its fields) stands for."""
    require(isinstance(model, dict) and model.get("num_layers"), f"{where} holds no model config (num_layers ...)",
            "pass the checkpoint's own sidecar, or --hf-config DIR with the model's config.json")
    out: Dict[str, Any] = {k: model[k] for k in SAME_NAME_FIELDS if model.get(k) is not None}
    for field, (arg, convert) in RENAMED_FIELDS.items():
        if model.get(field) is not None:
            out[arg] = convert(model[field])
    groups = model.get("num_query_groups")
    out["group_query_attention"] = groups is not None and groups != model.get("num_attention_heads")
    out.update(_activation(model, where))
    spec = _name_of(model.get("transformer_layer_spec"))
    out["transformer_impl"] = "local" if "local" in spec else "transformer_engine"  # Bridge's default: TE
    out.setdefault("max_position_embeddings", model.get("seq_length"))
    return argparse.Namespace(**out)


def _yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CkptError(f"{path}: not readable YAML ({str(e).splitlines()[0]})", "the sidecar is damaged")
    require(isinstance(data, dict), f"{path}: not a YAML mapping", "the sidecar is damaged")
    return data


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"{path}: not valid JSON ({e})", "pass a Hugging Face config.json")
    require(isinstance(data, dict), f"{path}: not a JSON object", "pass a Hugging Face config.json")
    return data


def _bridge(path: Path) -> Found:
    run = _yaml(path)
    args = args_from_transformer_config(run.get("model"), str(path))
    for section, fields in RUN_SECTION_ARGS.items():
        values = run.get(section) if isinstance(run.get(section), dict) else {}
        for field, arg in fields.items():
            if values.get(field) is not None:
                setattr(args, arg, values[field])
    return Found(f"Megatron-Bridge {path.name}", args=args)


def _nemo(path: Path) -> Found:
    return Found(f"NeMo 2 context/{path.name}", args=args_from_transformer_config(_yaml(path).get("config"), str(path)))


def _hf(path: Path) -> Found:
    return Found(f"Hugging Face config {path.parent.name}/{path.name}", hf=_json(path))


# (path relative to the directory holding the DCP index, reader), tried in order.
SIDECARS: Tuple[Tuple[str, Callable[[Path], Found]], ...] = (
    ("run_config.yaml", _bridge),  # Megatron-Bridge: in the iteration directory
    ("../context/model.yaml", _nemo),  # NeMo 2: weights/ beside context/
    ("../huggingface/config.json", _hf),  # verl (and slime) Megatron backends: dist_ckpt/ beside huggingface/
)


def find(d: Path, hf_config: Optional[str] = None) -> Optional[Found]:
    """The config a sidecar beside the torch_dist directory d gives, else --hf-config's, else None."""
    for rel, reader in SIDECARS:
        f = Path(d) / rel
        if f.is_file():
            return reader(f.resolve())
    if hf_config:
        g = Path(hf_config)
        f = g / "config.json" if g.is_dir() else g
        require(f.is_file(), f"--hf-config {hf_config}: no config.json there", "pass a config.json or a directory holding one")
        return Found(f"--hf-config {hf_config}", hf=_json(f))
    return None


def names() -> str:
    """The sidecars looked for, in words (for errors)."""
    return "run_config.yaml (Megatron-Bridge), ../context/model.yaml (NeMo 2), ../huggingface/config.json (verl)"
