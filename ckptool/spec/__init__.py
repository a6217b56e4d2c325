"""Model-family specs, the single source of truth for canonical tensors and their names in each format
(schema.py: what a spec is; gpt.py: the GPT family). Torch-free."""
from .gpt import GPT  # noqa: F401
