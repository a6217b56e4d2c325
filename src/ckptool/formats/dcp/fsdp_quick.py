"""FSDP / accelerate DCP saves of Hugging Face-named models for inspect, without torch: the DCP index (read into
inert StandIns, formats/dcp/quick.py checks it whole as the full reader does) gives every tensor's global shape and
dtype, config.json the GPTConfig, and the family's name table the canonical shapes (hf/quick.canonical_shapes),
as the full reader (fsdp.py) maps the tensors.

None (the full reader answers) for torchtitan's names (their RoPE rows and fused experts are the reader's
arithmetic), transformers' fused experts, saves holding optimizer state, or anything that does not match.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ... import families
from ...config import Layout
from ...errors import CkptError
from ...quick.torch_pickle import NotQuick, loads
from ...state import Checkpoint, SourceInfo
from ..hf.config import source_warnings
from ..hf.quick import canonical_shapes
from .files import DCP_METADATA
from .fsdp_files import OPTIMIZER_PREFIXES, find_config, locate, model_name, name_scheme
from .quick import is_record, sound_index, tensor_meta


def read(path: Path, format_name: str) -> Optional[Checkpoint]:
    try:
        d = locate(Path(path))
        meta = loads((d / DCP_METADATA).read_bytes())
        if not sound_index(meta, d):
            return None
        return _checkpoint(Path(path), format_name, d, meta)
    except (CkptError, NotQuick, OSError, ValueError, LookupError, TypeError, AttributeError):
        return None  # the full reader reports what is wrong


def _checkpoint(path: Path, format_name: str, d: Path, meta) -> Optional[Checkpoint]:
    stored = {k: tensor_meta(e) for k, e in meta.state_dict_metadata.items() if is_record(e, "TensorStorageMetadata")}
    scheme = name_scheme(list(stored))
    if scheme is None or scheme[0] != "hf" or any(k.startswith(OPTIMIZER_PREFIXES) for k in meta.state_dict_metadata):
        return None
    conf, conf_path = find_config(d, None)
    family = families.of_hf_config(conf)
    if family is None:
        return None
    entries = {name: t for k, t in stored.items() if (name := model_name(k, scheme[1])) is not None}
    cfg = family.read_config(conf, entries[family.names.word_embedding].shape[0])
    tensors = canonical_shapes(entries, family, cfg)
    if tensors is None:
        return None
    info = SourceInfo(path=str(path), format=format_name, dialect=f"hf {family.model_type}", layout=Layout(1, 1),
                      extra={"hf_config": conf, "dcp_dir": str(d), "config_from": str(conf_path)})
    ckpt = Checkpoint(cfg, tensors, info)
    for w in source_warnings(conf, family):
        ckpt.warn(w)
    return ckpt
