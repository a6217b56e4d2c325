"""`ckptool inspect` without importing torch, where a format's metadata says everything.

The format table (formats/registry.py) names the format without torch (its looks_like functions of
directory formats are torch-free) and gives that format's quick reader, if it has one:
  hf         config.json + safetensors headers (formats/hf/quick.py)
  megatron   the rank files' pickles read for structure, args -> config, MoE experts at any EP /
             expert TP, MLA models, the optimizer's state in the rank files and distrib_optim.pt (an
             MoE model's [dense, expert] chain too) (formats/megatron/quick.py, formats/megatron/quick_experts.py,
             formats/megatron/quick_optim.py, formats/megatron/quick_distopt.py)
  torch_dist the DCP .metadata pickle, the common state's args (else a trainer's config sidecar:
             formats/dcp/sidecars.py), model-space optimizer state and the
             flat dp_reshardable buckets (MoE chains and MLA too) (formats/dcp/quick.py, formats/dcp/quick_optim.py,
             formats/dcp/quick_buckets.py)
  deepspeed  Megatron models under DeepSpeed (pipeline layer files or `module`), ZeRO-1/2 and BF16
             shards (formats/deepspeed/quick.py); Hugging Face models under DeepSpeed, ZeRO-1/2/3 and BF16
             (formats/deepspeed/quick_hf.py)
Each returns a real Checkpoint whose tensors (and optimizer slots) are TensorMeta records (shape,
dtype name, bytes), so inspect's describe() and text output are the same code on both paths, or None
where only the full reader can say. Then, and for reading options (overrides, --true-vocab-size,
--weights), other forms (docs/inspect-json.md lists them), files and anything damaged, the caller
takes the full reader (api.open), which gives the answer, or the error, it always gave.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import CkptError
from .formats import registry
from .options import ReadOptions, pop_read_options
from .state import Checkpoint


def quick_open(path, read_options: dict) -> Optional[Checkpoint]:
    """The Checkpoint `inspect` would show, read without torch, or None where only the full reader
    can say (see the module docstring). read_options: inspect's reading options (CLI names)."""
    if pop_read_options(dict(read_options)) != ReadOptions():
        return None  # overrides and --true-vocab-size are the full reader's to apply
    path = Path(path)
    if not path.is_dir():
        return None  # the table's file formats (a BERT ckpt_N.pt) are told apart by loading them
    try:
        fmt = registry.source_format(path)
    except CkptError:
        return None
    return fmt.quick_read(path)
