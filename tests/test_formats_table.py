"""The one table of formats (ckptool/formats/registry.py): every entry resolves, the table alone
names a source's format and that is the format its reader reports, the default output follows the
table, and no module reaches into another's private names or branches on the source's format."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ckptool
from ckptool.errors import CkptError, NoCanonicalForm
from ckptool.formats import registry

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "ckptool"
GPT2 = ROOT / "fixtures" / "gpt2_mcore_tp2pp2"
REAL = ROOT / "fixtures" / "real"


def test_every_entry_resolves_to_functions():
    names = [f.name for f in registry.FORMATS]
    assert len(set(names)) == len(names)
    for fmt in registry.FORMATS:
        for ref in (fmt.looks_like_ref, fmt.read_ref, fmt.write_ref, fmt.quick_ref):
            if ref is not None:
                assert callable(registry.resolve(ref)), ref
        assert (fmt.looks_like_ref is None) == (fmt.read_ref is None), fmt.name  # what is claimed is read
    assert set(registry.OUTPUT_FORMATS) == {"torch", "torch_dist", "ds-universal", "dcp"}
    assert registry.OUTPUT_FORMATS[0] == "torch"
    with pytest.raises(CkptError, match="unknown output format 'zarr'"):
        registry.output_format("zarr")
    with pytest.raises(CkptError, match="does not write deepspeed"):
        registry.BY_NAME["deepspeed"].write


def test_naming_a_directorys_format_imports_no_torch():
    """The directory formats' looks_like and every quick reader import without torch, so the table
    can name a directory's format, and inspect read it, before torch is needed (quick_inspect.py)."""
    import os
    import subprocess
    import sys
    refs = [f.looks_like_ref for f in registry.FORMATS if f.looks_like_ref and f.name != "dle-bert"]
    refs += [f.quick_ref for f in registry.FORMATS if f.quick_ref]
    code = ("import sys\nfrom ckptool.formats import registry\n"
            f"for ref in {refs!r}: registry.resolve(ref)\n"
            f"print(registry.detect_format({str(GPT2 / 'checkpoint')!r}))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "megatron", r.stderr


@pytest.fixture(scope="module")
def torch_dist_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "ckpt"
    ckptool.merge(GPT2 / "checkpoint", out, format="torch_dist")
    return out


@pytest.mark.parametrize("where,expected", [
    ("gpt2/checkpoint", "megatron"), ("gpt2/hf", "hf"), ("torch_dist", "torch_dist"),
    ("real/mds_gpt2_pipe_tp2pp2_bf16_zero1/checkpoint", "deepspeed")])
def test_the_table_names_the_format_its_reader_reports(where, expected, torch_dist_dir):
    path = {"gpt2": GPT2, "real": REAL, "torch_dist": torch_dist_dir}[where.split("/")[0]]
    path = path.joinpath(*where.split("/")[1:])
    assert registry.detect_format(path) == expected
    assert registry.open_checkpoint(path).source.format == expected


def test_the_default_output_is_the_tables_answer():
    def src(fmt):
        return SimpleNamespace(source=SimpleNamespace(format=fmt))
    assert registry.default_output(src("torch_dist")).output == "torch_dist"
    for fmt in ("megatron", "deepspeed", "hf"):
        assert registry.default_output(src(fmt)).output == "torch"


def test_a_bert_file_is_claimed_and_refused_with_the_way_out(tmp_path):
    """A DeepLearningExamples BERT file has no canonical form: the table still names it, every command
    reports that (one CkptError), and to-hf is told how to export it."""
    word = "bert.embeddings.word_embeddings.weight"
    f = tmp_path / "run" / "ckpt_1.pt"
    f.parent.mkdir()
    torch.save({"model": {word: torch.zeros(8, 4), "cls.predictions.bias": torch.zeros(8)}}, f)
    assert registry.detect_format(f) == "dle-bert"
    with pytest.raises(NoCanonicalForm, match="DeepLearningExamples BERT") as e:
        ckptool.open(f)
    assert "to-hf" in str(e.value) and e.value.kind == "bert"
    with pytest.raises(CkptError, match="stores no config"):  # to-hf without --hf-config
        ckptool.to_hf(f, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_no_module_imports_another_modules_private_names():
    found = []
    for path, tree in _modules():
        imported_modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.name}: from {node.module} import {alias.name}")
                    elif node.module is None or alias.name[0].islower():
                        imported_modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                imported_modules.update((a.asname or a.name).split(".")[0] for a in node.names
                                        if (a.asname or a.name).split(".")[0] in ("ckptool",))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported_modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert found == []


def test_writers_and_conversions_never_branch_on_the_sources_format():
    """What a format can do is the table's: outside registry.py no format module or conversion reads
    SourceInfo.format to decide anything."""
    found = []
    for path, tree in _modules():
        if path.name == "registry.py" or not (path.parent.name == "formats" or path.name == "convert.py"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "format" and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "source"):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_to_hf_of_a_deepspeed_run_of_another_hf_model_reads_its_files_once(tmp_path, monkeypatch):
    """A DeepSpeed save of a non-GPT Hugging Face model (here a tiny BERT: module weights, no ZeRO
    shards) is named by the table, read once, and exported by the reader's NoCanonicalForm."""
    import json
    from safetensors.torch import load_file
    from ckptool.formats.deepspeed import zero as deepspeed_zero
    run = tmp_path / "run"
    (run / "global_step1").mkdir(parents=True)
    (run / "latest").write_text("global_step1")
    module = {"bert.embeddings.word_embeddings.weight": torch.randn(8, 4), "cls.predictions.bias": torch.randn(8)}
    torch.save({"module": module, "param_shapes": [{k: tuple(v.shape) for k, v in module.items()}]},
               run / "global_step1" / "mp_rank_00_model_states.pt")
    (run / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"],
                                                 "vocab_size": 8}))
    assert registry.detect_format(run) == "deepspeed"
    opened = []
    real = deepspeed_zero.load_torch_file  # how the ZeRO reader opens every model-states file
    monkeypatch.setattr(deepspeed_zero, "load_torch_file", lambda p, *a, **k: opened.append(Path(p).name) or real(p, *a, **k))
    result = ckptool.to_hf(run, tmp_path / "hf")
    assert opened == ["mp_rank_00_model_states.pt"]  # opened once, by the table's reader; the export reuses it
    assert result.kind == "deepspeed-hf" and result["model_type"] == "bert" and result.checkpoint is None
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == module.keys() and all(torch.equal(got[k], module[k]) for k in module)
    with pytest.raises(NoCanonicalForm, match="not a GPT"):
        ckptool.open(run)
