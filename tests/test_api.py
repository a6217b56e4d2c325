"""The Python API through its public names only (`import ckptool`, ckptool.open, ckptool.reshard, ...),
on the committed GPT-2 fixture (Megatron-core torch format, TP2 PP2, vocab 1001 padded to 1024, with
the ground-truth transformers model and its logits)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptool

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "fixtures" / "gpt2_mcore_tp2pp2"
SRC = CASE / "checkpoint"


def test_import_is_cheap_and_the_api_loads_on_first_use():
    code = ("import sys, ckptool; assert 'torch' not in sys.modules, 'import ckptool pulled in torch'; "
            # the API loads on first use, itself without torch (a read imports it: tests/test_quick_errors.py)
            "ckptool.open; assert 'ckptool.api' in sys.modules and 'torch' not in sys.modules; "
            "print(sorted(ckptool.__all__)); "
            # ckptool.verify is also the subpackage ckptool/verify/: importing a module of it keeps it callable
            "import ckptool.verify.compare; assert callable(ckptool.verify) and ckptool.verify.compare")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("open", "inspect", "merge", "reshard", "fix_vocab", "to_hf", "from_hf", "verify", "CkptError"):
        assert name in r.stdout


def test_open_gives_the_canonical_state():
    ckpt = ckptool.open(SRC)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.padded_vocab_size) == (4, 64, 1001, 1024)
    assert ckpt.source.format == "megatron" and ckpt.source.dialect == "mcore"
    assert (ckpt.source.layout.tp, ckpt.source.layout.pp) == (2, 2)
    assert ckpt.optimizer is None  # a weights-only read
    word = ckpt.tensors["embed.word"]
    assert tuple(word.shape) == (1024, 64) and word.load().shape == (1024, 64)  # full shape, merged from TP2
    assert "layers.3.attn.q.weight" in ckpt.tensors and "layers.4.attn.q.weight" not in ckpt.tensors
    # reading options by their CLI names
    over = ckptool.open(SRC, true_vocab_size=1000)
    assert over.config.vocab_size == 1000 and over.config.vocab_size_source == "--true-vocab-size"
    with pytest.raises(TypeError, match="true_vocab"):
        ckptool.open(SRC, true_vocab=1000)


def test_reshard_returns_the_writers_summary_and_verify_passes(tmp_path, capsys):
    seen = []
    result = ckptool.reshard(SRC, tmp_path / "tp1pp2", tp=1, pp=2, progress=lambda n, total: seen.append((n, total)))
    assert result.command == "reshard" and result.leader
    assert result["files"] == 2 and result["padded_vocab_size"] == 1024 and result["format"] == "torch"
    assert result.layout.describe() == "TP1 PP2"
    assert sum(n for n, _ in seen) == result["bytes"] and {t for _, t in seen} == {result.checkpoint.total_bytes}
    assert capsys.readouterr().out == ""  # the API reports by returning, not printing
    back = ckptool.open(tmp_path / "tp1pp2")
    assert (back.source.layout.tp, back.source.layout.pp) == (1, 2)
    src = ckptool.open(SRC)
    assert all(torch.equal(back.tensors[k].load(), src.tensors[k].load()) for k in src.tensors)

    verdict = ckptool.verify(tmp_path / "tp1pp2", reference=CASE / "hf", quiet=True)
    assert verdict.ok and bool(verdict) and "result=PASS" in verdict.lines
    assert capsys.readouterr().out == ""  # quiet
    assert ckptool.verify(files=tmp_path / "tp1pp2", quiet=True).ok


def test_verify_returns_a_failure_rather_than_raising(tmp_path):
    """Recorded logits that the checkpoint does not reproduce: ok is False and the report says FAIL."""
    expected = torch.load(CASE / "expected.pt")
    bad = dict(expected, logits=expected["logits"] + 0.5 * (torch.arange(1001) == 7))
    torch.save(bad, tmp_path / "bad.pt")
    good = ckptool.verify(SRC, reference_logits=f"{CASE / 'expected.pt'}:logits", quiet=True)
    assert good.ok, good.lines
    verdict = ckptool.verify(SRC, reference_logits=f"{tmp_path / 'bad.pt'}:logits", quiet=True)
    assert not verdict.ok and "result=FAIL" in verdict.lines


def test_verify_reports_through_a_callback_and_leaves_stdout_alone(capsys):
    """The report comes back as lines (and to on_line as each is written), without the API swapping
    sys.stdout to capture what something printed; not quiet, the same lines are printed."""
    seen, stdout_seen = [], set()

    def on_line(line):
        seen.append(line)
        stdout_seen.add(id(sys.stdout))
    recorded = f"{CASE / 'expected.pt'}:logits"
    verdict = ckptool.verify(SRC, reference_logits=recorded, quiet=True, on_line=on_line)
    assert verdict.ok and seen == verdict.lines and "result=PASS" in seen
    assert stdout_seen == {id(sys.stdout)}
    assert capsys.readouterr().out == ""
    loud = ckptool.verify(SRC, reference_logits=recorded)
    assert capsys.readouterr().out.splitlines() == loud.lines == verdict.lines


def test_the_api_runs_verify_without_the_cli_and_the_command_imports_without_torch(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    api_only = ("import sys, ckptool; v = ckptool.verify(files=sys.argv[1], quiet=True); assert not v.ok; "
                "assert not [m for m in sys.modules if m.startswith('ckptool.commands')], 'the API imported the CLI'")
    command = "import sys, ckptool.commands.verify_cmd; assert 'torch' not in sys.modules, 'verify_cmd pulled in torch'"
    for code in (api_only, command):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr


def test_errors_are_ckpt_errors_and_nothing_is_written(tmp_path):
    with pytest.raises(ckptool.CkptError, match="no such file"):
        ckptool.merge(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ckptool.CkptError, match="true vocabulary has 1001"):
        ckptool.fix_vocab(SRC, tmp_path / "cut", size=1000)
    with pytest.raises(ckptool.CkptError, match="pp-layers"):
        ckptool.reshard(SRC, tmp_path / "bad", tp=1, pp=2, pp_layers="3,x")
    with pytest.raises(ckptool.CkptError, match="unknown dtype"):
        ckptool.reshard(SRC, tmp_path / "bad", tp=1, dtype="fp8")
    for path in (SRC, CASE / "hf"):  # the one --true-vocab-size rule, Megatron and Hugging Face readers
        with pytest.raises(ckptool.CkptError, match="--true-vocab-size 2000 exceeds the 10.. embedding rows"):
            ckptool.open(path, true_vocab_size=2000)
    with pytest.raises(ckptool.CkptError, match="unknown replicas"):
        ckptool.open(SRC, replicas="average")
    with pytest.raises(ckptool.CkptError, match="not both"):
        ckptool.verify(SRC, reference=CASE / "hf", reference_logits=str(CASE / "expected.pt"))
    assert not any(p.name in ("out", "cut", "bad") for p in tmp_path.iterdir())


def test_to_hf_and_from_hf(tmp_path):
    from transformers import AutoModelForCausalLM
    hf = ckptool.to_hf(SRC, tmp_path / "hf")
    assert hf.kind == "gpt" and hf["architecture"] == "GPT2LMHeadModel" and hf["vocab_size"] == 1001
    expected = torch.load(CASE / "expected.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(expected["tokens"]).logits
    assert (logits - expected["logits"]).abs().max() < 1e-4

    back = ckptool.from_hf(tmp_path / "hf", tmp_path / "meg", tp=2, pp=2)
    assert back["padded_vocab_size"] == 1024 and back["files"] == 4 and back.layout.describe() == "TP2 PP2"
    src, again = ckptool.open(SRC), ckptool.open(tmp_path / "meg")
    assert again.config.vocab_size == 1001
    assert torch.equal(again.tensors["embed.word"].load()[:1001], src.tensors["embed.word"].load()[:1001])
    assert torch.equal(again.tensors["layers.2.mlp.up.weight"].load(), src.tensors["layers.2.mlp.up.weight"].load())


def test_fix_vocab_keeps_the_true_vocabulary_and_reads_the_source_once(tmp_path, monkeypatch):
    import ckptool.formats.registry as registry  # only to count reads of the source
    opened = []
    real = registry.open_checkpoint
    monkeypatch.setattr(registry, "open_checkpoint", lambda path, opts=None: opened.append(path) or real(path, opts))
    result = ckptool.fix_vocab(SRC, tmp_path / "fixed", size=1030)
    assert opened == [SRC]
    assert result["padded_vocab_size"] == 1030 and result.layout.describe() == "TP2 PP2"
    assert result.checkpoint.config.vocab_size == 1001
    fixed = ckptool.open(tmp_path / "fixed")
    assert fixed.config.vocab_size == 1001 and fixed.config.padded_vocab_size == 1030
    args = fixed.source.args
    # what Megatron computes from the written args gives the written rows
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    assert -(-args.vocab_size // multiple) * multiple == 1030
    src = ckptool.open(SRC)
    assert torch.equal(fixed.tensors["embed.word"].load()[:1024], src.tensors["embed.word"].load())
    assert not fixed.tensors["embed.word"].load()[1024:].any()  # new rows: zero (pad_fill default)

    # the CLI prints the same facts
    from click.testing import CliRunner
    from ckptool.cli import main
    r = CliRunner().invoke(main, ["fix-vocab", str(SRC), str(tmp_path / "cli"), "--multiple", "64"])
    assert r.exit_code == 0 and "vocab 1001 padded to 1024" in r.output, r.output


def test_exit_statuses_are_documented_where_users_look():
    from click.testing import CliRunner
    from ckptool.cli import main
    help_text = CliRunner().invoke(main, ["--help"]).output
    readme = (ROOT / "README.md").read_text()
    assert ckptool.EXIT["bad_input"] == 2 and ckptool.EXIT["mismatch"] == 1 and ckptool.EXIT["ok"] == 0
    for status in ckptool.EXIT_STATUSES:
        assert f"  {status.code:<4} " in help_text
        assert f"| {status.code} | {status.meaning} |" in readme
    r = CliRunner().invoke(main, ["merge", "/nonexistent-ckptool-source", "/tmp/unused-ckptool-out"])
    assert r.exit_code == ckptool.EXIT["bad_input"] and r.output.startswith("error:")


REAL_MDS = ROOT / "fixtures" / "real" / "mds_gpt2_pipe_tp2pp2_bf16_zero1" / "checkpoint"


def test_warn_is_told_the_readers_warnings_too(tmp_path):
    """The real Megatron-DeepSpeed run's reader warns (its tied position embeddings' copies, its drifted
    replicas): the warn callback hears every warning the result lists, the reader's included, each once."""
    heard = []
    result = ckptool.merge(REAL_MDS, tmp_path / "merged", warn=heard.append, optimizer=False)
    assert result.checkpoint.warnings, "the real Megatron-DeepSpeed source is expected to carry reader warnings"
    assert set(result.checkpoint.warnings) <= set(heard)
    assert sorted(heard) == sorted(result.warnings) and len(heard) == len(set(heard))
    heard_hf = []
    result = ckptool.to_hf(REAL_MDS, tmp_path / "hf", warn=heard_hf.append)
    assert set(result.checkpoint.warnings) <= set(heard_hf) and sorted(heard_hf) == sorted(result.warnings)


def test_inspect_is_a_function_returning_the_json_document():
    doc = ckptool.inspect(SRC)
    assert doc["format"] == "megatron" and doc["dialect"] == "mcore"
    assert (doc["layout"]["tp"], doc["layout"]["pp"]) == (2, 2)
    assert doc["config"]["vocab_size"] == 1001 and doc["config"]["padded_vocab_size"] == 1024
    assert "embed.word" in {t["name"] for t in doc["tensors"]}
    # the same document the command prints
    from click.testing import CliRunner
    from ckptool.cli import main
    import json
    out = CliRunner().invoke(main, ["inspect", str(SRC), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == doc
    # reading options go through, as for open(); an unknown one is a TypeError
    assert ckptool.inspect(SRC, true_vocab_size=1000)["config"]["vocab_size"] == 1000
    with pytest.raises(TypeError):
        ckptool.inspect(SRC, true_vocab=1000)
    with pytest.raises(ckptool.CkptError):
        ckptool.inspect(ROOT / "no-such-checkpoint")
