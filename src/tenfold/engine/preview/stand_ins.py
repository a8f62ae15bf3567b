"""What `tenfold plan --trace` puts in place of the parts of a run that a fake world of fake CPU
tensors cannot run as a GPU run does (tenfold.engine.preview.trace): each a context manager (or
a call) that moves no data and is undone after the trace."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any


@contextmanager
def _replaced(owner: Any, name: str, value: Any):
    """`owner.name` is `value` inside the block, and its own value again after it."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


@contextmanager
def balanced_routing():
    """Every MoE layer routes token t to experts t k, ..., t k + k - 1 (mod E), a real index
    tensor (tenfold.engine.preview.trace's docstring); the weights are the router's scores of those experts, as
    `MoE.route` takes them."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from tenfold.models.moe import MoE

    original = MoE.route

    def route(self, h):
        scores, chosen, _ = original(self, h)
        with _disable_current_modes():
            chosen = (torch.arange(chosen.numel()) % self.n_experts).reshape(chosen.shape)
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, chosen, weights

    with _replaced(MoE, "route", route):
        yield


@contextmanager
def module_conversion_to_itself_keeps_it():
    """`nn.Module._apply(fn)` where `fn` returns every tensor as it is (`.to(its device)`,
    `.float()` of fp32 weights) returns the module. torch swaps every FakeTensor parameter on
    such a conversion even when nothing changes, which fails ("Cannot swap t1 because it has
    weakref associated with it", torch 2.13); the engine's `model.to(dist.device)`
    (engine/loop/parts.py) and Hugging Face's `from_config(...).float()` (models/hf.py) are such calls."""
    import torch
    import torch.nn as nn

    original = nn.Module._apply

    def _apply(self, fn, recurse=True):
        with torch.no_grad():
            unchanged = all(fn(t) is t for t in [*self.parameters(), *self.buffers()])
        return self if unchanged else original(self, fn, recurse)

    with _replaced(nn.Module, "_apply", _apply):
        yield


@contextmanager
def sharding_metadata_apart():
    """DTensor derives each operator's global output shape by running the operator on fake
    tensors of the global shape (`ShardingPropagator._propagate_tensor_meta_non_cached`, also
    `loss_parallel`'s handlers), in the fake mode it finds current or a new one. In a real run that
    is a new fake mode, which no memory tracker sees; here it would be the trace's own, so the
    tracker would count every tensor-parallel operator's whole-vocabulary or whole-width shadow
    output as an activation (the loss's log-softmax over V columns instead of V/tp). The
    propagation runs with the trace's modes set aside, as in a real run."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def apart(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    with _replaced(ShardingPropagator, "_propagate_tensor_meta_non_cached", apart):
        yield


@contextmanager
def ddp_without_shape_check():
    """DDP's constructor compares every parameter's shape across ranks in C++ through real host
    memory (`_verify_param_shape_across_processes`), which fake tensors have none of: skipped
    here (every rank of a fake world runs the same build). The reducer, its buckets and its
    all-reduces run as in a run."""
    import torch.nn.parallel.distributed as ddp

    with _replaced(ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None):
        yield


def ddp_reduces_in_python(model) -> None:
    """DDP without a communication hook all-reduces each bucket in C++ and reads the result
    from the work's future, which the fake backend leaves empty: such a DDP gets PyTorch's
    `allreduce_hook` (torch.distributed.algorithms.ddp_comm_hooks.default_hooks), the documented
    equivalent of DDP's own reduction (an all-reduce of each bucket), whose future
    the trace's `_named_groups` fills."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not model._comm_hooks:
        model.register_comm_hook(model.process_group, allreduce_hook)
