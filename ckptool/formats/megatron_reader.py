"""Registry entry for Megatron torch-format checkpoints (see megatron.py)."""
from .megatron import looks_like_megatron as looks_like, read_megatron as read  # noqa: F401

FORMAT = "megatron"
