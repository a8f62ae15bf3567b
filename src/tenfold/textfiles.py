"""A user's text file (TOML config, DeepSpeed JSON) read whole, or one `UserError` line.

What can go wrong before parsing gets a message that says what the file is and what was
expected: missing, a directory or a device instead of a regular file, unreadable, too large
to be a config, or bytes that are not UTF-8 text (say, a checkpoint passed by mistake).
A UTF-8 byte-order mark, as some editors write it, is accepted.
"""

from __future__ import annotations

from pathlib import Path

from tenfold.errors import UserError

MAX_CONFIG_BYTES = 16 * 2**20  # configs are a few KB; a bigger file is the wrong file


def read_text(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The text of `path`; `what` names it in messages ("config file", "DeepSpeed config")."""
    p = Path(path)
    try:
        if not p.exists():
            raise UserError(f"{what} not found: {p}")
        if not p.is_file():
            kind = "a directory" if p.is_dir() else "not a regular file"
            raise UserError(f"{what} {p} is {kind}; expected a text file")
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)
    except (OSError, ValueError) as e:  # no permission, a name too long, a NUL byte in it
        raise UserError(f"cannot read {what} {str(p)[:200]}: {getattr(e, 'strerror', None) or e}") from None
    if len(data) > max_bytes:
        raise UserError(f"{what} {p} is larger than {max_bytes // 2**20} MiB; expected a text config of a few KB")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{what} {p} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
            "expected a text file saved as UTF-8"
        ) from None
