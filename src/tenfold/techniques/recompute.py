"""Activation checkpointing (Chen et al. 2016): keep fewer activations, recompute them in backward.

Policies (`--ac`, config `[recompute] policy`; grammar and block lists in tenfold.terms,
which the planner reads too), applied per transformer block with
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: full / every:N / segments:K wrap
the blocks `RecomputePolicy.checkpointed_blocks` lists; selective wraps the attention core or
the MLP of every block; op checkpoints every block with torchtitan's per-op policy
(techniques/recompute_ops.py: keep every other matmul, attention and reduce-scatter outputs,
recompute the rest); offload saves activations to pinned host memory
(`torch.autograd.graph.save_on_cpu`, GPU only).

How: the module's `forward` is replaced by a checkpointed call of the original forward (an
instance attribute), instead of wrapping the module in a new parent. Parameter names
(state_dict keys, named_parameters FQNs) therefore stay exactly as they were, checkpoints stay
portable, and FSDP2's `fully_shard` can still be applied to each block afterwards (its hooks
run around the checkpointed forward, so the all-gathered parameters are re-gathered inside
the recompute; engine/parallel/parallelize.py applies recompute before ZeRO for that reason).

"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from tenfold.errors import UserError
from tenfold.terms import RecomputePolicy, parse_recompute

if TYPE_CHECKING:  # pragma: no cover
    import torch.nn as nn

_MARK = "_tenfold_recompute"  # attribute set on each module whose forward we replaced


# --------------------------------------------------------------------------- applying


def find_blocks(model: "nn.Module") -> list["nn.Module"]:
    """The transformer blocks of tenfold's GPT (`model.layers`, a ModuleDict "0".."L-1").
    Other models must pass `blocks=` explicitly."""
    import torch.nn as nn

    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    raise UserError(
        f"recompute.policy needs the model's transformer blocks: {type(model).__name__} has no "
        "`layers` ModuleDict/ModuleList; pass blocks=[...] to apply_recompute (Python API) "
        "or use recompute.policy='none'"
    )


def check_supported(policy: RecomputePolicy, device_type: str | None = None) -> None:
    """Raise before anything starts if the policy cannot run on this machine."""
    import torch

    if policy.kind != "offload":
        return
    if not torch.cuda.is_available() or (device_type is not None and device_type != "cuda"):
        raise UserError(
            "recompute.policy 'offload' (--ac offload) moves saved activations from GPU memory "
            "to pinned CPU memory and needs a CUDA device; this run is on "
            f"{device_type or 'cpu'}. Use --ac full or --ac selective to save memory on CPU"
        )


def apply_recompute(
    model: "nn.Module", policy: str | RecomputePolicy, blocks: list["nn.Module"] | None = None
) -> None:
    """Apply `policy` to `model` in place, block by block; parameter names stay unchanged.

    `blocks` defaults to `model.layers.values()` (tenfold's GPT) and must be listed in the
    order the model calls them (segments:K relies on it).
    """
    policy = parse_recompute(policy)
    if policy.kind == "none":
        return
    check_supported(policy)
    blocks = list(blocks) if blocks is not None else find_blocks(model)
    if not blocks:
        return
    for b in blocks:
        if getattr(b, _MARK, None):
            raise UserError(f"activation recompute was already applied to this model ({getattr(b, _MARK)})")

    if policy.kind in ("full", "every"):
        for group in policy.checkpointed_blocks(len(blocks)):
            _replace_forward(blocks[group[0]], _checkpointed, str(policy))
    elif policy.kind == "segments":
        for group in policy.checkpointed_blocks(len(blocks)):
            _make_segment([blocks[i] for i in group], str(policy))
    elif policy.kind == "selective":
        for b in blocks:
            _replace_forward(_selective_target(b, policy.target), _checkpointed, str(policy))
            setattr(b, _MARK, str(policy))
    elif policy.kind == "op":
        from tenfold.techniques.recompute_ops import op_checkpointed

        for b in blocks:
            _replace_forward(b, op_checkpointed, str(policy))
    elif policy.kind == "offload":
        for b in blocks:
            _replace_forward(b, _offloaded, str(policy))


def _selective_target(block: "nn.Module", target: str) -> "nn.Module":
    try:
        return block.attn.core if target == "attention" else block.mlp
    except AttributeError:
        what = "attn.core" if target == "attention" else "mlp"
        raise UserError(
            f"recompute.policy selective:{target} needs blocks with a `{what}` submodule "
            f"(tenfold's Block); {type(block).__name__} has none"
        ) from None


def _replace_forward(module: "nn.Module", wrap: Callable, label: str) -> None:
    # An instance attribute shadows the class's forward; nn.Module.__call__ (and so every
    # hook, FSDP2's included) still runs around it, and no parameter changes its name.
    module.forward = wrap(module.forward)
    setattr(module, _MARK, label)


def _checkpointed(fn: Callable) -> Callable:
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def run(*args, **kwargs):
        # Non-reentrant: works with kwargs, with inputs that do not require grad, with
        # autograd hooks (FSDP2), and restores the autocast state on recompute.
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def _offloaded(fn: Callable) -> Callable:
    from torch.autograd.graph import save_on_cpu

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with save_on_cpu(pin_memory=True):
            return fn(*args, **kwargs)

    return run


def _make_segment(seg_blocks: list["nn.Module"], label: str) -> None:
    """Run consecutive blocks as one checkpointed unit without changing how the model loops.

    The model still calls every block in turn (GPT.forward: `for block in self.layers.values()`).
    The first block of the segment runs the whole segment under one checkpoint, calling the
    other blocks through `__call__` (so their hooks fire) while a flag tells them to run their
    real forward; when the model's loop then calls those blocks, they pass their input through.
    Only the segment's input is saved; backward recomputes the whole segment.
    """
    head, rest = seg_blocks[0], seg_blocks[1:]
    state = {"inside": False}
    head_forward = head.forward
    rest_forwards = [b.forward for b in rest]

    def run_segment(h, *args, **kwargs):
        state["inside"] = True
        try:
            h = head_forward(h, *args, **kwargs)
            for b in rest:
                h = b(h, *args, **kwargs)
        finally:
            state["inside"] = False
        return h

    checkpointed_segment = _checkpointed(run_segment)

    def head_fw(h, *args, **kwargs):
        return checkpointed_segment(h, *args, **kwargs)

    def make_rest_fw(orig: Callable) -> Callable:
        def rest_fw(h, *args, **kwargs):
            # Inside the segment (first run and recompute): the real block. Called by the
            # model's own loop afterwards: its work is already done, pass the input through.
            return orig(h, *args, **kwargs) if state["inside"] else h

        return rest_fw

    head.forward = functools.wraps(head_forward)(head_fw)
    setattr(head, _MARK, label)
    for b, orig in zip(rest, rest_forwards):
        b.forward = functools.wraps(orig)(make_rest_fw(orig))
        setattr(b, _MARK, label)


def describe(model: "nn.Module") -> dict[str, str]:
    """{module FQN: policy} for every module whose forward recompute replaced (for reports)."""
    return {name: getattr(m, _MARK) for name, m in model.named_modules() if getattr(m, _MARK, None)}
