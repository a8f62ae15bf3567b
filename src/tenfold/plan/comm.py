"""Collective times as NCCL models them: a bandwidth term and a per-step latency term.

Ring (nccl-tests `doc/PERFORMANCE.md`; NCCL `src/graph/tuning.cc`, `ncclTopoTuneModel`):
all-gather and reduce-scatter of an S-byte buffer over n ranks move (n-1)/n x S per rank in
n - 1 steps; all-reduce is both, 2 (n-1)/n x S in 2 (n-1) steps. Each step costs one link's
latency: NCCL charges its Simple protocol 3.4 us per NVLink hop and 9.6 us per network hop,
plus 8.4 us once per collective, and a ring crosses the network nodes - 1 times per pass. So
at 1536 ranks on 192 nodes one all-gather pays about 6.4 ms before a byte of bandwidth, and
latency, not bandwidth, is what a per-layer ZeRO-3 gather loses at scale. All-reduce may
instead run NCCL's double binary tree: the same 2 S/B of bandwidth, 2 (per_node - 1) intra
hops + 2 log2(nodes) network hops; NCCL picks the faster, and so do we.

Bandwidth B, per rank, is the slowest link the group spans. Inside a node that is NVLink.
Across nodes NCCL runs one ring per channel and each channel leaves the node through its own
NIC (`busBw = nChannels x per-channel inter-node speed` in tuning.cc), so a group with g
members on each node moves g NICs' worth, capped by NVLink: a whole DGX A100 node in the group
gets 8 x 25 = 200 GB/s, one member per node (the data-parallel group under TP = 8) one NIC,
25 GB/s. `Hardware.bus_efficiency` (0.8) is the share of that link rate NCCL reaches.
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

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / max(1, self.per_node))


def group_layout(size: int, stride: int, gpus_per_node: int) -> Group:
    """Ranks laid out Megatron-style (TP fastest, then DP, then PP): a group of `size` ranks
    spaced `stride` apart has min(size, gpus_per_node // stride) members per node."""
    per_node = max(1, min(size, gpus_per_node // max(1, stride)))
    return Group(size, per_node)


def bus_bandwidth(hw: Hardware, g: Group) -> float:
    """Per-rank bytes/s of a ring over `g`: NVLink inside a node, g NICs (<= NVLink) across."""
    if g.crosses_nodes:
        bw = min(hw.intra_node_bw, g.per_node * hw.nic_bw)
    else:
        bw = hw.intra_node_bw
    return bw * hw.bus_efficiency


def ring_latency(hw: Hardware, g: Group, passes: int) -> float:
    """NCCL's ring latency: one base latency, then `passes` x (n - 1) steps, of which
    `passes` x (nodes - 1) cross the network (tuning.cc: nsteps, nInterSteps)."""
    steps = passes * (g.size - 1)
    inter = passes * (g.nodes - 1)
    return hw.collective_latency_s + (steps - inter) * hw.intra_latency_s + inter * hw.inter_latency_s


def tree_latency(hw: Hardware, g: Group) -> float:
    """NCCL's tree all-reduce latency: up and down a chain inside the node and a binary tree
    across nodes (tuning.cc: 2 x ((per_node - 1) intra + log2(nodes) inter))."""
    hops_inter = math.ceil(math.log2(g.nodes)) if g.nodes > 1 else 0
    return hw.collective_latency_s + 2 * ((g.per_node - 1) * hw.intra_latency_s + hops_inter * hw.inter_latency_s)


def all_reduce_time(nbytes: float, hw: Hardware, g: Group) -> float:
    """The faster of a ring, 2 (n-1)/n S/B + 2 (n-1) steps, and a tree, 2 S/B + 2 log2 depth."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    n, bw = g.size, bus_bandwidth(hw, g)
    ring = 2 * (n - 1) / n * nbytes / bw + ring_latency(hw, g, 2)
    tree = 2 * nbytes / bw + tree_latency(hw, g)
    return min(ring, tree)


def reduce_scatter_time(nbytes: float, hw: Hardware, g: Group) -> float:
    """`nbytes` = the full (unsharded) buffer: (n-1)/n S/B + (n-1) steps (ring only in NCCL)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    n = g.size
    return (n - 1) / n * nbytes / bus_bandwidth(hw, g) + ring_latency(hw, g, 1)


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
