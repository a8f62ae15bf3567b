"""The one exception type for bad user input.

The CLI turns a `UserError` into one line on stderr and exit status 2 (exit status 2 with one clear message for bad input; nothing
half-written).
"""


class UserError(Exception):
    """Bad input from the user: config, CLI flag, data file or checkpoint."""

    exit_code = 2


class RunError(Exception):
    """A run that started and had to stop (non-finite loss with on_nan=stop, a failed rank).

    Not the user's input: the CLI prints the message and exits with status 1."""

    exit_code = 1
