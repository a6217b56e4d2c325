"""megatron-core torch_dist checkpoints for inspect, without torch: the DCP index (.metadata, a
pickle of torch.distributed.checkpoint's metadata dataclasses, read into inert StandIns by
quick/torch_pickle.py) gives every tensor's global shape and dtype, the common state (common.pt or
the common_state byte entry) the run's args, and the args the config (megatron_args, as the full
reader computes it); the canonical shapes follow from the config (quick/meta.py).

Covered: dense, MoE and MLA (DeepSeek-V2/V3 style, with either the local or the TE spec's names)
GPT models with args (MoE experts stacked per layer or per model, EP from the args as the full
reader takes it), without optimizer state or with it in a model-space form (formats/dcp/quick_optim.py).
A module buffer (the spec's "buffer" trait: the router's expert bias, which megatron-core keeps in
fp32 beside bf16 / fp16 weights) keeps its own dtype and has no optimizer slot or group.
None (the full reader answers) for other optimizer forms (formats/dcp/quick_optim.py names them), bare
saves without args, parameters of several dtypes, an unknown backend, or
stored tensors whose element count differs from the model the args describe (tensors the full
reader would refuse as not part of a GPT model, or files whose MLA ranks differ from the args).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

from ...errors import CkptError
from ..megatron import args as megatron_args
from . import sidecars
from .files import COMMON_FILE, COMMON_KEY, CONFIG_FILE, DCP_COMMON_KEYS, DCP_METADATA, locate
from ...spec import GPT
from ...spec.schema import MCORE
from ...state import Checkpoint, SourceInfo
from .quick_buckets import object_reader
from .quick_optim import training_state
from ...quick.meta import BUFFER_ROLES, TensorMeta, canonical_meta, canonical_shapes, is_buffer, split_dtypes
from ...io.standin import stands_for, state_of
from ...quick.torch_pickle import NotQuick, load_torch_zip, loads

WORD = "embedding.word_embeddings.weight"
HEAD = "output_layer.weight"  # a tied model's synchronised copy of WORD, when stored
# DCP entries that are not model weights: Transformer Engine extra state, RNG and rerun state, the
# common state, optimizer tensors (torch_dist.py SKIP says the same for the full reader).
NOT_WEIGHTS = re.compile(r"(_extra_state|^rng_state|^(chained_\d+\.)?optimizer\.|^common_state|rerun_state_machine)")
# a module buffer's DCP key ends with its megatron-core key (stacked or per layer) -> its role
BUFFER_KEYS = {"." + GPT.roles[r].key(MCORE): r for r in BUFFER_ROLES}
STACKED = re.compile(r"^decoder\.layers\.([^0-9].*)$")
PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def read(path: Path, format_name: str) -> Optional[Checkpoint]:
    try:
        d, iteration, release = locate(path)
        if not _known_backend(d):
            return None
        meta = loads((d / DCP_METADATA).read_bytes())
        common = _common_state(d, meta)
    except (CkptError, NotQuick, OSError, ValueError):
        return None
    if not sound_index(meta, d) or not isinstance(common, dict):
        return None
    try:
        return _checkpoint(path, format_name, d, meta, common, iteration, release)
    except (NotQuick, LookupError, TypeError, AttributeError, ValueError, OSError):
        return None  # structures the quick reader does not know: the full reader says what they are


def is_record(obj, name: str) -> bool:
    """obj is a record of torch.distributed.checkpoint's class `name`."""
    module, cls = stands_for(obj)
    return cls == name and module.startswith("torch.distributed.checkpoint")


def _index(value, dims: Optional[int] = None) -> bool:
    return isinstance(value, tuple) and all(type(x) is int and x >= 0 for x in value) and \
        (dims is None or len(value) == dims)


def sound_index(meta, d: Path) -> bool:
    """Whether the DCP index is whole, as the full reader checks it on opening (io/dcp_io.py): every
    entry tensor or bytes metadata, chunks inside their tensor, every storage entry a plain file of
    this directory that exists, holding its bytes, without stream transforms. Anything else is the
    full reader's to report."""
    entries, storage = getattr(meta, "state_dict_metadata", None), getattr(meta, "storage_data", None)
    if not is_record(meta, "Metadata") or not isinstance(entries, dict) or not isinstance(storage, dict):
        return False
    for fqn, e in entries.items():
        if is_record(e, "BytesStorageMetadata"):
            continue
        size = getattr(e, "size", None)
        if not (isinstance(fqn, str) and is_record(e, "TensorStorageMetadata") and _index(size)
                and tensor_meta(e) is not None and isinstance(getattr(e, "chunks", None), list)):
            return False
        for c in e.chunks:
            offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not (is_record(c, "ChunkStorageMetadata") and _index(offsets, len(size)) and _index(sizes, len(size))
                    and all(o + n <= full for o, n, full in zip(offsets, sizes, size))):
                return False
    lengths = {}
    for idx, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if not (is_record(idx, "MetadataIndex") and isinstance(getattr(idx, "fqn", None), str) and is_record(info, "_StorageInfo")
                and isinstance(rel, str) and rel and Path(rel).name == rel and rel not in (".", "..")
                and type(getattr(info, "offset", None)) is int and type(getattr(info, "length", None)) is int
                and info.offset >= 0 and info.length >= 0 and not getattr(info, "transform_descriptors", None)):
            return False
        if rel not in lengths:
            f = d / rel
            lengths[rel] = f.stat().st_size if f.is_file() else -1
        if info.offset + info.length > lengths[rel]:
            return False
    return True


def _known_backend(d: Path) -> bool:
    f = d / CONFIG_FILE
    if not f.is_file():
        return True  # plain DCP
    conf = json.loads(f.read_text())
    return isinstance(conf, dict) and conf.get("sharded_backend") in ("torch_dist", "torch")


def _common_state(d: Path, meta) -> Optional[dict]:
    """As the full reader finds it: common.pt, else the common_state byte entry (torch.save([state]))."""
    if (d / COMMON_FILE).is_file():
        state = load_torch_zip(d / COMMON_FILE)
    else:
        raw = _entry_bytes(d, meta, COMMON_KEY)
        if raw is None:  # torch_dcp / fsdp_dtensor: each common entry a byte entry of its own
            found = {k: _entry_bytes(d, meta, k) for k in DCP_COMMON_KEYS}
            return {k: load_torch_zip(v) for k, v in found.items() if v is not None}
        state = load_torch_zip(raw)
        if isinstance(state, (list, tuple)) and len(state) == 1:
            state = state[0]
    return state if isinstance(state, dict) else {}


def _entry_bytes(d: Path, meta, fqn: str) -> Optional[bytes]:
    """A byte entry's bytes (a torch.save of the object), where the index stores it once; else None."""
    where = [v for k, v in getattr(meta, "storage_data", {}).items() if getattr(k, "fqn", None) == fqn]
    if len(where) != 1:
        return None
    info = where[0]
    with open(d / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def tensor_meta(entry) -> Optional[TensorMeta]:
    """A TensorStorageMetadata record as TensorMeta (its properties pickle as a state tuple, dtype first)."""
    props = getattr(entry, "properties", None)
    size = getattr(entry, "size", None)
    state = state_of(props)
    dtype = getattr(props, "dtype", None) or (state[0] if isinstance(state, tuple) and state else None)
    if not isinstance(size, tuple) or not isinstance(dtype, str):
        return None
    return TensorMeta(size, str(dtype))


def _config_source(d: Path, common: dict):
    """(args, sidecar or None) as the full reader takes them: the common state's args, else the config sidecar its
    trainer wrote (dcp/sidecars.py: Megatron-Bridge, NeMo 2, verl); None for neither, or a damaged sidecar (the full
    reader says what is wrong with it)."""
    if common.get("args") is not None:
        return common["args"], None
    try:
        sidecar = sidecars.find(d)
    except CkptError:
        return None
    return (sidecar.args, sidecar) if sidecar is not None else None


def _checkpoint(path, format_name, d, meta, common, iteration, release) -> Optional[Checkpoint]:
    entries = meta.state_dict_metadata
    source = _config_source(d, common)
    if source is None:
        return None
    args, sidecar = source
    weights: Dict[str, TensorMeta] = {}
    for key, entry in entries.items():
        if NOT_WEIGHTS.search(key) or type(entry).__name__ == "BytesStorageMetadata":
            continue
        t = tensor_meta(entry)
        if t is None:
            return None
        weights[key] = t
    word = [k for k in weights if k.endswith(WORD)]
    if len(word) != 1:
        return None
    prefix = word[0][:-len(WORD)]
    if any(not k.startswith(prefix) for k in weights):
        return None
    keys = {k[len(prefix):]: t for k, t in weights.items()}
    stacked = [t.shape[0] for k, t in keys.items() if STACKED.match(k)]
    per_layer = {int(m.group(1)) for k in keys for m in [PER_LAYER.match(k)] if m}
    if stacked and per_layer or len(set(stacked)) > 1:
        return None
    by_role: Dict[str, set] = {}  # a module buffer's role (by its key's ending) or "param" -> the dtypes stored
    for k, t in keys.items():
        by_role.setdefault(next((r for end, r in BUFFER_KEYS.items() if k.endswith(end)), "param"), set()).add(t.dtype)
    dtype, buffer_dtype = split_dtypes(by_role)  # ValueError (None) for several
    num_layers = stacked[0] if stacked else (max(per_layer) + 1 if per_layer else 0)
    if not stacked and per_layer != set(range(num_layers)):
        return None
    rows = keys[WORD].shape[0]
    try:
        cfg = sidecar.config(rows) if sidecar is not None else megatron_args.config_from_args(args, rows)
    except CkptError:
        return None
    cfg, note = megatron_args.as_megatron_core_computes(cfg)  # torch_dist is always megatron-core
    shapes = canonical_shapes(cfg)
    if cfg.num_layers != num_layers or (cfg.vocab_size or 0) > rows:
        return None
    stored = sum(_numel(t.shape) for k, t in keys.items() if not (cfg.tied_embeddings and k == HEAD))
    if stored != sum(_numel(s) for s in shapes.values()):
        return None  # tensors outside the model the args describe: the full reader names them
    info = SourceInfo(path=str(path), format=format_name, dialect="mcore-dist" if stacked else "mcore-dist-per-layer",
                      layout=megatron_args.run_layout(args, cfg),
                      release=release,
                      iteration=iteration if iteration is not None else common.get("iteration"),
                      checkpoint_version=common.get("checkpoint_version"), args=args,
                      extra={"hf_config": sidecar.hf, "config_sidecar": sidecar.what} if sidecar is not None else {})
    canonical = canonical_meta(shapes, cfg, dtype, buffer_dtype)
    stored_tensors = {k: tensor_meta(e) for k, e in entries.items() if is_record(e, "TensorStorageMetadata")}
    head = prefix + HEAD if cfg.tied_embeddings and prefix + HEAD in weights else None
    objects = object_reader([k for k, e in entries.items() if is_record(e, "BytesStorageMetadata")],
                            lambda key: _entry_bytes(d, meta, key))
    # a module buffer (the router's expert bias) is in no optimizer: no slot, no group, no place in a buffer
    params = {k: t for k, t in weights.items() if not k.endswith(tuple(BUFFER_KEYS))}
    trained = {n: t for n, t in canonical.items() if not is_buffer(n, cfg)}
    optimizer = training_state(common, stored_tensors, params, trained, args, head, cfg, objects)
    return Checkpoint(cfg, canonical, info, [note] if note else [], optimizer)


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
