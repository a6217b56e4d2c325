"""Any Hugging Face model trained under DeepSpeed -> a Hugging Face directory with its own names.

GPT-2 and Llama runs are GPT sources (deepspeed.py reads them into canonical names, so every
command works on them). Other architectures (a ZeRO-3 BertForMaskedLM run, say) have no canonical
form; `ckptool to-hf` still consolidates them: the engine's parameter names are already the
model's HF names, so the ZeRO partitions are reassembled and written as safetensors, one tensor
at a time, next to the run's own config.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, List, Optional

import torch

from ..errors import CkptError
from ..io.safetensors_writer import Item, parse_size, write_sharded
from ..options import ReadOptions
from . import deepspeed as ds
from .hf import gpt_model_type
from .hf_writer import config_dtype
from .deepspeed_zero import find_files, looks_like_deepspeed, read_rank

def non_gpt_hf_model(path, opts: ReadOptions) -> Optional[str]:
    """The model_type when `path` is a DeepSpeed run of an HF model ckptool cannot read as a GPT.

    None for everything else (Megatron-DeepSpeed, GPT-2 / Llama runs, non-DeepSpeed sources), which
    the ordinary readers handle, with their own errors."""
    if not looks_like_deepspeed(Path(path)):
        return None
    try:
        tf = find_files(Path(path), opts.iteration)
        if tf.layers or len(tf.mp_ranks) != 1:
            return None
        r = read_rank(tf, tf.mp_ranks[0])
        names = set(r.module) | set(r.master)
        if not names or ds.mds.is_pipe_names(names) or ds._looks_megatron({n: None for n in names}):
            return None
        hf = ds.find_hf_config(tf.tag_dir, opts.hf_config)
    except CkptError:
        return None  # the reader will say what is wrong
    if hf is None or gpt_model_type(hf) is not None:
        return None
    return str(hf.get("model_type"))


def write_hf_consolidated(path, out_dir: Path, opts: ReadOptions, dtype: Optional[torch.dtype] = None,
                          max_shard_size="5GB", progress: Optional[Callable[[int], None]] = None) -> dict:
    hf, named = ds.consolidate_hf_state(path, opts)
    items: List[Item] = []
    for name, t in named.items():
        if dtype is not None:
            t = t.to(dtype)
        items.append((name, t, name))  # each tensor its own load scope: one parameter in memory
    if not items:
        raise CkptError(f"{path}: no weights to export", "the checkpoint holds no parameters")
    out_dir = Path(out_dir)
    summary = write_sharded(out_dir, items, parse_size(max_shard_size), progress)
    out_dtype = dtype or items[0][1].dtype
    conf = dict(hf)
    conf["dtype"] = conf["torch_dtype"] = config_dtype(out_dtype)
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    arch = (hf.get("architectures") or [hf.get("model_type")])[0]
    summary.update(architecture=arch, vocab_size=hf.get("vocab_size"), dtype=conf["dtype"], tensors=len(items))
    return summary
