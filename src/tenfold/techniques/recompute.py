"""Activation checkpointing (seed §3): keep fewer activations, recompute them in backward.

Policies (`--ac`, config `[recompute] policy`), all applied per transformer block with
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`:

  none                 keep every activation (the baseline)
  full                 checkpoint every block: only block inputs are kept (Korthikanti's 2sbh
                       per layer in 16 bit), one extra forward per block in backward
  every:N              checkpoint one block in N (blocks N-1, 2N-1, ...; torchtitan's layer
                       SAC, `selective_ac_option="N"`)
  segments:K           the stack cut into K segments of consecutive blocks; only segment
                       boundaries are kept (`torch.utils.checkpoint.checkpoint_sequential`'s
                       semantics, which the seed uses: as there, the last segment is not
                       checkpointed because its backward starts right after its forward)
  selective            = selective:attention: recompute only the parameter-free attention
                       core softmax(QK^T)V (Korthikanti et al. 2022, §4.3)
  selective:mlp        recompute only the MLP
  offload              keep everything but move saved activations to pinned CPU memory
                       (`torch.autograd.graph.save_on_cpu`); GPU only

How: the module's `forward` is replaced by a checkpointed call of the original forward (an
instance attribute), instead of wrapping the module in a new parent. Parameter names
(state_dict keys, named_parameters FQNs) therefore stay exactly as they were, checkpoints stay
portable, and FSDP2's `fully_shard` can still be applied to each block afterwards (its hooks
run around the checkpointed forward, so the all-gathered parameters are re-gathered inside
the recompute; engine/parallelize.py applies recompute before ZeRO for that reason).

This module's top level does not import torch, so the planner can parse a policy with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tenfold.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    import torch.nn as nn

ALLOWED_FORMS = (
    "none, full, every:N, segments:K, selective, selective:attention, selective:mlp, offload "
    "(N, K positive integers)"
)
_MARK = "_tenfold_recompute"  # attribute set on each module whose forward we replaced


@dataclass(frozen=True)
class RecomputePolicy:
    kind: str  # "none" | "full" | "every" | "segments" | "selective" | "offload"
    n: int = 0  # N of every:N, K of segments:K
    target: str = ""  # "attention" | "mlp" for selective

    def __str__(self) -> str:
        if self.kind in ("every", "segments"):
            return f"{self.kind}:{self.n}"
        if self.kind == "selective":
            return f"selective:{self.target}"
        return self.kind

    def checkpointed_blocks(self, n_blocks: int) -> list[list[int]]:
        """Groups of block indices run as one checkpointed unit (pure Python: the planner uses
        it too). `full` -> [[0], [1], ...]; `every:2` on 4 -> [[1], [3]]; `segments:2` on 4 ->
        [[0, 1]] (the last segment is not checkpointed, as in checkpoint_sequential)."""
        if self.kind == "full":
            return [[i] for i in range(n_blocks)]
        if self.kind == "every":
            return [[i] for i in range(n_blocks) if (i + 1) % self.n == 0]
        if self.kind == "segments":
            return [seg for seg in split_segments(n_blocks, self.n)[:-1] if seg]
        return []


def split_segments(n_blocks: int, k: int) -> list[list[int]]:
    """Cut range(n_blocks) into min(k, n_blocks) runs of consecutive indices, sizes differing by
    at most one (the first runs get the extra block)."""
    k = max(1, min(k, n_blocks))
    base, extra = divmod(n_blocks, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def _bad(text: str, why: str = "") -> UserError:
    extra = f" ({why})" if why else ""
    return UserError(f"invalid recompute.policy (--ac) {text!r}{extra}; allowed: {ALLOWED_FORMS}")


def parse_policy(text: str | RecomputePolicy) -> RecomputePolicy:
    """Parse `none | full | every:N | segments:K | selective[:attention|:mlp] | offload`."""
    if isinstance(text, RecomputePolicy):
        return text
    if not isinstance(text, str):
        raise _bad(repr(text), "not a string")
    raw = text.strip().lower()
    if raw in ("none", "full", "offload"):
        return RecomputePolicy(raw)
    if raw in ("selective", "selective:attention", "selective:attn"):
        return RecomputePolicy("selective", target="attention")
    if raw == "selective:mlp":
        return RecomputePolicy("selective", target="mlp")
    head, sep, arg = raw.partition(":")
    if sep and head in ("every", "segments"):
        if not arg.isdigit() or int(arg) <= 0:
            raise _bad(text, f"{head}: needs a positive integer, got {arg!r}")
        return RecomputePolicy(head, n=int(arg))
    raise _bad(text)


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
    policy = parse_policy(policy)
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
