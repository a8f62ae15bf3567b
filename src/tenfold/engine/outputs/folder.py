"""The run folder (`--out`): one run per folder, checked before any work, written without
following links.

    OUT/metrics.jsonl  summary.json  tensorboard/  tokenizer/  checkpoints/  hf/  wandb/  model.safetensors

* `check_out_path` (tenfold/out_paths.py, shared with `data prepare`): `--out` must be a folder
  tenfold can create and write; one line, exit 2, before data or model are built.
* `RunFolder.check(cfg)`: a fresh run into an `--out` that holds an earlier run's metrics or
  checkpoints is refused (two runs would mix: metrics appended, `step_N` overwritten, `latest`
  moved back); `--resume auto` continues it, `--overwrite` replaces it. A symbolic link or an
  entry of the wrong kind where the run writes is refused too.
* `RunFolder.open()` (rank 0, after setup): with `--overwrite` the earlier run's entries are
  renamed into `OUT/.tenfold-replaced-<time>-<pid>/` (renames on one file system: atomic, and
  a link is moved, never followed; a `checkpoints` link stays and what is behind it is set
  aside there). The aside folders are deleted only once the new run is itself a usable run:
  it has saved its first checkpoint, or finished (`stepped(saved=...)`, `commit()`). If it
  fails before its first step, `failed()` puts everything back as it was; if it fails later but
  before that, the earlier run stays aside, whole, and `failed()` says where.
* On resume `metrics.jsonl` loses the rows after the resumed step (`metrics.keep_rows_up_to`),
  so every step appears once.
* `replace_folder`: a folder written by a library that follows links (the tokenizer copy) is
  filled under a fresh scratch name and renamed into place.

Every entry of OUT is reached through `safe_files.Folder` (openat with `O_NOFOLLOW`). A link
at OUT itself, or at `OUT/checkpoints`, is the user's own (to a scratch disk, say) and is
followed; nothing inside is.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tenfold.engine.outputs.safe_files import Folder, UnsafeFileError
from tenfold.errors import UserError
from tenfold.out_paths import check_out_path, check_output_file, kind_of as _kind  # noqa: F401 (re-exported)

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
# What a run writes into OUT, and the kind each entry must be.
RUN_FILES = (METRICS, SUMMARY, "model.safetensors", "model.config.json")
RUN_FOLDERS = ("tensorboard", "tokenizer", CHECKPOINTS, "hf", "wandb")
SCRATCH = (f"{SUMMARY}.tmp", f".{METRICS}.tmp", ".tokenizer.tmp", ".model.safetensors.tmp", ".model.config.json.tmp")
RUN_ENTRIES = (*RUN_FILES, *RUN_FOLDERS, *SCRATCH)
ASIDE_PREFIX = ".tenfold-replaced-"
_CHECKPOINT_NAME = re.compile(r"^(step_\d+|latest)$")
CONTINUE_HINT = "continue it with --resume auto, or replace it with --overwrite (or choose another --out)"


# --------------------------------------------------------------------------- the run in OUT


def _earlier_run(folder: Folder) -> list[str]:
    """What in OUT belongs to an earlier run: its metrics, summary or checkpoints."""
    found = []
    st = folder.lstat(METRICS)
    if st is not None and st.st_size > 0:
        found.append(METRICS)
    if folder.lstat(SUMMARY) is not None:
        found.append(SUMMARY)
    try:
        with Folder(folder.path / CHECKPOINTS, follow=True) as ckpts:
            names = [n for n in ckpts.names() if _CHECKPOINT_NAME.match(n)]
    except UnsafeFileError:  # no checkpoints folder
        names = []
    found += [f"{CHECKPOINTS}/{n}" for n in sorted(names, key=_step_order)[-2:]]
    return found


def _step_order(name: str) -> tuple[int, int]:
    return (1, 0) if name == "latest" else (0, int(name.split("_")[1]))


def _check_entry_kinds(folder: Folder) -> None:
    """A link, or an entry of the wrong kind, where the run writes: one line naming it."""
    for name in (*RUN_FILES, *RUN_FOLDERS):
        st = folder.lstat(name)
        if st is None or (name == CHECKPOINTS and stat.S_ISLNK(st.st_mode)):
            continue
        path = folder.path / name
        if stat.S_ISLNK(st.st_mode):
            raise UserError(f"{path} is a symbolic link; tenfold does not follow links in a run folder: "
                            "remove it, or choose another --out")
        want_dir = name in RUN_FOLDERS
        if stat.S_ISDIR(st.st_mode) != want_dir or not (want_dir or stat.S_ISREG(st.st_mode)):
            raise UserError(f"{path} is {_kind(path)}; tenfold writes a {'folder' if want_dir else 'file'} there: "
                            "remove it, or choose another --out")


@dataclass
class RunFolder:
    """The checked plan for OUT; rank 0 carries it out (`open`, `started`, `failed`)."""

    path: Path
    overwrite: bool = False
    resume: bool = False
    existed: set = field(default_factory=set)  # entries present before this run (kept)
    created: bool = False  # OUT itself was made by this run
    asides: list = field(default_factory=list)  # (folder, name): where --overwrite moved the earlier run
    has_stepped: bool = False  # the new run has done a step: its own outputs are worth keeping
    is_committed: bool = False  # ... and saved a checkpoint or finished: the earlier run can go

    @classmethod
    def check(cls, cfg: Any) -> "RunFolder":
        """Everything about OUT that can be checked before any work; writes nothing."""
        overwrite, resume = bool(cfg.log.overwrite), bool(cfg.checkpoint.resume)
        if overwrite and resume:
            raise UserError("--overwrite starts a new run in --out and --resume continues the one there: use one of them")
        check_resume_path(cfg.checkpoint.resume)
        path = check_out_path(cfg.log.out)
        if path.is_dir():
            with Folder(path, follow=True) as folder:
                if not overwrite:
                    _check_entry_kinds(folder)
                earlier = _earlier_run(folder)
            if earlier and not (overwrite or resume):
                raise UserError(f"--out {path} holds an earlier run ({', '.join(earlier)}); {CONTINUE_HINT}")
        return cls(path, overwrite=overwrite, resume=resume)

    def open(self) -> None:
        """Rank 0, before the first write: create OUT; with --overwrite move the earlier run aside.
        A `checkpoints` link (yours, to a scratch disk) stays; what is behind it is set aside there."""
        self.created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        with Folder(self.path, follow=True) as folder:
            present = {n for n in RUN_ENTRIES if folder.lstat(n) is not None}
            st = folder.lstat(CHECKPOINTS)
            kept_link = st is not None and stat.S_ISLNK(st.st_mode)
        if self.overwrite:
            if kept_link:
                present.discard(CHECKPOINTS)
                self._set_aside(self.path / CHECKPOINTS, None)
            self._set_aside(self.path, present)
            present = {CHECKPOINTS} if kept_link else set()
        self.existed = present

    def _set_aside(self, where: Path, names: set | None) -> None:
        """Rename `names` (None: every entry but earlier asides) of `where` into a new aside folder there."""
        with Folder(where, follow=True) as folder:
            names = {n for n in folder.names() if not n.startswith(ASIDE_PREFIX)} if names is None else names
            if not names:
                return
            aside = f"{ASIDE_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            folder.mkdir(aside)
            with folder.subfolder(aside) as box:
                for name in sorted(names):
                    os.rename(name, name, src_dir_fd=folder.fd, dst_dir_fd=box.fd)
            folder.fsync()
        self.asides.append((where, aside))

    def stepped(self, saved: bool) -> None:
        """After each of the new run's steps; `saved`: it has a complete checkpoint by now."""
        self.has_stepped = True
        if saved:
            self.commit()

    def commit(self) -> None:
        """The new run has a checkpoint or has finished: the run it replaced is deleted (never
        through a link)."""
        if self.is_committed:
            return
        self.is_committed = True
        for where, aside in self.asides:
            with Folder(where, follow=True) as folder:
                folder.remove(aside)
        self.asides = []

    def failed(self) -> None:
        """The new run failed. Before its first step: what it created goes, the earlier run
        comes back. After it, without a checkpoint yet: both stay, and where the earlier run is
        is said (one line on stderr)."""
        if self.is_committed or not self.path.is_dir():
            return
        if self.has_stepped:
            if self.asides:
                import sys

                kept = " and ".join(str(where / aside) for where, aside in self.asides)
                print(f"tenfold: note: --overwrite: this run stopped before its first checkpoint; the run it replaced "
                      f"is kept, whole, in {kept} (move its entries back to use it again)", file=sys.stderr)
            return
        with Folder(self.path, follow=True) as folder:
            for name in RUN_ENTRIES:
                if name not in self.existed:
                    folder.remove(name)
        for where, aside in reversed(self.asides):
            with Folder(where, follow=True) as folder, folder.subfolder(aside) as box:
                for name in box.names():
                    folder.remove(name)  # the new run's entry of that name, if any
                    os.rename(name, name, src_dir_fd=box.fd, dst_dir_fd=folder.fd)
            with Folder(where, follow=True) as folder:
                folder.remove(aside)
        self.asides = []
        if self.created:
            try:
                self.path.rmdir()
            except OSError:  # not empty: something else was put there meanwhile
                pass


def replace_folder(out: Path, name: str, fill: Callable[[Path], Any]) -> Path | None:
    """OUT/name written by `fill(folder)` into a fresh scratch folder, then renamed into place
    (an old copy, or a link there, is removed itself). None when `fill` wrote nothing."""
    scratch = f".{name}.tmp"
    with Folder(out, follow=True) as folder:
        folder.remove(scratch)
        folder.mkdir(scratch)
        try:
            wrote = fill(out / scratch)
        except BaseException:
            folder.remove(scratch)
            raise
        if wrote is None:
            folder.remove(scratch)
            return None
        folder.remove(name)
        folder.rename(scratch, name)
        folder.fsync()
    return out / name


def check_resume_path(resume: str | None) -> None:
    """`--resume PATH` checked now, so that the mistake is not found after data and model
    are built (`auto` is resolved when the run starts)."""
    if resume and resume != "auto":
        check_checkpoint_path(resume, "--resume")


def check_checkpoint_path(path: str | Path, flag: str) -> None:
    """A checkpoint or run folder to read (`--resume PATH`, `tenfold export PATH`): missing, a
    file, a device, a FIFO, a link, a folder without checkpoints: one UserError line."""
    from tenfold.engine.outputs.checkpoint.layout import resolve_checkpoint_path

    p = Path(path).expanduser()
    try:
        if os.path.islink(p):  # a checkpoint is never read through a link (layout.open_checkpoint)
            where = os.path.realpath(p)
            if not os.path.exists(where):
                raise UserError(f"checkpoint not found: {flag} {p} is a symbolic link to {where}, which does not exist")
            raise UserError(f"{flag} {p} is a symbolic link; tenfold does not read checkpoints through links: "
                            f"give the folder itself, {where}")
        if os.path.exists(p) and not p.is_dir():
            raise UserError(f"{flag} {p} is {_kind(p)}, not a checkpoint: expected a checkpoint folder "
                            "(OUT/checkpoints/step_N) or a run folder (OUT)")
        resolve_checkpoint_path(p)
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission to look
        raise UserError(f"{flag} {str(path)[:200]}: {getattr(e, 'strerror', None) or e}") from None
