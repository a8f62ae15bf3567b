"""Optional libraries imported without their import-time log lines, or one clear UserError.

torchao's import logs one warning per prebuilt CUDA kernel library it cannot load (on a CPU-only
or older-GPU machine that is every one, and none of them is what tenfold uses), and torch a
deprecation notice for how torchao registers an enum with torch.compile. PEFT imports torchao
when it is installed, and transformers imports it when it builds a model, so both print the same
lines. No torch here (the libraries are imported by name).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from types import ModuleType

from tenfold.errors import UserError

NOISY_AT_IMPORT = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def torchao_logs_silenced():
    """torchao's and torch's import-time warnings silenced inside the block."""
    loggers = [logging.getLogger(name) for name in NOISY_AT_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_quietly(module: str, missing: str) -> ModuleType:
    """`module` imported with torchao's and torch's import-time warnings silenced; `missing`: the
    UserError's text when it is not installed."""
    with torchao_logs_silenced():
        try:
            return importlib.import_module(module)
        except ImportError:
            raise UserError(missing) from None
