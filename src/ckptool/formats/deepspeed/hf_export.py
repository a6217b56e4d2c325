"""Any Hugging Face model trained under DeepSpeed -> a Hugging Face directory with its own names.

GPT-2 and Llama runs are GPT sources (checkpoint.py reads them into canonical names, so every
command works on them). Other architectures (a ZeRO-3 BertForMaskedLM run, say) have no canonical
form; `ckptool to-hf` still consolidates them: the engine's parameter names are already the
model's HF names, so the ZeRO partitions are reassembled and written as safetensors, one tensor
at a time, next to the run's own config.json. The DeepSpeed reader, finding such a model, raises
errors.NoCanonicalForm whose export calls write_hf_state on the files it opened (its
consolidate_hf_state gives the same from a path).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ...errors import CkptError
from ...io.safetensors_writer import Item, parse_size, write_sharded
from ...lazy import LazyTensor
from ...summary import WriteSummary, from_sharded
from ..hf.writer import config_dtype


def write_hf_state(hf: dict, named: Dict[str, LazyTensor], out_dir: Path, dtype: Optional[torch.dtype] = None,
                   max_shard_size="5GB", progress: Optional[Callable[[int], None]] = None) -> WriteSummary:
    """The model's own {HF name: lazy tensor} as safetensors shards beside its config.json (hf)."""
    items: List[Item] = []
    for name, t in named.items():
        if dtype is not None:
            t = t.to(dtype)
        items.append((name, t, name))  # each tensor its own load scope: one parameter in memory
    if not items:
        raise CkptError("no weights to export", "the checkpoint holds no parameters")
    out_dir = Path(out_dir)
    written = write_sharded(out_dir, items, parse_size(max_shard_size), progress)
    out_dtype = dtype or items[0][1].dtype
    conf = dict(hf)
    conf["dtype"] = conf["torch_dtype"] = config_dtype(out_dtype)
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    arch = (hf.get("architectures") or [hf.get("model_type")])[0]
    return from_sharded("hf", written, tensors=len(items), architecture=arch, vocab_size=hf.get("vocab_size"),
                        dtype=conf["dtype"])
