"""Records, read lazily from where they live, and what shape they have.

A `RecordSource` yields `(index, record)` from any record index on, without reading what
comes before it into memory: that index is the position a streaming run's checkpoint stores.
A record is the bytes of a text file, or a dict (a JSONL line, a Hugging Face `datasets` row).

Shapes (`data.format`, detected from the first record when `auto`):
  text               a file is one document
  jsonl              a dict whose `data.jsonl_field` (default "text") is the document
  prompt-completion  {"prompt": str, "completion": str}: the loss is on the completion only
  chat               {"messages": [{"role": ..., "content": ...}, ...]}: the loss is on the
                     assistant turns, rendered with the tokenizer's chat template
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tenfold.errors import UserError

FINETUNE_FORMATS = ("prompt-completion", "chat")


@dataclass
class RecordSource:
    """Where records come from: `files` (text or JSONL, by `kind`) or a `datasets` dataset."""

    kind: str  # "text" | "jsonl" | "dataset"
    name: str
    files: list[Path] = field(default_factory=list)
    dataset: Any = None

    def records(self, start: int = 0) -> Iterator[tuple[int, Any]]:
        if self.kind == "dataset":
            return _dataset_records(self.dataset, start)
        if self.kind == "jsonl":
            return _jsonl_records(self.files, start)
        return _text_records(self.files, start)

    def first_record(self) -> tuple[int, Any]:
        """(index, record) of the first record; a UserError when there is none."""
        for index, record in self.records():
            return index, record
        if len(self.files) == 1:
            raise UserError(f"data.path: data file is empty: {self.files[0]}")
        raise UserError(f"data.path: {self.name} holds no records (every file is empty)")


def _text_records(files: list[Path], start: int) -> Iterator[tuple[int, bytes]]:
    """Record i is file i; empty files are skipped (as the in-memory reader does)."""
    for index in range(start, len(files)):
        raw = files[index].read_bytes()
        if raw.strip():
            yield index, raw


def _jsonl_records(files: list[Path], start: int) -> Iterator[tuple[int, dict]]:
    """One record per non-blank line, parsed only from `start` on."""
    index = 0
    for f in files:
        with open(f, "rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                if index >= start:
                    yield index, parse_json_line(line, f, lineno)
                index += 1


def parse_json_line(line: bytes, f: Path | str, lineno: int) -> dict:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{f}:{lineno}: invalid JSON line ({e})") from None
    if not isinstance(record, dict):
        raise UserError(f"{f}:{lineno}: a JSON line must be an object, got {type(record).__name__}")
    return record


def _dataset_records(dataset, start: int) -> Iterator[tuple[int, dict]]:
    # Dataset.skip / IterableDataset.skip: an arrow dataset seeks, a streamed one reads past.
    rows = dataset.skip(start) if start else dataset
    for offset, row in enumerate(rows):
        yield start + offset, row


def detect_format(record: Any, where: str, text_field: str) -> str:
    """The shape of one record (the module docstring); a UserError names what is allowed."""
    if isinstance(record, bytes):
        return "text"
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    if text_field in record:
        return "jsonl"
    raise UserError(
        f"{where}: JSON records have no field {text_field!r} (data.jsonl_field) and are not prompt/completion "
        f"or chat records (their fields: {', '.join(sorted(record)[:8])}); allowed: a text field named by "
        "data.jsonl_field, 'prompt' + 'completion', or 'messages'"
    )


def record_text(record: Any, text_field: str, where: str) -> str | bytes:
    """The document of a text or jsonl record."""
    if isinstance(record, bytes):
        return record
    if text_field not in record:
        raise UserError(f"{where}: record has no field {text_field!r} (data.jsonl_field); "
                        "set data.jsonl_field to the key that holds the text")
    text = record[text_field]
    if not isinstance(text, str):
        raise UserError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    return text
