"""ckptool's command line: thin click commands that parse, call, report.

Each command lives in ckptool/commands/; this file only assembles the group.
"""
from __future__ import annotations

import inspect

import click

from . import __version__
from .errors import exit_status_table
from .commands.convert_cmds import fix_vocab_cmd, merge_cmd, reshard_cmd
from .commands.hf_cmds import from_hf_cmd, to_hf_cmd
from .commands.inspect_cmd import inspect_cmd
from .commands.verify_cmd import verify_cmd

COMMANDS = [inspect_cmd, merge_cmd, reshard_cmd, fix_vocab_cmd, to_hf_cmd, from_hf_cmd, verify_cmd]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
    from .io import profile
    profile.command_started()


main.help = inspect.cleandoc(main.help) + "\n\n\b\nExit status:\n" + exit_status_table()


for _cmd in COMMANDS:
    main.add_command(_cmd)


if __name__ == "__main__":  # pragma: no cover
    main()
