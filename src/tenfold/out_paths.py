"""Where tenfold writes: an output folder (`train --out`, `export --out DIR`) or an output file
(`export --out X.safetensors`, `data prepare --out FILE.bin`), checked before any work.

An existing file where a folder is wanted, a path under a file, a place where no folder can be
created (`/proc/x`, a read-only file system): one line naming the flag, exit 2. Writability is
probed the way it will be used: a scratch folder is created and removed again (`os.access`
says yes to root on a read-only or virtual file system). Torch-free, imported by every layer.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from tenfold.errors import UserError


def kind_of(path: Path) -> str:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if stat.S_ISREG(st.st_mode):
        return "a file"
    return "a device, FIFO or socket"


def _deepest_existing(path: Path) -> Path:
    """The longest prefix of `path` that exists (`.` for a relative path with none)."""
    for candidate in [path, *path.parents]:
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def _probe_writable(folder: Path, label: str) -> None:
    try:
        probe = tempfile.mkdtemp(prefix=".tenfold-write-test-", dir=folder)
    except OSError as e:
        raise UserError(
            f"{label} cannot be written: creating a folder in {folder} fails ({e.strerror or e}); "
            "choose a writable place"
        ) from None
    os.rmdir(probe)


def check_out_path(out: str | Path, flag: str = "--out") -> Path:
    """`--out` as a Path, or one UserError line saying why tenfold cannot write a folder there."""
    p = Path(out).expanduser()
    label = f"{flag} {p}"
    try:
        if p.exists():  # follows a link at OUT itself: the user's own
            if not p.is_dir():
                raise UserError(f"{label} is {kind_of(p)}, not a folder; give a folder (created when missing)")
            _probe_writable(p, label)
            return p
        if os.path.islink(p):
            raise UserError(f"{label} is a symbolic link to {os.readlink(p)}, which does not exist")
        above = _deepest_existing(p)
        if not above.is_dir():
            raise UserError(f"{label} is under {above}, which is {kind_of(above)}, not a folder")
        _probe_writable(above, label)
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission to look
        raise UserError(f"{flag} {str(p)[:200]}: {getattr(e, 'strerror', None) or e}") from None
    return p


def check_output_file(path: str | Path, flag: str = "export --out", example: str = "model.safetensors") -> Path:
    """A file tenfold will write (`tenfold export --out X.safetensors`): not a folder or a
    device, in a folder that can be created and written. Checked before any work."""
    p = Path(path).expanduser()
    try:
        if os.path.lexists(p) and not os.path.islink(p) and not p.is_file():
            raise UserError(f"{flag} {p} is {kind_of(p)}; give a file name, e.g. {p / example}")
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {str(p)[:200]}: {getattr(e, 'strerror', None) or e}") from None
    check_out_path(p.parent, flag=f"{flag} {p}: its folder")
    return p
