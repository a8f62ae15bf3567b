"""AdamW with decoupled weight decay, and gradient clipping by the global norm.

Weight decay choice: decay every parameter with 2 or more dimensions (all matmul weights
AND the embeddings), none for 1-D parameters (norm gains, biases). This is nanoGPT's rule
(`configure_optimizers`: "all weight tensors in matmuls + embeddings decay, all biases and
layernorms don't"). Why embeddings too: with tied embeddings the embedding *is* the output
projection, a matmul weight, so excluding it would also exclude the head; the rule is by
shape only, so it is identical whether a parameter is a plain tensor or an FSDP2 DTensor
shard (DTensor reports the global shape), and a planner can reproduce it.

Build the optimizer AFTER the techniques are applied (`parallelize`), so that FSDP2's
sharded DTensor parameters are the ones it holds.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed (ndim >= 2) and not decayed (ndim < 2); frozen params left out.
    Each is split further by device mesh when tensor parallelism leaves DTensor and plain
    parameters (or DTensors of two meshes) side by side: the foreach kernels take one kind."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for params, wd in ((decay, weight_decay), (no_decay, 0.0))
              for ps in by_mesh(params)]
    return [g for g in groups if g["params"]]


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by DTensor device mesh (plain tensors form one group), first seen first."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)  # DeviceMesh: equal = same ranks
    return list(groups.values()) or [[]]


def adamw_kwargs(train_cfg: Any, device: torch.device) -> dict[str, Any]:
    """lr/betas/eps from `[train]`; the multi-tensor kernel: fused on CUDA, foreach elsewhere."""
    kw: dict[str, Any] = {"lr": train_cfg.lr, "betas": (train_cfg.beta1, train_cfg.beta2), "eps": train_cfg.eps}
    if device.type == "cuda":
        kw["fused"] = True  # one kernel for the whole update (supports DTensor params)
    else:
        kw["foreach"] = True  # fused AdamW on CPU exists but is not faster than foreach here
    return kw


def build_optimizer(model: nn.Module, train_cfg: Any, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, train_cfg.weight_decay), **adamw_kwargs(train_cfg, device))


@torch.no_grad()
def allocate_states(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW's states now instead of inside the first `step()`, exactly as the
    first step would (zeros, step 0), so that a run fails before its first step if they do not
    fit, and the first training steps do not also pay for allocating and first touching them.
    DeepSpeed's ZeRO optimizers do the same at `initialize` (`initialize_optimizer_states`).

    How: one step with zero gradients at learning rate 0 (torch's own
    `torch.distributed.checkpoint.state_dict._init_optim_state` does this), which leaves every
    parameter unchanged (decay `p * (1 - 0 * wd)`, update `0 * m / (sqrt(v) + eps)` with m = v
    = 0), then the step counters back to 0: the states are then those of a fresh optimizer,
    bit for bit (tests/test_optimizer_states.py). Other optimizer classes are left alone."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return  # gradients in flight: leave the lazy initialisation to the real step
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    extra_groups: Sequence[dist.ProcessGroup] = (),
    uncounted: Iterable[nn.Parameter] = (),
) -> float:
    """Clip gradients to a global norm of `max_norm`; return the PRE-clip global norm.

    `max_norm == 0` disables clipping (DeepSpeed's `gradient_clipping: 0`) but the norm is
    still computed and returned. DTensor gradients (FSDP2) give a DTensor norm whose
    `full_tensor()` is already the norm over all shards (torchtitan's `clip_grad_norm_`
    does the same). `extra_groups` are process groups whose ranks hold *disjoint* parameters
    that this rank's `params` don't cover (pipeline stages): the local norms are combined
    over them (sum of norm**p, or max for the inf-norm) before clipping. `uncounted`: parameters
    clipped with the others but left out of the norm, because another rank counts the same
    weight (a tied embedding's copy on the last pipeline stage, techniques/tied_embeddings.py).
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    skip = {id(p) for p in uncounted}
    counted = [p for p in params if id(p) not in skip]
    # Tensor parallelism mixes meshes (FSDP2 puts the tp-split parameters on a (dp, tp) mesh,
    # the others on the dp mesh, plain tensors beside them), and a foreach kernel takes one.
    groups = by_mesh(params)
    total = _combine([_group_norm([p.grad for p in ps], norm_type) for ps in by_mesh(counted)], norm_type)
    for group in extra_groups:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        for ps in groups:
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)
    return float(total.item())


def _group_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm of one mesh's gradients over every shard: DTensor gradients give a DTensor norm
    whose `full_tensor()` reduces the shards' parts and leaves replicated dims alone."""
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
    full_tensor = getattr(total, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else total


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of disjoint groups from the groups' norms."""
    if len(norms) == 1:
        return norms[0]
    stacked = torch.stack([n.float() for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return (stacked**norm_type).sum() ** (1.0 / norm_type)
