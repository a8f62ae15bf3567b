"""Per-op selective activation checkpointing (`--ac op`): torchtitan's `op` policy.

Each transformer block runs under one non-reentrant `torch.utils.checkpoint.checkpoint` whose
`context_fn` is `create_selective_checkpoint_contexts(policy)`. In the forward, the policy
labels every ATen op the block dispatches: MUST_SAVE keeps the op's outputs until the block's
backward, PREFER_RECOMPUTE frees them and backward runs the op again. The labels are
torchtitan's (`torchtitan/distributed/activation_checkpoint.py`, `selective_ac_option="op"`,
with the save list of `torchtitan/models/llama3/parallelize.py`):

* matmuls (`aten.mm`; `aten.linear` where a backend dispatches it whole): the 1st, 3rd, 5th,
  ... of each block's forward are kept, every second one is recomputed ("saves output of all
  compute ops, except every second mm"). torchtitan's models have no biases; a Linear with a
  bias dispatches `aten.addmm`, which tenfold counts as a matmul too, so a biased model keeps
  the same matmuls as an unbiased one.
* attention: every `scaled_dot_product_attention` kernel (flash, memory-efficient, cuDNN,
  math, fused-overrideable, and the CPU flash kernel, which torchtitan never meets): output
  and logsumexp are kept.
* collectives: the functional reduce-scatter (a sequence-parallel block's output) and
  all-to-all are kept, so recompute does not communicate them again.
* `aten.max` (float8 scaling's amax) and copies from an accelerator to the host.

Everything else (norms, RoPE, activations, elementwise products, residual adds, autocast's
casts, all-reduces) is recomputed. For tenfold's GPT block the kept tensors are listed by
`tenfold.terms.op_saved_tensors` (what the planner counts; tests/test_recompute.py checks the
engine keeps exactly those).
"""

from __future__ import annotations

import functools
from typing import Callable

MATMUL_OPS = ("aten.mm.default", "aten.addmm.default", "aten.linear.default")
SAVED_OPS = (
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "aten.max.default",
)


@functools.lru_cache(maxsize=1)
def _ops() -> tuple[frozenset, frozenset]:
    """(matmul ops, other kept ops) as OpOverloads; a name this torch lacks is skipped."""
    return frozenset(_resolve(MATMUL_OPS)), frozenset(_resolve(SAVED_OPS))


def _resolve(names: tuple[str, ...]) -> list:
    import torch

    out = []
    for dotted in names:
        obj = torch.ops
        try:
            for part in dotted.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        out.append(obj)
    return out


def _to_host(func, args, kwargs) -> bool:
    import torch

    return (func is torch.ops.aten._to_copy.default and bool(args) and args[0].device.type != "cpu"
            and str(kwargs.get("device", "")) == "cpu")


def op_policy() -> Callable:
    """A fresh policy for one checkpointed forward of one block. The matmul count restarts
    with each block's forward; the recompute keeps its own count so that it labels the same
    matmuls (older torch releases ask the policy again during the recompute; 2.13 replays
    the forward's labels)."""
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls, saved = _ops()
    count = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in matmuls:
            count[ctx.is_recompute] += 1
            odd = count[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        if func in saved or _to_host(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_contexts():
    """`context_fn` for torch.utils.checkpoint: called once per checkpointed forward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(op_policy())


def op_checkpointed(fn: Callable) -> Callable:
    """`fn` (a block's forward) run under per-op selective checkpointing."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=op_contexts, **kwargs)

    return run
