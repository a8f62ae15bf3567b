"""The exception types for bad input and failed runs, and the one-line form every message takes.

The CLI turns a `UserError` into one line on stderr and exit status 2 (bad input; nothing
half-written), a `RunError` into one line and exit status 1.
"""

import sys


class UserError(Exception):
    """Bad input from the user: config, CLI flag, data file or checkpoint."""

    exit_code = 2


class TenfoldNote(UserWarning):
    """tenfold's own advice about a run (a slow precision here, ignored DeepSpeed settings).

    A Python warning, so that the Python API can filter or record it; the CLI prints it as one
    line, `tenfold: note: ...`, never as Python's source-line format."""


class RunError(Exception):
    """A run that started and had to stop (non-finite loss with on_nan=stop, a failed rank).

    Not the user's input: the CLI prints the message and exits with status 1."""

    exit_code = 1


def escaped(text: str) -> str:
    """`text` with its control characters shown escaped (a key or path typed with a newline
    in it stays on one line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def say(kind: str, message: object) -> None:
    """One line on stderr: `tenfold: <kind>: <message>`."""
    print(f"tenfold: {kind}: {escaped(str(message))}", file=sys.stderr)
