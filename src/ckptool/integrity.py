"""`ckptool verify --files`: is every file of a checkpoint whole, by the checks its format carries?

A directory ckptool wrote holds a manifest (io/outdir.py) and is checked against it. Any other
checkpoint is checked by what its own format records, every file under PATH by its kind (KINDS):
  - torch zip archives (torch.save since 1.6: Megatron's model_optim_rng.pt, DeepSpeed's *_states.pt,
    pytorch_model.bin): torch writes a CRC-32 for every record, so every record's bytes are read and
    summed against the zip's central directory (and its local header, where that holds one), and a
    bad record is named by the tensor whose storage it is (data.pkl read as in quick/torch_pickle.py);
  - safetensors: the header parses, its tensors tile the data buffer and end at the file's end
    (io/safetensors_header.py), and an index's weight map names files and tensors that exist;
  - torch DCP (torch_dist): every storage entry of `.metadata` lies within its existing .distcp file,
    every chunk of every tensor has one, and the entries that are torch.save blobs pass their CRCs;
  - DeepSpeed tag directories: every model-parallel rank's model states, every data-parallel rank's
    optimizer shard, every layer file's TP ranks, and ZeRO partitions the size the parameters need;
  - Megatron iteration directories: every rank of the TP x PP (x EP) grid;
  - legacy (pre-1.6, non-zip) torch files carry no checksum: they are listed as not verified.
Nothing here imports torch: `verify --files` starts in a blink (zlib's CRC-32, positioned reads on
the checksum pool of io/chunked.py).
"""
from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional


from .errors import CkptError, require
from .formats.deepspeed.files import has_states, scan_tag_dir
from .formats.dcp.files import DCP_METADATA
from .formats.megatron.files import MODEL_FILES, RANK_DIR, is_optimizer_only
from .io import chunked
from .io.outdir import MANIFEST, check_manifest
from .io.safetensors_header import read_safetensors_header
from .io.standin import StandIn, state_of
from .io.zip_records import ZIP_MAGIC, ZipRecord, zip_records
from .quick import torch_pickle
from .quick.meta import TensorMeta

# a legacy torch.save file begins with the pickled magic number 0x1950a86a20f9469cfc6c (protocol 2)
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
INLINE_CRC = 1 << 20  # records below this are summed on the calling thread
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # names torch files go by


@dataclass
class Findings:
    """What a check found: problems (each one line), and what was checked, for the summary."""
    problems: List[str] = field(default_factory=list)
    unverified: List[str] = field(default_factory=list)  # files whose format has no checksum
    files: int = 0
    records: int = 0  # zip records whose CRC-32 was checked
    headers: int = 0  # safetensors headers checked
    entries: int = 0  # DCP storage entries checked against their files
    nbytes: int = 0  # bytes read and summed

    def summary(self) -> str:
        parts = [f"{self.files} file{'s' * (self.files != 1)}"]
        if self.records:
            parts.append(f"{self.records} zip records' CRC-32 over {self.nbytes} bytes")
        if self.headers:
            parts.append(f"{self.headers} safetensors headers against their file sizes")
        if self.entries:
            parts.append(f"{self.entries} DCP storage entries against their .distcp files")
        return ", ".join(parts)


# --- the command ---------------------------------------------------------------------------------

def verify_files(path: Path, say: Callable[[str], None]) -> bool:
    """Check PATH (a directory or one file): each problem, then the result, go to say(line); True when
    it holds."""
    path = Path(path)
    require(path.exists(), f"{path}: no such file or directory")
    if path.is_dir() and (path / MANIFEST).is_file():
        return _report_manifest(path, say)
    found = check_checkpoint(path)
    for p in found.problems:
        say(f"  {p}")
    for f in found.unverified:
        say(f"  {f}: legacy (pre-1.6) torch file: no checksum in this format, not verified")
    if found.problems:
        n = len(found.problems)
        say(f"result=FAIL ({n} problem{'s' * (n > 1)} in {path}; checked {found.summary()})")
        return False
    if not found.files - len(found.unverified):
        what = ("only legacy torch files, which carry no checksum" if found.unverified
                else "no checkpoint file ckptool knows (torch, safetensors, DCP)")
        say(f"result=FAIL (nothing in {path} could be verified: {what})")
        return False
    note = f"; {len(found.unverified)} legacy torch files not verified" if found.unverified else ""
    say(f"result=PASS (checked {found.summary()}{note})")
    return True


def _report_manifest(root: Path, say: Callable[[str], None]) -> bool:
    problems = check_manifest(root)
    for p in problems:
        say(f"  {p}")
    if problems:
        say(f"result=FAIL ({len(problems)} problem{'s' if len(problems) > 1 else ''} in {root})")
        return False
    say(f"result=PASS (every file in {root} matches its manifest)")
    return True


def check_checkpoint(path: Path) -> Findings:
    """Every file under path (or path itself) checked by its kind, and the directories' structure."""
    found = Findings()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        kind = _kind(f)
        if kind is None and (f == path or f.suffix in TORCH_SUFFIXES):
            kind = "unknown"  # named as a checkpoint file, yet none ckptool knows: damaged where it says what it is
        if kind is not None:
            found.files += 1
            KINDS[kind](f, found)
    dirs = [path] + sorted(p for p in path.rglob("*") if p.is_dir()) if path.is_dir() else []
    for d in dirs:
        if has_states(d):
            check_deepspeed_tag(d, found)
        if any(RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir()):
            check_megatron_grid(d, found)
    return found


def _kind(f: Path) -> Optional[str]:
    """Which check a file gets (KINDS), None for files that are not checkpoint data (json, txt)."""
    if f.name == DCP_METADATA:
        return "dcp"
    if f.suffix == ".distcp":
        return None if (f.parent / DCP_METADATA).is_file() else "orphan_distcp"
    if f.suffix == ".safetensors":
        return "safetensors"
    if f.name.endswith(".safetensors.index.json"):
        return "safetensors_index"
    head = _head(f, len(LEGACY_MAGIC))
    if head.startswith(ZIP_MAGIC):
        return "torch_zip"
    if head == LEGACY_MAGIC:
        return "legacy"
    return None


def _head(f: Path, n: int) -> bytes:
    with open(f, "rb") as fh:
        return fh.read(n)


# --- torch zip archives: every record's CRC-32 -------------------------------------------------------

def crc32_of_range(fd: int, offset: int, length: int) -> int:
    """zlib.crc32 of bytes [offset, offset + length) of fd: pieces read and summed on the checksum
    pool (pread and zlib release the GIL), so a large record is summed on every core."""
    if length <= INLINE_CRC:
        return zlib.crc32(_pread(fd, offset, length))
    piece = chunked.CRC_PIECE
    spans = [(a, min(length, a + piece)) for a in range(0, length, piece)]
    futures = [chunked.pool().submit(lambda a, b: zlib.crc32(_pread(fd, offset + a, b - a)), a, b) for a, b in spans]
    crc = 0
    for (a, b), f in zip(spans, futures):
        crc = chunked.crc32_combine(crc, f.result(), b - a)
    return crc


def blob_problem(data) -> Optional[str]:
    """What is wrong with a torch.save blob held in memory (a DCP tensor chunk), by its records'
    CRC-32s (summed over the cores); None when it is whole."""
    try:
        records = zip_records(io.BytesIO(data), 0, len(data))
    except CkptError as e:
        return str(e)
    view = memoryview(data)
    for rec in records:
        got = chunked.crc32_parallel(view[rec.start:rec.start + rec.size])
        if got != rec.crc:
            return f"record {rec.name}'s bytes' CRC-32 is {got:08x}, the blob's zip directory says {rec.crc:08x}"
    return None


def _pread(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise CkptError(f"the file ended at byte {offset + len(data)} (truncated)")
        data += more
    return data


def check_torch_zip(f: Path, found: Findings) -> None:
    with open(f, "rb") as fh:
        try:
            records = zip_records(fh)
        except CkptError as e:
            found.problems.append(f"{f}: {e}")
            return
        bad = _bad_records(fh.fileno(), records, found)
    if bad:
        names = tensor_names(f)
        for rec, got in bad:
            found.problems.append(corrupt_record_message(f, rec.name, got, rec.crc, names))


def _bad_records(fd: int, records: List[ZipRecord], found: Findings) -> list:
    bad = []
    for rec in records:
        got = crc32_of_range(fd, rec.start, rec.size)
        found.records += 1
        found.nbytes += rec.size
        if got != rec.crc:
            bad.append((rec, got))
    return bad


def corrupt_record_message(f, record: str, got: int, want: int, names: Optional[Dict[str, List[str]]]) -> str:
    """One line naming the file, the tensor(s) whose storage the record is, and the two CRCs."""
    return (f"{f}: {what_record_holds(record, names)} is corrupt: its bytes' CRC-32 is {got:08x}, "
            f"the zip directory says {want:08x}")


def what_record_holds(record: str, names: Optional[Dict[str, List[str]]]) -> str:
    """'tensor KEY (record archive/data/N)', or what else the record is."""
    tail = record.split("/", 1)[1] if "/" in record else record
    if not tail.startswith("data/"):
        return f"record {record}"
    held = (names or {}).get(tail[len("data/"):])
    if not held:
        unknown = "" if names else "; data.pkl is unreadable, so which tensor is unknown"
        return f"record {record} (a tensor storage{unknown})"
    more = f" (and {len(held) - 3} more)" if len(held) > 3 else ""
    return f"tensor {', '.join(held[:3])}{more} (record {record})"


# --- which tensor a storage record holds ---------------------------------------------------------

@dataclass(frozen=True)
class _Located:
    """A tensor in the pickle: the storage record it lives in."""
    key: str


def _located(storage, *rest, **kw) -> _Located:
    return _Located(storage.key)


def _from_type(func, new_type, args, state):
    if func is not _located and func is not torch_pickle.TORCH_REBUILDS["_rebuild_parameter"]:
        raise torch_pickle.NotQuick(f"tensor subclass rebuilt by {func!r}")
    return func(*args)


class _LocatingUnpickler(torch_pickle.MetaUnpickler):
    """quick/torch_pickle.py's unpickler, every tensor coming back as the key of its storage."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name.startswith("_rebuild_tensor"):
            return _located
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _from_type
        return super().find_class(module, name)


def tensor_names(f: Path) -> Optional[Dict[str, List[str]]]:
    """{storage key: [dotted paths of the tensors on it]} of a torch zip file; None when its data.pkl
    cannot be read (it may be what is damaged)."""
    try:
        with zipfile.ZipFile(f) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            data = z.read(pkl[0]) if len(pkl) == 1 else None
        if data is None:
            return None
        up = _LocatingUnpickler(io.BytesIO(data), encoding="utf-8")
        up.storage_keys = set()
        tree = up.load()
    except Exception:  # any damage to the pickle: the record is then named without its tensor
        return None
    names: Dict[str, List[str]] = {}
    for path, leaf in _leaves(tree, "", set()):
        names.setdefault(leaf.key, []).append(path or "(the file's top object)")
    return names


def _children(obj):
    if isinstance(obj, dict):
        return obj.items()
    if isinstance(obj, (list, tuple)):
        return enumerate(obj)
    if isinstance(obj, StandIn):
        state = state_of(obj)
        return [("", state)] if state is not None and not isinstance(state, dict) else \
            [(k, v) for k, v in obj.__dict__.items() if not k.startswith("_ckptool_")]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):  # argparse.Namespace
        return vars(obj).items()
    return ()


def _leaves(obj, path: str, seen: set):
    if isinstance(obj, _Located):
        yield path, obj
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for k, v in _children(obj):
        yield from _leaves(v, f"{path}.{k}" if path and k != "" else (path or str(k)), seen)


# --- safetensors -------------------------------------------------------------------------------------

def check_safetensors(f: Path, found: Findings) -> None:
    try:
        read_safetensors_header(f)  # validates the header against the file's size, or raises
    except CkptError as e:
        found.problems.append(e.message)
        return
    found.headers += 1


def check_safetensors_index(f: Path, found: Findings) -> None:
    """The weight map of model.safetensors.index.json: every file it names exists and holds the tensor."""
    try:
        weight_map = json.loads(f.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        found.problems.append(f"{f}: not a safetensors index with a weight_map ({e})")
        return
    held: Dict[str, Optional[set]] = {}
    for name, rel in weight_map.items():
        shard = f.parent / str(rel)
        if rel not in held:
            try:
                held[rel] = set(read_safetensors_header(shard).tensors) if shard.is_file() else None
            except CkptError:
                held[rel] = set()  # its own check reports the damage
        if held[rel] is None:
            found.problems.append(f"{f}: {name} is in {rel}, which is missing")
            held[rel] = set()
        elif held[rel] and name not in held[rel]:
            found.problems.append(f"{f}: {name} is said to be in {rel}, which does not hold it")


# --- torch DCP ---------------------------------------------------------------------------------------

def check_dcp(md_path: Path, found: Findings) -> None:
    """Every storage entry of a DCP index within its .distcp file, every tensor chunk stored, and each
    entry that is a torch.save blob (a tensor chunk) whole by its zip records' CRCs."""
    d = md_path.parent
    try:
        md = torch_pickle.loads(md_path.read_bytes())
        storage, entries = md.storage_data, md.state_dict_metadata
        assert isinstance(storage, dict) and isinstance(entries, dict)
    except (torch_pickle.NotQuick, AttributeError, AssertionError, OSError) as e:
        found.problems.append(f"{md_path}: not a readable torch.distributed.checkpoint index ({e})")
        return
    stored = {(getattr(k, "fqn", None), _offsets(getattr(k, "offset", None))) for k in storage}
    for fqn, e in entries.items():
        for c in getattr(e, "chunks", None) or ():
            if (fqn, _offsets(getattr(c, "offsets", None))) not in stored:
                found.problems.append(f"{md_path}: {fqn}'s chunk at {_offsets(c.offsets)} has no storage entry")
    sizes: Dict[str, int] = {}
    for idx, info in storage.items():
        _check_dcp_entry(d, getattr(idx, "fqn", "?"), _offsets(getattr(idx, "offset", None)), info, sizes, found)


def _offsets(v) -> Optional[tuple]:
    return tuple(v) if isinstance(v, (tuple, list)) else v


def _check_dcp_entry(d: Path, fqn: str, at, info, sizes: Dict[str, int], found: Findings) -> None:
    rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    what = f"{fqn}" + (f" chunk at {at}" if at else "")
    if not (isinstance(rel, str) and Path(rel).name == rel and type(offset) is int and type(length) is int):
        found.problems.append(f"{d}: the storage entry of {what} is damaged ({info!r:.80})")
        return
    f = d / rel
    if rel not in sizes:
        sizes[rel] = f.stat().st_size if f.is_file() else -1
    found.entries += 1
    if sizes[rel] < 0:
        found.problems.append(f"{f}: missing (it holds {what})")
    elif offset + length > sizes[rel]:
        found.problems.append(f"{f}: {what} needs bytes {offset}..{offset + length}, the file has "
                              f"{sizes[rel]} (truncated)")
    else:
        _check_blob(f, fqn, at, offset, length, found)


def _check_blob(f: Path, fqn: str, at, offset: int, length: int, found: Findings) -> None:
    """A tensor chunk is a torch.save blob: its records' CRCs hold (byte entries may be anything)."""
    with open(f, "rb") as fh:
        fh.seek(offset)
        if length < len(ZIP_MAGIC) or fh.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
            return
        what = f"{fqn}" + (f" (chunk at {at})" if at else "")
        try:
            records = zip_records(fh, offset, length)
        except CkptError as e:
            found.problems.append(f"{f}: the torch.save blob of {what}: {e}")
            return
        for rec, got in _bad_records(fh.fileno(), records, found):
            found.problems.append(f"{f}: {what} is corrupt: record {rec.name}'s bytes' CRC-32 is {got:08x}, "
                                  f"the blob's zip directory says {rec.crc:08x}")


def check_orphan_distcp(f: Path, found: Findings) -> None:
    found.problems.append(f"{f}: a .distcp file without the .metadata index beside it")


# --- DeepSpeed and Megatron directories --------------------------------------------------------------

def _contiguous(found: Findings, where: Path, what: str, have) -> None:
    """have (rank numbers) must be 0..n-1."""
    have = sorted(set(have))
    missing = sorted(set(range(max(have) + 1)) - set(have)) if have else []
    if missing:
        found.problems.append(f"{where}: {what} {', '.join(map(str, missing))} missing (have {have})")


def check_deepspeed_tag(d: Path, found: Findings) -> None:
    """Every rank's file present; ZeRO partitions the size the model-parallel rank's parameters need."""
    tf = scan_tag_dir(d)
    _contiguous(found, d, "model states of model-parallel rank", tf.mp_ranks)
    dps: Dict[int, set] = {}
    for dp, mp in tf.optim:
        dps.setdefault(mp, set()).add(dp)
    if dps:
        for mp in tf.mp_ranks:
            if mp not in dps:
                found.problems.append(f"{d}: no optimizer shards for model-parallel rank {mp:02d}")
        for mp, have in sorted(dps.items()):
            _contiguous(found, d, f"optimizer shard (model-parallel rank {mp:02d}) of data-parallel rank", have)
        if len({len(v) for v in dps.values()}) > 1:
            found.problems.append(f"{d}: model-parallel ranks have different numbers of optimizer shards "
                                  f"({ {mp: len(v) for mp, v in sorted(dps.items())} })")
    for dp, mp in tf.optim:
        if tf.zero_model and (dp, mp) not in tf.zero_model:
            found.problems.append(f"{d}: ZeRO-3 model states of DP rank {dp}, MP rank {mp:02d} missing")
    tps: Dict[int, set] = {}
    for layer, tp in tf.layers:
        tps.setdefault(layer, set()).add(tp)
    if len({frozenset(v) for v in tps.values()}) > 1:
        found.problems.append(f"{d}: layer files' tensor-parallel ranks differ from layer to layer "
                              f"({ {k: sorted(v) for k, v in sorted(tps.items())} })")
    for mp, have in sorted(dps.items()):
        _check_partitions(d, tf, mp, sorted(have), found)


def _meta_tree(f: Path):
    try:
        return torch_pickle.load_torch_zip(f)
    except torch_pickle.NotQuick:
        return None  # its record check says what is wrong, or the pickle holds what this check skips


def _check_partitions(d: Path, tf, mp: int, dps: List[int], found: Findings) -> None:
    """ZeRO-1/2 and BF16_Optimizer: Adam's moments the size of their flat fp32 partition, and the
    partitions of each group, over the data-parallel ranks, exactly the group's parameters (param_shapes
    of the rank's model states). DeepSpeed pads a group to split it evenly and records each rank's
    padding (group_paddings); newer versions store the last partition without it, older ones with it,
    so either total is whole. ZeRO-3 (fp32_flat_groups): the moments only."""
    states = {dp: _meta_tree(tf.optim[(dp, mp)]) for dp in dps}
    osds = {dp: s.get("optimizer_state_dict") for dp, s in states.items() if isinstance(s, dict)}
    if len(osds) != len(dps) or not all(isinstance(o, dict) for o in osds.values()):
        return
    key = "single_partition_of_fp32_groups" if "single_partition_of_fp32_groups" in osds[dps[0]] else "fp32_flat_groups"
    flats = {dp: o.get(key) for dp, o in osds.items()}
    if not all(isinstance(v, list) for v in flats.values()) or len({len(v) for v in flats.values()}) != 1:
        return
    sizes = {dp: [_numel(t) for t in v] for dp, v in flats.items()}
    for dp, o in osds.items():
        _check_moments(tf.optim[(dp, mp)], o, sizes[dp], found)
    model = tf.model.get(mp)
    if key == "single_partition_of_fp32_groups" and model is not None:
        totals = [sum(s[i] for s in sizes.values()) for i in range(len(sizes[dps[0]]))]
        _check_group_sizes(d / f"mp_rank_{mp:02d}", model, osds, totals, found)


def _numel(t) -> int:
    return _prod(getattr(t, "shape", ()) or ())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_moments(f: Path, osd: dict, sizes: List[int], found: Findings) -> None:
    """Each group's Adam moments the size of its fp32 partition (with this rank's padding, which newer
    DeepSpeed keeps in the moments but not in the stored partition)."""
    base, pads = osd.get("base_optimizer_state"), osd.get("group_paddings")
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict):  # (ZeRO-3 keeps a list per sub-group: not checked here)
        return
    for i, slots in state.items():
        if not isinstance(slots, dict) or not isinstance(i, int) or not 0 <= i < len(sizes):
            continue
        pad = pads[i] if isinstance(pads, list) and i < len(pads) and isinstance(pads[i], int) else 0
        for name, t in slots.items():
            if isinstance(t, TensorMeta) and t.shape and _numel(t) not in (sizes[i], sizes[i] + pad):
                found.problems.append(f"{f}: group {i}'s {name} holds {_numel(t)} values, its partition {sizes[i]}")


def _check_group_sizes(where: Path, model: Path, osds: Dict[int, dict], totals: List[int], found: Findings) -> None:
    tree = _meta_tree(model)
    shapes = tree.get("param_shapes") if isinstance(tree, dict) else None
    if not isinstance(shapes, list) or len(shapes) != len(totals):
        return
    pads = [o.get("group_paddings") for o in osds.values()]
    for i, group in enumerate(shapes):
        if not isinstance(group, dict) or not all(isinstance(s, tuple) for s in group.values()):
            return
        need = sum(_prod(s) for s in group.values())
        padding = sum(p[i] for p in pads if isinstance(p, list) and i < len(p) and isinstance(p[i], int))
        if need not in (totals[i], totals[i] - padding):
            found.problems.append(f"{where}: parameter group {i}'s fp32 partitions hold {totals[i]} values "
                                  f"(padding {padding}) over {len(osds)} data-parallel ranks, its {len(group)} "
                                  f"parameters in {model.name} need {need}")


def check_megatron_grid(d: Path, found: Findings) -> None:
    """An iteration directory's mp_rank_TT[_PPP[_EEE]] directories make a full grid, each with its file."""
    ranks = [p for p in d.iterdir() if p.is_dir() and RANK_DIR.match(p.name) and not is_optimizer_only(p)]
    coords = {tuple(int(g) for g in RANK_DIR.match(p.name).groups() if g is not None) for p in ranks}
    for axis in range(max((len(c) for c in coords), default=0)):
        _contiguous(found, d, f"rank directories along axis {axis} (mp_rank_*), number",
                    [c[axis] for c in coords if len(c) > axis])
    axes = [sorted({c[a] for c in coords if len(c) > a}) for a in range(max(map(len, coords), default=0))]
    full = 1
    for a in axes:
        full *= len(a)
    if len(coords) != full:
        found.problems.append(f"{d}: {len(coords)} mp_rank_* directories of a {' x '.join(str(len(a)) for a in axes)} "
                              "grid: some rank directories are missing")
    for p in ranks:
        if not any((p / n).is_file() for n in MODEL_FILES):
            found.problems.append(f"{p}: no {' or '.join(MODEL_FILES)}")


def check_legacy(f: Path, found: Findings) -> None:
    found.unverified.append(str(f))


def check_unknown(f: Path, found: Findings) -> None:
    found.problems.append(f"{f}: neither a torch file (zip or legacy) nor a safetensors or DCP file "
                          f"({f.stat().st_size} bytes beginning {_head(f, 4)!r})")


KINDS: Dict[str, Callable[[Path, Findings], None]] = {
    "torch_zip": check_torch_zip, "legacy": check_legacy, "safetensors": check_safetensors,
    "safetensors_index": check_safetensors_index, "dcp": check_dcp, "orphan_distcp": check_orphan_distcp,
    "unknown": check_unknown,
}
