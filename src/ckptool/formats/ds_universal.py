"""Canonical training state -> a DeepSpeed universal checkpoint (`--format ds-universal`).

The folder DeepSpeed's ds_to_universal.py makes and the engine loads with
`"checkpoint": {"load_universal": true}` at any DP size (shared/reference/deepspeed.md 3.2):

  DST/latest_universal                     the tag below (the engine reads it instead of `latest`)
  DST/<tag>/zero/<param>/fp32.pt           {"param": full fp32 master, "cat_dim": 0|1, ...}
  DST/<tag>/zero/<param>/exp_avg.pt        the same for each Adam moment
  DST/<tag>/zero/<param>/exp_avg_sq.pt
  DST/<tag>/zero/<param>/step.pt           the optimizer step (ZeRO-1/2 and BF16_Optimizer read it)
  DST/<tag>/zero/optimizer_state.pt        param_groups, loss scaler, clip_grad, ds_version, and the
                                           torch optimizer's step for ZeRO-3 targets
  DST/<tag>/mp_rank_00_model_states.pt     engine counters, LR scheduler, param_shapes, client state
  DST/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, under the name ZeRO-3 engines look for

<param> is the engine's own parameter name: the Hugging Face module names for HF models trained under
DeepSpeed, the pipe names (`tied_modules.embed.word_embeddings.weight`, `<idx>.mlp.dense_4h_to_h.weight`)
for Megatron-DeepSpeed pipeline runs, and the dotted Megatron names (`language_model.encoder.layers.0...`)
for Megatron-DeepSpeed --no-pipeline-parallel runs. Tensors are full: TP-merged the way the universal format merges
them (row-parallel on dim 1 with cat_dim 1, SwiGLU's dense_h_to_4h as two sub-params, the word
embeddings cut to the true vocabulary and marked vocab_tensor), so the loader's own chunking re-splits
them for any TP. Frozen parameters get fp32.pt only, as DeepSpeed writes them. The module weights are
not written (the engine ignores them on a universal load). Both model-states names are written, so a
ZeRO-1/2 and a ZeRO-3 engine load the same folder.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..config import Layout
from ..errors import CkptError, require
from ..io.torchfile import StreamingTorchWriter
from ..lazy import LazyTensor, load_scope
from ..roles import canonical_names, global_role_tensor, layer_role_tensor, rule_for
from ..sharding import Rule
from ..state import OPTIMIZER_SLOTS, Checkpoint
from ..summary import WriteSummary
from ..write_options import WriteOptions
from . import hf_names
from .hf_writer import materialise

FORMAT = "ds-universal"
# canonical slot -> the state file name the universal loader expects
STATE_FILES = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# model-states keys the engine reads back (engine_state from the DeepSpeed reader), with defaults
ENGINE_DEFAULTS = {"global_steps": 0, "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 1,
                   "lr_scheduler": None, "ds_version": "0.0.0"}
# Megatron-DeepSpeed client state carried beside the engine's own keys
CLIENT_KEYS = ("iteration", "checkpoint_version", "tokens")


class Param:
    """One engine parameter: its name, per slot its full lazy tensor, and the merge facts the
    universal loader reads (cat_dim, param_n_sub_params, vocab_tensor)."""

    def __init__(self, name: str, slots: Dict[str, LazyTensor], canonical: List[str], extra: Optional[dict] = None):
        self.name, self.slots, self.canonical = name, slots, canonical
        self.extra = {"cat_dim": 0} if extra is None else extra


# --- engine names per source scheme -----------------------------------------------------------

def _hf_params(ckpt: Checkpoint, naming: dict, slots: Dict[str, Dict[str, LazyTensor]]) -> List[Param]:
    """HF module names through the one HF table (hf_names), applied to every slot alike."""
    family = hf_names.MODEL_TYPES[naming["model_type"]][0]
    out = []
    for hf_name, entry, _group in hf_names.expand(family, ckpt.config.num_layers):
        if hf_name == "lm_head.weight" and ckpt.config.tied_embeddings:
            continue
        made = {slot: materialise(entry, tensors) for slot, tensors in slots.items()}
        if any(t is None for t in made.values()):
            continue
        out.append(Param(hf_name, made, list(hf_names.canonical_names(entry))))
    return out


def _mds_params(ckpt: Checkpoint, naming: dict, slots: Dict[str, Dict[str, LazyTensor]]) -> List[Param]:
    """Megatron-DeepSpeed pipe names; fused roles rebuilt whole (TP 1) from the canonical slots."""
    cfg = ckpt.config
    if naming.get("qkv_layout", "grouped") != "grouped":
        raise CkptError(f"--format ds-universal: this run packs each rank's QKV as {naming['qkv_layout']} "
                        "(not per query group), which the universal loader's plain chunking cannot re-split",
                        "write a Megatron checkpoint instead (ckptool merge SRC DST)")
    rows = cfg.vocab_size or cfg.padded_vocab_size
    out = []
    for (role, layer), name in sorted(naming["roles"].items(), key=lambda kv: kv[1]):
        made = {}
        for slot, tensors in slots.items():
            t = global_role_tensor(tensors, role) if layer is None else layer_role_tensor(tensors, cfg, layer, role)
            if t is None:
                raise CkptError(f"--format ds-universal: no {slot} for {name}", "the source is incomplete")
            made[slot] = t
        rule = rule_for(role, cfg)
        # DeepSpeed records no cat_dim for TP-replicated tensors (the loader takes them whole)
        extra = {} if rule is Rule.REPLICATED else {"cat_dim": 1 if rule is Rule.ROW else 0}
        if rule is Rule.GATED:
            extra["param_n_sub_params"] = 2
        if rule is Rule.VOCAB:
            # the universal format keeps the true vocabulary; the loader pads for its own TP
            made = {s: t.narrow(0, 0, rows) if t.shape[0] != rows else t for s, t in made.items()}
            extra["vocab_tensor"] = True
        out.append(Param(name, made, canonical_names(role, layer, cfg), extra))
    return out


# naming scheme (the DeepSpeed reader's source.extra["param_names"]) -> engine parameters
SCHEMES: Dict[str, Callable] = {"hf": _hf_params, "mds-pipe": _mds_params, "megatron-module": _mds_params}


def universal_params(ckpt: Checkpoint) -> Tuple[List[Param], dict]:
    naming = ckpt.source.extra.get("param_names") or {}
    make = SCHEMES.get(naming.get("scheme"))
    if make is None:
        why = ("its parameters have no DeepSpeed names" if not naming
               else f"ckptool cannot name this DeepSpeed run's parameters ({naming.get('scheme')})")
        raise CkptError(f"--format ds-universal: {why}",
                        "the source must be a DeepSpeed run of a Hugging Face GPT or of Megatron-DeepSpeed")
    return make(ckpt, naming, _slots(ckpt)), naming


def _slots(ckpt: Checkpoint) -> Dict[str, Dict[str, LazyTensor]]:
    """The three slots the universal format stores; an fp32-trained source keeps no separate master
    (its weights are the masters)."""
    opt = ckpt.optimizer
    slots = {s: opt.slots.get(s, {}) for s in OPTIMIZER_SLOTS}
    if not slots["master"] and all(t.dtype == torch.float32 for t in ckpt.tensors.values()):
        slots["master"] = dict(ckpt.tensors)
    missing = [s for s in OPTIMIZER_SLOTS if not slots[s]]
    require(not missing, f"--format ds-universal needs fp32 masters and both Adam moments; this source's "
            f"optimizer state ({opt.kind}) has no {', '.join(missing)}", "write a Megatron checkpoint instead")
    return slots


# --- writing ----------------------------------------------------------------------------------

def _save(path: Path, obj) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = StreamingTorchWriter(path, obj)
    n = 0
    for ps in w.pending:
        n += w.write(ps)
    w.finish()
    return n


def _groups_of(ckpt: Checkpoint) -> Dict[str, int]:
    """canonical name -> index of the optimizer group that trains it (absent: frozen)."""
    out = {}
    for g, group in enumerate(ckpt.optimizer.param_groups):
        for n in group.names:
            out.setdefault(n, g)
    return out


def write_ds_universal(ckpt: Checkpoint, out_dir: Path, layout: Layout, opts: WriteOptions = WriteOptions(),
                       progress=None, warn=print) -> WriteSummary:
    # of opts, only dtype and optimizer apply (registry.DS_UNIVERSAL_HONOURS; the others are refused before)
    opt, dtype = ckpt.optimizer, opts.dtype
    require(opts.optimizer, "--format ds-universal is the training state itself; it cannot be written --no-optimizer",
            "drop --no-optimizer, or write --format torch for the weights only")
    require(opt is not None, "--format ds-universal writes the training state, and this source holds no "
            "optimizer state", "convert a DeepSpeed checkpoint that has its *_optim_states.pt shards")
    require(layout.tp == 1 and layout.pp == 1 and not layout.vpp,
            "--format ds-universal has no layout of its own (the engine re-splits it at load)",
            "use `ckptool merge SRC DST --format ds-universal`")
    require(dtype is None or dtype == torch.float32, "--format ds-universal stores fp32 masters and moments",
            "leave --dtype out")
    params, naming = universal_params(ckpt)
    out_dir = Path(out_dir)
    es = {**ENGINE_DEFAULTS, **{k: v for k, v in (ckpt.source.extra.get("engine_state") or {}).items()
                                if v is not None}}
    step = opt.step if opt.step is not None else es["global_steps"]
    tag = f"global_step{es['global_steps']}_universal"
    zero = out_dir / tag / "zero"
    group_of = _groups_of(ckpt)
    files = nbytes = tensors = 0
    shapes: Dict[int, "OrderedDict[str, torch.Size]"] = {}
    for p in params:
        groups = {group_of[n] for n in p.canonical if n in group_of}
        trained = bool(groups)
        with load_scope():
            for slot, t in p.slots.items():
                if slot != "master" and not trained:
                    continue  # DeepSpeed keeps no moments for frozen parameters
                # a frozen parameter's fp32.pt is the bare {"param": ...} DeepSpeed writes for it
                n = _save(zero / p.name / f"{STATE_FILES[slot]}.pt", {"param": t, **(p.extra if trained else {})})
                files += 1
                tensors += 1
                nbytes += n
                if progress:
                    progress(n)
        if trained:
            _save(zero / p.name / "step.pt", torch.tensor(float(step)))
            files += 1
            shapes.setdefault(min(groups), OrderedDict())[p.name] = p.slots["master"].shape
    hyper = [dict(g.hyper, params=[i]) for i, g in enumerate(opt.param_groups)] or [{"params": [0]}]
    optim = {**(opt.grad_scaler or {}), "ds_version": es["ds_version"], "param_groups": hyper,
             "optimizer_state_dict": {"state": {i: {"step": torch.tensor(float(step))} for i in range(len(hyper))},
                                      "param_groups": hyper}}
    _save(zero / "optimizer_state.pt", optim)
    model_states = {
        "module": None, "buffer_names": [], "optimizer": None,
        "param_shapes": [shapes[g] for g in sorted(shapes)], "frozen_param_shapes": None, "shared_params": {},
        "frozen_param_fragments": None, "lr_scheduler": es["lr_scheduler"], "data_sampler": None,
        "random_ltd": None, "sparse_tensor_module_names": set(), "skipped_steps": es["skipped_steps"],
        "global_steps": es["global_steps"],
        "global_samples": es.get("global_samples", opt.consumed_samples or 0),
        "dp_world_size": es["dp_world_size"], "mp_world_size": es["mp_world_size"],
        "ds_config": es.get("ds_config"), "ds_version": es["ds_version"]}
    if naming["scheme"] in ("mds-pipe", "megatron-module"):
        model_states.update({k: es[k] for k in CLIENT_KEYS if es.get(k) is not None})
        model_states["args"] = ckpt.source.args
        model_states["universal_checkpoint_info"] = ckpt.source.extra.get("universal_checkpoint_info")
    for name in MODEL_STATES:
        _save(out_dir / tag / name, model_states)
    (out_dir / "latest_universal").write_text(tag)
    files += 1 + len(MODEL_STATES) + 1
    rows = next((p.slots["master"].shape[0] for p in params if p.extra.get("vocab_tensor")), None)
    carried = {"kind": FORMAT, "step": step, "groups": len(opt.param_groups), "slots": sorted(OPTIMIZER_SLOTS)}
    return WriteSummary(FORMAT, files, nbytes, tensors=tensors, optimizer=carried,
                        dialect=f"{naming['scheme']} names, {len(params)} parameters", iteration_dir=tag,
                        padded_vocab_size=rows or ckpt.config.vocab_size or ckpt.config.padded_vocab_size)
