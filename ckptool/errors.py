"""User-facing errors: one line that says what is wrong and what to do instead.

Everything a user can cause (bad paths, unreadable files, inconsistent shards, impossible layouts)
raises CkptError; the CLI prints it as one line and exits non-zero. Anything else is a bug.
"""


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


def require(condition: bool, message: str, hint: str = "") -> None:
    """Raise CkptError(message, hint) unless condition holds."""
    if not condition:
        raise CkptError(message, hint)
