"""Library messages that are not the user's business, kept off the terminal.

On import, torchao logs one `Failed to load .../torchao/_C_mxfp8...so` warning per prebuilt
kernel library it cannot load (a build for another Python or device; tenfold needs none of
them), torch logs `<enum ...> is an Enum subclass ... register_constant() ... is deprecated`
(torch/utils/_pytree.py) for how torchao registers its enums, and torch and transformers warn
about their own deprecations. `tenfold` (the command line) keeps them back before anything
imports those libraries: the loggers that say them answer only errors, and deprecation
warnings (DeprecationWarning, PendingDeprecationWarning, FutureWarning) are ignored. tenfold's
own warnings and notes, and every library error, still print.

`--verbose` on any subcommand, or TENFOLD_VERBOSE=1 in the environment (the ranks of
`--nproc N` inherit it), shows them all.

Optional libraries that print the same lines when tenfold is used as a library (PEFT and
transformers import torchao when it is installed) are imported through `import_quietly`, or
inside `torchao_logs_silenced`, which keep those loggers quiet for the import alone. No torch
here (the libraries are imported by name).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from types import ModuleType

from tenfold.errors import UserError

VERBOSE_ENV = "TENFOLD_VERBOSE"
# Loggers that speak at import time about things a training run does not use.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def verbose(flag: bool = False) -> bool:
    """Whether library messages are shown: `--verbose`, or TENFOLD_VERBOSE set (not 0)."""
    return flag or os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0")


def hush_libraries() -> None:
    """Keep library noise (module docstring) off the terminal, for this process."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in HIDDEN_WARNINGS:
        warnings.filterwarnings("ignore", category=category)


@contextlib.contextmanager
def torchao_logs_silenced():
    """The import-time loggers (NOISY_LOGGERS) answer only errors inside the block, unless
    library messages are asked for (`verbose`)."""
    loggers = [] if verbose() else [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_quietly(module: str, missing: str) -> ModuleType:
    """`module` imported inside `torchao_logs_silenced`; `missing`: the UserError's text when it
    is not installed."""
    with torchao_logs_silenced():
        try:
            return importlib.import_module(module)
        except ImportError:
            raise UserError(missing) from None
