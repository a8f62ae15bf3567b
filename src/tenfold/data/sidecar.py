"""FILE.json beside a `tenfold data prepare` FILE.bin: the ids' dtype, the counts, and the
tokenizer that made them (written by tenfold.data.prepare, read by every run of FILE.bin)."""

from __future__ import annotations

import json
from pathlib import Path

SIDECAR_FORMAT = "tenfold-tokens"


def sidecar_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".json")


def read_sidecar(bin_path: str | Path) -> dict:
    """FILE.json of a prepared FILE.bin ({} when there is none, or it is something else)."""
    from tenfold.errors import UserError
    from tenfold.textfiles import read_text  # a regular file of a few MB: never a FIFO read forever

    path = sidecar_path(bin_path)
    try:
        data = json.loads(read_text(path, "sidecar"))
    except (UserError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == SIDECAR_FORMAT else {}
