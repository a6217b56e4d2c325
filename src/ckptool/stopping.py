"""Being told to stop: Ctrl-C (SIGINT), a scheduler's or `timeout`'s SIGTERM, a closed terminal's SIGHUP.

One mechanism for the three: each raises Stopped (a KeyboardInterrupt, which is what Ctrl-C raises
anyway) in the main thread, so the with-blocks that clean up after Ctrl-C (io/outdir.py removes the
partial output and puts back a DST that --force had set aside) do the same for the other two, and
the command ends with one line and the status a shell shows for the signal, 128 + its number.

Without this, SIGTERM and SIGHUP end the interpreter at once: no clean-up, no message, the hidden
partial output left on disk. Installed only by ckptool's own command line (cli.py), and only for a
signal still at its default: `nohup ckptool ...` ignores SIGHUP and keeps ignoring it, and a program
that calls ckptool's functions keeps its own handlers.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Optional

# signal -> the words a stopped command's line starts with
STOP_SIGNALS = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)",
                signal.SIGHUP: "hung up (SIGHUP)"}


class Stopped(KeyboardInterrupt):
    """The process was told to stop by `signum` (one of STOP_SIGNALS)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(error: BaseException) -> int:
    """The signal a KeyboardInterrupt stands for (a plain one is Python's own Ctrl-C)."""
    return getattr(error, "signum", signal.SIGINT)


def stop_words(error: BaseException) -> str:
    return STOP_SIGNALS.get(signal_of(error), f"stopped ({signal.Signals(signal_of(error)).name})")


# While a step that must not be cut in two runs (deferred()), a signal waits here until it ends. Only the
# first signal raises: once the process is stopping, a second Ctrl-C must not cut its clean-up short.
_deferring = 0
_pending: Optional[int] = None
_stopping: Optional[int] = None  # the signal that is stopping the process, once one has been raised


def _on_signal(signum, _frame) -> None:
    global _pending, _stopping
    if _stopping:
        return
    if _deferring:
        _pending = _pending or signum
        return
    _stopping = signum
    raise Stopped(signum)


def as_stop(error: BaseException) -> BaseException:
    """The error a command ends with, seen in the light of a stop signal raised earlier: the signal, when
    the error came after it. Under torchrun a peer that stopped breaks this rank's collective (gloo:
    "Connection closed by peer"), and a Stopped raised inside a callback from C++ can come back as
    such an error: either way the signal is what ended the command."""
    if _stopping and not isinstance(error, KeyboardInterrupt):
        return Stopped(_stopping)
    return error


def install() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise Stopped, where each is still at its default."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (an embedding program's worker)
    defaults = (signal.SIG_DFL, signal.default_int_handler)
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) in defaults:
            signal.signal(signum, _on_signal)


def uninstall() -> None:
    """The command is over (its output complete or removed): a signal now simply ends the process, as
    it would any program, instead of raising into the atexit handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


@contextlib.contextmanager
def deferred():
    """Run the block whole: a stop signal that arrives meanwhile is raised (as Stopped) when it ends.
    For the steps that must not be cut in two: the renames that swap an old DST for the new one, and
    the clean-up after a failure."""
    global _deferring, _pending, _stopping
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None and not _stopping:
            signum, _pending, _stopping = _pending, None, _pending
            raise Stopped(signum)


def surely(clean_up) -> None:
    """Run clean_up whole even when the signal that stops the process is raised as it starts (before its
    own deferred() takes hold): then it runs again, and the signal goes on."""
    try:
        with deferred():
            clean_up()
    except KeyboardInterrupt:
        with deferred():
            clean_up()
        raise
