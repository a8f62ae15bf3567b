"""Context parallelism's key/value traffic per layer, and how much of it compute hides.

tenfold's cp attention (techniques/context_parallel.py) all-gathers every rank's K and V over
the cp group before a layer's attention (Llama 3's all-gather context parallelism, Dubey et al.
2024, arXiv:2407.21783, section 3.3.2) and reduce-scatters their gradients in backward: per
layer and micro-batch, each direction moves the whole sequence's K and V, b x s x 2 x kv_dim/tp
elements, of which a rank sends and receives (cp-1)/cp (ring all-gather / reduce-scatter
volume, nccl-tests' "bus bandwidth" convention). A recomputed layer gathers again.

Hiding: the all-gather completes before the attention starts, so none of it overlaps the
layer's own attention (`overlapped=False`, the engine's case). A ring (send/recv of one block
while the previous block is computed: Liu et al. 2023, arXiv:2310.01889; torch's
`context_parallel`, Megatron-Core) hides the traffic behind the attention compute and exposes
only max(0, traffic - attention); `exposed_s` prices both.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.models.presets import ModelConfig
from tenfold.plan import comm
from tenfold.plan.hardware import Hardware
from tenfold.run import ResolvedRun
from tenfold.terms import element_bytes


@dataclass(frozen=True)
class CpTraffic:
    bytes_per_layer: float  # the gathered K and V of one layer, one micro-batch (whole sequence)
    fwd_s: float  # the forward all-gather of one layer
    bwd_s: float  # the backward reduce-scatter of one layer


def kv_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """K and V of the whole sequence for one layer, one micro-batch, one tp rank."""
    kv = cfg.kv_heads * cfg.head_dim
    return run.micro_batch * run.seq_len * 2 * kv / run.tp * element_bytes(run.precision)


def cp_group(run: ResolvedRun, hw: Hardware) -> comm.Group:
    """The cp ranks: neighbours in the dp dimension, tp apart (engine/parallel/distributed.py)."""
    return comm.group_layout(run.cp, run.tp, hw.gpus_per_node)


def layer_traffic(cfg: ModelConfig, run: ResolvedRun, hw: Hardware) -> CpTraffic:
    if run.cp <= 1:
        return CpTraffic(0.0, 0.0, 0.0)
    n, g = kv_bytes(cfg, run), cp_group(run, hw)
    return CpTraffic(n, comm.all_gather_time(n, hw, g), comm.reduce_scatter_time(n, hw, g))


def bytes_per_step(cfg: ModelConfig, run: ResolvedRun) -> float:
    """Bytes one rank sends on its cp group per optimizer step (ring convention, as
    tenfold.plan.tp_traffic counts tensor-parallel traffic), on the busiest pipeline rank: per
    micro-batch and layer the K and V all-gather forward (again in each recomputed layer, the
    rule `step_time.cp_comm` prices) and the reduce-scatter of their gradients backward, each
    (cp-1)/cp of `kv_bytes`; 0 without cp."""
    if run.cp <= 1:
        return 0.0
    ring = kv_bytes(cfg, run) * (run.cp - 1) / run.cp
    rc_again = run.recompute.kind in ("full", "every", "segments")
    out = 0.0
    for rank in run.busiest_ranks():
        layers = run.rank_layers(rank)
        recomputed = sum(len(run.recompute.recomputed_blocks(n)) for n in run.rank_stage_layers(rank)) if rc_again else 0
        out = max(out, (2 * layers + recomputed) * ring * run.grad_accum)
    return out


def exposed_s(traffic_s: float, attention_s: float, overlapped: bool) -> float:
    """What compute does not hide: all of it when the collective precedes the attention, the
    excess over the attention when a ring overlaps each block's transfer with the previous
    block's compute."""
    return max(0.0, traffic_s - attention_s) if overlapped else traffic_s
