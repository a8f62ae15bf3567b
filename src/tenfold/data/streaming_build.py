"""`data.streaming = true`: a DataBundle whose training rows are read lazily (`RowStream`).

Validation: record i is held out when i % k == k - 1, k = round(1 / data.val_fraction), so the
two sets never share a document; the first `STREAM_VAL_ROWS` validation rows are read once, at
setup, and kept in memory (every evaluation scores the same rows).
"""

from __future__ import annotations

from itertools import islice

import numpy as np

from tenfold.data.bundle import DataBundle
from tenfold.data.examples import ExampleRows, example_rows
from tenfold.data.packing import text_rows
from tenfold.data.records import FINETUNE_FORMATS, RecordSource
from tenfold.data.stream import RowStream
from tenfold.errors import UserError

STREAM_VAL_ROWS = 256


def val_every(val_fraction: float) -> int | None:
    """k of the module docstring (None: no validation)."""
    return max(2, round(1 / val_fraction)) if val_fraction > 0 else None


def stream_bundle(source: RecordSource, fmt: str, tokenizer, data_cfg, seq_len: int) -> DataBundle:
    if data_cfg.max_bytes is not None:
        raise UserError("data.max_bytes caps what is read into memory; a streamed run reads as far as "
                        "train.steps takes it: drop data.max_bytes, or set data.streaming=false")
    width = seq_len + 1
    k = val_every(data_cfg.val_fraction)

    def is_val(i: int) -> bool:
        return k is not None and i % k == k - 1

    def is_train(i: int) -> bool:
        return not is_val(i)

    if fmt in FINETUNE_FORMATS:
        def read(pos, keep):
            return example_rows(source, fmt, tokenizer, width, data_cfg.packing, start=pos[0], keep=keep)
        stack = ExampleRows.stack
    else:
        firsts = {keep: _first_index(source, keep) for keep in (is_train, is_val)}

        def read(pos, keep):
            return text_rows(source, tokenizer, width, data_cfg.jsonl_field, start=pos, keep=keep, first=firsts[keep])

        def stack(rows):
            return np.stack(rows) if rows else np.zeros((0, width), dtype=np.int64)
    val_rows = [row for row, _ in islice(read((0, 0), is_val), STREAM_VAL_ROWS)] if k else []
    stream = RowStream(read=lambda pos: read(pos, is_train), stack=stack, start=(0, 0), width=width, name=source.name)
    return DataBundle(
        None, stack(val_rows), tokenizer.vocab_size, tokenizer, source.name, None, seq_len, fmt,
        stream=stream, shuffle_block=data_cfg.shuffle_block, packing=data_cfg.packing,
    )


def _first_index(source: RecordSource, keep) -> int:
    """The first record of a stream: the only one without a separator before it."""
    return next((i for i, _ in source.records() if keep(i)), 0)
