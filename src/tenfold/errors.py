"""The one exception type for bad user input.

The CLI turns a `UserError` into one line on stderr and exit status 2 (DESIGN.md:
"Exit status 2 with one clear message for bad input; nothing half-written").
"""


class UserError(Exception):
    """Bad input from the user: config, CLI flag, data file or checkpoint."""

    exit_code = 2
