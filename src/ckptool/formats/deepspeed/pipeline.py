"""Megatron-DeepSpeed names onto ckptool roles: pipeline layer files and pipe parameter names.

A GPTModelPipe save (shared/reference/deepspeed.md 4.1) stores one file per spec-list entry,
layer_LL-model_TT-model_states.pt, holding that layer's plain state dict; the optimizer and
param_shapes use pipe names `<LL>.<key>` or `tied_modules.embed.<key>` for the tied embedding.
The spec index of the first transformer layer moved from 3 to 2 in 2023 (commit 53db2b14) and an
untied LM head adds one more file; so a layer's kind is read from its keys, never from its index,
and transformer layers are numbered in index order. That covers both eras.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

from ...config import GPTConfig
from ...errors import CkptError
from ...spec import GPT
from ...spec.schema import MDS

if TYPE_CHECKING:  # the name tables are torch-free: the quick inspect reads them (formats/deepspeed/quick.py)
    import torch  # torch on use: the quick inspect reads this module's tables
    from ...lazy import LazyTensor

# key inside a layer file -> role (roles.py), from the spec's "mds" column: "<file kind>/<key>" for the globals
# (which pipeline module holds them), the legacy Megatron-LM names inside a transformer layer's file.
def _file_keys(kind: str) -> Dict[str, str]:
    return {key[len(kind) + 1:]: role for role, key in GPT.keys("global", MDS).items() if key.startswith(kind + "/")}


EMBED_KEYS = _file_keys("embed")
HEAD_KEYS = _file_keys("head")
FINAL_NORM_KEYS = _file_keys("final_norm")
LAYER_KEYS = {key: role for role, key in GPT.keys("layer", MDS).items()}
# Pre-2023-11 GQA kept query and key_value apart; nothing here knows their per-rank packing.
UNSUPPORTED_KEYS = ("self_attention.query.weight", "self_attention.key_value.weight")
# QKV packing of one TP rank's fused tensor (--qkv-layout; the files do not say which):
#   grouped  per query group [q heads, k, v] x head_dim (per head [q,k,v] for MHA): MDS before 2024-12
#   split    [all q | all k | all v] blocks: MDS since 676a482c (2024-12, FPDT)
QKV_LAYOUTS = ("grouped", "split")
TIED_PREFIX = "tied_modules.embed."
PIPE_NAME = re.compile(r"^(\d+)\.(.+)$")


def split_pipe_name(name: str) -> Optional[Tuple[Optional[int], str]]:
    """'3.mlp.dense_4h_to_h.weight' -> (3, 'mlp.dense_4h_to_h.weight'); tied -> (None, key)."""
    if name.startswith(TIED_PREFIX):
        return None, name[len(TIED_PREFIX):]
    m = PIPE_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_pipe_names(names: Iterable[str]) -> bool:
    names = list(names)
    return bool(names) and all(split_pipe_name(n) is not None for n in names)


def classify(keys_by_index: Dict[Optional[int], Iterable[str]]) -> Dict[Optional[int], str]:
    """index -> embed | layer | final_norm | head, from the keys each layer holds."""
    kinds = {}
    for idx, keys in keys_by_index.items():
        keys = set(keys)
        bad = [k for k in keys if k in UNSUPPORTED_KEYS]
        if bad:
            raise CkptError(f"layer {idx}: separate {bad[0]} (Megatron-DeepSpeed GQA before 2023-11) is not supported",
                            "convert the checkpoint with a newer Megatron-DeepSpeed first")
        if keys & set(EMBED_KEYS):
            kinds[idx] = "embed"
        elif keys & set(HEAD_KEYS):
            kinds[idx] = "head"
        elif keys & set(LAYER_KEYS):
            kinds[idx] = "layer"
        elif keys and keys <= set(FINAL_NORM_KEYS):
            kinds[idx] = "final_norm"
        else:
            raise CkptError(f"pipeline layer {idx} holds keys {sorted(keys)[:4]} that are not part of a "
                            "Megatron-DeepSpeed GPT", "ckptool converts GPT models")
    return kinds


def layer_numbers(kinds: Dict[Optional[int], str]) -> Dict[int, int]:
    """spec index -> global transformer layer number (index order; works for both eras)."""
    return {idx: n for n, idx in enumerate(sorted(i for i, k in kinds.items() if k == "layer"))}


def role_of(kind: str, key: str) -> str:
    table = {"embed": EMBED_KEYS, "head": HEAD_KEYS, "final_norm": FINAL_NORM_KEYS, "layer": LAYER_KEYS}[kind]
    role = table.get(key)
    if role is None:
        raise CkptError(f"unexpected key {key!r} in a Megatron-DeepSpeed {kind} layer",
                        "ckptool converts GPT models")
    return role


def first_layer_index(kinds) -> Optional[int]:
    idx = sorted(i for i, k in kinds.items() if k == "layer")
    return idx[0] if idx else None


def split_qkv_to_grouped(t: torch.Tensor, cfg: GPTConfig, tp: int) -> torch.Tensor:
    """One rank's [Q | K | V] blocks -> the grouped [ng, nq/ng + 2, hd] order roles.py expects."""
    import torch  # torch on use: the quick inspect reads this module's tables
    nq, ng, hd = cfg.num_attention_heads // tp, max(1, cfg.num_query_groups // tp), cfg.head_dim
    rest = t.shape[1:]
    q, k, v = torch.split(t, [nq * hd, ng * hd, ng * hd], dim=0)
    per = nq // ng
    g = torch.cat([q.reshape(ng, per, hd, *rest), k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest)], 1)
    return g.reshape(t.shape)


def regroup_qkv(parts: List[LazyTensor], cfg: GPTConfig, layout: str) -> List[LazyTensor]:
    if layout == "grouped":
        return parts
    if layout != "split":
        raise CkptError(f"unknown --qkv-layout {layout!r}", f"choose one of {', '.join(QKV_LAYOUTS)}")
    from ...lazy import Derived  # imports torch: as above
    tp = len(parts)
    return [Derived(lambda x: split_qkv_to_grouped(x, cfg, tp), [p]) for p in parts]
