"""A user's text file (TOML config, DeepSpeed JSON, Hugging Face config.json, tokenizer files)
read whole, or one `UserError` line.

What can go wrong before parsing gets a message that says what the file is and what was
expected: missing, a directory, a device, a FIFO or a socket instead of a regular file,
unreadable, too large for what it is, or bytes that are not UTF-8 text (say, a checkpoint
passed by mistake). The file is opened without blocking and checked on the open descriptor, so
`/dev/zero` or a FIFO with no writer is refused at once instead of read forever, and the read
stops one byte past the cap whatever the file claims its size to be. A UTF-8 byte-order mark,
as some editors write it, is accepted.

`check_file` makes the same checks for a file another library opens by its path (a
tokenizer.json the `tokenizers` package reads).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tenfold.errors import UserError

MAX_CONFIG_BYTES = 4 * 2**20  # configs are a few KB; a bigger file is the wrong file
# tokenizer.json files reach tens of MB (Gemma's: 33 MB); beyond this it is not a tokenizer
MAX_TOKENIZER_BYTES = 256 * 2**20

_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _size_text(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def _checked_fd(p: Path, what: str, max_bytes: int, expected: str) -> int:
    """An open descriptor of the regular file `p`, no larger than `max_bytes`, or UserError."""
    if not str(p):
        raise UserError(f"{what}: the path is empty; expected {expected}")
    try:
        fd = os.open(p, _FLAGS)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {p}") from None
    except (OSError, ValueError) as e:  # no permission, a name too long, a NUL byte in it
        raise UserError(f"cannot read {what} {str(p)[:200]}: {getattr(e, 'strerror', None) or e}") from None
    try:
        mode, size = (st := os.fstat(fd)).st_mode, st.st_size
        if stat.S_ISDIR(mode):
            raise UserError(f"{what} {p} is a directory; expected {expected}")
        if not stat.S_ISREG(mode):
            raise UserError(f"{what} {p} is not a regular file (a device, FIFO or socket); expected {expected}")
        if size > max_bytes:
            raise UserError(f"{what} {p} is larger than {_size_text(max_bytes)} ({size:,} bytes); expected {expected}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(path: str | Path, what: str, max_bytes: int, expected: str = "a text file") -> Path:
    """`path` as a Path once it is known to be a regular file of at most `max_bytes`: for a
    file another library opens by name."""
    os.close(_checked_fd(Path(path), what, max_bytes, expected))
    return Path(path)


def read_bytes(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES, expected: str = "a text file") -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them, or UserError."""
    p = Path(path)
    fd = _checked_fd(p, what, max_bytes, expected)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)  # the size can change between fstat and read
    except OSError as e:
        raise UserError(f"cannot read {what} {str(p)[:200]}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise UserError(f"{what} {p} is larger than {_size_text(max_bytes)}; expected {expected}")
    return data


def read_text(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The text of `path`; `what` names it in messages ("config file", "DeepSpeed config")."""
    data = read_bytes(path, what, max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
            "expected a text file saved as UTF-8"
        ) from None
