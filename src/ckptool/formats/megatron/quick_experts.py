"""The MoE experts of a Megatron torch-format checkpoint, checked without torch for quick inspect
(formats/megatron/quick.py): the files hold exactly the experts the args describe, in one of the module forms
KeyMatcher knows (SequentialMLP local_experts.{j}, TEGroupedMLP linear_fc1.weight{j}: one tensor per
local expert; the legacy GroupedMLP weight1 / weight2: all local experts in one tensor), each cut as
expert tensor parallelism cuts it. The full reader (formats/megatron/checkpoint.py _rank_params, _check_experts)
checks the same on the tensors; where anything differs, holds() says False and the full reader
answers (with its error where the files are wrong).

An expert's key counts experts locally to its expert-parallel rank: local expert j of EP rank e is
global expert e * (experts per EP rank) + j.
"""
from __future__ import annotations

from typing import Dict, Set, Tuple

from ...quick.meta import TensorMeta
from .names import global_layer

STACKED = "experts.*."  # KeyMatcher's role prefix of a tensor stacking all local experts (legacy GroupedMLP)
DENSE_MLP = ("fc1.", "fc2.")  # a dense layer's MLP roles; an MoE layer has none
MOE_ONLY = ("router.", "shared", "experts.")  # roles only an MoE layer has


def holds(models, matcher, cfg, counts: Dict[Tuple[int, int], int], ep: int, etp: int) -> bool:
    """Whether the files (models: (tp, pp, ep) -> {chunk: {key: value}}) hold the experts cfg describes
    (and no dense MLP in an MoE layer, no MoE part in a dense one), cut at expert TP etp."""
    offsets = layer_offsets(counts)
    roles: Dict[int, Set[str]] = {}  # global layer -> the roles held, expert index dropped
    held: Dict[str, Set[Tuple[int, int]]] = {}  # fc1.weight, fc2.bias, ... -> {(global layer, global expert)}
    stacked: Dict[str, Set[int]] = {}  # fc1 / fc2 -> global layers of legacy GroupedMLP tensors
    shapes: Dict[Tuple[str, bool], Set[tuple]] = {}  # (fc1.weight, fc2.bias, ..., stacked) -> the shapes stored
    for (_, p, e), chunks in models.items():
        for v, flat in chunks.items():
            for key, value in flat.items():
                hit = matcher.match(key)
                if hit is None or hit[1] is None or not isinstance(value, TensorMeta):
                    continue
                role, layer = hit[0], global_layer(hit[1], offsets[(p, v)], cfg.num_layers)  # MTP layers after
                if not role.startswith("experts."):
                    roles.setdefault(layer, set()).add(role)
                    continue
                local, base = role[len("experts."):].split(".", 1)
                roles.setdefault(layer, set()).add("experts." + base)
                shapes.setdefault((base, local == "*"), set()).add(value.shape)
                if local == "*":
                    stacked.setdefault(base.split(".")[0], set()).add(layer)
                else:
                    held.setdefault(base, set()).add((layer, e, int(local)))
    moe = cfg.moe
    moe_layers = {i for i in range(cfg.all_layers) if cfg.is_moe_layer(i)}  # an MTP layer's too
    for layer, rs in roles.items():
        is_moe = any(r.startswith(MOE_ONLY) for r in rs)
        if is_moe != (layer in moe_layers) or is_moe and any(r.startswith(DENSE_MLP) for r in rs):
            return False
    if moe is None or not moe_layers:
        return not held and not stacked
    if stacked and held or moe.num_experts % ep or etp < 1:
        return False
    per_ep = moe.num_experts // ep
    fc1_rows = moe.ffn_hidden_size * (2 if cfg.gated else 1)
    if fc1_rows % etp or moe.ffn_hidden_size % etp:
        return False
    h = cfg.hidden_size
    if stacked:  # weight1 [h, local experts x fc1 rows], weight2 [local experts x ffn, h] (stacked_expert_block)
        want = {("fc1.weight", True): {(h, per_ep * fc1_rows // etp)},
                ("fc2.weight", True): {(per_ep * moe.ffn_hidden_size // etp, h)}}
        return shapes == want and all(stacked.get(fc) == moe_layers for fc in ("fc1", "fc2"))
    want = {("fc1.weight", False): {(fc1_rows // etp, h)}, ("fc2.weight", False): {(h, moe.ffn_hidden_size // etp)}}
    if cfg.add_bias_linear:  # issue 32: GPT-OSS's biased experts; fc1's bias cut as its rows, fc2's whole on each
        want.update({("fc1.bias", False): {(fc1_rows // etp,)}, ("fc2.bias", False): {(h,)}})
    every = {(layer, x) for layer in moe_layers for x in range(moe.num_experts)}
    for fc, _ in want:  # every expert's every tensor
        locals_ = held.get(fc, set())
        if any(j >= per_ep for _, _, j in locals_) or {(layer, e * per_ep + j) for layer, e, j in locals_} != every:
            return False
    return shapes == want


def layer_offsets(counts: Dict[Tuple[int, int], int]) -> Dict[Tuple[int, int], int]:
    """First global layer per (pipeline stage, virtual chunk): Megatron's order, chunk-major."""
    pp = max(p for p, _ in counts) + 1
    vpp = max(v for _, v in counts) + 1
    offsets, first = {}, 0
    for v in range(vpp):
        for p in range(pp):
            offsets[(p, v)] = first
            first += counts.get((p, v), 0)
    return offsets
