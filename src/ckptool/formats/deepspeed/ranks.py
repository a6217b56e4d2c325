"""One rank's share of a DeepSpeed checkpoint, as that rank held it in training.

The DeepSpeed counterpart of megatron/ranks.py, for `ckptool verify` under torchrun: model-parallel
rank mp = pp_rank * TP + tp_rank (DeepSpeed's and Megatron-DeepSpeed's order) computes with the
tensors of ITS OWN files, so replicated tensors that drifted apart in training (dropout on, a
Megatron-DeepSpeed run in practice) give the numbers they gave there.

What a rank reads (tensor bytes; the architecture comes from the merged read's metadata):

  pipeline, --weights model   its stage's layer_LL-model_TT files. The last stage of a tied model
                              computes its logits with the embedding's file (layer_01-model_TT):
                              DeepSpeed saves the tied module once, from the first stage, and on
                              load broadcasts that copy to every stage that shares it.
  pipeline, --weights master  the ZeRO partitions of its mp rank (every DP rank's optimizer shard
                              for that mp rank): its own fp32 masters, the last stage's own master
                              of the tied embedding included.
  Megatron names, no pipeline mp_rank_TT_model_states.pt (model) or its ZeRO partitions (master);
                              ZeRO-3: its zero_pp_rank_*_mp_rank_TT files.
  Hugging Face names          TP1 PP1 only: the merged tensors.

Tensors come out under the names parallel.py computes with (megatron_ranks.RankShards).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from ...errors import CkptError
from ...io.torchfile import load_torch_file
from ...lazy import Derived, LazyTensor
from ...options import ReadOptions
from ...roles import GLOBAL_ROLES, HEAD_COPY
from ...state import Checkpoint
from . import pipeline as mds
from .checkpoint import named_weights
from .files import megatron_key
from .zero import find_files, read_rank
from ..megatron.checkpoint import detect_dialect, flatten
from ..megatron.names import KeyMatcher, qkv_to_grouped
from ..megatron.ranks import RankShards, slice_rank_shards


class DeepSpeedRanks:
    """(tp_rank, pp_rank) -> RankShards of a DeepSpeed save whose merged view is `ckpt`."""

    def __init__(self, path, opts: ReadOptions, ckpt: Checkpoint):
        self.opts, self.ckpt = opts, ckpt
        self.cfg, self.layout = ckpt.config, ckpt.source.layout
        self.weights = ckpt.source.extra["weights"]
        self.tf = find_files(Path(path), opts.iteration)
        self.kinds = ckpt.source.extra.get("pipe_kinds")  # None unless layer_* pipeline files
        if self.kinds is not None:
            self.numbers = mds.layer_numbers(self.kinds)  # spec index -> global transformer layer
            self.index_of = {n: idx for idx, n in self.numbers.items()}
        self.hf_names = (ckpt.source.extra.get("param_names") or {}).get("scheme") == "hf"

    def mp_rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.layout.tp + tp_rank

    def _chunk(self, pp_rank: int):
        return [(first, count) for p, _, first, count in self.layout.chunks(self.cfg.num_layers) if p == pp_rank]

    def shards(self, tp_rank: int, pp_rank: int) -> RankShards:
        if not (0 <= tp_rank < self.layout.tp and 0 <= pp_rank < self.layout.pp):
            raise CkptError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside the checkpoint's {self.layout.describe()}")
        if self.hf_names:
            return slice_rank_shards(self.ckpt, self.layout, tp_rank, pp_rank)
        chunks = self._chunk(pp_rank)
        if self.kinds is not None:
            tensors = self._pipeline(tp_rank, pp_rank, chunks)
        else:
            tensors = self._megatron_module(tp_rank)
        self._check_complete(tensors, tp_rank, pp_rank, chunks)
        return RankShards(self.cfg, self.layout, tp_rank, pp_rank, chunks, tensors, None)

    # --- Megatron-DeepSpeed pipeline (layer_* files, pipe parameter names) ------------------

    def _pipeline(self, t: int, p: int, chunks) -> Dict[str, LazyTensor]:
        """{name: lazy} from (spec index, key, tensor) triples of this rank's own files."""
        out: Dict[str, LazyTensor] = {}
        for idx, key, value in self._pipe_entries(t, p, chunks):
            kind = "embed" if idx is None else self.kinds.get(idx)
            if kind is None:
                raise CkptError(f"{self.tf.tag_dir}: parameter {key!r} of spec index {idx} is not in the "
                                "layer files", "the layer files and the optimizer shards come from different saves")
            name = self._pipe_name(kind, key, idx, p)
            if name is not None:
                out[name] = self._qkv(name, value)
        return out

    def _pipe_entries(self, t: int, p: int, chunks):
        if self.weights == "master":
            for name, v in named_weights(read_rank(self.tf, self.mp_rank(t, p)), "master").items():
                hit = mds.split_pipe_name(name)
                if hit is None:
                    raise CkptError(f"unexpected parameter {name!r} in a pipeline checkpoint",
                                    "ckptool converts Megatron-DeepSpeed GPT models")
                yield hit[0], hit[1], v
            return
        wanted = [self.index_of[i] for first, count in chunks for i in range(first, first + count)]
        last, untied = p == self.layout.pp - 1, "head" in self.kinds.values()
        for idx, kind in self.kinds.items():
            if (kind == "embed" and (p == 0 or (last and not untied))) or (last and kind in ("final_norm", "head")):
                wanted.append(idx)
        for idx in sorted(wanted):
            f = self.tf.layers.get((idx, t))
            if f is None:
                raise CkptError(f"{self.tf.tag_dir}: no layer_{idx:02d}-model_{t:02d}-model_states.pt",
                                "copy every layer_*-model_TT file of this step")
            tree = load_torch_file(f)
            for key, v in tree.items():
                if isinstance(v, LazyTensor):
                    yield idx, key, v

    def _pipe_name(self, kind: str, key: str, idx, p: int) -> Optional[str]:
        role = mds.role_of(kind, key)
        first, last = p == 0, p == self.layout.pp - 1
        if kind == "layer":
            return f"layers.{self.numbers[idx]}.{role}"
        if kind == "embed":
            if first:
                return GLOBAL_ROLES[role]
            # a later stage holds the tied embedding only to compute the logits with it
            return "output.weight" if last and role == "word" else None
        return GLOBAL_ROLES[role]  # final norm, untied head: the last stage's own

    def _qkv(self, name: str, value: LazyTensor) -> LazyTensor:
        if ".qkv." not in name or (self.opts.qkv_layout or "grouped") == "grouped":
            return value
        cfg, tp = self.cfg, self.layout.tp
        return Derived(lambda x: mds.split_qkv_to_grouped(x, cfg, tp), [value])

    # --- Megatron names under `module` (no pipeline engine) --------------------------------

    def _megatron_module(self, t: int) -> Dict[str, LazyTensor]:
        named = named_weights(read_rank(self.tf, t), self.weights)
        flat = flatten(named) if any(isinstance(x, dict) for x in named.values()) else named
        flat = {megatron_key(k): v for k, v in flat.items()}
        dialect = detect_dialect(flat)
        matcher = KeyMatcher(dialect)
        cfg = self.cfg
        heads_local = cfg.num_attention_heads // self.layout.tp
        out: Dict[str, LazyTensor] = {}
        for key, v in flat.items():
            hit = matcher.match(key)
            if hit is None or not isinstance(v, LazyTensor) or hit[0] == HEAD_COPY:
                continue  # the merged read already refused keys that are not part of the model
            role, layer = hit
            if layer is None:
                out[GLOBAL_ROLES[role]] = v
                continue
            if role.startswith("qkv.") and dialect.qkv_version0_only:  # 2019: [3, np, hd] per rank
                v = Derived(lambda x: qkv_to_grouped(x, 0, heads_local, cfg.head_dim), [v])
            out[f"layers.{layer}.{role}"] = v
        return out

    # --- checks and names ------------------------------------------------------------------

    def _check_complete(self, tensors, t: int, p: int, chunks) -> None:
        """Every layer of the stage, the embedding on the first stage, the head on the last."""
        need = [f"layers.{i}.qkv.weight" for first, count in chunks for i in range(first, first + count)]
        if p == 0:
            need.append("embed.word")
        if p == self.layout.pp - 1:
            need.append("final_norm.weight")
        missing = [n for n in need if n not in tensors]
        if missing:
            raise CkptError(f"{self.tf.tag_dir}: the files of TP rank {t}, pipeline stage {p} hold no {missing[0]}",
                            "the checkpoint is incomplete, or its stages are split differently from "
                            f"{self.layout.describe()}")

    def files(self, t: int, p: int) -> str:
        """What rank (t, p) reads, for naming a divergence: its layer files or its mp rank's files."""
        if self.weights == "master":
            return f"mp_rank_{self.mp_rank(t, p):02d} ZeRO partitions"
        if self.kinds is None:
            return f"mp_rank_{self.mp_rank(t, p):02d}_model_states.pt"
        idx = [self.index_of[i] for first, count in self._chunk(p) for i in range(first, first + count)]
        if not idx:
            return f"layer_*-model_{t:02d}"
        span = f"{min(idx):02d}" if len(idx) == 1 else f"{min(idx):02d}..{max(idx):02d}"
        return f"layer_{span}-model_{t:02d}"
