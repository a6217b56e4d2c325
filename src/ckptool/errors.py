"""User-facing errors: one line that says what is wrong and what to do instead, and the exit statuses.

Everything a user can cause (bad paths, unreadable files, inconsistent shards, impossible layouts)
raises CkptError; the CLI prints it as one line and exits with EXIT["bad_input"]. Anything else is a
bug (EXIT["internal"]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict
import textwrap


class CkptError(Exception):
    """A problem with the user's input or request, reported without a traceback."""

    def __init__(self, message: str, hint: str = ""):
        # one line, whatever a wrapped library error contained
        message, hint = " ".join(str(message).split()), " ".join(str(hint).split())
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class TeamError(CkptError):
    """An error of a torchrun team that one rank reports for all: `reporter` is the rank that found it
    and prints it, `status` the exit status it exits with. The other ranks raise this to exit with the
    same status, silently."""

    def __init__(self, message: str, hint: str = "", reporter: int = 0, status: int = 2):
        super().__init__(message, hint)
        self.reporter = reporter
        self.status = status


class NoCanonicalForm(CkptError):
    """A checkpoint ckptool recognises but cannot read into the canonical GPT state (a
    DeepLearningExamples BERT file, a DeepSpeed run of a non-GPT Hugging Face model or of any other
    module). Every command reports it as the error it is, except where its reader can still write the
    output asked for from the files it opened: exports maps a format's name in the format table
    (formats/registry.py: "hf", "ds-universal") to export(out_dir, **the writer's options) -> summary,
    which registry.Format.exporter finds for the target (to-hf's Hugging Face directory, merge
    --format ds-universal's universal checkpoint). `kind` names the source in the API's result."""

    def __init__(self, message: str, hint: str, kind: str, exports: Dict[str, Callable]):
        super().__init__(message, hint)
        self.kind = kind
        self.exports = dict(exports)


def require(condition: bool, message: str, hint: str = "") -> None:
    """Raise CkptError(message, hint) unless condition holds."""
    if not condition:
        raise CkptError(message, hint)


@dataclass(frozen=True)
class ExitStatus:
    code: int
    name: str
    meaning: str


# Every status ckptool exits with (the CLI uses these; README and `ckptool --help` list them).
EXIT_STATUSES = (
    ExitStatus(0, "ok", "success (verify: result=PASS)"),
    ExitStatus(1, "mismatch", "verify: the target does not compute what the reference computes, or an "
                              "output file does not match its manifest (result=FAIL)"),
    ExitStatus(2, "bad_input", "bad input or request: the one `error:` line says what and what to do "
                               "(also files that cannot be read or written)"),
    ExitStatus(3, "internal", "internal error: a bug in ckptool (rerun with `ckptool --debug` and report it)"),
    ExitStatus(129, "hung_up", "hung up (SIGHUP: the terminal closed): nothing was written to the output"),
    ExitStatus(130, "interrupted", "interrupted (Ctrl-C): nothing was written to the output"),
    ExitStatus(143, "terminated", "terminated (SIGTERM: `timeout`, Slurm, Kubernetes): nothing was written "
                                  "to the output, and a DST that --force would have replaced is left as it was"),
    ExitStatus(141, "broken_pipe", "the reader of stdout went away (e.g. `| head`)"),
)
EXIT = {s.name: s.code for s in EXIT_STATUSES}


def exit_status_of(error: BaseException) -> int:
    """The exit status an exception ends a command with (see EXIT_STATUSES)."""
    if isinstance(error, TeamError):
        return error.status
    if isinstance(error, (CkptError, OSError)):
        return EXIT["bad_input"]
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C, or stopping.Stopped for SIGTERM and SIGHUP
        return 128 + getattr(error, "signum", 2)  # as a shell shows a signal (SIGINT is 2)
    return EXIT["internal"]


def exit_status_table(width: int = 96) -> str:
    """The statuses as aligned text lines (for --help)."""
    return "\n".join(textwrap.fill(s.meaning, width, initial_indent=f"  {s.code:<4} ", subsequent_indent=" " * 7)
                     for s in EXIT_STATUSES)
