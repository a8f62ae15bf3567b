"""The files of one save on disk, apart from what goes in them: the save's scratch folder, the
manifest written last, the rename into place and `latest`, `--keep-last`, and the clean-up and
one-line error of a failed save. Rank 0 moves folders; every rank hashes its share of files.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from tenfold.engine.parallel import distributed as d
from tenfold.engine.outputs.checkpoint import layout as lay
from tenfold.engine.outputs.checkpoint.reader import inner_error
from tenfold.engine.outputs.safe_files import Folder
from tenfold.errors import RunError, UserError

# Test hook (an environment variable, read at save time): slow the write down so a test can
# SIGKILL the process in the middle of a save.
SLOW_SAVE_ENV = "TENFOLD_TEST_SLOW_SAVE"


def make_tmp(root: Path, name: str) -> None:
    """Rank 0: remove leftovers of killed saves (a link is unlinked, never followed), then
    create the save's own folder."""
    root.mkdir(parents=True, exist_ok=True)
    with Folder(root, follow=True) as folder:
        for entry in folder.names():
            if entry.startswith(lay.TMP_PREFIX):
                folder.remove(entry)
        folder.mkdir(name)


def write_manifest(tmp: Path, step: int) -> int:
    """Every file's size and sha256 (hashed round-robin over ranks), then rank 0 writes
    the manifest last: a folder without one is an unfinished save. Returns the bytes saved."""
    d.side_barrier()  # every rank's files are on disk
    with Folder(tmp) as folder:
        names = d.broadcast_small(folder.names() if d.rank_now() == 0 else None)
        mine = names[d.rank_now():: d.world_now()]
        part = d.on_every_rank(lambda: lay.digests(folder, mine))
        files: dict = {}
        for each in d.all_gather_small(part):
            files.update(each)

        def write() -> None:
            if d.rank_now() == 0:
                folder.create(lay.MANIFEST, lay.encode_json(lay.manifest_for(step, d.world_now(), files)))
                folder.fsync()

        d.on_every_rank(write)
    return sum(v["bytes"] for v in files.values())


def publish(root: Path, tmp: Path, final: Path, keep_last: int | None) -> None:
    """Rank 0: rename .tmp-step_N -> step_N, then update `latest`, then prune."""
    with Folder(root, follow=True) as folder:
        if folder.lstat(final.name) is not None:  # an older step_N (or a link there): replaced
            trash = f"{lay.TMP_PREFIX}old-{final.name}"
            folder.remove(trash)
            folder.rename(final.name, trash)
            folder.rename(tmp.name, final.name)
            folder.remove(trash)
        else:
            folder.rename(tmp.name, final.name)
        folder.fsync()
        lay.write_latest(folder, final.name)
        prune(root, folder, keep_last, keep=final.name)


def prune(root: Path, folder: Folder, keep_last: int | None, keep: str) -> None:
    """--keep-last: delete the oldest real checkpoint folders (links are left alone)."""
    if not keep_last:
        return
    for i, (_, path) in enumerate(lay.list_step_dirs(root)):
        if i >= keep_last and path.name != keep:
            folder.remove(path.name)


def abandon(root: Path, tmp: Path, err: BaseException) -> None:
    """A failed save: remove the partial folder; the previous checkpoint and `latest`
    were never touched. (After Ctrl-C-twice no barrier: the other ranks may not come.)"""
    if not isinstance(err, (KeyboardInterrupt, SystemExit)):
        try:
            d.side_barrier()
        except Exception:  # noqa: BLE001 - best effort; the error being reported is `err`
            pass
    if d.rank_now() == 0:
        try:
            with Folder(root, follow=True) as folder:
                folder.remove(tmp.name)
        except (OSError, UserError):
            pass  # the next save removes it


def save_error(root: Path, e: BaseException, tmp: Path) -> BaseException:
    """The one-line error a failed save raises: what failed, and which checkpoint is intact."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, UserError, RunError)):
        return e
    os_err = find_os_error(e)
    previous = lay.read_latest(root)
    keep = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    if os_err is not None:
        what = os.strerror(os_err.errno) if os_err.errno else str(os_err)
        hint = "; free disk space or set --out elsewhere" if os_err.errno == errno.ENOSPC else ""
        return lay.CheckpointError(
            f"checkpoint save to {tmp} failed: {what} (errno {os_err.errno}); removed the "
            f"partial save; {keep}{hint}"
        )
    return lay.CheckpointError(
        f"checkpoint save to {tmp} failed: {d.first_line(inner_error(e))}; removed the partial save; {keep}"
    )


def find_os_error(e: BaseException | None) -> OSError | None:
    """The OSError (ENOSPC, EACCES, ...) behind a failed save, if there is one."""
    seen = 0
    while e is not None and seen < 10:
        e = inner_error(e)
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def slow_save_hook() -> None:
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        time.sleep(float(delay))
