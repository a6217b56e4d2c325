"""ckptool/io/startup.py: what runs before torch is imported (read-ahead, bytecode cache)."""
import os
import subprocess
import sys
from pathlib import Path

from ckptool.io import startup


def _megatron_like(tmp_path: Path) -> Path:
    src = tmp_path / "ckpt"
    (src / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (src / "iter_0000010" / "mp_rank_01").mkdir(parents=True)
    (src / "iter_0000005" / "mp_rank_00").mkdir(parents=True)  # an older iteration: not read
    (src / "latest_checkpointed_iteration.txt").write_text("10")
    (src / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"a" * 10000)
    (src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt").write_bytes(b"b" * 30000)
    (src / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"c" * 10)
    return src


def test_source_argument_skips_options_and_missing_paths(tmp_path):
    src = _megatron_like(tmp_path)
    argv = ["--debug", "reshard", "--tp", "4", str(src), str(tmp_path / "out")]
    assert startup.source_argument(argv) == src
    assert startup.source_argument(["inspect", str(src)]) is None  # not a command that reads it all
    assert startup.source_argument(["merge", str(tmp_path / "nope")]) is None


def test_files_follow_the_tracker_and_readahead_splits_the_cap(tmp_path):
    src = _megatron_like(tmp_path)
    files = startup.files_to_read(src)
    assert [f.parent.name for f in files] == ["mp_rank_00", "mp_rank_01"]
    assert all("iter_0000010" in str(f) for f in files)
    assert startup.readahead(files, 1 << 30) == 40000  # both whole under a large cap
    # a small cap: the smaller file whole when under its share, the rest of the cap to the larger
    assert startup.readahead(files, 30000) == 30000
    assert startup.readahead(files, 12000) == 12000  # 6000 of each
    assert startup.readahead([tmp_path / "missing"], 100) == 0


def _child(code: str, **env) -> str:
    full = dict(os.environ, PYTHONPATH=str(Path(startup.__file__).parents[2]), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_bytecode_cache_only_where_the_interpreter_would_not_keep_one(tmp_path):
    # a package installed without bytecode (as torch is in some container images) decides it
    pkg = tmp_path / "site" / "bare_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    code = ("import sys; sys.path.insert(0, %r); from ckptool.io import startup; "
            "r = startup.use_own_bytecode_cache('bare_pkg'); "
            "print(r, sys.pycache_prefix, sys.dont_write_bytecode)" % str(tmp_path / "site"))
    cache = tmp_path / "pyc"
    # told not to write bytecode: ckptool keeps it in its own folder, nothing beside the sources
    assert _child(code, PYTHONDONTWRITEBYTECODE="1", CKPTOOL_PYCACHE=str(cache)) == f"{cache} {cache} False"
    assert cache.is_dir()
    # switched off, or a prefix the user chose, or bytecode written normally: left alone
    assert _child(code, PYTHONDONTWRITEBYTECODE="1", CKPTOOL_PYCACHE="0") == "None None True"
    assert _child(code, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "mine")) \
        == f"None {tmp_path / 'mine'} True"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(Path(startup.__file__).parents[2])),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "None None False"
    # the package compiled beside its sources (pip's default): the interpreter reads that, left alone
    import py_compile
    py_compile.compile(str(pkg / "__init__.py"), doraise=True)
    assert _child(code, PYTHONDONTWRITEBYTECODE="1", CKPTOOL_PYCACHE=str(tmp_path / "other")) == "None None True"


def test_readahead_stops_when_the_conversion_takes_over(tmp_path, monkeypatch):
    """The start-up read-ahead ends once its stop event is set (prefetch.HANDOVER: set when the
    conversion starts its own read-ahead), between pieces, not after the whole cap."""
    import threading
    from ckptool.io import prefetch
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 * 4 * prefetch.PIECE))
    stop = threading.Event()
    stop.set()
    assert startup.readahead([big], 1 << 40, stop) == 0
    calls = []
    real = prefetch.pull

    def pull_then_stop(fd, off, n, st=None, piece=prefetch.PIECE):
        calls.append((off, n))
        got = real(fd, off, n, st, piece)
        stop.set()  # the conversion started while the first piece was read
        return got
    stop.clear()
    monkeypatch.setattr(prefetch, "pull", pull_then_stop)
    assert startup.readahead([big], 1 << 40, stop) == 4 * prefetch.PIECE
    assert calls == [(0, 4 * prefetch.PIECE)]


def test_startup_readahead_only_where_cores_are_spare(tmp_path, monkeypatch):
    """On a host of fewer than MIN_CORES cores the import needs the CPU: no start-up read-ahead
    there unless CKPTOOL_READAHEAD=1; CKPTOOL_READAHEAD=0 turns it off everywhere."""
    src = _megatron_like(tmp_path)
    argv = ["reshard", str(src), str(tmp_path / "out"), "--tp", "4"]
    monkeypatch.delenv("CKPTOOL_READAHEAD", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: startup.MIN_CORES - 1)
    assert startup.start_readahead(argv) is None
    monkeypatch.setenv("CKPTOOL_READAHEAD", "1")
    t = startup.start_readahead(argv)
    assert t is not None
    t.join(10)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("CKPTOOL_READAHEAD")
    t = startup.start_readahead(argv)
    assert t is not None
    t.join(10)
    monkeypatch.setenv("CKPTOOL_READAHEAD", "0")
    assert startup.start_readahead(argv) is None
