"""ZeRO stages 0-3 on PyTorch's own sharding (DDP, ZeroRedundancyOptimizer, FSDP2).

PLACEHOLDER for one process only, replaced by the ZeRO work (issue 5): with a single
process there is nothing to shard, so every stage is the plain model.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from tenfold.errors import UserError


def apply_zero(model: nn.Module, parallel_cfg, dist, param_dtype: torch.dtype | None = None) -> nn.Module:
    if dist.dp_size > 1:
        raise UserError("data parallelism is not available yet in this build (issue 5)")
    return model


def build_optimizer_for(model: nn.Module, train_cfg, parallel_cfg, dist) -> torch.optim.Optimizer:
    from tenfold.engine.optim import build_optimizer

    return build_optimizer(model, train_cfg, dist.device)


def grad_sync(model: nn.Module, enabled: bool):
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    from tenfold.engine.optim import clip_grad_norm as _clip

    return _clip([p for p in model.parameters() if p.grad is not None], max_norm)
