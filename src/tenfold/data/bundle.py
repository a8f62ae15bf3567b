"""`DataBundle`: what `build_data` (tenfold.data.build) and a streamed build
(tenfold.data.streaming_build) hand the loaders and the trainer."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenfold.data.examples import ExampleRows, PackStats, model_masks_packed_examples
from tenfold.data.records import FINETUNE_FORMATS
from tenfold.models.specs import spec_for


@dataclass
class DataBundle:
    """Packed rows ([N, seq_len + 1] arrays, possibly memmap views, or `ExampleRows` for
    fine-tuning formats) and how they were made. `train` and `val` never share a token. A
    streaming bundle has `stream` (read by `StreamingLoader`) instead of `train`."""

    train: Any
    val: Any
    vocab_size: int
    tokenizer: Any  # encode(str) -> list[int], decode(ids) -> str, describe(), save(folder)
    source: str
    num_tokens: int | None
    seq_len: int
    format: str = "text"
    stream: Any = None
    shuffle_block: int = 1024
    pack_stats: PackStats | None = None
    packing: bool = True
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line (plus the packing line of fine-tuning data) for the run header."""
        tok = f"tokenizer {self.tokenizer.name} (vocab {self.vocab_size})"
        if self.stream is not None:
            line = (f"{self.source} | {self.format}, streamed (shuffled in blocks of {self.shuffle_block} rows) | "
                    f"rows of {self.seq_len}+1 | {len(self.val):,} val rows | {tok}")
        else:
            what = "target tokens" if self.fine_tuning else "tokens"
            line = (f"{self.source} | {self.format} | {self.num_tokens:,} {what} | {len(self.train):,} train + "
                    f"{len(self.val):,} val sequences of {self.seq_len}+1 | {tok}")
        return "\n".join([line, *self.notes])

    @property
    def fine_tuning(self) -> bool:
        return self.format in FINETUNE_FORMATS

    def packing_note(self, masks_examples: bool) -> str | None:
        """The run header's line on how examples share rows (None for plain text)."""
        if not self.fine_tuning:
            return None
        how = "packed whole into rows" if self.packing else "one per row"
        stats = (self.pack_stats.describe(self.seq_len + 1, self.packing) if self.pack_stats
                 else f"examples {how} of {self.seq_len + 1} ids, as they stream")
        if not self.packing:
            return f"packing: off, {stats}; no example sees another"
        if masks_examples:
            return f"packing: {stats}; attention masked per example (position_ids restart at each)"
        return (f"packing: {stats}; attention crosses example boundaries inside a row (this model takes "
                "no document mask; data.packing=false gives one example per row)")

    def fit_to_model(self, model, kind: str, device) -> None:
        """Fine-tuning rows: batches carry position_ids only if this model masks attention by
        them (checked on the model itself), and the run header says which applies."""
        if not self.fine_tuning:
            return
        masks = self.packing and spec_for(kind).hugging_face and model_masks_packed_examples(model, self.vocab_size, device)
        self.use_positions(bool(masks))
        self.notes = [self.packing_note(bool(masks))]

    def use_positions(self, flag: bool) -> None:
        """Whether batches carry position_ids (only for a model that masks by them)."""
        for rows in (self.train, self.val):
            if isinstance(rows, ExampleRows):
                rows.with_positions = flag
        if self.stream is not None and self.fine_tuning:
            self.stream.stack = functools.partial(ExampleRows.stack, with_positions=flag)

    def tokenizer_record(self) -> dict:
        return self.tokenizer.describe() if hasattr(self.tokenizer, "describe") else {"name": self.tokenizer.name}

    def save_tokenizer(self, folder: str | Path) -> Path | None:
        """Write the tokenizer's files into `folder` (None when there is nothing to write)."""
        return self.tokenizer.save(folder) if hasattr(self.tokenizer, "save") else None
