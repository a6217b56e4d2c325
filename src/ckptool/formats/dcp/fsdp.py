"""FSDP / FSDP2 torch.distributed.checkpoint saves of Hugging Face-named (or torchtitan-named) models: reader.

Where such a folder is, its prefix and its config.json: fsdp_files.py. The tensors are read as DCP byte ranges
(io/dcp_io.py; every FSDP2 rank's Shard(0) chunk, never dcp.load of the whole), renamed from torchtitan's names
where the folder uses them (titan.py), and mapped to the canonical state by the Hugging Face reader's own
mapping (formats/hf/reader.to_canonical: the family's name table, fused experts, the same completeness checks).

Optimizer state (torch's get_optimizer_state_dict, flattened as torchtitan saves it: `optimizer.state.<fqn>.
exp_avg | exp_avg_sq | step` tensors and `optimizer.param_groups.<fqn>.<hyperparameter>` byte entries, fqn the
model's own parameter name): AdamW's moments go through the weights' mapping slot by slot; the master is the
weight itself in fp32 (FSDP2 steps its sharded fp32 parameters; a bf16 parameter is made fp32, as for
DeepSpeed's 16-bit weights); parameters with equal hyperparameters form one param group. accelerate keeps the
state in a DCP folder of its own (optimizer_0/ beside pytorch_model_fsdp_0/) in get_optimizer_state_dict's nested
form (groups by index, each listing its FQNs): read the same way. Any other optimizer is dropped with a warning
naming it; the weights are still converted.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ... import families
from ...config import Layout
from ...errors import CkptError, require
from ...io.dcp_io import DcpDir
from ...io.torchfile import load_torch_bytes
from ...lazy import LazyTensor
from ...options import ReadOptions
from ...state import Checkpoint, OptimizerState, ParamGroup, SourceInfo
from ..deepspeed.optim import Tag, reaches
from ..hf.config import gpt_model_type, refused_model, source_warnings
from ..hf.reader import to_canonical
from . import titan
from .fsdp_files import (  # noqa: F401 (looks_like: the table's)
    FORMAT, OPTIMIZER_PREFIXES, find_config, locate, looks_like, model_name, name_scheme)

MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_STATE = MOMENTS + ("step",)
ACCELERATE_OPTIMIZER = "optimizer_[0-9]*"  # save_fsdp_optimizer's folder beside pytorch_model_fsdp_0/


class _Read:
    """One FSDP DCP read: the folder, its name scheme, the model's config.json and family."""

    def __init__(self, path: Path, opts: ReadOptions):
        self.path, self.opts = Path(path), opts
        self.dir = locate(self.path, opts.iteration)
        self.dcp = DcpDir(self.dir)
        self.keys = self.dcp.tensor_keys()
        scheme = name_scheme(self.keys)
        require(scheme is not None, f"{self.dir}: no word embedding among the DCP tensors",
                "ckptool reads DCP saves of Hugging Face-named or torchtitan-named models")
        self.dialect, self.prefix = scheme
        self.conf, self.conf_path = find_config(self.dir, opts.hf_config)
        self.model_type = gpt_model_type(self.conf)
        refused = refused_model(self.conf) or (None if self.model_type else
                                               f"model_type {self.conf.get('model_type')!r} is not a GPT ckptool converts")
        require(not refused, f"{self.conf_path}: {refused}",
                "pass the config.json of the model that was trained (--hf-config DIR)")
        self.warnings: List[str] = []

    def model_keys(self) -> Dict[str, LazyTensor]:
        """The model's tensors under its own names (prefix off, trainer states left out), lazily."""
        return {name: self.dcp.lazy(key) for key in self.keys if (name := model_name(key, self.prefix)) is not None}

    def hf_named(self, named: Dict[str, LazyTensor]) -> Dict[str, LazyTensor]:
        if self.dialect == "torchtitan":
            return titan.to_hf(named, self.conf, self.model_type, self.warnings.append, str(self.dir))
        return named

    def canonical(self, named: Dict[str, LazyTensor]):
        return to_canonical(self.hf_named(named), self.conf, self.model_type, self.opts, self.dir)


def read(path, opts: Optional[ReadOptions] = None) -> Checkpoint:
    r = _Read(Path(path), opts or ReadOptions())
    cfg, tensors = r.canonical(r.model_keys())
    info = SourceInfo(path=str(path), format=FORMAT, dialect=f"{r.dialect} {r.model_type}", layout=Layout(1, 1),
                      extra={"hf_config": r.conf, "dcp_dir": str(r.dir), "config_from": str(r.conf_path)})
    optimizer = _optimizer(r, tensors) if r.opts.optimizer else None
    ckpt = Checkpoint(cfg, tensors, info, r.warnings, optimizer)
    for w in source_warnings(r.conf, families.for_model_type(r.model_type)):
        ckpt.warn(w)
    return ckpt


# --- optimizer state ------------------------------------------------------------------------------
# accelerate's save_fsdp_optimizer (SHARDED_STATE_DICT) keeps the optimizer in a DCP folder of its own beside the
# model's: dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}) into optimizer_{i}/ (huggingface/
# accelerate src/accelerate/utils/fsdp_utils.py save_fsdp_optimizer, FSDP2 branch). get_optimizer_state_dict's
# default (nested) form is `state.<fqn>.<slot>` and `param_groups.<i>.<hyperparameter>` with `param_groups.<i>.params`
# listing the group's FQNs, once DCP has flattened it; torchtitan's flattened form keys the groups by FQN instead.
NESTED_GROUP = re.compile(r"^(\d+)\.(.+)$")


def _state_entries(dcp: DcpDir) -> Optional[tuple]:
    """(prefix, {state name: {fqn: lazy}}) of the optimizer state in dcp, None where there is none."""
    for p in OPTIMIZER_PREFIXES:
        state = defaultdict(dict)
        for key in dcp.tensor_keys():
            if key.startswith(p + "state."):
                fqn, name = key[len(p + "state."):].rsplit(".", 1)
                state[name][fqn] = dcp.lazy(key)
        if state:
            return p, dict(state)
    return None


def _drop(r: _Read, why: str) -> None:
    r.warnings.append(f"optimizer state dropped: {why}; the output holds the weights only")


def _optimizer_dir(r: _Read) -> Optional[DcpDir]:
    """The DCP holding the optimizer: the model's own, else accelerate's optimizer_0/ beside it."""
    if _state_entries(r.dcp) is not None:
        return r.dcp
    beside = sorted(p for p in r.dir.parent.glob(ACCELERATE_OPTIMIZER) if (p / ".metadata").is_file())
    return DcpDir(beside[0]) if beside and r.dir.name.startswith("pytorch_model_fsdp") else None


def _optimizer(r: _Read, tensors: Dict[str, LazyTensor]) -> Optional[OptimizerState]:
    dcp = _optimizer_dir(r)
    found = _state_entries(dcp) if dcp is not None else None
    if found is None:
        if any(k.startswith(OPTIMIZER_PREFIXES) for k in r.dcp.entries):
            _drop(r, "the optimizer entries are not get_optimizer_state_dict's AdamW state")
        return None
    prefix, state = found
    other = sorted(set(state) - set(ADAM_STATE))
    if other or not all(m in state for m in MOMENTS):
        _drop(r, f"its per-parameter state {sorted(state)} is not AdamW's ({', '.join(ADAM_STATE)})")
        return None
    slots = {"master": {n: t.to(torch.float32) for n, t in tensors.items()}}
    for moment in MOMENTS:
        try:
            _, slots[moment] = r.canonical(_own_names(r, state[moment]))
        except CkptError as e:
            _drop(r, f"its {moment} does not map onto the model's parameters ({e})")
            return None
        for n, t in slots[moment].items():
            require(tuple(t.shape) == tuple(tensors[n].shape), f"{r.dir}: {moment} of {n} has shape "
                    f"{tuple(t.shape)}, the weight {tuple(tensors[n].shape)}", "the optimizer state is not this model's")
    hyper = _own_names(r, _hyperparameters(dcp, prefix))
    groups = groups_by_hyper(hyper, _own_names(r, state[MOMENTS[0]]), lambda named: r.canonical(named)[1],
                             list(tensors))
    return OptimizerState(kind="fsdp-adamw", slots=slots, step=_step(r, state.get("step", {})), param_groups=groups)


def _own_names(r: _Read, by_fqn: Dict[str, LazyTensor]) -> Dict[str, LazyTensor]:
    """The optimizer's FQNs as the model keys read (a wrapper's prefix, when the optimizer kept it, off)."""
    p = r.prefix
    if p and all(k.startswith(p) for k in by_fqn):
        return {k[len(p):]: v for k, v in by_fqn.items()}
    return by_fqn


def _step(r: _Read, steps: Dict[str, LazyTensor]) -> Optional[int]:
    values = {int(t.load().item()) for t in steps.values()}
    require(len(values) <= 1, f"{r.dir}: the parameters' AdamW steps differ ({sorted(values)[:4]})",
            "the optimizer state is inconsistent")
    return values.pop() if values else None


def _hyperparameters(dcp: DcpDir, prefix: str) -> Dict[str, dict]:
    """{fqn: its group's hyperparameters} from either form's param_groups byte entries."""
    head = prefix + "param_groups."
    stored = {key[len(head):]: load_torch_bytes(dcp.read_bytes(key), source=f"{dcp.path.name}:{key}")
              for key in dcp.entries if key.startswith(head) and not hasattr(dcp.entries[key], "chunks")}
    nested: Dict[str, dict] = defaultdict(dict)
    for key, value in stored.items():
        m = NESTED_GROUP.match(key)
        if m and m.group(2) != "params":
            nested[m.group(1)][m.group(2)] = value
    owners = {m.group(1): value for key, value in stored.items() for m in [NESTED_GROUP.match(key)]
              if m and m.group(2) == "params" and isinstance(value, (list, tuple))}
    if owners:  # nested: each group lists its FQNs
        return {fqn: nested[i] for i, fqns in owners.items() for fqn in fqns}
    hyper: Dict[str, dict] = defaultdict(dict)
    for key, value in stored.items():
        fqn, name = key.rsplit(".", 1)
        hyper[fqn][name] = value
    return dict(hyper)


def groups_by_hyper(hyper: Dict[str, dict], moments: Dict[str, LazyTensor], canonical: Callable,
                    order: List[str]) -> List[ParamGroup]:
    """Parameters with equal stored hyperparameters as one group, each holding the canonical names made from its
    parameters, traced through the weights' own mapping: canonical({name: tensor}) -> {canonical name: tensor}."""
    tags = {fqn: Tag(t) for fqn, t in moments.items()}
    owners = {id(tag): fqn for fqn, tag in tags.items()}
    traced = canonical(tags)
    groups: Dict[str, ParamGroup] = {}
    for name in order:
        for fqn in sorted(reaches(traced[name], owners)):
            h = hyper.get(fqn, {})
            group = groups.setdefault(repr(sorted(h.items())), ParamGroup([], h))
            if name not in group.names:
                group.names.append(name)
    return list(groups.values())
