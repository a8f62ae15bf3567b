"""Hugging Face `datasets` as a record source, offline: local parquet / JSON / arrow files,
`save_to_disk` folders, and dataset names already in the local cache (`hf:NAME[:CONFIG]`).

`datasets` is an optional dependency (`pip install 'tenfold[data]'`), imported only here and
only when such a path is given. HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before the
import, so a name missing from the cache is an error, never a download.
"""

from __future__ import annotations

import os
from pathlib import Path

from tenfold.data.records import RecordSource
from tenfold.errors import UserError

HF_PREFIX = "hf:"
# File suffix -> the `datasets` packaged builder that reads it.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}
EXTRA_HINT = "pip install 'tenfold[data]' (datasets>=2.16)"


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise UserError(f"this data.path needs the Hugging Face datasets package: {EXTRA_HINT}") from None
    # Also when datasets was imported before the variables were set (it reads them at import).
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()  # tenfold draws its own progress
    datasets.logging.set_verbosity_error()
    return datasets


def is_saved_dataset(path: Path) -> bool:
    """A `Dataset.save_to_disk` / `DatasetDict.save_to_disk` folder."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def builder_of(files: list[Path]) -> str | None:
    """The `datasets` builder when every file is parquet, arrow or (one-document) JSON."""
    kinds = {BUILDERS.get(f.suffix.lower()) for f in files}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def open_dataset(path: str, files: list[Path] | None, split: str, streaming: bool) -> RecordSource:
    """A RecordSource over a dataset: a save_to_disk folder, data files of one builder, or a
    cached name. `streaming` reads files lazily (no arrow cache is built)."""
    ds = _datasets()
    try:
        if path.startswith(HF_PREFIX):
            name, _, config = path[len(HF_PREFIX):].partition(":")
            dataset = ds.load_dataset(name, config or None, split=split, streaming=streaming)
            label = f"{path} [{split}] (local cache)"
        elif is_saved_dataset(Path(path)):
            dataset = _pick_split(ds.load_from_disk(path), split, path)
            label = f"{path} (datasets save_to_disk)"
        else:
            builder = builder_of(files or [])
            dataset = ds.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=streaming)
            label = f"{path} ({builder}, {len(files)} file(s))"
    except UserError:
        raise
    except (FileNotFoundError, ConnectionError, ValueError, OSError) as e:
        where = "the local datasets cache (nothing is downloaded)" if path.startswith(HF_PREFIX) else "datasets"
        raise UserError(f"data.path {path}: cannot be read by {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return RecordSource("dataset", label, dataset=dataset)


def _pick_split(loaded, split: str, path: str):
    if not hasattr(loaded, "keys"):  # a single Dataset
        return loaded
    if split not in loaded:
        raise UserError(f"data.path {path}: no split {split!r} (data.split); the folder has: {', '.join(loaded)}")
    return loaded[split]
