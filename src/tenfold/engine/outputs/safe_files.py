"""Files in a run folder, read and written without ever following a symbolic link.

A run folder (`--out`) or a checkpoint someone handed you may hold links planted by another
user of a shared filesystem: `checkpoints/.tmp-latest -> ~/.bashrc` would make a plain
`open(..., "w")` overwrite the link's target, a `step_9 -> ../../other_run/step_3` would
resume another run, a manifest entry `../../../../dev/zero` would make a hash read forever.
`Folder` closes all of these the way coreutils and `shutil.rmtree` do (openat(2) with
`O_NOFOLLOW`, relative to a directory descriptor):

* a folder is opened once, with `O_NOFOLLOW | O_DIRECTORY` on its own name, and every file
  inside is opened relative to that descriptor, so no component of the path is re-resolved;
* only plain names are accepted (no `/`, `..` or `.`), so nothing outside the folder can be
  named;
* a file is `lstat`ed first and must be a regular file (not a link, FIFO or device) of a
  bounded size; it is then opened with `O_NOFOLLOW | O_NONBLOCK` (a FIFO swapped in between
  cannot block the open) and `fstat`ed again to be sure it is the file that was checked;
* writes go to a scratch name created with `O_CREAT | O_EXCL | O_NOFOLLOW` and are renamed
  over the target: a link at either name is replaced, never written through;
* removal unlinks a link itself and deletes a directory with `shutil.rmtree(dir_fd=...)`,
  which never descends through a link (`shutil.rmtree.avoids_symlink_attacks`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import IO

from tenfold.errors import UserError

_HASH_CHUNK = 1 << 22
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class UnsafeFileError(UserError):
    """A path in a run folder that tenfold refuses to use: a link, a device, a name reaching
    outside the folder, a file larger than allowed. One line, exit status 2."""


def check_plain_name(name: object, where: Path) -> str:
    """`name` if it names an entry directly inside `where` (no separators, no `.`/`..`)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\0" in name):
        raise UnsafeFileError(
            f"{name!r} is not a plain file name inside {where} (no '/', '..' or absolute paths allowed)"
        )
    return name


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


class Folder:
    """A directory opened without following a link at its own name; everything inside is
    reached relative to its descriptor and never through a link. Use as a context manager."""

    def __init__(self, path: str | Path, parent: "Folder | None" = None, follow: bool = False):
        """`path` inside `parent` (a plain name), or a path of its own; `follow=True` accepts
        a link at the top folder's own name (one the user made, e.g. to a scratch disk)."""
        self.path = Path(path) if parent is None else parent.path / check_plain_name(str(path), parent.path)
        name = str(path) if parent is not None else str(self.path)
        flags = os.O_RDONLY | _DIRECTORY | _CLOEXEC | (0 if follow and parent is None else _NOFOLLOW)
        try:
            self.fd = os.open(name, flags, dir_fd=parent.fd if parent is not None else None)
        except FileNotFoundError:
            raise UnsafeFileError(f"folder not found: {self.path}") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                what = "a symbolic link" if os.path.islink(self.path) else "not a folder"
                raise UnsafeFileError(f"{self.path} is {what}; tenfold does not follow links in a run folder") from None
            raise UnsafeFileError(f"cannot open folder {self.path}: {e.strerror or e}") from None

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def subfolder(self, name: str) -> "Folder":
        return Folder(name, parent=self)

    # ------------------------------------------------------------------ looking

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's own status (a link is not followed), or None when it does not exist."""
        try:
            return os.stat(check_plain_name(name, self.path), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def regular_size(self, name: str) -> int:
        """The size of a regular file `name`; a link, device, FIFO or folder is refused."""
        st = self.lstat(name)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "file missing", str(self.path / name))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{self.path / name} is {_kind(st.st_mode)}; only regular files are read")
        return st.st_size

    # ------------------------------------------------------------------ reading

    def _open_checked(self, name: str, max_bytes: int) -> tuple[int, int]:
        size = self.regular_size(name)
        if size > max_bytes:
            raise UnsafeFileError(f"{self.path / name} is {size} bytes; at most {max_bytes} expected")
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=self.fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            os.close(fd)
            raise UnsafeFileError(f"{self.path / name} changed while it was being opened")
        return fd, size

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        """The whole content of a regular file of at most `max_bytes` bytes."""
        fd, size = self._open_checked(name, max_bytes)
        with os.fdopen(fd, "rb") as f:
            data = f.read(size + 1)
        if len(data) != size:
            raise UnsafeFileError(f"{self.path / name} changed size while it was read")
        return data

    def sha256(self, name: str, size: int) -> str:
        """sha256 of a regular file that must be exactly `size` bytes; reads at most that."""
        fd, actual = self._open_checked(name, size)
        h = hashlib.sha256()
        left = size
        with os.fdopen(fd, "rb") as f:
            while left > 0 and (chunk := f.read(min(_HASH_CHUNK, left))):
                h.update(chunk)
                left -= len(chunk)
        if left or actual != size:
            raise UnsafeFileError(f"{self.path / name} changed size while it was read")
        return h.hexdigest()

    # ------------------------------------------------------------------ writing

    def write_atomic(self, name: str, data: bytes, scratch: str | None = None) -> None:
        """Write `data` to `scratch` (default `.NAME.tmp`), fsync, rename over `name`: readers
        see the old or the new file. A link at either name is replaced, not written through."""
        scratch = check_plain_name(scratch or f".{name}.tmp", self.path)
        check_plain_name(name, self.path)
        self.remove(scratch)  # a stale scratch file or a planted link: unlink the entry itself
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(scratch, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.remove(scratch)
            raise
        self.fsync()

    def create(self, name: str, data: bytes) -> None:
        """Write a new file (it must not exist yet), fsynced."""
        fd = os.open(check_plain_name(name, self.path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC,
                     0o644, dir_fd=self.fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def open_append(self, name: str) -> IO[str]:
        """A text stream appending to `name` (created if missing); a link there is refused."""
        st = self.lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{self.path / name} is {_kind(st.st_mode)}; only regular files are written")
        try:
            fd = os.open(check_plain_name(name, self.path),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o644, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeFileError(f"{self.path / name} is a symbolic link; tenfold does not write through links") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafeFileError(f"{self.path / name} is {_kind(st.st_mode)}; only regular files are written")
        return os.fdopen(fd, "a")

    def mkdir(self, name: str) -> None:
        os.mkdir(check_plain_name(name, self.path), dir_fd=self.fd)

    def rename(self, old: str, new: str) -> None:
        os.rename(check_plain_name(old, self.path), check_plain_name(new, self.path),
                  src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name: str) -> None:
        """Delete the entry `name`: a link or file is unlinked itself, a folder is deleted
        with everything in it without descending through any link. Missing is fine."""
        st = self.lstat(name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode) and sys.version_info >= (3, 11):
            shutil.rmtree(name, dir_fd=self.fd)
        elif stat.S_ISDIR(st.st_mode):  # Python 3.10: rmtree refuses a link at the top itself
            shutil.rmtree(self.path / name)
        else:
            os.unlink(name, dir_fd=self.fd)

    def fsync(self) -> None:
        """Make renames and new entries in this folder durable (best effort)."""
        try:
            os.fsync(self.fd)
        except OSError:
            pass
