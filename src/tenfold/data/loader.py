"""The resumable, split-independent loader.

Order rule (so that 1 x 4 and 4 x 1 micro-batches, or 2 ranks and 1 rank, see the same data):
  * epoch e visits the sequences in `default_rng([seed, e]).permutation(N)`;
  * global batch k is the next `global_batch` indices of that permutation; a tail shorter
    than a global batch is dropped and epoch e + 1 starts (each sample at most once per epoch);
  * in a global batch of G = micro_batch * grad_accum * dp_size rows, micro-step j of rank r
    takes rows [j * micro_batch * dp_size + r * micro_batch, ... + micro_batch).
So concatenating the micro-batches in (micro-step, rank) order gives the global batch in
permutation order, whatever the split. The position is counted in global samples, which is
why a state saved with one dp_size / micro_batch resumes with another at the same sample.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from tenfold.errors import UserError


def to_batch(rows: np.ndarray) -> dict[str, torch.Tensor]:
    """[B, seq_len + 1] token rows -> int64 `input_ids` = rows[:, :-1], `labels` = rows[:, 1:]
    (CPU tensors; the trainer moves them). Fine-tuning rows (`ExampleRows`) make their own
    batch: labels masked outside the targets, and position_ids."""
    if hasattr(rows, "to_batch"):
        return rows.to_batch()
    t = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


def check_batch_split(global_batch: int, micro_batch: int, grad_accum: int, dp_rank: int, dp_size: int) -> None:
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch),
                    ("grad_accum", grad_accum), ("dp_size", dp_size)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if global_batch != micro_batch * grad_accum * dp_size:
        raise ValueError(
            f"global_batch {global_batch} != micro_batch {micro_batch} * grad_accum "
            f"{grad_accum} * dp_size {dp_size}"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")


class GlobalBatchLoader:
    def __init__(
        self,
        sequences,
        global_batch: int,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ):
        check_batch_split(global_batch, micro_batch, grad_accum, dp_rank, dp_size)
        if global_batch > len(sequences):
            raise UserError(
                f"the global batch ({global_batch} sequences = micro_batch {micro_batch} x "
                f"grad_accum {grad_accum} x data-parallel {dp_size}) is larger than the training "
                f"set ({len(sequences)} sequences); use a smaller batch, a shorter --seq-len or more data"
            )
        self.sequences = sequences
        self.global_batch, self.micro_batch, self.grad_accum = global_batch, micro_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.epoch = 0
        self.index_in_epoch = 0  # samples of this epoch's permutation already consumed
        self.samples_seen = 0  # global samples consumed since the start, all ranks together
        self.steps = 0
        self.last_global_indices: np.ndarray | None = None  # the whole global batch of the last step
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    # ------------------------------------------------------------------ order

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))
            self._perm_epoch = epoch
        return self._perm

    def _next_global_indices(self) -> np.ndarray:
        if self.index_in_epoch + self.global_batch > len(self.sequences):
            self.epoch += 1
            self.index_in_epoch = 0
        start = self.index_in_epoch
        indices = self._permutation(self.epoch)[start : start + self.global_batch]
        self.index_in_epoch += self.global_batch
        self.samples_seen += self.global_batch
        self.steps += 1
        return indices

    def rank_rows(self, global_indices: np.ndarray, micro_step: int) -> np.ndarray:
        """This rank's rows of micro-step `micro_step` (the order rule in the module doc)."""
        start = micro_step * self.micro_batch * self.dp_size + self.dp_rank * self.micro_batch
        return global_indices[start : start + self.micro_batch]

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """`grad_accum` micro-batches of this rank for the next optimizer step."""
        indices = self._next_global_indices()
        self.last_global_indices = indices
        return [to_batch(self.sequences[self.rank_rows(indices, j)]) for j in range(self.grad_accum)]

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        """Plain ints (JSON-safe). The position is in global samples, not in per-rank batches,
        so it does not depend on dp_size or on the micro-batch split."""
        return {
            "epoch": self.epoch,
            "index_in_epoch": self.index_in_epoch,
            "samples_seen": self.samples_seen,
            "steps": self.steps,
            "seed": self.seed,
            "num_sequences": len(self.sequences),
        }

    def load_state_dict(self, state: dict) -> None:
        # Refuse a position in other data or another order: continuing silently would
        # repeat or skip samples.
        if state.get("kind") == "stream":
            raise UserError("the saved data position is for streamed data (data.streaming=true); "
                            "resume with the same data settings")
        if int(state["num_sequences"]) != len(self.sequences):
            raise UserError(
                f"the saved data position is for {state['num_sequences']} training sequences but "
                f"this data has {len(self.sequences)}; resume with the same data, data.seq_len, "
                "data.val_fraction and data.max_bytes"
            )
        if int(state["seed"]) != self.seed:
            raise UserError(
                f"the saved data position is for seed {state['seed']} but this run's seed is "
                f"{self.seed}; resume with train.seed={state['seed']}"
            )
        self.epoch = int(state["epoch"])
        self.index_in_epoch = int(state["index_in_epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.steps = int(state["steps"])


def iter_eval(
    sequences, batch_size: int, max_batches: int | None = None, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """Validation batches: the first `max_batches * batch_size * dp_size` validation sequences,
    in order (no shuffling, so every evaluation scores the same tokens). With dp_size > 1,
    rank r takes rows [b * batch_size * dp_size + r * batch_size, ... + batch_size) of round b:
    the union over ranks equals the single-process evaluation set. With several ranks a final
    partial round is dropped so every rank yields the same number of batches; one process
    keeps a final short batch (a small validation set is still scored)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    per_round = batch_size * dp_size
    rounds = -(-len(sequences) // per_round) if dp_size == 1 else len(sequences) // per_round
    if max_batches is not None:
        rounds = min(rounds, max_batches)
    for b in range(rounds):
        start = (b * dp_size + dp_rank) * batch_size
        yield to_batch(sequences[start : start + batch_size])
