"""The language-model objective every model is trained with: next-token cross-entropy summed
over the positions that carry a target. Labels are already shifted (labels[t] is the token
after input_ids[t]); positions labelled IGNORE_INDEX (padding, prompt tokens of a fine-tuning
example) carry no loss and are not counted."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tenfold.terms import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over positions that carry a target, in fp32."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return replicated_value(loss)


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor. Logits split over the vocabulary (a DTensor, tensor
    parallelism under `loss_parallel`) give a replicated DTensor loss: every rank already
    holds the whole value, and autograd flows through `to_local` back into the DTensor graph."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
