"""ckptool's command line: thin click commands that parse, call, report.

Each command lives in ckptool/commands/; this file only assembles the group. Command modules are
imported when their command runs (LazyGroup), so `ckptool --help` and `ckptool inspect` of a
format that needs no torch never import torch (a few seconds on a busy machine).
"""
from __future__ import annotations

import inspect

import click

from . import __version__, quick_exit, stopping
from .errors import exit_status_table
import importlib
import sys
from .io import startup

# command name -> (module under ckptool.commands, click command in it, the one line `--help` lists).
# The line is kept here so listing the commands imports none of them; tests/test_quick_inspect.py
# checks it against each command's own docstring.
COMMANDS = {
    "inspect": ("inspect_cmd", "inspect_cmd", "Show a checkpoint's format, dialect, layout, config, vocab..."),
    "merge": ("convert_cmds", "merge_cmd", "Merge a model-parallel checkpoint into one rank (TP1 PP1):..."),
    "reshard": ("convert_cmds", "reshard_cmd", "Rewrite a checkpoint for any tensor/pipeline(/virtual..."),
    "fix-vocab": ("convert_cmds", "fix_vocab_cmd", "Pad or trim the word embedding (and an untied output layer)..."),
    "to-hf": ("hf_cmds", "to_hf_cmd", "Export any checkpoint ckptool reads as a Hugging Face model..."),
    "from-hf": ("hf_cmds", "from_hf_cmd", "Convert a Hugging Face GPT-2 / Llama / Mistral / Qwen2 /..."),
    "verify": ("verify_cmd", "verify_cmd", "Check that TARGET computes what the reference computes (exit..."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use (click's documented lazy pattern)."""

    def main(self, args=None, *a, **kw):
        # before any command module imports torch: bytecode cache, read-ahead of the source (io/startup.py)
        from .distributed import stop_with_the_team
        if args is None:  # this process's own command line: SIGTERM and SIGHUP clean up as Ctrl-C does
            stopping.install()
        stop_with_the_team()  # first: torchrun may stop this rank any moment once a peer has failed
        startup.prepare(sys.argv[1:] if args is None else args)
        try:
            return super().main(args, *a, **kw)
        except SystemExit as done:  # click ends every standalone run this way, success included
            stopping.uninstall()
            if args is not None or not quick_exit.owns_process():
                raise  # called in-process (tests, a script): the caller decides what an exit means
            quick_exit.end_process(done.code)

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(f".commands.{module}", __package__), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(__version__, prog_name="ckptool")
@click.pass_context
def main(ctx, debug):
    """Merge, reshard, convert and verify Megatron-LM / DeepSpeed / Hugging Face GPT checkpoints.

    \b
    Examples:
      ckptool inspect ckpts/run1
      ckptool merge ckpts/run1 merged                 # mp2 -> mp1
      ckptool reshard ckpts/run1 out --tp 2 --pp 2
      ckptool fix-vocab merged fixed --size 50257
      ckptool to-hf ckpts/run1 hf_model               # transformers loads hf_model
      torchrun --nproc-per-node 4 -m ckptool verify out --reference ckpts/run1

    Sources are read lazily and never modified; outputs appear complete or not at all.
    """
    ctx.obj = {"debug": debug}
    from .io import profile  # it prints a report at exit once imported: not in torchrun's agent, which imports COMMANDS
    profile.command_started()


main.help = inspect.cleandoc(main.help) + "\n\n\b\nExit status:\n" + exit_status_table()


if __name__ == "__main__":  # pragma: no cover
    main()
