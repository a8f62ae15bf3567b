"""A user's own packed token rows (`Trainer(dataset=array)`): an int array or tensor of shape
(sequences, seq_len + 1), split into training and validation rows like any other source."""

from __future__ import annotations

import numpy as np
import torch

from tenfold.errors import UserError


class ArrayBundle:
    def __init__(self, train, val, vocab_size: int):
        self.train, self.val, self.vocab_size = train, val, vocab_size

    def describe(self) -> str:
        return f"user dataset: {len(self.train)} train / {len(self.val)} val sequences"


def bundle_from_array(data, val_fraction: float) -> ArrayBundle:
    arr = np.asarray(data.numpy() if isinstance(data, torch.Tensor) else data)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise UserError(
            f"dataset must be an integer array of shape (sequences, seq_len + 1), got shape {arr.shape}"
        )
    n_val = int(len(arr) * val_fraction)
    train, val = (arr[: len(arr) - n_val], arr[len(arr) - n_val :]) if n_val else (arr, arr[:0])
    return ArrayBundle(train, val, int(arr.max()) + 1)
