"""Fine-tuning examples: prompt/completion and chat records -> token rows with a loss mask.

An example is its ids and, per id, whether it is a target (trained on). Prompt tokens, the
user/system turns of a chat and the template's markup around them are not targets; the
completion (or assistant turn) and the EOS / end-of-turn after it are, so a model learns to
stop. A target id is predicted from the position before it, so `labels = IGNORE_INDEX`
wherever the next id is not a target, and the first id of every example is never a target
(nothing of the example precedes it).

Rows: examples are packed whole, in order, into rows of seq_len + 1 ids (`data.packing`,
default on; off: one example per row) and padded at the end (padding is never a target). An
example longer than a row is cut to the row. Each row records which example every id belongs
to (`segments`, 0 = padding), from which `position_ids` restart at 0 for each example: a
Hugging Face model turns restarting position_ids into a block-diagonal causal mask
(transformers' packed-sequence detection, `masking_utils.find_packed_sequence_indices`), so
an example attends only to itself. tenfold's own GPT takes no document mask: with it,
attention crosses example boundaries inside a row (the run header says which applies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from tenfold.terms import IGNORE_INDEX
from tenfold.data.records import RecordSource
from tenfold.errors import UserError


@dataclass
class ExampleRows:
    """Packed fine-tuning rows: ids, target flags and example numbers, each [N, seq_len + 1].
    Indexing returns ExampleRows (so the loaders slice it like an array of rows)."""

    tokens: np.ndarray
    targets: np.ndarray
    segments: np.ndarray
    with_positions: bool = True  # pass position_ids (the model masks attention per example)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tokens.shape

    def __getitem__(self, idx) -> "ExampleRows":
        return ExampleRows(self.tokens[idx], self.targets[idx], self.segments[idx], self.with_positions)

    def to_batch(self) -> dict[str, torch.Tensor]:
        """input_ids = ids[:, :-1]; labels = ids[:, 1:] where a target, else IGNORE_INDEX;
        position_ids restart at every example (see the module docstring)."""
        ids = torch.from_numpy(np.asarray(self.tokens, dtype=np.int64))
        labels = ids[:, 1:].clone()
        labels[~torch.from_numpy(np.asarray(self.targets[:, 1:], dtype=bool))] = IGNORE_INDEX
        batch = {"input_ids": ids[:, :-1].contiguous(), "labels": labels}
        if self.with_positions:
            batch["position_ids"] = torch.from_numpy(positions_of(np.asarray(self.segments)[:, :-1]))
        return batch

    @classmethod
    def stack(cls, rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], with_positions: bool = True) -> "ExampleRows":
        if not rows:
            empty = np.zeros((0, 0), dtype=np.int64)
            return cls(empty, empty.astype(bool), empty, with_positions)
        tokens, targets, segments = (np.stack([r[k] for r in rows]) for k in range(3))
        return cls(tokens, targets, segments, with_positions)


def positions_of(segments: np.ndarray) -> np.ndarray:
    """Per row, each id's offset from the start of its run of equal segment numbers."""
    n, width = segments.shape
    col = np.broadcast_to(np.arange(width), (n, width))
    boundary = np.diff(segments, axis=1, prepend=np.full((n, 1), -1)) != 0
    start = np.maximum.accumulate(np.where(boundary, col, 0), axis=1)
    return (col - start).astype(np.int64)


@dataclass
class PackStats:
    examples: int = 0
    truncated: int = 0  # cut to the row length
    skipped: int = 0  # no target left after the cut (a prompt longer than a row)
    rows: int = 0
    target_tokens: int = 0
    notes: list = field(default_factory=list)

    def describe(self, width: int, packing: bool) -> str:
        how = "packed whole into rows" if packing else "one per row"
        text = f"{self.examples:,} examples {how} of {width} ids, {self.rows:,} rows"
        if self.truncated:
            text += f"; {self.truncated:,} longer than a row were cut"
        if self.skipped:
            text += f"; {self.skipped:,} skipped (prompt longer than a row, nothing to train on)"
        return text


def example_ids(record, fmt: str, tok, where: str) -> tuple[list[int], list[bool]]:
    """One record -> (ids, is-target per id)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: data.format={fmt} needs JSON records, got a text file")
    if fmt == "prompt-completion":
        prompt, completion = _string(record, "prompt", where), _string(record, "completion", where)
        head = tok.prompt_ids(prompt) if hasattr(tok, "prompt_ids") else tok.encode(prompt)
        tail = tok.encode(completion) + ([tok.eot_id] if tok.eot_id is not None else [])
        ids, targets = head + tail, [False] * len(head) + [True] * len(tail)
    else:
        ids, targets = _chat_ids(record, tok, where)
    if targets:
        targets[0] = False  # predicted from the previous example's last id: never a target
    return ids, targets


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise UserError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _chat_ids(record: dict, tok, where: str) -> tuple[list[int], list[bool]]:
    if not hasattr(tok, "render_chat"):
        raise UserError(f"data.format=chat needs a tokenizer with a chat template; {tok.name} has none "
                        "(pass --tokenizer PATH to a Hugging Face tokenizer folder)")
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise UserError(f"{where}: 'messages' must be a list of {{\"role\": str, \"content\": str}} objects")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: a chat record needs at least one 'assistant' message (the loss is on those)")
    text, spans = tok.render_chat(messages)
    ids, offsets = tok.encode_with_offsets(text)
    targets = [any(begin < span_end and span_begin < end for span_begin, span_end in spans) for begin, end in offsets]
    return ids, targets


def example_rows(
    source: RecordSource, fmt: str, tok, width: int, packing: bool,
    start: int = 0, keep=lambda i: True, stats: PackStats | None = None,
) -> Iterator[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, int]]]:
    """Rows (ids, targets, segments) from record `start` on, each with where the next row
    starts: (record index, 0). A row always starts at an example."""
    stats = stats if stats is not None else PackStats()
    ids_buf: list[int] = []
    tgt_buf: list[bool] = []
    seg_buf: list[int] = []
    index = start
    for index, record in source.records(start):
        if not keep(index):
            continue
        ids, targets = example_ids(record, fmt, tok, f"{source.name} record {index}")
        stats.examples += 1
        if len(ids) > width:
            ids, targets = ids[:width], targets[:width]
            stats.truncated += 1
        if not any(targets):
            stats.skipped += 1
            continue
        if ids_buf and (not packing or len(ids_buf) + len(ids) > width):
            yield _padded(ids_buf, tgt_buf, seg_buf, width, tok, stats), (index, 0)
            ids_buf, tgt_buf, seg_buf = [], [], []
        segment = (seg_buf[-1] + 1) if seg_buf else 1
        ids_buf += ids
        tgt_buf += targets
        seg_buf += [segment] * len(ids)
    if ids_buf:
        yield _padded(ids_buf, tgt_buf, seg_buf, width, tok, stats), (index + 1, 0)


def _padded(ids, targets, segments, width, tok, stats: PackStats):
    pad = width - len(ids)
    pad_id = tok.eot_id if getattr(tok, "eot_id", None) is not None else 0
    stats.rows += 1
    stats.target_tokens += sum(targets[1:])
    return (
        np.asarray(ids + [pad_id] * pad, dtype=np.int64),
        np.asarray(targets + [False] * pad, dtype=bool),
        np.asarray(segments + [0] * pad, dtype=np.int32),
    )


# --------------------------------------------------------------------------- the model side


@torch.no_grad()
def model_masks_packed_examples(model: torch.nn.Module, vocab_size: int, device) -> bool:
    """Does this Hugging Face model confine attention to each example when position_ids
    restart? Checked on the model itself (before any wrapping): the second of two packed
    3-token examples must give the logits it gives alone."""
    ids = torch.randint(0, max(vocab_size, 2), (1, 6), generator=torch.Generator().manual_seed(0)).to(device)
    packed_pos = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=ids, position_ids=packed_pos, use_cache=False).logits[:, 3:]
        alone = model(input_ids=ids[:, 3:], position_ids=packed_pos[:, :3], use_cache=False).logits
    except (TypeError, ValueError, RuntimeError):  # a model without position_ids support
        return False
    finally:
        model.train(was_training)
    return bool(torch.allclose(packed.float(), alone.float(), rtol=1e-4, atol=1e-4))
