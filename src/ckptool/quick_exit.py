"""Ending the `ckptool` process without the interpreter's teardown, once the command is done.

Why: after a command has written, fsynced and committed its output, a normal interpreter exit still
frees every module and runs the C++ static destructors of torch (and, on CUDA builds, of its CUDA
libraries). Their code pages are often not in memory any more (a conversion streams gigabytes
through the page cache), so the teardown faults them back in from disk: on the 16-core device
machine the disk read ~400 MB for 1.4 s after a conversion's last write (bench.py --disk-trace),
8% of a 17 s conversion; 0.5 s of CPU on the 2-core box. None of it changes anything on disk.

What still happens, in this order: the atexit handlers (the profile line, closing torchrun's process
group, tempfile clean-ups), a flush of stdout and stderr, then os._exit with the command's status.
What is skipped: joining idle worker threads (their work ended with the command), object finalizers
and module teardown. Every output file is closed and fsynced before a command returns, so there is
nothing left in a Python buffer to lose. Used only where ckptool owns the process (`ckptool ...`,
`python -m ckptool ...`), never when a program calls the command line in-process (click's test runner,
an embedding script). CKPTOOL_QUICK_EXIT=0 keeps the normal exit.
"""
from __future__ import annotations

import atexit
import os
import sys

ENABLED = os.environ.get("CKPTOOL_QUICK_EXIT", "1") != "0"


def owns_process() -> bool:
    """Whether this process runs ckptool as its program: `python -m ckptool` (the __main__ module is
    ckptool's) or the `ckptool` console script (argv[0]), and the user has not turned this off."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return ENABLED and (getattr(spec, "name", None) == "ckptool.__main__"
                        or os.path.basename(sys.argv[0] if sys.argv else "") == "ckptool")


def status_of(code) -> int:
    """The process status sys.exit(code) would give: None -> 0, an int as is, anything else is
    printed to stderr and gives 1 (Python's own rule)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_process(code) -> None:
    """Run the atexit handlers, flush the standard streams and end the process with code's status."""
    status = status_of(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # closed or replaced stream: nothing of ours is waiting in it
    os._exit(status)
