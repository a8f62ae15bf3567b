"""The one exception type for bad user input.

The CLI turns a `UserError` into one line on stderr and exit status 2 (exit status 2 with one clear message for bad input; nothing
half-written).
"""


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
