"""Reliability: bad inputs give one clean line, sources are never touched, outputs are atomic.

Every bad input below is built from a copy of the embedded TP2 PP2 fixture. For each, the command
must exit non-zero with exactly one stderr line starting with "error:", print no traceback, leave
no output (neither DST nor a partial sibling) and leave the source byte-identical.
"""
from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptool.cli import main
from ckptool.config import GPTConfig, check_tensor_parallel
from ckptool.errors import CkptError
from ckptool.io.outdir import MANIFEST, PARTIAL_TAG, check_manifest
from ckptool.io.torchfile import StreamingTorchWriter, load_torch_file, save_streaming
from ckptool.lazy import Const

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "fixtures" / "gpt2_mcore_tp2pp2" / "checkpoint"
LLAMA = REPO / "fixtures" / "llama_legacy_norm_tp2pp1" / "checkpoint"
ITER = "iter_0000010"
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}


# --- helpers ----------------------------------------------------------------------------------

def tree_hashes(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def run_inprocess(argv) -> tuple:
    r = CliRunner().invoke(main, [str(a) for a in argv])
    return r.exit_code, r.stdout, r.stderr


def run_subprocess(argv) -> tuple:
    r = subprocess.run([sys.executable, "-m", "ckptool", *map(str, argv)], capture_output=True, text=True,
                       cwd=REPO, env=ENV, timeout=120)
    return r.returncode, r.stdout, r.stderr


def rank_file(src: Path, name: str) -> Path:
    return src / ITER / name / "model_optim_rng.pt"


def edit_rank(src: Path, name: str, edit) -> None:
    """Rewrite one rank file after edit(tree) (a torch.save-compatible file, tensors lazily copied)."""
    f = rank_file(src, name)
    tree = load_torch_file(f)
    edit(tree)
    tmp = f.with_suffix(".tmp")
    save_streaming(tree, tmp)
    os.replace(tmp, f)


def assert_clean_failure(code, stderr, *expect):
    lines = stderr.strip().splitlines()
    assert code != 0
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in stderr
    for e in expect:
        assert e in lines[0], f"{e!r} not in {lines[0]!r}"


def assert_no_output(dst: Path):
    assert not dst.exists(), f"{dst} was left behind"
    assert not list(dst.parent.glob(f".{dst.name}{PARTIAL_TAG}*")), "a partial output was left behind"


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(FIXTURE, d)
    return d


# --- the bad inputs -----------------------------------------------------------------------------
# name -> builder(src, tmp_path) -> (argv, expected substrings). `DST` in argv is tmp_path/"out".

def _nonexistent(src, tmp):
    return ["inspect", tmp / "nope"], ["no such file or directory"]


def _empty_dir(src, tmp):
    (tmp / "empty").mkdir()
    return ["merge", tmp / "empty", "DST"], ["empty directory"]


def _file_not_dir(src, tmp):
    (tmp / "a.txt").write_text("hello")
    return ["merge", tmp / "a.txt", "DST"], ["not a checkpoint ckptool recognises"]


def _rank_file_as_src(src, tmp):
    return ["inspect", rank_file(src, "mp_rank_00_000")], ["not a checkpoint ckptool recognises"]


def _not_a_checkpoint_dir(src, tmp):
    (tmp / "junk").mkdir()
    (tmp / "junk" / "notes.txt").write_text("x")
    return ["inspect", tmp / "junk"], ["not a checkpoint"]


def _truncated_pt(src, tmp):
    f = rank_file(src, "mp_rank_01_000")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return ["merge", src, "DST"], ["mp_rank_01_000", "truncated"]


def _empty_pt(src, tmp):
    rank_file(src, "mp_rank_01_001").write_bytes(b"")
    return ["merge", src, "DST"], ["empty file"]


def _corrupt_zip_directory(src, tmp):
    f = rank_file(src, "mp_rank_00_001")
    data = bytearray(f.read_bytes())
    i = data.rfind(b"PK\x01\x02")  # the last central-directory entry
    data[i:i + 40] = b"\xff" * 40
    f.write_bytes(bytes(data))
    return ["merge", src, "DST"], ["mp_rank_00_001"]


def _corrupt_pickle(src, tmp):
    f = rank_file(src, "mp_rank_00_000")
    data = bytearray(f.read_bytes())
    i = data.find(b"data.pkl") + len(b"data.pkl") + 64  # inside the pickle record
    data[i:i + 200] = bytes(range(200))
    f.write_bytes(bytes(data))
    return ["merge", src, "DST"], ["mp_rank_00_000"]


def _not_a_torch_file(src, tmp):
    rank_file(src, "mp_rank_01_001").write_text("this is not a checkpoint\n" * 10)
    return ["merge", src, "DST"], ["mp_rank_01_001"]


def _missing_rank(src, tmp):
    shutil.rmtree(src / ITER / "mp_rank_01_001")
    return ["merge", src, "DST"], ["missing rank directory mp_rank_01_001"]


def _missing_model_file(src, tmp):
    rank_file(src, "mp_rank_01_001").unlink()
    return ["merge", src, "DST"], ["mp_rank_01_001", "no model_optim_rng.pt"]


def _extra_rank(src, tmp):
    for pp in ("000", "001"):
        shutil.copytree(src / ITER / f"mp_rank_01_{pp}", src / ITER / f"mp_rank_02_{pp}")
    return ["merge", src, "DST"], ["extra rank directory"]


def _shape_mismatch(src, tmp):
    def edit(tree):
        key = "decoder.layers.0.mlp.linear_fc1.weight"
        w = tree["model"][key]
        tree["model"][key] = Const(torch.zeros(w.shape[0] // 2, w.shape[1]))
    edit_rank(src, "mp_rank_01_000", edit)
    return ["merge", src, "DST"], ["layers.0.fc1.weight", "inconsistent across tensor-parallel ranks"]


def _args_disagree(src, tmp):
    edit_rank(src, "mp_rank_01_000", lambda tree: setattr(tree["args"], "ffn_hidden_size", 512))
    return ["merge", src, "DST"], ["args disagree", "ffn_hidden_size"]


def _unknown_version(src, tmp):
    for name in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        edit_rank(src, name, lambda tree: tree.__setitem__("checkpoint_version", 9.0))
    return ["merge", src, "DST"], ["checkpoint_version 9.0"]


def _tracker_missing_iteration(src, tmp):
    (src / "latest_checkpointed_iteration.txt").write_text("20")
    return ["merge", src, "DST"], ["iteration 20", "--iteration"]


def _tracker_garbage(src, tmp):
    (src / "latest_checkpointed_iteration.txt").write_text("\x00\xffgarbage")
    return ["merge", src, "DST"], ["not an iteration number"]


def _tracker_release_missing(src, tmp):
    (src / "latest_checkpointed_iteration.txt").write_text("release")
    return ["merge", src, "DST"], ["says 'release'", "does not exist"]


def _dst_is_a_file(src, tmp):
    (tmp / "out").write_text("mine")
    return ["merge", src, "DST", "--force"], ["exists and is not a directory"]


def _missing_iteration_flag(src, tmp):
    return ["merge", src, "DST", "--iteration", 7], ["no iteration 7"]


def _dst_inside_src(src, tmp):
    return ["reshard", src, src / "out", "--tp", 1], ["inside the source"]


def _src_inside_dst(src, tmp):
    return ["reshard", src, tmp, "--tp", 1, "--force"], ["lies inside the output"]


def _dst_exists(src, tmp):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    return ["merge", src, "DST"], ["already exists", "--force"]


def _tp_not_dividing_heads(src, tmp):
    return ["reshard", src, "DST", "--tp", 3], ["--tp 3", "4 attention heads"]


def _tp_zero(src, tmp):
    return ["reshard", src, "DST", "--tp", 0], ["--tp 0: the tensor-parallel size is at least 1"]


def _uneven_pp(src, tmp):
    return ["reshard", src, "DST", "--tp", 1, "--pp", 3], ["3 pipeline stages", "--pp-layers"]


def _bad_pp_split(src, tmp):
    return ["reshard", src, "DST", "--tp", 1, "--pp", 2, "--pp-layers", "1,2"], ["does not add up"]


def _fix_vocab_too_small(src, tmp):
    return ["fix-vocab", src, "DST", "--size", 10], []


BAD_INPUTS = {f.__name__[1:]: f for f in (
    _nonexistent, _empty_dir, _file_not_dir, _rank_file_as_src, _not_a_checkpoint_dir, _truncated_pt,
    _empty_pt, _corrupt_zip_directory, _corrupt_pickle, _not_a_torch_file, _missing_rank,
    _missing_model_file, _extra_rank, _shape_mismatch, _args_disagree, _unknown_version,
    _tracker_missing_iteration, _tracker_garbage, _tracker_release_missing, _missing_iteration_flag,
    _dst_is_a_file, _dst_inside_src,
    _src_inside_dst, _dst_exists, _tp_not_dividing_heads, _tp_zero, _uneven_pp, _bad_pp_split,
    _fix_vocab_too_small)}
# Run through the installed entry point (python -m ckptool, a real process) for these; the rest
# in-process with click's runner.
SUBPROCESS = {"nonexistent", "truncated_pt", "dst_exists"}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(case, src, tmp_path):
    argv, expect = BAD_INPUTS[case](src, tmp_path)
    dst = tmp_path / "out"
    argv = [dst if a == "DST" else a for a in argv]
    existed = dst.exists()
    before_src = tree_hashes(src)
    before_dst = (tree_hashes(dst) if dst.is_dir() else dst.read_bytes()) if existed else None
    code, out, err = (run_subprocess if case in SUBPROCESS else run_inprocess)(argv)
    assert_clean_failure(code, err, *expect)
    assert tree_hashes(src) == before_src, "the source changed"
    if existed:
        assert (tree_hashes(dst) if dst.is_dir() else dst.read_bytes()) == before_dst, "DST was modified"
    else:
        assert_no_output(dst)
    if case == "dst_inside_src":
        assert not (src / "out").exists()


def test_debug_flag_shows_the_traceback(tmp_path):
    code, _, err = run_inprocess(["--debug", "inspect", tmp_path / "nope"])
    assert code != 0 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error:")


def test_messages_for_the_report(src, tmp_path, capsys):
    """Not an assertion of wording: prints each case's message (pytest -s) for the docs/report."""
    for case in sorted(BAD_INPUTS):
        case_src = tmp_path / case / "src"
        shutil.copytree(FIXTURE, case_src)
        argv, _ = BAD_INPUTS[case](case_src, tmp_path / case)
        argv = [tmp_path / case / "out" if a == "DST" else a for a in argv]
        code, _, err = run_inprocess(argv)
        print(f"{case}: {err.strip()}")
        assert code != 0


# --- query groups: accept what Megatron accepts ------------------------------------------------

def test_tp_against_query_groups():
    cfg = GPTConfig(num_layers=2, hidden_size=96, num_attention_heads=12, num_query_groups=4,
                    ffn_hidden_size=384, padded_vocab_size=128, max_position_embeddings=16)
    for tp in (1, 2, 4, 12):  # divides the groups, or is a multiple of them
        check_tensor_parallel(cfg, tp)
    with pytest.raises(CkptError, match="neither divides nor is a multiple of the 4 query groups"):
        check_tensor_parallel(cfg, 6)
    with pytest.raises(CkptError, match="does not divide the 12 attention heads"):
        check_tensor_parallel(cfg, 5)


def test_tp_multiple_of_query_groups_is_written(tmp_path):
    """8 heads in 2 query groups at TP4: each rank holds half a group's K/V (replicated)."""
    before = tree_hashes(LLAMA)
    code, out, err = run_inprocess(["reshard", LLAMA, tmp_path / "tp4", "--tp", 4])
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "tp4" / ITER).iterdir()) == [f"mp_rank_0{i}" for i in range(4)]
    assert check_manifest(tmp_path / "tp4") == []
    assert tree_hashes(LLAMA) == before


# --- full disk -----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["tensor", "finish"])
def test_full_disk(monkeypatch, src, tmp_path, where):
    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    # write_prepared is where a tensor's bytes reach the disk (write = prepare + write_prepared)
    monkeypatch.setattr(StreamingTorchWriter, "write_prepared" if where == "tensor" else "finish", no_space)
    before = tree_hashes(src)
    dst = tmp_path / "out"
    code, out, err = run_inprocess(["reshard", src, dst, "--tp", 1])
    assert_clean_failure(code, err, "no space left on the device")
    assert_no_output(dst)
    assert tree_hashes(src) == before


def test_full_disk_keeps_an_existing_dst(monkeypatch, src, tmp_path):
    """--force over an existing output: a failed write leaves the old output as it was."""
    dst = tmp_path / "out"
    assert run_inprocess(["merge", src, dst])[0] == 0
    old = tree_hashes(dst)
    monkeypatch.setattr(StreamingTorchWriter, "finish",
                        lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    code, _, err = run_inprocess(["reshard", src, dst, "--tp", 2, "--force"])
    assert_clean_failure(code, err, "no space left")
    assert tree_hashes(dst) == old and check_manifest(dst) == []


# --- every command leaves the source byte-identical ---------------------------------------------

@pytest.mark.parametrize("argv", [
    ["inspect", "SRC"], ["inspect", "SRC", "--json"], ["merge", "SRC", "DST"],
    ["reshard", "SRC", "DST", "--tp", 1, "--pp", 4], ["reshard", "SRC", "DST", "--tp", 4, "--dtype", "bf16"],
    ["fix-vocab", "SRC", "DST", "--size", 1002], ["fix-vocab", "SRC", "DST", "--multiple", 64],
    ["to-hf", "SRC", "DST", "--dtype", "bf16", "--max-shard-size", "200KB"], ["verify", "SRC"],
], ids=lambda a: "-".join(map(str, a)))
def test_source_is_untouched(argv, src, tmp_path):
    before = tree_hashes(src)
    mtimes = {p: p.stat().st_mtime_ns for p in src.rglob("*")}
    dst = tmp_path / "out"
    code, out, err = run_inprocess([src if a == "SRC" else dst if a == "DST" else a for a in argv])
    assert code == 0, err
    assert tree_hashes(src) == before
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*")} == mtimes
    if "DST" in argv:
        assert check_manifest(dst) == []


def test_hf_source_is_untouched(src, tmp_path):
    """from-hf and reshard with a Hugging Face directory as the source."""
    hf = tmp_path / "hf"
    assert run_inprocess(["to-hf", src, hf])[0] == 0
    before = tree_hashes(hf)
    for argv in (["from-hf", hf, tmp_path / "m", "--tp", 2], ["reshard", hf, tmp_path / "r", "--tp", 1, "--pp", 2],
                 ["inspect", hf]):
        code, out, err = run_inprocess(argv)
        assert code == 0, err
    assert tree_hashes(hf) == before


# --- broken pipe ---------------------------------------------------------------------------------

def test_closed_pipe_is_quiet():
    cmd = f"{sys.executable} -m ckptool inspect {FIXTURE} | true; echo rc=${{PIPESTATUS[0]}}"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert r.stderr.strip() == "", r.stderr
    assert r.stdout.strip() in ("rc=0", "rc=141"), r.stdout


# --- atomic output under SIGKILL -----------------------------------------------------------------

def _big_checkpoint(path: Path, hidden: int = 256) -> None:
    """The TP2 PP2 fixture scaled up (random weights) so that a reshard takes about a second."""
    from ckptool.config import Layout
    from ckptool.convert import write_layout
    from ckptool.formats.registry import open_checkpoint
    from ckptool.state import Checkpoint
    small = open_checkpoint(FIXTURE)
    dims = {64: hidden, 256: 4 * hidden, 1024: 16 * hidden}
    g = torch.Generator().manual_seed(0)
    tensors = {n: Const(torch.randn([dims.get(d, d) for d in t.shape], generator=g))
               for n, t in small.tensors.items()}
    cfg = small.config.replace(hidden_size=hidden, ffn_hidden_size=4 * hidden, padded_vocab_size=16 * hidden,
                               max_position_embeddings=hidden, head_dim=hidden // 4)
    write_layout(Checkpoint(cfg, tensors, small.source, []), path, Layout(1, 1), warn=lambda m: None)


def _dst_state(dst: Path) -> str:
    if not dst.exists():
        return "absent"
    problems = check_manifest(dst)
    assert problems == [], f"{dst} exists but does not verify: {problems}"
    return "complete"


def test_sigkill_leaves_nothing_half_written(tmp_path):
    big = tmp_path / "big"
    _big_checkpoint(big)
    before = tree_hashes(big)
    dst = tmp_path / "out"
    argv = [sys.executable, "-m", "ckptool", "reshard", str(big), str(dst), "--tp", "2", "--pp", "2"]
    partials = lambda: list(tmp_path.glob(f".out{PARTIAL_TAG}*"))  # noqa: E731
    rng = random.Random(1234)
    states, mid_write = [], 0
    for delay in [rng.uniform(0.0, 0.6) for _ in range(3)] + [None]:
        p = subprocess.Popen(argv, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if delay is None:  # once before it even got going
            time.sleep(0.3)
        else:  # otherwise at a random moment after it started writing
            deadline = time.monotonic() + 120
            while not partials() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(delay)
        mid_write += bool(partials()) and not dst.exists()
        p.send_signal(signal.SIGKILL)
        p.wait()
        states.append(_dst_state(dst))  # absent, or complete and verifying against its manifest
        if dst.exists():  # it finished before the kill: start the next round clean
            shutil.rmtree(dst)
    assert mid_write >= 1, f"no kill landed while writing: {states}"
    # a rerun over whatever partial directories were left succeeds and cleans them up
    r = subprocess.run(argv, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert check_manifest(dst) == []
    assert sorted(p.name for p in (dst / ITER).iterdir()) == [
        f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(2)]
    assert not partials()
    assert tree_hashes(big) == before


def test_check_manifest_detects_damage(src, tmp_path):
    dst = tmp_path / "out"
    assert run_inprocess(["merge", src, dst])[0] == 0
    assert check_manifest(dst) == []
    f = next(dst.rglob("model_optim_rng.pt"))
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    assert any("sha256" in p for p in check_manifest(dst))
    f.write_bytes(bytes(data[:-10]))
    assert any("size" in p for p in check_manifest(dst))
    (dst / "stray.bin").write_bytes(b"x")
    assert any("unexpected file stray.bin" in p for p in check_manifest(dst))
    (dst / MANIFEST).unlink()
    assert any("no ckptool-manifest.json" in p for p in check_manifest(dst))
