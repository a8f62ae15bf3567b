"""On-disk layout of tenfold checkpoints: names, the `latest` pointer, the manifest, and the
checks a checkpoint passes before anything in it is parsed.

    OUT/checkpoints/latest           one line: the name of the newest complete checkpoint
    OUT/checkpoints/step_N/          one checkpoint (see the package docstring for its files)
    OUT/checkpoints/.tmp-step_N/     a save in progress (never read; removed by the next save)

Everything inside `OUT/checkpoints/` is reached through `safe_files.Folder`: no link is
followed, every file name is a plain name inside its folder, sizes are checked with `lstat`
before a byte is read, and hashing reads at most the size the manifest declares.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from tenfold.engine.parallel import distributed as d
from tenfold.engine.outputs.safe_files import Folder, UnsafeFileError, check_plain_name
from tenfold.errors import UserError

FORMAT_TAG = "tenfold-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.json"
METADATA = ".metadata"  # DCP's own name
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
REQUIRED_FILES = (METADATA, TRAINER_STATE)
MAX_JSON_BYTES = 64 << 20  # a manifest of 100,000 ranks is ~15 MB; more is not a checkpoint
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used (missing, truncated, corrupt, foreign, malformed) or a
    save that failed (full disk). One line naming the file, exit status 2 in the CLI."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def checkpoints_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def open_checkpoint(ckpt: Path) -> Folder:
    """The checkpoint folder, opened without following a link at its own name."""
    if not os.path.lexists(ckpt):
        raise CheckpointError(f"checkpoint not found: {ckpt} is not a directory")
    try:
        return Folder(ckpt)
    except UnsafeFileError as e:
        raise CheckpointError(f"checkpoint {ckpt} refused: {e}") from None


# --------------------------------------------------------------------------- JSON files


def encode_json(data: Any) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


def read_json_in(folder: Folder, name: str) -> Any:
    """A JSON file inside a checkpoint, read without following links; CheckpointError naming
    the file when it is missing, not a regular file, too large or not JSON."""
    path = folder.path / name
    try:
        return json.loads(folder.read_bytes(name, MAX_JSON_BYTES))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except UnsafeFileError as e:
        raise CheckpointError(f"checkpoint file refused: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {path}: not valid JSON ({e})") from None


def read_json(path: Path) -> Any:
    with open_checkpoint(path.parent) as folder:
        return read_json_in(folder, path.name)


def load_trainer_state(ckpt: Path) -> dict:
    return read_json(ckpt / TRAINER_STATE)


# --------------------------------------------------------------------------- the checkpoints folder


def open_root(root: Path) -> Folder | None:
    """OUT/checkpoints (a link you made there, e.g. to a scratch disk, is followed; nothing
    inside it is), or None when there is none."""
    try:
        return Folder(root, follow=True)
    except UnsafeFileError:
        return None


def list_step_dirs(root: Path, include_links: bool = False) -> list[tuple[int, Path]]:
    """Final-named checkpoint folders under `root`, newest first (`.tmp-` saves excluded).
    Links named step_N are left out unless `include_links` (then loading refuses them)."""
    folder = open_root(root)
    if folder is None:
        return []
    found = []
    with folder:
        for name in folder.names():
            m = STEP_DIR.match(name)
            st = folder.lstat(name) if m else None
            if st is not None and (stat.S_ISDIR(st.st_mode) or (include_links and stat.S_ISLNK(st.st_mode))):
                found.append((int(m.group(1)), root / name))
    return sorted(found, reverse=True)


def read_latest(root: Path) -> Path | None:
    """The checkpoint `latest` names; None when it is missing, a link or not a step name."""
    folder = open_root(root)
    if folder is None:
        return None
    with folder:
        try:
            name = folder.read_bytes(LATEST, 256).decode().strip()
        except (FileNotFoundError, UnsafeFileError, UnicodeDecodeError):
            return None
    return root / name if STEP_DIR.match(name) else None


def write_latest(root_folder: Folder, name: str) -> None:
    """Point `latest` at `name` atomically (os.replace: readers see the old or the new name;
    a link planted at `latest` or `.tmp-latest` is replaced, never written through)."""
    root_folder.write_atomic(LATEST, (name + "\n").encode(), scratch=f"{TMP_PREFIX}{LATEST}")


def auto_candidates(root: Path) -> list[Path]:
    """What `latest` names, then the older step_N (descending), then any newer ones. Older
    first because a newer step_N than `latest` belongs to a trajectory the user abandoned by
    resuming from an earlier checkpoint (or to a save that died between rename and `latest`).
    Links named step_N are listed so that loading names and refuses them."""
    steps = list_step_dirs(root, include_links=True)
    latest = read_latest(root)
    if latest is None or all(p != latest for _, p in steps):
        return [p for _, p in steps]
    n = int(STEP_DIR.match(latest.name).group(1))
    return [latest] + [p for s, p in steps if s < n] + [p for s, p in steps if s > n]


def is_checkpoint_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / METADATA).is_file()


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (OUT) / its checkpoints folder, whose `latest`
    (or newest step_N) is taken."""
    p = Path(path).expanduser()
    if not p.exists() and not p.is_symlink():
        raise CheckpointError(f"checkpoint not found: {p}")
    if p.exists() and not p.is_dir():
        raise CheckpointError(
            f"{p} is a file, not a checkpoint: expected a checkpoint folder (OUT/checkpoints/step_N) "
            "or a run folder (OUT)"
        )
    if p.is_symlink() or is_checkpoint_dir(p) or STEP_DIR.match(p.name):
        return p  # a link is refused when it is opened, with its name
    for root in (p / "checkpoints", p):
        candidates = auto_candidates(root)
        if candidates:
            return candidates[0]
    raise CheckpointError(f"no checkpoint in {p} (expected {p}/checkpoints/step_N or a step_N folder)")


# --------------------------------------------------------------------------- the manifest


def _check_entry(mpath: Path, name: object, entry: object) -> str | None:
    try:
        check_plain_name(name, mpath.parent)
    except UnsafeFileError as e:
        return f"malformed checkpoint file {mpath}: {e}"
    if name == MANIFEST:
        return f"malformed checkpoint file {mpath}: it lists itself"
    size = entry.get("bytes") if isinstance(entry, dict) else None
    digest = entry.get("sha256") if isinstance(entry, dict) else None
    if type(size) is not int or size < 0 or not isinstance(digest, str) or not _SHA256.match(digest):
        return (f"malformed checkpoint file {mpath}: the entry for {name!r} must be "
                '{"bytes": <size>, "sha256": <64 hex digits>}')
    return None


def check_manifest(manifest: Any, mpath: Path) -> dict:
    """The manifest's structure: tag, version, step, world size, and plain file entries."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_TAG:
        raise CheckpointError(f"not a tenfold checkpoint (format tag is not {FORMAT_TAG!r}): {mpath}")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"unsupported checkpoint version {manifest.get('version')!r} in {mpath} "
            f"(this tenfold reads version {FORMAT_VERSION})"
        )
    for key in ("step", "world_size"):
        if type(manifest.get(key)) is not int or manifest[key] < (0 if key == "step" else 1):
            raise CheckpointError(f"malformed checkpoint file {mpath}: {key!r} must be a whole number")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"malformed checkpoint file {mpath}: 'files' must map file names to sizes and hashes")
    problems = [p for name, entry in files.items() if (p := _check_entry(mpath, name, entry))]
    if problems:
        raise CheckpointError(problems[0])
    missing = [n for n in REQUIRED_FILES if n not in files]
    if missing:
        raise CheckpointError(f"malformed checkpoint file {mpath}: it does not list {missing[0]}")
    return manifest


def read_manifest_in(folder: Folder) -> dict:
    """The manifest, or a CheckpointError saying why this is not a complete tenfold checkpoint."""
    st = folder.lstat(MANIFEST)
    if st is None:
        if folder.lstat(METADATA) is not None:
            raise CheckpointError(
                f"not a tenfold checkpoint (foreign DCP checkpoint, no {MANIFEST}): {folder.path}"
            )
        raise CheckpointError(f"incomplete checkpoint (no {MANIFEST}; the save did not finish): {folder.path}")
    return check_manifest(read_json_in(folder, MANIFEST), folder.path / MANIFEST)


def read_manifest(ckpt: Path) -> dict:
    with open_checkpoint(ckpt) as folder:
        return read_manifest_in(folder)


def check_one_file(folder: Folder, name: str, expected: dict) -> str | None:
    """Size (lstat, before any read) and sha256 (reading at most that size) of one entry."""
    path = folder.path / name
    try:
        size = folder.regular_size(name)
        if size != expected["bytes"]:
            return f"truncated or altered checkpoint file {path}: {size} bytes, manifest says {expected['bytes']}"
        if folder.sha256(name, size) != expected["sha256"]:
            return f"corrupt checkpoint file {path}: sha256 differs from {folder.path / MANIFEST}"
    except FileNotFoundError:
        return f"checkpoint file missing: {path}"
    except UnsafeFileError as e:
        return f"checkpoint file refused: {e}"
    return None


def verify_checkpoint(ckpt: Path, collective: bool = True) -> dict:
    """Check the manifest and every file's size and sha256. Collective when distributed: the
    files are hashed round-robin across ranks and the verdict is the same on every rank.
    `collective=False`: this process checks every file alone (export, tools)."""
    rank, world = (d.rank_now(), d.world_now()) if collective else (0, 1)
    manifest, errors = None, []
    try:
        with open_checkpoint(ckpt) as folder:
            manifest = read_manifest_in(folder)
            files = sorted(manifest["files"].items())
            errors = [e for name, exp in files[rank::world] if (e := check_one_file(folder, name, exp))]
    except CheckpointError as e:
        errors = [str(e)]
    everyone = [e for errs in d.all_gather_small(errors) for e in errs] if collective else errors
    if everyone:
        raise CheckpointError(sorted(everyone)[0])
    assert manifest is not None
    return manifest


def digests(folder: Folder, names: list[str]) -> dict:
    """{name: {"bytes", "sha256"}} of files this rank just wrote (for the manifest)."""
    out = {}
    for name in names:
        size = folder.regular_size(name)
        out[name] = {"bytes": size, "sha256": folder.sha256(name, size)}
    return out


def manifest_for(step: int, world_size: int, files: dict) -> dict:
    return {"format": FORMAT_TAG, "version": FORMAT_VERSION, "step": step, "world_size": world_size, "files": files}
