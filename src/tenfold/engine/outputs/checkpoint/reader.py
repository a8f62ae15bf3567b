"""Reading DCP files so that a checkpoint can neither run code nor read outside its folder.

DCP (torch 2.13) reads tensors with `torch.load(weights_only=True)`, but its `.metadata` is a
plain pickle, its non-tensor items (optimizer `param_groups`: lr, betas, ...) are read with
`torch.load(weights_only=False)`, and every storage file is opened at the `relative_path` the
metadata names, following links. The three classes here close those holes:

* `_MetadataUnpickler`: the Python docs' "restricting globals" unpickler (pickle module docs,
  "Restricting Globals"): only DCP's metadata dataclasses, `torch.Size`, dtypes and layouts may
  be constructed; `os.system` and everything else is refused.
* `SafeReader`: checks that the metadata is DCP metadata and that every storage file name is
  a plain name of a regular file inside the checkpoint folder (and listed in the manifest when
  one is given), then opens each with `O_NOFOLLOW`.
* `SafeLoadPlanner`: `torch.load(weights_only=True)` for the non-tensor items: floats, tuples
  and strings load, code does not.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tenfold.engine.outputs.checkpoint.layout import METADATA, CheckpointError
from tenfold.engine.outputs.safe_files import Folder, UnsafeFileError, check_plain_name

_MAX_METADATA_BYTES = 1 << 30

_SAFE_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout *name* to torch.strided etc.
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata dataclasses, torch.Size and dtypes may be constructed."""

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def _check_storage(metadata: Metadata, folder: Folder, listed: set[str] | None) -> None:
    """Every storage entry names a plain, regular file inside the folder (and in the manifest)."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError("its storage table is not a mapping")
    for info in storage.values():
        if not isinstance(info, _StorageInfo) or type(info.offset) is not int or type(info.length) is not int:
            raise ValueError("a storage entry is not (file, offset, length)")
        transforms = info.transform_descriptors
        if transforms is not None and not (isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)):
            raise ValueError("a storage entry's transforms are not a list of names")
        name = check_plain_name(info.relative_path, folder.path)
        if listed is not None and name not in listed:
            raise ValueError(f"storage file {name!r} is not listed in the manifest")
        st = folder.lstat(name)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise ValueError(f"storage file {name!r} is not a regular file in the checkpoint folder")


def read_safe_metadata(ckpt: str | Path, listed: set[str] | None = None) -> Metadata:
    """The checkpoint's `.metadata`, unpickled with the allow-list and checked; one
    CheckpointError naming the file for anything that is not DCP metadata of this folder."""
    path = Path(ckpt) / METADATA
    try:
        with Folder(ckpt) as folder:
            data = folder.read_bytes(METADATA, _MAX_METADATA_BYTES)
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
                raise ValueError("it is not DCP checkpoint metadata")
            _check_storage(metadata, folder, listed)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except (UnsafeFileError, pickle.UnpicklingError, ValueError) as e:
        raise CheckpointError(f"malformed checkpoint file {path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any other unpickling failure: truncated, garbage
        raise CheckpointError(f"malformed checkpoint file {path}: not DCP metadata ({type(e).__name__}: {e})") from None
    return metadata


class _NoFollowFileSystem(FileSystem):
    """DCP's local filesystem, opening files for reading with O_NOFOLLOW."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"checkpoint file refused: {path} is not a regular file")
        with os.fdopen(fd, "rb") as stream:
            yield stream


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read with the allow-list unpickler and checked
    (`read_safe_metadata`), and whose storage files are opened without following links.
    `listed`: the manifest's file names; storage files must be among them."""

    def __init__(self, path: str | Path, listed: set[str] | None = None):
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.listed = listed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_safe_metadata(self.path, self.listed)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reads non-tensor items with `torch.load(weights_only=False)`; these
    are floats, tuples and strings, so weights_only=True loads them just as well and refuses
    code."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def inner_error(e: BaseException) -> BaseException:
    """DCP wraps every rank's failure in a CheckpointException whose `failures` maps rank ->
    (exception, traceback); the first rank's exception says what went wrong."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return e
