"""A DeepSpeed run's training state -> a DeepSpeed universal checkpoint (`--format ds-universal`).

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
DeepSpeed, the pipe names (`tied_modules.embed.word_embeddings.weight`,
`<idx>.mlp.dense_4h_to_h.weight`) for Megatron-DeepSpeed pipeline runs, and the dotted Megatron names
(`language_model.encoder.layers.0...`) for Megatron-DeepSpeed --no-pipeline-parallel runs. A canonical
source is mapped back to those names (from_checkpoint); a run with no canonical form (a non-GPT HF
model, any other module) keeps the names module.named_parameters() gave (deepspeed/universal_source.py,
through the reader's errors.NoCanonicalForm export). Either way a Universal is built and
write_universal streams it. Tensors are full: TP-merged the way the universal format merges them
(row-parallel on dim 1 with cat_dim 1, SwiGLU's dense_h_to_4h as two sub-params, the word embeddings
cut to the true vocabulary and marked vocab_tensor), so the loader's own chunking re-splits them for
any TP. Frozen parameters get fp32.pt only, as DeepSpeed writes them. The module weights are not
written (the engine ignores them on a universal load). Both model-states names are written, so a
ZeRO-1/2 and a ZeRO-3 engine load the same folder.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...config import Layout
from ...errors import CkptError, require
from ...io.torchfile import save_streaming
from ...lazy import LazyTensor, load_scope
from ...roles import canonical_names, global_role_tensor, layer_role_tensor, rule_for
from ...sharding import Rule
from ...state import OPTIMIZER_SLOTS, Checkpoint
from ...summary import WriteSummary
from ... import families
from ...families.family import canonical_names as hf_canonical_names
from ...write_options import WriteOptions
from ..hf.writer import materialise

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
    """One engine parameter: its name, per slot its full lazy tensor, the index of the torch param
    group that trains it (None: frozen, written as fp32.pt only), the canonical names it is made of
    (canonical sources) and the merge facts the universal loader reads (cat_dim,
    param_n_sub_params, vocab_tensor)."""

    def __init__(self, name: str, slots: Dict[str, LazyTensor], canonical: Sequence[str] = (),
                 extra: Optional[dict] = None, group: Optional[int] = None):
        self.name, self.slots, self.canonical, self.group = name, slots, list(canonical), group
        self.extra = {"cat_dim": 0} if extra is None else extra


@dataclass
class Universal:
    """Everything a universal folder is written from, whichever reader made it: the parameters
    (streamed one at a time), the torch param groups' hyperparameters in order, the optimizer step,
    the engine's model-states counters (ENGINE_DEFAULTS' keys), the loss scaler / clip_grad the
    optimizer state keeps, extra model-states entries (Megatron-DeepSpeed client state) and, for the
    summary, how the parameters are named."""
    params: List[Param]
    hyper: List[dict]
    step: int
    engine: dict
    scaler: dict = field(default_factory=dict)
    client: dict = field(default_factory=dict)
    naming: str = ""
    vocab_rows: Optional[int] = None


def engine_counters(engine_state: Optional[dict]) -> dict:
    """The model-states counters a universal folder carries: the source's where it kept them, else
    ENGINE_DEFAULTS."""
    return {**ENGINE_DEFAULTS, **{k: v for k, v in (engine_state or {}).items() if v is not None}}


# --- engine names per source scheme -----------------------------------------------------------

def _hf_params(ckpt: Checkpoint, naming: dict, slots: Dict[str, Dict[str, LazyTensor]]) -> List[Param]:
    """HF module names through the model family's one name table (families/), applied to every slot alike."""
    names = families.for_model_type(naming["model_type"]).names
    out = []
    for hf_name, entry, _group in names.expand(ckpt.config.num_layers):
        if hf_name == "lm_head.weight" and ckpt.config.tied_embeddings:
            continue
        made = {slot: materialise(entry, tensors) for slot, tensors in slots.items()}
        if any(t is None for t in made.values()):
            continue
        out.append(Param(hf_name, made, list(hf_canonical_names(entry))))
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


class Scheme(NamedTuple):
    params: Callable  # (ckpt, naming, slots) -> [Param]
    client_state: bool  # the model states carry Megatron-DeepSpeed's client state (args, iteration, ...)


# naming scheme (the DeepSpeed reader's source.extra["param_names"]) -> how its engine parameters are made
SCHEMES: Dict[str, Scheme] = {"hf": Scheme(_hf_params, False), "mds-pipe": Scheme(_mds_params, True),
                              "megatron-module": Scheme(_mds_params, True)}


def _scheme(ckpt: Checkpoint) -> Tuple[Scheme, dict]:
    naming = ckpt.source.extra.get("param_names") or {}
    scheme = SCHEMES.get(naming.get("scheme"))
    if scheme is None:
        why = ("its parameters have no DeepSpeed names" if not naming
               else f"ckptool cannot name this DeepSpeed run's parameters ({naming.get('scheme')})")
        raise CkptError(f"--format ds-universal: {why}", "the source must be a DeepSpeed run")
    return scheme, naming


def universal_params(ckpt: Checkpoint) -> Tuple[List[Param], dict]:
    """The engine parameters of a canonical DeepSpeed source, each with its group, and its naming."""
    scheme, naming = _scheme(ckpt)
    params = scheme.params(ckpt, naming, _slots(ckpt))
    group_of = _groups_of(ckpt)
    for p in params:
        groups = [group_of[n] for n in p.canonical if n in group_of]
        p.group = min(groups) if groups else None
    return params, naming


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


def _groups_of(ckpt: Checkpoint) -> Dict[str, int]:
    """canonical name -> index of the optimizer group that trains it (absent: frozen)."""
    out = {}
    for g, group in enumerate(ckpt.optimizer.param_groups):
        for n in group.names:
            out.setdefault(n, g)
    return out


def from_checkpoint(ckpt: Checkpoint) -> Universal:
    """A canonical DeepSpeed source (an HF GPT or a Megatron-DeepSpeed run) as a Universal."""
    opt, cfg = ckpt.optimizer, ckpt.config
    params, naming = universal_params(ckpt)
    es = engine_counters(ckpt.source.extra.get("engine_state"))
    es.setdefault("global_samples", opt.consumed_samples or 0)
    client = {}
    if SCHEMES[naming["scheme"]].client_state:
        client = {k: es[k] for k in CLIENT_KEYS if es.get(k) is not None}
        client["args"] = ckpt.source.args
        client["universal_checkpoint_info"] = ckpt.source.extra.get("universal_checkpoint_info")
    rows = next((p.slots["master"].shape[0] for p in params if p.extra.get("vocab_tensor")), None)
    return Universal(params, [dict(g.hyper) for g in opt.param_groups],
                     opt.step if opt.step is not None else es["global_steps"], es, dict(opt.grad_scaler or {}),
                     client, f"{naming['scheme']} names", rows or cfg.vocab_size or cfg.padded_vocab_size)


# --- writing ----------------------------------------------------------------------------------

def check_request(layout: Layout, opts: WriteOptions) -> None:
    """Refuse what a universal folder cannot be, beyond the options the format table says it does not honour
    (write_options.refuse_unhonoured: --dialect, --release, --pad-fill, ... refused by name before): before
    anything is read or written."""
    require(opts.optimizer, "--format ds-universal is the training state itself; it cannot be written --no-optimizer",
            "drop --no-optimizer, or write --format torch for the weights only")
    require(layout.tp == 1 and layout.pp == 1 and not layout.vpp,
            "--format ds-universal has no layout of its own (the engine re-splits it at load)",
            "use `ckptool merge SRC DST --format ds-universal`")
    require(opts.dtype is None or opts.dtype == torch.float32, "--format ds-universal stores fp32 masters and moments",
            "leave --dtype out")


def write_ds_universal(ckpt: Checkpoint, out_dir: Path, layout: Layout, opts: WriteOptions = WriteOptions(),
                       progress=None, warn=print) -> WriteSummary:
    """The format table's writer: a canonical DeepSpeed source's training state as a universal folder."""
    check_request(layout, opts)
    require(ckpt.optimizer is not None, "--format ds-universal writes the training state, and this source holds "
            "no optimizer state", "convert a DeepSpeed checkpoint that has its *_optim_states.pt shards")
    return write_universal(from_checkpoint(ckpt), out_dir, progress)


def export_universal(make: Callable[[Callable[[str], None]], Universal], out_dir: Path, layout: Layout,
                     opts: WriteOptions = WriteOptions(), progress=None, warn=print) -> WriteSummary:
    """The export a reader attaches to errors.NoCanonicalForm for this format: make(warn) builds the
    Universal from the files the reader opened, after the request is checked."""
    check_request(layout, opts)
    return write_universal(make(warn), out_dir, progress)


def _save(path: Path, obj) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_streaming(obj, path)


def _write_param(zero: Path, p: Param, step: int, progress) -> Tuple[int, int, int]:
    """One parameter's files, its tensors read in one load scope (one parameter in memory):
    (files, tensors, bytes)."""
    trained = p.group is not None
    files = tensors = nbytes = 0
    with load_scope():
        for slot, t in p.slots.items():
            if slot != "master" and not trained:
                continue  # DeepSpeed keeps no moments for frozen parameters
            # a frozen parameter's fp32.pt is the bare {"param": ...} DeepSpeed writes for it
            n = _save(zero / p.name / f"{STATE_FILES[slot]}.pt", {"param": t, **(p.extra if trained else {})})
            files, tensors, nbytes = files + 1, tensors + 1, nbytes + n
            if progress:
                progress(n)
    if trained:
        _save(zero / p.name / "step.pt", torch.tensor(float(step)))
        files += 1
    return files, tensors, nbytes


def _optimizer_file(u: Universal) -> dict:
    """zero/optimizer_state.pt: param groups, loss scaler, clip_grad, and the step where ZeRO-3 reads it."""
    hyper = [dict(h, params=[i]) for i, h in enumerate(u.hyper)] or [{"params": [0]}]
    return {**u.scaler, "ds_version": u.engine["ds_version"], "param_groups": hyper,
            "optimizer_state_dict": {"state": {i: {"step": torch.tensor(float(u.step))} for i in range(len(hyper))},
                                     "param_groups": hyper}}


def _model_states(u: Universal, shapes: Dict[int, "OrderedDict[str, torch.Size]"]) -> dict:
    es = u.engine
    return {"module": None, "buffer_names": [], "optimizer": None,
            "param_shapes": [shapes[g] for g in sorted(shapes)], "frozen_param_shapes": None, "shared_params": {},
            "frozen_param_fragments": None, "lr_scheduler": es["lr_scheduler"], "data_sampler": None,
            "random_ltd": None, "sparse_tensor_module_names": set(), "skipped_steps": es["skipped_steps"],
            "global_steps": es["global_steps"], "global_samples": es.get("global_samples", 0),
            "dp_world_size": es["dp_world_size"], "mp_world_size": es["mp_world_size"],
            "ds_config": es.get("ds_config"), "ds_version": es["ds_version"], **u.client}


def write_universal(u: Universal, out_dir: Path, progress=None) -> WriteSummary:
    """The universal folder (see the module docstring), one parameter at a time."""
    out_dir = Path(out_dir)
    tag = f"global_step{u.engine['global_steps']}_universal"
    zero = out_dir / tag / "zero"
    files = nbytes = tensors = 0
    shapes: Dict[int, "OrderedDict[str, torch.Size]"] = {}
    for p in u.params:
        f, t, n = _write_param(zero, p, u.step, progress)
        files, tensors, nbytes = files + f, tensors + t, nbytes + n
        if p.group is not None:
            shapes.setdefault(p.group, OrderedDict())[p.name] = p.slots["master"].shape
    _save(zero / "optimizer_state.pt", _optimizer_file(u))
    model_states = _model_states(u, shapes)
    for name in MODEL_STATES:
        _save(out_dir / tag / name, model_states)
    (out_dir / "latest_universal").write_text(tag)
    files += 1 + len(MODEL_STATES) + 1
    carried = {"kind": FORMAT, "step": u.step, "groups": len(u.hyper), "slots": sorted(OPTIMIZER_SLOTS)}
    return WriteSummary(FORMAT, files, nbytes, tensors=tensors, optimizer=carried,
                        dialect=f"{u.naming}, {len(u.params)} parameters", iteration_dir=tag,
                        padded_vocab_size=u.vocab_rows)
