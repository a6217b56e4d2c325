"""Hugging Face model directories: what config.json says, read without torch.

Detection (looks_like), the weight files a directory holds, and which family (families/) a config.json
is, as the reader (reader.py) and the torch-free quick inspect (quick_inspect.py) both need them; the
family's record turns config.json into a GPTConfig. Nothing here touches tensors, so nothing here imports torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

from ... import families
from ...config import GPTConfig
from ...errors import CkptError, require
from ...families.family import Family
from ...families.moe import EXPERT_KEYS

FORMAT = "hf"
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Buffers older transformers versions saved with the weights: recomputed by the model, never data.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _read_config(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None


def gpt_model_type(conf: dict) -> Optional[str]:
    family = families.of_hf_config(conf)
    return family.model_type if family is not None else None


def refused_model(conf: dict) -> Optional[str]:
    """What ckptool recognises in this config and does not convert yet, or None."""
    mt = conf.get("model_type")
    if mt in families.REFUSED_MODEL_TYPES:
        return f"{families.REFUSED_MODEL_TYPES[mt]} is not supported yet"
    if gpt_model_type(conf) is None and any(conf.get(k) for k in EXPERT_KEYS):
        return (f"Mixture-of-Experts model_type {mt!r} is not supported (ckptool converts "
                f"{', '.join(families.moe_model_types())})")
    return None


def has_weights(path) -> bool:
    """A weights file (or its index) transformers would load from this directory."""
    return any((Path(path) / f).is_file() for f in WEIGHT_FILES + WEIGHT_INDEXES)


def looks_like(path) -> bool:
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    if not has_weights(path) and (path / "latest_checkpointed_iteration.txt").is_file():
        return False  # a Megatron save dir with an HF config.json kept beside it: Megatron's to read
    conf = _read_config(path)
    return conf is not None and (gpt_model_type(conf) is not None or refused_model(conf) is not None)


def weight_files(path: Path):
    for idx in WEIGHT_INDEXES:
        if (path / idx).is_file():
            try:
                weight_map = json.loads((path / idx).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CkptError(f"{path / idx}: unreadable index ({e})")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).is_file()]
            require(not missing, f"{path}: the index lists {', '.join(missing[:3])} but the file is missing",
                    "the download is incomplete")
            return [path / f for f in files]
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise CkptError(f"{path}: config.json but no model.safetensors / pytorch_model.bin (or their index)",
                    "pass a directory written by save_pretrained")



def read_supported_config(path: Path) -> Tuple[dict, Family]:
    """(config.json as a dict, its family) of a directory ckptool converts; CkptError otherwise."""
    conf = _read_config(path)
    require(conf is not None, f"{path / 'config.json'} is not readable JSON")
    family = families.of_hf_config(conf)
    require(refused_model(conf) is None, f"{path}: {refused_model(conf)}",
            "ckptool refuses what it cannot convert exactly rather than leave parts out")
    require(family is not None, f"{path}: model_type {conf.get('model_type')!r} is not one ckptool converts",
            f"supported: {', '.join(families.BY_MODEL_TYPE)}")
    return conf, family


def source_warnings(conf: dict, family: Family) -> List[str]:
    """What reading this model into a Megatron GPT changes, said once per checkpoint."""
    if conf.get("sliding_window") and conf.get("use_sliding_window", family.sliding_window_default):
        return [f"{family.model_type} sliding_window={conf['sliding_window']} is dropped: Megatron attends over the "
                "whole context (identical for sequences up to that length)"]
    return []


# --- rows shared by the reader and quick inspect ---------------------------------------------------

def part_rows(name: str, cfg: GPTConfig) -> int:
    """Rows of one canonical part (q, k or v) of a fused HF tensor ("cat" / "cat_T" in a family's names)."""
    return cfg.q_size if ".attn.q." in name else cfg.kv_size


# --- MoE experts: per expert or fused (transformers 5) ------------------------------------------------
# transformers 5.24 holds a layer's experts fused in the model (Glm4MoeExperts, Qwen2MoeExperts, MixtralExperts:
# gate_up_proj [E, 2I, h] with gate rows [:I] before up rows [I:], down_proj [E, h, I]); its conversion_mapping.py
# ("mixtral", and "qwen2_moe", which glm4_moe, qwen3_moe and deepseek_v3 reuse) stacks the Hub's per-expert tensors
# into that on load, and save_pretrained (save_original_format=True, the default) splits them back: Hub repositories
# and default saves are per expert; save_original_format=False and raw state_dicts are fused.

def fused_shape(op: str, cfg: GPTConfig) -> tuple:
    """The shape of a family's fused expert tensor (families/family.py fused_experts: "halves" gate_up, "each" down)."""
    m = cfg.moe
    return (m.num_experts, 2 * m.ffn_hidden_size, cfg.hidden_size) if op == "halves" else \
        (m.num_experts, cfg.hidden_size, m.ffn_hidden_size)


def experts_form(names, family: Family, cfg: GPTConfig) -> Optional[str]:
    """How the stored tensor names keep the experts (state.HF_EXPERT_FORMS), None for a model without them."""
    if cfg.moe is None or not family.fused_experts:
        return None
    fused = [s for s, (op, _) in family.fused_experts.items() if op != "rename"]
    prefix = family.names.layer_prefix.format(i=cfg.moe.layers[0])
    return "fused" if any(prefix + s in names for s in fused) else "per-expert"
