"""One rank's share of a Megatron checkpoint, as that rank held it in training.

`ckptool verify` under torchrun runs the model the way the framework did: every (tp, pp) rank
computes with the tensors in ITS OWN file. Replicated tensors (norms, biases, positions, the tied
embedding copy on the last stage) are therefore the rank's own copies, never rank 0's, so a run
whose replicas drifted apart is reproduced exactly.

read_rank_shards() returns role tensors under names that say what they are and where they sit:

  embed.word  embed.pos  final_norm.{weight,bias}  output.weight
  layers.{i}.{role}   role from roles.ROLE_RULES (qkv.weight, fc1.weight, proj.weight, ...), i global

Tensors are lazy and read from this rank's model file only. The architecture and the layer
offsets of the stages come from read_megatron(), which reads every file's pickle metadata (small)
but no tensor bytes of other ranks. Old QKV orders (checkpoint_version < 2) are turned into the
grouped order per rank, as Megatron does when it loads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ..config import GPTConfig, Layout
from ..errors import CkptError
from ..io.torchfile import load_torch_file
from ..lazy import Derived, LazyTensor
from ..options import ReadOptions
from ..roles import GLOBAL_ROLES
from .megatron import _model_file, flatten, read_megatron, resolve_iteration_dir
from .megatron_names import DIALECTS, KeyMatcher, qkv_to_grouped


@dataclass
class RankShards:
    config: GPTConfig
    layout: Layout
    tp_rank: int
    pp_rank: int
    first_layer: int  # global index of this stage's first layer
    num_local_layers: int
    tensors: Dict[str, LazyTensor]
    file: Path


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def read_layout(path, opts: Optional[ReadOptions] = None):
    """(config, layout) of a Megatron checkpoint without reading any tensor bytes."""
    ckpt = read_megatron(path, opts or ReadOptions())
    return ckpt.config, ckpt.source.layout, ckpt


def read_rank_shards(path, tp_rank: int, pp_rank: int, opts: Optional[ReadOptions] = None,
                     meta=None) -> RankShards:
    opts = opts or ReadOptions()
    cfg, layout, ckpt = meta or read_layout(path, opts)
    if layout.vpp:
        raise CkptError("virtual pipeline checkpoints are not supported by the parallel verify yet",
                        "merge or reshard to --vpp 1 first, or run `ckptool verify` without torchrun")
    if not (0 <= tp_rank < layout.tp and 0 <= pp_rank < layout.pp):
        raise CkptError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside the checkpoint's {layout.describe()}")
    it_dir, _, _ = resolve_iteration_dir(Path(path), opts.iteration)
    file = _model_file(it_dir / rank_dir_name(tp_rank, pp_rank, layout.pp))
    tree = load_torch_file(file)
    flat = flatten(tree["model"])
    dialect = DIALECTS[ckpt.source.dialect]
    matcher = KeyMatcher(dialect)
    chunks = layout.chunks(cfg.num_layers)
    _, _, first, count = next(c for c in chunks if c[0] == pp_rank)
    version = 0.0 if dialect.qkv_version0_only else float(ckpt.source.checkpoint_version or 0)
    heads_local = cfg.num_attention_heads // layout.tp

    out: Dict[str, LazyTensor] = {}
    for key, value in flat.items():
        hit = matcher.match(key)
        if hit is None or not isinstance(value, LazyTensor):
            continue
        role, local = hit
        if local is None:
            # the last stage's copy of a tied embedding is its output matrix (what it multiplies by)
            name = "output.weight" if role == "head_copy" else GLOBAL_ROLES[role]
            out[name] = value
            continue
        if role.startswith("qkv.") and version < 2:
            value = Derived(lambda x: qkv_to_grouped(x, version, heads_local, cfg.head_dim), [value])
        out[f"layers.{first + local}.{role}"] = value
    return RankShards(cfg, layout, tp_rank, pp_rank, first, count, out, file)
