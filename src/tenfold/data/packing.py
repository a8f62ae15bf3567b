"""Pack a token stream into fixed-length sequences and hold out a validation split."""

from __future__ import annotations

import math

import numpy as np

from tenfold.errors import UserError


def pack_sequences(tokens: np.ndarray, seq_len: int, source: str) -> np.ndarray:
    """[N, seq_len + 1] non-overlapping windows of the stream (a view, no copy; a memmap
    stays a memmap). Row i gives inputs row[:-1] and labels row[1:]. The tail shorter than
    one window is dropped. Windows do not share tokens, so a train/val cut between two rows
    leaks nothing."""
    width = seq_len + 1
    n = len(tokens) // width
    if n == 0:
        raise UserError(
            f"{source}: {len(tokens)} tokens is too little data for one sequence of "
            f"seq_len + 1 = {width} tokens; use more data or a smaller --seq-len"
        )
    return tokens[: n * width].reshape(n, width)


def split_train_val(sequences: np.ndarray, val_fraction: float, source: str) -> tuple[np.ndarray, np.ndarray]:
    """The last ceil(N * val_fraction) sequences are validation, the rest training.

    A contiguous tail (not a random subset) keeps both splits memmap views and makes the
    split independent of the seed, so changing the seed never moves data between them."""
    n = len(sequences)
    n_val = math.ceil(n * val_fraction) if val_fraction > 0 else 0
    if n - n_val < 1:
        raise UserError(
            f"{source}: only {n} sequence(s) of seq_len + 1 = {sequences.shape[1]} tokens, too "
            f"few to hold out data.val_fraction={val_fraction} for validation; use more data, "
            "a smaller --seq-len, or data.val_fraction=0"
        )
    return sequences[: n - n_val], sequences[n - n_val :]


def text_rows(source, tok, width: int, text_field: str, start: tuple[int, int] = (0, 0),
              keep=lambda i: True, first: int = 0):
    """Streamed `pack_sequences`: rows of `width` ids cut from the documents of `source` from
    record `start[0]`, id `start[1]` on, each with where the next row starts (record, id).
    Document i is `tok.document_ids(text, i != first)`, so the rows equal those of the
    in-memory path (a separator between documents, none before the first). The tail shorter
    than a row is dropped."""
    from tenfold.data.records import record_text

    buf: list[int] = []
    for i, record in source.records(start[0]):
        if not keep(i):
            continue
        ids = tok.document_ids(record_text(record, text_field, f"{source.name} record {i}"), int(i != first))
        k = start[1] if i == start[0] else 0
        while k < len(ids):
            take = min(width - len(buf), len(ids) - k)
            buf += ids[k : k + take]
            k += take
            if len(buf) == width:
                yield np.asarray(buf, dtype=np.int64), (i, k)
                buf = []
