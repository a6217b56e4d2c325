"""Fuzzing the parsers that see a file's bytes before anything else: whatever the input, they
either succeed or raise ckptool's own CkptError, never another exception.

Kept short (a few hundred examples each, well under 30 s in all); hypothesis prints the failing
input when one is found. The torch_dist reader is fuzzed through its two index files: the DCP
`.metadata` pickle (bytes flipped and cut, and structured changes to a valid Metadata) and
megatron-core's `metadata.json`; the whole read, tensors included, must end in CkptError.
"""
from __future__ import annotations

import argparse
import io
import json
import pickle
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptool.errors import CkptError
from ckptool.formats.megatron import args as megatron_args
from ckptool.formats.megatron.checkpoint import resolve_iteration_dir
from ckptool.io.safe_pickle import safe_loads
from ckptool.io.safetensors_header import DTYPES, parse_safetensors_header
from ckptool.io.torchfile import load_torch_file
from ckptool.lazy import LazyTensor
from ckptool.write_options import WriteOptions

REPO = Path(__file__).resolve().parents[1]
RANK_FILE = REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint" / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
FAST = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def ckpt_error_or_ok(fn, *args):
    try:
        return fn(*args)
    except CkptError as e:
        assert "\n" not in e.message
        return None


# --- safetensors header ---------------------------------------------------------------------------

def _header_bytes(doc, data_len: int) -> bytes:
    raw = json.dumps(doc).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data_len


@FAST
@given(st.binary(max_size=64), st.integers(0, 1 << 40))
def test_safetensors_header_random_bytes(data, extra):
    ckpt_error_or_ok(parse_safetensors_header, data, len(data) + extra % 3, "f")


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 1 << 40) | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=8)
_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(DTYPES) + ["F7", 3, None]),
    "shape": st.lists(st.integers(-2, 6), max_size=3) | _json,
    "data_offsets": st.lists(st.integers(-4, 200), min_size=0, max_size=3) | _json,
})


@FAST
@given(st.dictionaries(st.text(max_size=4), _entry | _json, max_size=4),
       st.integers(0, 200), st.one_of(st.none(), _json))
def test_safetensors_header_structured(doc, data_len, metadata):
    if metadata is not None:
        doc = {**doc, "__metadata__": metadata}
    raw = _header_bytes(doc, data_len)
    got = ckpt_error_or_ok(parse_safetensors_header, raw, len(raw), "f")
    if got is not None:  # what parses is consistent: tensors tile the buffer exactly
        assert sum(t.nbytes for t in got.tensors.values()) == data_len


def test_safetensors_header_real_file_truncations(tmp_path):
    from safetensors.torch import save_file
    from ckptool.io.safetensors_header import read_safetensors_header
    f = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(3, 2), "b": torch.zeros(5, dtype=torch.bfloat16)}, f)
    data = f.read_bytes()
    assert set(read_safetensors_header(f).tensors) == {"a", "b"}
    for cut in range(0, len(data), 7):
        f.write_bytes(data[:cut])
        with pytest.raises(CkptError, match="safetensors file is truncated or corrupt"):
            read_safetensors_header(f)


# --- tracker files ----------------------------------------------------------------------------------

@FAST
@given(st.binary(max_size=24) | st.sampled_from([b"10", b"release", b"0010\n", b" 10 ", b"-1", b"1e3", b"\xd9\xa1"]))
def test_tracker_file(content):
    root = Path(tempfile.mkdtemp())
    try:
        (root / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_bytes(content)
        got = ckpt_error_or_ok(resolve_iteration_dir, root)
        if got is not None:
            assert got[0].is_dir()
    finally:
        shutil.rmtree(root)


# --- pickles: args and data.pkl -------------------------------------------------------------------------

def _real_pickles():
    args = argparse.Namespace(num_layers=2, hidden_size=64, params_dtype=torch.bfloat16, seq=[1, 2],
                              od={"a": (1.5, None)}, name="x")
    return [pickle.dumps(args, protocol=p) for p in (2, 4)]


@FAST
@given(st.binary(max_size=80))
def test_pickle_random_bytes(data):
    ckpt_error_or_ok(safe_loads, data, "p")


@FAST
@given(st.sampled_from(_real_pickles()), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                                   min_size=1, max_size=4))
def test_pickle_mutations(data, flips):
    data = bytearray(data)
    for pos, val in flips:
        data[pos % len(data)] = val
    ckpt_error_or_ok(safe_loads, bytes(data), "p")


# --- torch zip archives: central directory, local headers, data.pkl ---------------------------------------

def _small_torch_file() -> bytes:
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(num_layers=1), "model": {"w": torch.arange(6.0).view(2, 3),
                                                                   "b": torch.ones(4, dtype=torch.bfloat16)}}, buf)
    return buf.getvalue()


SMALL = _small_torch_file()


def _load_everything(path):
    tree = load_torch_file(path)

    def walk(o):
        if isinstance(o, LazyTensor):
            t = o.load()
            assert tuple(t.shape) == tuple(o.shape)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(tree)


_region = st.sampled_from(["anywhere", "tail", "pickle"])


@FAST
@given(_region, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 1 << 20) | st.none())
def test_torch_zip_mutations(region, flips, cut):
    data = bytearray(SMALL)
    n = len(data)
    lo = {"anywhere": 0, "tail": max(0, n - 400), "pickle": data.find(b"data.pkl")}[region]
    for pos, val in flips:
        data[lo + pos % (n - lo)] = val
    if cut is not None and region == "anywhere":
        data = data[: cut % (n + 1)]
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        f.write(bytes(data))
        f.flush()
        ckpt_error_or_ok(_load_everything, f.name)


def test_real_rank_file_still_loads():
    tree = load_torch_file(RANK_FILE)
    assert isinstance(tree["model"]["embedding.word_embeddings.weight"], LazyTensor)


# --- args -> config -----------------------------------------------------------------------------------

_arg_value = st.none() | st.integers(-3, 70) | st.booleans() | st.text(max_size=3) | st.floats(allow_nan=True)
ARG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "kv_channels", "max_position_embeddings", "padded_vocab_size", "vocab_size",
              "make_vocab_size_divisible_by", "group_query_attention", "swiglu", "normalization",
              "position_embedding_type", "norm_epsilon", "layernorm_epsilon", "rotary_percent",
              "untie_embeddings_and_output_weights", "add_bias_linear", "tokenizer_type")


@FAST
@given(st.fixed_dictionaries({}, optional={f: _arg_value for f in ARG_FIELDS}))
def test_args_to_config(fields):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                max_position_embeddings=32, padded_vocab_size=128)
    args = argparse.Namespace(**{**base, **fields})
    ckpt_error_or_ok(megatron_args.config_from_args, args, 128)


# --- torch_dist: the DCP .metadata index and megatron-core's metadata.json ---------------------------

DIST_FEW = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory):
    """A small torch_dist checkpoint (ckptool's writer, checked against megatron-core in test_dist)."""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from ckptool.formats.registry import open_checkpoint
    out = tmp_path_factory.mktemp("dist") / "ck"
    write_layout(open_checkpoint(RANK_FILE.parents[2]), out, Layout(tp=1),
                 WriteOptions(format="torch_dist"), warn=lambda m: None)
    d = next(p.parent for p in out.rglob(".metadata"))
    assert (d / "metadata.json").is_file()
    return d


def _read_all_dist(d: Path):
    from ckptool.formats.dcp import torch_dist as dist
    ckpt = dist.read(d)
    for t in ckpt.tensors.values():
        x = t.load()
        assert tuple(x.shape) == tuple(t.shape)


def _with_file(src: Path, name: str, data: bytes, fn):
    """A copy of src with `name` replaced by data (the other files linked, not copied: fast)."""
    work = Path(tempfile.mkdtemp())
    try:
        d = work / src.name
        d.mkdir()
        for f in src.iterdir():
            if f.name != name:
                (d / f.name).symlink_to(f)
        (d / name).write_bytes(data)
        return ckpt_error_or_ok(fn, d)
    finally:
        shutil.rmtree(work)


def test_dist_fixture_reads(dist_dir):
    _read_all_dist(dist_dir)


@DIST_FEW
@given(data=st.data())
def test_dcp_metadata_bytes(dist_dir, data):
    raw = bytearray((dist_dir / ".metadata").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    _with_file(dist_dir, ".metadata", bytes(raw), _read_all_dist)


_odd_int = st.integers(-2, 3) | st.integers(1 << 20, 1 << 62) | st.none() | st.text(max_size=2)


@DIST_FEW
@given(data=st.data())
def test_dcp_metadata_structure(dist_dir, data):
    """Valid pickles of a Metadata whose entries lie: sizes, offsets, lengths, paths, types."""
    import copy
    md = pickle.loads((dist_dir / ".metadata").read_bytes())  # our own test file: plain pickle is fine
    md = copy.deepcopy(md)
    storage = sorted(md.storage_data.items(), key=lambda kv: (kv[0].fqn, str(kv[0].offset)))
    tensors = sorted(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))
    for _ in range(data.draw(st.integers(1, 3))):
        what = data.draw(st.sampled_from(["length", "offset", "path", "size", "chunk", "chunk_offsets",
                                          "drop_storage", "drop_entry", "entry_type"]))
        idx, info = storage[data.draw(st.integers(0, len(storage) - 1))]
        fqn = tensors[data.draw(st.integers(0, len(tensors) - 1))]
        tmd = md.state_dict_metadata[fqn]
        if what in ("length", "offset"):
            setattr(info, what, data.draw(_odd_int))
        elif what == "path":
            info.relative_path = data.draw(st.sampled_from(["../x", "", "__9_9.distcp", "/etc/passwd"]))
        elif what == "size":
            tmd.size = torch.Size(data.draw(st.lists(st.integers(0, 70), max_size=3)))
        elif what == "chunk" and tmd.chunks:
            tmd.chunks[0].sizes = torch.Size(data.draw(st.lists(st.integers(0, 70), max_size=3)))
        elif what == "chunk_offsets" and tmd.chunks:
            tmd.chunks[0].offsets = torch.Size(data.draw(st.lists(st.integers(0, 70), max_size=3)))
        elif what == "drop_storage":
            md.storage_data.pop(idx, None)
        elif what == "drop_entry":
            md.state_dict_metadata.pop(fqn, None)
        elif what == "entry_type":
            md.state_dict_metadata[fqn] = data.draw(st.sampled_from([None, 3, "x", {"a": 1}]))
    _with_file(dist_dir, ".metadata", pickle.dumps(md), _read_all_dist)


@DIST_FEW
@given(st.binary(max_size=40) | _json.map(lambda d: json.dumps(d).encode())
       | st.fixed_dictionaries({"sharded_backend": st.sampled_from(["torch_dist", "torch", "zarr", "", None, 3])},
                               optional={"sharded_backend_version": _json, "common_backend": _json})
       .map(lambda d: json.dumps(d).encode()))
def test_megatron_core_metadata_json(dist_dir, content):
    _with_file(dist_dir, "metadata.json", content, _read_all_dist)
