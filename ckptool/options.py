"""What a user can tell a reader that the checkpoint itself may not say."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class ReadOptions:
    iteration: Optional[int] = None  # which iter_XXXXXXX (default: the tracker's / the latest)
    true_vocab_size: Optional[int] = None
    replicas: str = "first"  # first | mean | strict: TP replicas that differ
    weights: Optional[str] = None  # DeepSpeed: master (fp32 optimizer) | model (16-bit module)
    qkv_layout: Optional[str] = None  # Megatron-DeepSpeed QKV packing when the files cannot tell
    hf_config: Optional[str] = None
    args_from: Optional[str] = None  # take missing args from another checkpoint
    optimizer: bool = True  # False (--no-optimizer): leave the optimizer state unread, even a broken one
    # Architecture facts for checkpoints that store no args (2019 files, bare DCP saves):
    overrides: Dict[str, Any] = field(default_factory=dict)
