"""What a writer wrote: one typed summary for every output format.

Writers (formats/registry.py `write`) and the exports that bypass the canonical state return a
WriteSummary; api.py hands it back as ConversionResult.summary and the commands print it. The fields
every format has are typed; a format's own facts (a Hugging Face architecture and dtype, a BERT's
padding rows) sit in `details`. `summary["files"]` reads a field or a detail by name, as callers of
the dict this replaced did.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclass
class WriteSummary:
    format: str  # the output's format: torch, torch_dist, ds-universal, hf
    files: int  # tensor files written (rank files, distrib_optim.pt files, safetensors shards, ...)
    bytes: int  # tensor bytes written
    tensors: Optional[int] = None  # tensor records written (None where the writer does not count them)
    warnings: List[str] = field(default_factory=list)  # what was warned about while writing
    optimizer: Optional[Dict[str, Any]] = None  # the optimizer state carried (kind, step, groups, ...); None: weights only
    dialect: Optional[str] = None  # Megatron outputs: the key dialect written (ds-universal: its naming)
    iteration_dir: Optional[str] = None  # Megatron / DeepSpeed outputs: the directory under the output
    padded_vocab_size: Optional[int] = None  # rows of the written word embedding
    checkpoint_version: Optional[float] = None  # Megatron outputs
    file_names: List[str] = field(default_factory=list)  # where the writer lists them (safetensors shards)
    details: Dict[str, Any] = field(default_factory=dict)  # the format's own facts (hf: architecture, dtype, ...)
    replaced: Optional[Tuple[int, int]] = None  # (files, bytes) the output held before --force replaced it

    def __getitem__(self, key: str) -> Any:
        if key in self.details:
            return self.details[key]
        if key in _FIELDS:
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            value = self[key]
        except KeyError:
            return default
        return default if value is None else value

    @classmethod
    def combined(cls, parts: Sequence["WriteSummary"]) -> "WriteSummary":
        """The summaries of a team's ranks, each of which wrote its share, as one: the first part's facts
        (the rank that wrote the shared files has them), every part's files, tensors, bytes and names."""
        first = next((p for p in parts if p.details or p.optimizer is not None), parts[0])
        counted = [p.tensors for p in parts]
        return dataclasses.replace(
            first, files=sum(p.files for p in parts), bytes=sum(p.bytes for p in parts),
            tensors=None if None in counted else sum(counted),
            file_names=[n for p in parts for n in p.file_names],
            warnings=[w for p in parts for w in p.warnings])


_FIELDS = {f.name for f in dataclasses.fields(WriteSummary)} - {"details"}


def from_sharded(fmt: str, written: dict, tensors: Optional[int] = None, **details) -> WriteSummary:
    """The summary of a safetensors output from io.safetensors_writer.write_sharded's {files, bytes}."""
    return WriteSummary(fmt, len(written["files"]), written["bytes"], tensors=tensors,
                        file_names=list(written["files"]), details=details)
