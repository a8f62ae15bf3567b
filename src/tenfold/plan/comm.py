"""Collective times: ring bandwidth terms (nccl-tests PERFORMANCE.md) plus a latency term.

All-reduce of S bytes over n ranks: t = 2 (n-1)/n x S / B + latency; reduce-scatter and
all-gather: (n-1)/n x S / B + latency. B is the bus bandwidth one rank sees: NVLink inside a
node; across nodes NCCL runs one ring per NIC, so a group that has g members on each node
moves g NICs' worth (DGX A100, whole node in the group: 8 x 25 GB/s = 200 GB/s; one member per
node, e.g. the DP group under TP=8: 25 GB/s). Latency: NCCL switches to trees at scale, so we
charge 2 log2(n) steps (all-reduce) or log2(n) (reduce-scatter/all-gather) of the link latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tenfold.plan.hardware import Hardware


@dataclass(frozen=True)
class Group:
    """A process group: its size and how many of its members share a node."""

    size: int
    per_node: int  # members on one node (1 .. gpus_per_node)

    @property
    def crosses_nodes(self) -> bool:
        return self.size > self.per_node


def group_layout(size: int, stride: int, gpus_per_node: int) -> Group:
    """Ranks laid out Megatron-style (TP fastest, then DP, then PP): a group of `size` ranks
    spaced `stride` apart has min(size, gpus_per_node // stride) members per node."""
    per_node = max(1, min(size, gpus_per_node // max(1, stride)))
    return Group(size, per_node)


def bus_bandwidth(hw: Hardware, g: Group) -> float:
    if g.crosses_nodes:
        bw = min(hw.intra_node_bw, g.per_node * hw.nic_bw)
    else:
        bw = hw.intra_node_bw
    return bw * hw.bus_efficiency


def _latency(hw: Hardware, g: Group, steps: float) -> float:
    lat = hw.inter_latency_s if g.crosses_nodes else hw.intra_latency_s
    return steps * lat


def all_reduce_time(nbytes: float, hw: Hardware, g: Group) -> float:
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    n = g.size
    return 2 * (n - 1) / n * nbytes / bus_bandwidth(hw, g) + _latency(hw, g, 2 * math.ceil(math.log2(n)))


def reduce_scatter_time(nbytes: float, hw: Hardware, g: Group) -> float:
    """`nbytes` = the full (unsharded) buffer size."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    n = g.size
    return (n - 1) / n * nbytes / bus_bandwidth(hw, g) + _latency(hw, g, math.ceil(math.log2(n)))


all_gather_time = reduce_scatter_time  # same volume and steps (nccl-tests: (n-1)/n)


def p2p_time(nbytes: float, hw: Hardware, crosses_nodes: bool) -> float:
    """Pipeline send/recv between neighbouring stages: one link, one message."""
    if nbytes <= 0:
        return 0.0
    bw = (hw.nic_bw if crosses_nodes else hw.intra_node_bw) * hw.bus_efficiency
    return nbytes / bw + (hw.inter_latency_s if crosses_nodes else hw.intra_latency_s)


def tp_volume_elements_per_layer(b: int, s: int, h: int, t: int) -> float:
    """Narayanan §3.2: 2 all-reduces forward + 2 backward of b*s*h elements; a ring all-reduce
    moves 2 (t-1)/t of its buffer per device: 8 b s h (t-1)/t elements per layer per device."""
    return 4 * 2 * (t - 1) / t * b * s * h


def pp_volume_elements(b: int, s: int, h: int, t: int = 1, scatter_gather: bool = True) -> float:
    """Narayanan §4.1: b*s*h per micro-batch per stage boundary; b*s*h/t with scatter/gather."""
    return b * s * h / (t if scatter_gather else 1)
