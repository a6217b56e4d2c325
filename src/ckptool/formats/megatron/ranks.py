"""One rank's share of a Megatron checkpoint, as that rank held it in training.

`ckptool verify` under torchrun runs the model the way the framework did: every (tp, pp[, ep]) rank
computes with the tensors in ITS OWN file. Replicated tensors (norms, biases, positions, the tied
embedding copy on the last stage) are therefore the rank's own copies, never rank 0's, so a run
whose replicas drifted apart is reproduced exactly.

read_rank_shards() returns role tensors under names that say what they are and where they sit:

  embed.word  embed.pos  final_norm.{weight,bias}  output.weight
  layers.{i}.{role}   role from roles.ROLE_RULES (qkv.weight, fc1.weight, proj.weight, ...), i global
  layers.{i}.experts.{e}.fc1.weight ...   MoE layers: the rank's own experts, e GLOBAL (its file numbers
                      them from 0 on every expert-parallel rank: EP rank r holds r * E/EP + j)

With a virtual pipeline a file holds several model chunks (model0, model1, ...): stage s chunk c
holds the layers of model chunk c * PP + s (Megatron's interleaved order), so `chunks` lists one
(first layer, count) per virtual chunk and the forward visits every stage's chunk 0, then chunk 1.

slice_rank_shards() cuts the same share out of a merged checkpoint (torch_dist stores global
tensors): every lazy is a narrow of the global one, so a rank reads only its slices.

Tensors are lazy and read from this rank's model file only. The architecture and the layer
offsets of the stages come from read_megatron(), which reads every file's pickle metadata (small)
but no tensor bytes of other ranks. Old QKV orders (checkpoint_version < 2) are turned into the
grouped order per rank, as Megatron does when it loads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...config import GPTConfig, Layout, check_tensor_parallel
from ...errors import CkptError
from ...io.torchfile import load_torch_file
from ...lazy import Derived, LazyTensor
from ...options import ReadOptions
from ...roles import (FIRST_STAGE_ROLES, GLOBAL_ROLES, HEAD_COPY, LAYER_ROLES, expert_role, global_role_tensor, layer_role_tensor,
                     moe_layer_roles, rule_for)
from ...sharding import Rule
from ...state import Checkpoint
from ...vocab import resize_vocab, target_rows
from .checkpoint import model_file, flatten, rank_piece, read_megatron, resolve_iteration_dir, unstack_grouped
from .names import DIALECTS, KeyMatcher, qkv_to_grouped


@dataclass
class RankShards:
    config: GPTConfig
    layout: Layout
    tp_rank: int
    pp_rank: int
    chunks: List[Tuple[int, int]]  # per virtual chunk: (global index of its first layer, layer count)
    tensors: Dict[str, LazyTensor]
    file: Optional[Path]  # the rank's own model file (None when cut from a merged checkpoint)
    ep_rank: int = 0
    experts: range = range(0)  # the global experts this rank holds in each MoE layer


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's name: mp_rank_TT, _PPP with pipeline parallelism, _EEE with expert parallelism."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def _local_experts(cfg: GPTConfig, layout: Layout, ep_rank: int) -> range:
    return layout.local_experts(cfg.moe.num_experts, ep_rank) if cfg.moe is not None else range(0)


def read_layout(path, opts: Optional[ReadOptions] = None):
    """(config, layout) of a Megatron checkpoint without reading any tensor bytes."""
    ckpt = read_megatron(path, opts or ReadOptions())
    return ckpt.config, ckpt.source.layout, ckpt


def read_rank_shards(path, tp_rank: int, pp_rank: int, opts: Optional[ReadOptions] = None,
                     meta=None, ep_rank: int = 0) -> RankShards:
    opts = opts or ReadOptions()
    cfg, layout, ckpt = meta or read_layout(path, opts)
    if not (0 <= tp_rank < layout.tp and 0 <= pp_rank < layout.pp and 0 <= ep_rank < layout.ep):
        raise CkptError(f"rank (tp {tp_rank}, pp {pp_rank}, ep {ep_rank}) is outside the checkpoint's "
                        f"{layout.describe()}")
    it_dir, _, _ = resolve_iteration_dir(Path(path), opts.iteration)
    file = model_file(it_dir / rank_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep))
    experts = _local_experts(cfg, layout, ep_rank)
    tree = load_torch_file(file)
    dialect = DIALECTS[ckpt.source.dialect]
    matcher = KeyMatcher(dialect, mla=cfg.mla is not None)  # MLA: q_layernorm is the q latent norm
    chunks = [(first, count) for p, _, first, count in layout.chunks(cfg.num_layers) if p == pp_rank]
    models = [tree["model"]] if not layout.vpp else [tree[f"model{v}"] for v in range(layout.vpp)]
    version = 0.0 if dialect.qkv_version0_only else float(ckpt.source.checkpoint_version or 0)
    heads_local = cfg.num_attention_heads // layout.tp

    out: Dict[str, LazyTensor] = {}
    for (first, _), model in zip(chunks, models):
        for key, value in flatten(model).items():
            hit = matcher.match(key)
            if hit is None or not isinstance(value, LazyTensor):
                continue
            role, local = hit
            if local is None:
                # the last stage's copy of a tied embedding is its output matrix (what it multiplies by)
                name = "output.weight" if role == HEAD_COPY else GLOBAL_ROLES[role]
                out[name] = value
                continue
            if role.startswith("qkv.") and version < 2:
                value = Derived(lambda x: qkv_to_grouped(x, version, heads_local, cfg.head_dim), [value])
            if role.startswith("experts."):  # local index j -> global expert
                # the legacy GroupedMLP's weight1 / weight2 hold every local expert: the reader's cut
                for name, piece in unstack_grouped(role, value, len(experts)):
                    _, j, base = name.split(".", 2)
                    out[f"layers.{first + local}.{expert_role(experts.start + int(j), base)}"] = piece
                continue
            out[f"layers.{first + local}.{role}"] = _as_local_spec_piece(value, role, cfg, layout, tp_rank,
                                                                        first + local, dialect)
    return RankShards(cfg, layout, tp_rank, pp_rank, chunks, out, file, ep_rank, experts)


def _as_local_spec_piece(value: LazyTensor, role: str, cfg: GPTConfig, layout: Layout, tp_rank: int, layer: int,
                         dialect) -> LazyTensor:
    """A rank file's tensor as the parallel forward computes with it, which is the split of the spec's own TP
    rules (the local spec's): a role the dialect's modules keep whole on every TP rank (Transformer Engine's MLA
    down projections, TELinear parallel_mode 'duplicated': Dialect.rule_column) is cut here as the local spec
    cuts it; every other tensor is the file's own."""
    if dialect.rule_column is None or layout.tp == 1:
        return value
    if rule_for(role, cfg, dialect.rule_column) != Rule.REPLICATED or rule_for(role, cfg) == Rule.REPLICATED:
        return value
    return rank_piece(value, role, cfg, layout, tp_rank, layer)


def slice_rank_shards(ckpt: Checkpoint, layout: Layout, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> RankShards:
    """Rank (tp_rank, pp_rank, ep_rank)'s role tensors cut from a merged checkpoint (torch_dist: global
    tensors) by the split write_megatron writes that rank's file with (megatron.rank_piece), so the rank
    computes with exactly the pieces a conversion would give it. Every tensor is a narrow of a stored one, so
    only this rank's slices (and its experts) are read; the vocabulary is padded as the writer pads it for
    this TP size (vocab.target_rows)."""
    cfg = ckpt.config
    check_tensor_parallel(cfg, layout.tp)
    rows = target_rows(cfg, layout.tp)  # the rows write_megatron pads the vocabulary to for this TP size
    tensors = resize_vocab(ckpt.tensors, cfg, rows)
    cfg = cfg.replace(padded_vocab_size=rows)
    chunks = [(first, count) for p, _, first, count in layout.chunks(cfg.num_layers) if p == pp_rank]

    out: Dict[str, LazyTensor] = {}
    last = pp_rank == layout.pp - 1
    for role, name in GLOBAL_ROLES.items():
        wanted = pp_rank == 0 if role in FIRST_STAGE_ROLES else last
        tensor = global_role_tensor(tensors, role)
        if role == "output" and tensor is None and last:
            tensor = global_role_tensor(tensors, "word")  # tied: the last stage's copy of the embedding
        if wanted and tensor is not None:
            out[name] = rank_piece(tensor, role, cfg, layout, tp_rank)
    experts = _local_experts(cfg, layout, ep_rank)
    for first, count in chunks:
        for i in range(first, first + count):
            moe_roles = moe_layer_roles(cfg, experts) if cfg.is_moe_layer(i) else []
            for role in list(LAYER_ROLES) + moe_roles:
                tensor = layer_role_tensor(tensors, cfg, i, role)
                if tensor is not None:
                    out[f"layers.{i}.{role}"] = rank_piece(tensor, role, cfg, layout, tp_rank, i)
    return RankShards(cfg, layout, tp_rank, pp_rank, chunks, out, None, ep_rank, experts)
