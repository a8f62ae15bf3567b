"""Where the tokens come from: the default corpus, local text / JSONL files, `.bin` memmaps.

Text sources yield a list of documents (bytes), which a tokenizer turns into one token stream;
`.bin` sources are already tokens and are memory-mapped, never copied when there is one file.
Every problem with a path or its contents is a `UserError` that names the file.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tenfold.errors import UserError

# Parts of the standard library left out of the default corpus: third-party packages
# (they differ between machines, so the corpus would too), the huge test suites, caches.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
BIN_SUFFIXES = (".bin",)


@dataclass
class TextCorpus:
    """Raw documents (bytes) and a one-line name of where they came from."""

    documents: list[bytes]
    source: str
    num_bytes: int


def stdlib_python_files() -> list[Path]:
    """The running Python's standard-library `.py` files, sorted (the default corpus).

    `os.walk` with pruning, not `rglob`: a venv's site-packages can hold tens of thousands of
    files, and walking them first would cost seconds.
    """
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return [Path(f) for f in sorted(files)]


def list_data_files(path: str | Path) -> list[Path]:
    """A file -> [file]; a directory -> every non-hidden file below it, sorted by path."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"data.path: file or directory not found: {p}")
    if p.is_file():
        return [p]
    if not p.is_dir():  # a device, FIFO or socket: reading it could block or never end
        raise UserError(f"data.path: {p} is not a regular file or a folder; give a data file or a folder of them")
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        and not (f.suffix == ".json" and f.with_suffix(".bin").is_file())  # `data prepare`'s FILE.json
    )
    if not files:
        raise UserError(f"data.path: directory {p} holds no data files")
    return files


def resolve_format(files: list[Path], fmt: str) -> str:
    """`auto` picks by extension: .bin -> bin, .jsonl/.ndjson -> jsonl, anything else -> text.
    A directory must not mix pre-tokenized `.bin` files with raw text."""
    if fmt != "auto":
        return fmt
    kinds = {_format_of(f) for f in files}
    if "bin" in kinds and len(kinds) > 1:
        raise UserError(
            "data.path mixes pre-tokenized .bin files with text files; point data.path at one "
            "kind, or set data.format explicitly"
        )
    return "bin" if kinds == {"bin"} else ("jsonl" if kinds == {"jsonl"} else "mixed")


def all_text(files: list[Path]) -> bool:
    """No file is JSONL or .bin (each file is one text document)."""
    return all(_format_of(f) == "text" for f in files)


def _format_of(f: Path) -> str:
    suffix = f.suffix.lower()
    if suffix in BIN_SUFFIXES:
        return "bin"
    return "jsonl" if suffix in JSONL_SUFFIXES else "text"


def default_corpus_files() -> list[Path]:
    files = stdlib_python_files()
    if not files:
        raise UserError(
            f"the default corpus is empty: no .py files under {sysconfig.get_paths()['stdlib']}; "
            "set data.path to a text, JSONL or .bin file"
        )
    return files


def read_default_corpus(max_bytes: int | None) -> TextCorpus:
    files = default_corpus_files()
    docs, total = _read_capped(files, "text", "text", max_bytes)
    return TextCorpus(docs, f"python-stdlib ({len(docs)} files)", total)


def read_text_corpus(files: list[Path], fmt: str, jsonl_field: str, max_bytes: int | None) -> TextCorpus:
    """Read text or JSONL files (fmt = text | jsonl | mixed) up to `max_bytes` bytes in all."""
    docs, total = _read_capped(files, fmt, jsonl_field, max_bytes)
    if not docs:
        raise UserError(f"data.path: every data file is empty under {files[0].parent}")
    name = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
    return TextCorpus(docs, name, total)


def _read_capped(files: list[Path], fmt: str, jsonl_field: str, max_bytes: int | None) -> tuple[list[bytes], int]:
    """An empty file is an error when it is the only one; inside a folder (or the standard
    library, whose package `__init__.py` files are often empty) it is skipped."""
    docs: list[bytes] = []
    total = 0
    for f in files:
        raw = _read_file(f)
        if not raw.strip():
            if len(files) == 1:
                raise UserError(f"data.path: data file is empty: {f}")
            continue
        file_fmt = _format_of(f) if fmt == "mixed" else fmt
        new_docs = _jsonl_documents(raw, f, jsonl_field) if file_fmt == "jsonl" else [raw]
        for doc in new_docs:
            if max_bytes is not None and total + len(doc) >= max_bytes:
                docs.append(doc[: max_bytes - total])
                return docs, max_bytes
            docs.append(doc)
            total += len(doc)
    return docs, total


def _read_file(f: Path) -> bytes:
    try:
        return f.read_bytes()
    except FileNotFoundError:
        raise UserError(f"data.path: file not found: {f}") from None
    except OSError as e:
        raise UserError(f"data.path: cannot read {f}: {e.strerror}") from None


def _jsonl_documents(raw: bytes, f: Path, field: str) -> list[bytes]:
    """One document per JSON line's `field` (data.jsonl_field); blank lines are skipped."""
    docs = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{f}:{lineno}: invalid JSON line ({e})") from None
        if not isinstance(record, dict) or field not in record:
            raise UserError(
                f"{f}:{lineno}: JSON line has no field {field!r} (data.jsonl_field); "
                f"set data.jsonl_field to the key that holds the text"
            )
        text = record[field]
        if not isinstance(text, str):
            raise UserError(f"{f}:{lineno}: field {field!r} must be a string, got {type(text).__name__}")
        docs.append(text.encode("utf-8"))
    if not docs:
        raise UserError(f"data.path: JSONL file has no records: {f}")
    return docs


def read_bin_tokens(files: list[Path], dtype: str, max_bytes: int | None) -> np.ndarray:
    """Pre-tokenized files as one 1-D token array: a read-only memmap when there is one file
    (no copy, any size); several files are concatenated in memory."""
    np_dtype = np.dtype(dtype)
    parts = []
    for f in files:
        size = f.stat().st_size
        if size == 0:
            if len(files) == 1:
                raise UserError(f"data.path: data file is empty: {f}")
            continue
        if size % np_dtype.itemsize:
            raise UserError(
                f"data.path: {f} has {size} bytes, not a multiple of {np_dtype.itemsize} "
                f"(data.bin_dtype={dtype}); is data.bin_dtype right? allowed: uint16, uint32"
            )
        parts.append(np.memmap(f, dtype=np_dtype, mode="r"))
    if not parts:
        raise UserError(f"data.path: every data file is empty under {files[0].parent}")
    tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if max_bytes is not None:
        tokens = tokens[: max(1, max_bytes // np_dtype.itemsize)]
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str, chunk: int = 1 << 24) -> int:
    """Largest token id, scanned in chunks (a memmap is never loaded whole); an id at or above
    the model's vocabulary would index past the embedding table, so it is a `UserError`."""
    largest = 0
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start : start + chunk])
        block_max = int(block.max())
        if block_max >= vocab_size:
            pos = start + int(np.argmax(block >= vocab_size))
            raise UserError(
                f"{source}: token id {int(tokens[pos])} at position {pos} is >= the model's "
                f"vocabulary size {vocab_size} (model.vocab_size); wrong data.bin_dtype or model?"
            )
        largest = max(largest, block_max)
    return largest
