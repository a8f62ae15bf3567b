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
"""

from __future__ import annotations

import logging
import os
import warnings

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
