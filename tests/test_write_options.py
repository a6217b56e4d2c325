"""The write options as one record (write_options.WriteOptions, built once by the API) and the format
table's one check of a write (write_options.refuse_unwritable): every option a format does not honour,
and every content it cannot hold, is refused by name before anything is written; options at their
default never are; an unknown option is a TypeError."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import ckptool
from ckptool.cli import main
from ckptool.config import Layout
from ckptool.convert import write_layout
from ckptool.describe import GEMMA_FIELDS
from ckptool.errors import CkptError
from ckptool.formats import registry
from ckptool.write_options import (REFUSED_CONTENTS, WriteOptions, build_write_options, flag, refuse_unwritable,
                                   with_torch_dtype)

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "fixtures" / "real" / "mlm_mcore_gpt2_torch_tp2pp2" / "checkpoint"  # dense, with optimizer state
# a value other than the default for every option (what a user who gave it could have given)
GIVEN = {"format": "torch_dist", "dialect": "mcore", "release": True, "dtype": torch.bfloat16, "divisible_by": 64,
         "pad_fill": "mean", "iteration": 7, "checkpoint_version": 2.0, "optimizer": False,
         "distributed_optimizer": True, "dp": 2, "overlap_grad_reduce": True, "ddp_bucket_size": 1000,
         "distrib_optim_era": "2024-02", "moe_grouped_gemm": True, "max_shard_size": "1GB", "tokenizer": "tok",
         "experts": "fused", "fp8": True, "drop_mtp": True}
WRITERS = [f for f in registry.FORMATS if f.writes]


def _quiet(message: str) -> None:
    pass


def test_every_option_has_a_given_value_that_counts_as_given():
    assert set(GIVEN) == {f.name for f in dataclasses.fields(WriteOptions)}
    for name, value in GIVEN.items():
        assert WriteOptions(**{name: value}).given() == {name}, name
    assert WriteOptions().given() == frozenset()


def test_the_apis_defaults_are_not_given():
    """What every API call passes when the user says nothing (pad_fill "zero", optimizer on, ...)."""
    opts = build_write_options(format=None, dialect=None, release=None, dtype=None, make_vocab_size_divisible_by=None,
                               pad_fill="zero", optimizer=True, distributed_optimizer=False, dp=None,
                               overlap_grad_reduce=None, ddp_bucket_size=None, distrib_optim_era=None,
                               moe_grouped_gemm=None, max_shard_size="5GB", tokenizer=None)
    assert opts == WriteOptions() and opts.given() == frozenset()


def test_the_record_is_built_once_with_the_apis_names_and_checked():
    opts = build_write_options(make_vocab_size_divisible_by=64, dtype="bf16", format="torch_dist")
    assert (opts.divisible_by, opts.dtype, opts.format) == (64, "bf16", "torch_dist")
    assert with_torch_dtype(opts).dtype == torch.bfloat16  # for the writers, once the source is open
    with pytest.raises(TypeError, match="unknown write options: frobnicate"):
        build_write_options(frobnicate=1)
    with pytest.raises(TypeError, match="divisible_by"):  # the record's name is not the API's
        build_write_options(divisible_by=64)
    with pytest.raises(CkptError, match="unknown dtype 'fp8'"):
        build_write_options(dtype="fp8")
    with pytest.raises(CkptError, match="unknown pad_fill 'ones'"):
        build_write_options(pad_fill="ones")
    with pytest.raises(CkptError, match="--dp shapes the distributed optimizer's files"):
        build_write_options(dp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.dtype = None


@pytest.mark.parametrize("fmt", WRITERS, ids=lambda f: f.name)
def test_each_option_a_format_does_not_honour_is_refused_by_name_before_writing(fmt, tmp_path):
    """One row of the table: every option outside its `honours`, given alone, is refused in one line that
    names the option and the format, and no output exists; every option inside it passes the check."""
    ckpt = ckptool.open(SRC)
    refused = [name for name in GIVEN if name not in fmt.honours]
    assert refused  # no writer honours every option (torch: the Hugging Face ones)
    for name in refused:
        opts = WriteOptions(**{name: GIVEN[name]})
        out = tmp_path / name
        with pytest.raises(CkptError) as e:
            if fmt.output:  # a layout writer: through the conversion, which checks before writing
                write_layout(ckpt, out, Layout(1, 1), opts.replace(format=fmt.output), warn=_quiet)
            else:
                refuse_unwritable(ckpt, fmt, opts)
        said = str(e.value)
        assert flag(name, GIVEN[name]) in said and (fmt.output or fmt.name) in said and "\n" not in said, said
        assert "leave" in said  # what to do instead
        assert not out.exists()
    refuse_unwritable(ckpt, fmt, WriteOptions(**{name: GIVEN[name] for name in fmt.honours}))


def _holding(content: str):
    moe = SimpleNamespace(num_experts=4, top_k=2, layers=[0, 1]) if content == "moe" else None
    mla = SimpleNamespace() if content == "mla" else None
    gemma = {field: None for field in GEMMA_FIELDS}  # Gemma's maths (issue 32): its post norms, or none of it
    gemma["post_norms"] = content == "gemma"
    return SimpleNamespace(config=SimpleNamespace(moe=moe, mla=mla, num_layers=2, activation="gelu",
                                                  mtp_num_layers=1 if content == "mtp" else 0, **gemma))


@pytest.mark.parametrize("fmt", WRITERS, ids=lambda f: f.name)
def test_each_content_a_format_cannot_hold_is_refused_by_name(fmt):
    for content in REFUSED_CONTENTS:
        if content in fmt.holds:
            refuse_unwritable(_holding(content), fmt, WriteOptions())
            continue
        with pytest.raises(CkptError, match="MoE layers|Multi-Latent Attention|Gemma's maths|multi-token prediction") as e:
            refuse_unwritable(_holding(content), fmt, WriteOptions())
        assert (fmt.output or fmt.name) in str(e.value)
        assert "not supported" in str(e.value) or "cannot hold" in str(e.value)


def test_options_the_target_ignored_are_refused_on_the_command_line(tmp_path):
    """torch_dist has no release/ directory: --release (and --no-release) used to be dropped silently."""
    for given in ("--release", "--no-release"):
        out = tmp_path / given
        res = CliRunner().invoke(main, ["reshard", str(SRC), str(out), "--tp", "1", "--format", "torch_dist", given])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        assert given in res.output and "torch_dist" in res.output and "Traceback" not in res.output
        assert not out.exists()
    with pytest.raises(CkptError, match="--pad-fill .*--format ds-universal does not honour it"):
        ckptool.merge(SRC, tmp_path / "u", format="ds-universal", pad_fill="mean", warn=_quiet)
    assert not (tmp_path / "u").exists()


def test_the_torch_dist_writer_plans_as_the_torch_writer():
    """dist.py takes the iteration, vocabulary, dtype, training state and args from megatron.plan_megatron
    instead of repeating its steps."""
    tree = ast.parse((ROOT / "src" / "ckptool" / "formats" / "dcp" / "torch_dist.py").read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "plan_megatron" in called
    assert not called & {"args_for_target", "target_rows", "resize_vocab", "resize_slot_vocab", "for_target"}


def _is_source_format(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "format" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "source"


def test_conversions_and_commands_do_not_branch_on_target_format_names():
    """Which options and contents a target takes is the table's (Format.honours / holds / megatron_run): no
    comparison with a format's name in the conversion, the write options or the conversion commands (but
    the one that reads the SOURCE's format, convert_cmds' resume advice, which no target decides)."""
    names = {f.output for f in registry.FORMATS if f.output} | {f.name for f in registry.FORMATS}
    found = []
    for rel in ("convert.py", "commands/convert_cmds.py", "write_options.py"):
        tree = ast.parse((ROOT / "src" / "ckptool" / rel).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or _is_source_format(node.left):
                continue
            values = [node.left, *node.comparators]
            values += [e for c in node.comparators if isinstance(c, ast.Tuple) for e in c.elts]
            if any(isinstance(c, ast.Constant) and c.value in names for c in values):
                found.append(f"{rel}:{node.lineno}")
    assert found == []
