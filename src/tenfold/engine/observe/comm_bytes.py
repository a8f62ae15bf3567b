"""Bytes each collective moves, measured: a TorchDispatchMode that sees every collective a
step issues, DTensor's included, and records its payload, its group, and the bytes one rank
sends in a ring implementation:

    all-reduce of S bytes over n ranks      2 (n-1)/n x S
    reduce-scatter of S bytes (the input)   (n-1)/n x S
    all-gather into S bytes (the output)    (n-1)/n x S
    broadcast of S bytes                    (n-1)/n x S

(nccl-tests' PERFORMANCE.md "bus bandwidth" factors.) The planner's per-step traffic
(tenfold.plan.tp_traffic) is stated in the same unit, so a test can hold the two together.

It is PyTorch's `torch.distributed.tensor.debug.CommDebugMode` reduced to its dispatch rule
(return NotImplemented for DTensor operands so that DTensor first turns the operator into
functional collectives, then see those) plus the byte count CommDebugMode does not keep.
CommDebugMode itself cannot be used here: its module tracker fails on the second forward of
the root module within one mode (gradient accumulation; IndexError in torch 2.13). Only
functional collectives are counted (DTensor's, FSDP2's): the plain c10d calls tenfold makes
itself (token count, loss, overflow vote) are scalars on the dp or world group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n}
# torch.ops._c10d_functional names -> kinds
_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast"}


@dataclass
class Collective:
    kind: str  # all_reduce | reduce_scatter | all_gather | broadcast
    group: str  # process group name
    group_size: int
    payload_bytes: int  # the full buffer: all-reduce/broadcast tensor, reduce-scatter input, all-gather output
    dtype: torch.dtype

    @property
    def ring_bytes(self) -> float:
        return RING_FACTOR[self.kind](self.group_size) * self.payload_bytes


class CollectiveBytes(TorchDispatchMode):
    """`with CollectiveBytes() as c: step()`, then `c.ring_bytes(group)` per rank,
    `c.by_kind(group)` {kind: (count, ring bytes)}; `group` is a process group's name."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first and desugars into collectives
        out = func(*args, **(kwargs or {}))
        record = _collective_of(func, args)
        if record is not None:
            self.collectives.append(record)
        return out

    def ring_bytes(self, group: str | None = None) -> float:
        return sum(c.ring_bytes for c in self.collectives if group is None or c.group == group)

    def by_kind(self, group: str | None = None) -> dict[str, tuple[int, float]]:
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for c in self.collectives:
            if group is None or c.group == group:
                out[c.kind][0] += 1
                out[c.kind][1] += c.ring_bytes
        return {k: (n, b) for k, (n, b) in out.items()}


def _collective_of(func, args) -> Collective | None:
    """The collective behind one functional-collective op (what DTensor issues), else None.
    Signatures (torch.ops._c10d_functional): all_reduce(t, op, group), all_gather_into_tensor(
    t, group_size, group), reduce_scatter_tensor(t, op, group_size, group), broadcast(t, src, group)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    kind = _KINDS.get(getattr(getattr(func, "_overloadpacket", None), "__name__", ""))
    if kind is None or "c10d_functional" not in str(func):
        return None
    tensor, group = args[0], args[-1]
    size = _resolve_process_group(group).size()
    payload = tensor.numel() * tensor.element_size()
    if kind == "all_gather":
        payload *= size  # the input is this rank's shard
    return Collective(kind, str(group), size, payload, tensor.dtype)
