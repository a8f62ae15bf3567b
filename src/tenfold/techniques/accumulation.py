"""Gradient accumulation with token-weighted loss.

The loss of a step is sum(token losses) / (target tokens in the WHOLE global batch, over
every micro-batch and every data-parallel rank). Dividing each micro-batch by its own
token count, or by the number of micro-batches, gives a different gradient as soon as
micro-batches carry different numbers of targets (padding, packed documents): the
gradient-accumulation bug fixed across the ecosystem in 2024 (Hugging Face transformers #34191). With this
normalisation k micro-batches of b sequences give exactly the gradient of one batch of k*b.

Data-parallel wrappers (DDP, FSDP2) average gradients over ranks, i.e. divide by dp_size; we
multiply the loss by dp_size so that their average is the global sum / global tokens. (gloo
has no PREMUL_SUM, so FSDP2's set_gradient_divide_factor cannot be used instead.)
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

from tenfold.terms import IGNORE_INDEX


def count_targets(micro_batches: list[dict]) -> int:
    return int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches))


def all_reduce_sum(value: float, group=None) -> float:
    """Sum a Python number over the ranks of `group` (identity on one process)."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    if torch_dist.get_backend(group) == "nccl":
        t = t.cuda()
    torch_dist.all_reduce(t, group=group)
    return float(t.item())


def scaled_for_backward(loss_sum: torch.Tensor, global_tokens: int, dp_size: int) -> torch.Tensor:
    """The micro-batch's share of the global mean loss, pre-multiplied by dp_size for the
    data-parallel average (see module docstring)."""
    return loss_sum * (dp_size / max(global_tokens, 1))
