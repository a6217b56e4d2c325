"""Canonical state -> a torch.distributed.checkpoint folder of the model's state dict, as FSDP2 trainers save it,
for torch's own dcp.load into a model sharded at any world size (DCP reshards on load).

Names: the Hugging Face family's (the HF writer's mapping, hf/writer.hf_items), with a family's experts fused as
transformers >= 5 holds them in model.state_dict() (families' fused_experts: Qwen3-MoE's mlp.experts.gate_up_proj
[E, 2I, h] and down_proj [E, h, I]); with --dialect torchtitan, torchtitan's (titan.py: its RoPE row order, its
fused moe.experts.w1 / w2 / w3). Each tensor is one chunk of __0_0.distcp (each expert its own chunk of the fused
tensor, so one expert is in memory at a time); config.json beside it says what model it is (ckptool reads the
folder back, and a trainer builds its model from it). Weights only: optimizer state is dropped with a warning.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ...errors import CkptError
from ...io.dcp_io import DcpWriter
from ...lazy import LazyTensor, load_scope
from ...state import Checkpoint
from ...summary import WriteSummary
from ...write_options import WriteOptions
from ..hf.writer import token_ids, config_dtype, hf_config, hf_items
from . import titan
from .fsdp_files import DIALECTS, FORMAT

# an expert's tensor written as a part of a fused one: (fused name, expert, row offset in the expert's block)
Part = Tuple[str, int, int]


def write_dcp(ckpt: Checkpoint, out_dir: Path, layout=None, opts: WriteOptions = WriteOptions(),
              progress: Optional[Callable[[int], None]] = None, warn=print) -> WriteSummary:
    """Write ckpt's weights as a DCP folder under HF names (opts.dialect "torchtitan": torchtitan's) in opts.dtype.
    layout is not used: dcp.load reshards to the loading model's sharding."""
    dialect = opts.dialect or "hf"
    if dialect not in DIALECTS:
        raise CkptError(f"--dialect {dialect}: the dcp writer names tensors as {' or '.join(DIALECTS)}",
                        "leave --dialect out for Hugging Face names, or give --dialect torchtitan")
    family, vocab, items = hf_items(ckpt, opts.dtype, warn)
    out_dir = Path(out_dir)
    conf = hf_config(ckpt.config, family, vocab, opts.dtype or items[0][1].dtype, token_ids(ckpt))
    if dialect == "torchtitan":
        placed = _titan_places(titan.from_hf(((n, t) for n, t, _ in items), conf, family.model_type))
    else:
        placed = _hf_places([(n, t) for n, t, _ in items], family, ckpt.config)
    writer = DcpWriter(out_dir)
    written = 0
    for name, t, part, shape in placed:
        with load_scope():
            value = t.load()
        offsets = (0,) * value.dim()
        if part is not None:
            value = value.unsqueeze(0)
            offsets = (part[1], part[2]) + (0,) * (value.dim() - 2)
        writer.declare(name, shape, value.dtype)
        written += writer.add_chunk(name, value, offsets)
        if progress:
            progress(value.numel() * value.element_size())
    writer.finish()
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return WriteSummary(FORMAT, 1, written, tensors=len(placed), dialect=dialect,
                        details={"architecture": family.architecture, "dtype": config_dtype(items[0][1].dtype)})


def _hf_places(items: List[Tuple[str, LazyTensor]], family, cfg) -> list:
    """[(DCP name, tensor, part or None, global shape)]: HF names, a layer's experts as parts of the fused
    tensors of family.fused_experts (transformers >= 5's state dict)."""
    fused: Dict[str, Tuple[str, int]] = {}  # per-expert hub suffix pattern -> (fused suffix, which half)
    for suffix, (op, arg) in family.fused_experts.items():
        for half, hub in enumerate({"halves": arg, "each": (arg,)}.get(op, ())):  # "rename": not an expert
            fused[hub] = (suffix, half)
    out = []
    for name, t in items:
        hit = _expert_part(name, fused, family.names.layer_prefix)
        if hit is None:
            out.append((name, t, None, tuple(t.shape)))
            continue
        fused_name, e, half = hit
        rows = t.shape[0]
        n = cfg.moe.num_experts
        shape = (n, rows * (2 if _halves(family, fused_name) else 1)) + tuple(t.shape[1:])
        out.append((fused_name, t, (fused_name, e, half * rows), shape))
    return out


def _halves(family, fused_name: str) -> bool:
    return any(fused_name.endswith(s) and op == "halves" for s, (op, _) in family.fused_experts.items())


def _expert_part(name: str, fused: Dict[str, Tuple[str, int]], layer_prefix: str) -> Optional[tuple]:
    """(fused DCP name, expert, half) of a per-expert HF name that transformers holds fused, else None."""
    for hub, (suffix, half) in fused.items():
        pattern = re.escape(layer_prefix).replace(r"\{i\}", r"(\d+)") + re.escape(hub).replace(r"\{e\}", r"(\d+)") + "$"
        m = re.match(pattern, name)
        if m:
            return layer_prefix.format(i=m.group(1)) + suffix, int(m.group(2)), half
    return None


def _titan_places(named: List[Tuple[str, LazyTensor]]) -> list:
    """[(DCP name, tensor, part or None, global shape)] of titan.from_hf's output: `name@e` is expert e of the
    fused [E, ...] tensor `name`."""
    experts: Dict[str, int] = {}
    for name, _ in named:
        if "@" in name:
            base, e = name.split("@")
            experts[base] = max(experts.get(base, 0), int(e) + 1)
    out = []
    for name, t in named:
        if "@" not in name:
            out.append((name, t, None, tuple(t.shape)))
            continue
        base, e = name.split("@")
        out.append((base, t, (base, int(e), 0), (experts[base],) + tuple(t.shape)))
    return out
