"""Streaming: corpora larger than memory, read in order, with an exact resume.

Rows are read lazily from a `RowStream` (documents -> ids -> rows, nothing held but one
block) and shuffled within blocks of `data.shuffle_block` rows: block b of epoch e is permuted
by `default_rng([seed, e, b])`. Global batches take the next `global_batch` rows of that
order and are split over micro-steps and ranks by `GlobalBatchLoader`'s rule, so the split
does not change the data. Every rank reads the whole stream and keeps its own rows.

The position a checkpoint stores is (epoch, the record and id where the current block
starts, the block's number, the rows of it already used). A resume re-reads that one block
from its start (the same ids, the same permutation) and skips the used rows: exactly the
rows an uninterrupted run would have seen next, on any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from tenfold.data.loader import check_batch_split, to_batch
from tenfold.errors import UserError

Position = tuple[int, int]  # (record index, id offset inside that record's ids)


@dataclass
class RowStream:
    """`read(position)` yields (row, position of the next row); `stack(rows)` makes the rows
    one batch object (an int array, or ExampleRows)."""

    read: Callable[[Position], Iterator[tuple[Any, Position]]]
    stack: Callable[[list], Any]
    start: Position
    width: int
    name: str


class StreamingLoader:
    def __init__(self, stream: RowStream, global_batch: int, micro_batch: int, grad_accum: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, block_rows: int = 1024):
        check_batch_split(global_batch, micro_batch, grad_accum, dp_rank, dp_size)
        self.stream, self.block_rows, self.seed = stream, block_rows, seed
        self.global_batch, self.micro_batch, self.grad_accum = global_batch, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch = 0
        self.block_start: Position = stream.start
        self.block_index = 0
        self.index_in_block = 0
        self.epoch_steps = 0  # global batches made in this epoch (an empty epoch is an error)
        self.samples_seen = 0
        self.steps = 0
        self._rows: list | None = None  # the current block, permuted
        self._block_end: Position = stream.start
        self._reader: Iterator | None = None  # open where the current block ends

    # ------------------------------------------------------------------ order

    def _load_block(self) -> None:
        if self._reader is None:
            self._reader = self.stream.read(self.block_start)
        rows, end = [], self.block_start
        for row, end in self._reader:
            rows.append(row)
            if len(rows) == self.block_rows:
                break
        perm = np.random.default_rng([self.seed, self.epoch, self.block_index]).permutation(len(rows))
        self._rows, self._block_end = [rows[i] for i in perm], end

    def _next_row(self):
        """The next row in block-shuffled order, or None at the end of the stream."""
        if self._rows is not None and self.index_in_block == len(self._rows):
            self.block_start, self.block_index, self.index_in_block = self._block_end, self.block_index + 1, 0
            self._rows = None
        if self._rows is None:
            self._load_block()
        if not self._rows:
            return None
        self.index_in_block += 1
        return self._rows[self.index_in_block - 1]

    def _new_epoch(self) -> None:
        if self.epoch_steps == 0:
            raise UserError(
                f"{self.stream.name}: the stream holds fewer rows than one global batch "
                f"({self.global_batch} sequences); use a smaller batch, a shorter --seq-len or more data")
        self.epoch, self.epoch_steps = self.epoch + 1, 0
        self.block_start, self.block_index, self.index_in_block = self.stream.start, 0, 0
        self._rows, self._reader = None, None

    def next_global_rows(self) -> list:
        rows: list = []
        while len(rows) < self.global_batch:
            row = self._next_row()
            if row is None:  # a tail shorter than a global batch is dropped, as in memory
                self._new_epoch()
                rows = []
                continue
            rows.append(row)
        self.epoch_steps += 1
        self.samples_seen += self.global_batch
        self.steps += 1
        return rows

    def next_step(self) -> list[dict]:
        rows = self.next_global_rows()
        out = []
        for j in range(self.grad_accum):  # GlobalBatchLoader.rank_rows's rule
            first = j * self.micro_batch * self.dp_size + self.dp_rank * self.micro_batch
            out.append(to_batch(self.stream.stack(rows[first : first + self.micro_batch])))
        return out

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        return {
            "kind": "stream", "epoch": self.epoch, "block_start": list(self.block_start),
            "block_index": self.block_index, "index_in_block": self.index_in_block,
            "epoch_steps": self.epoch_steps, "samples_seen": self.samples_seen, "steps": self.steps,
            "seed": self.seed, "block_rows": self.block_rows, "width": self.stream.width,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "stream":
            raise UserError("the saved data position is for in-memory data, this run streams "
                            "(data.streaming); resume with the same data settings")
        for key, mine in (("seed", self.seed), ("block_rows", self.block_rows), ("width", self.stream.width)):
            if int(state[key]) != mine:
                raise UserError(
                    f"the saved data position is for {key} {state[key]} but this run has {mine} "
                    "(train.seed, data.shuffle_block, data.seq_len); resume with the same settings")
        self.epoch, self.block_index = int(state["epoch"]), int(state["block_index"])
        self.block_start = (int(state["block_start"][0]), int(state["block_start"][1]))
        self.index_in_block, self.epoch_steps = int(state["index_in_block"]), int(state["epoch_steps"])
        self.samples_seen, self.steps = int(state["samples_seen"]), int(state["steps"])
        self._rows, self._reader = None, None
        if self.index_in_block:  # re-read the current block; its first rows were used
            used = self.index_in_block
            self._load_block()
            self.index_in_block = min(used, len(self._rows))


def make_loader(bundle, global_batch: int, micro_batch: int, grad_accum: int,
                dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
    """The loader a DataBundle asks for: streaming, or the in-memory permutation loader."""
    from tenfold.data.loader import GlobalBatchLoader

    stream = getattr(bundle, "stream", None)
    if stream is not None:
        return StreamingLoader(stream, global_batch, micro_batch, grad_accum, dp_rank, dp_size, seed,
                               block_rows=bundle.shuffle_block)
    return GlobalBatchLoader(bundle.train, global_batch, micro_batch, grad_accum, dp_rank, dp_size, seed)
