"""Mixture-of-experts terms of the planner: the experts' share of a rank's parameters under expert
parallelism, the all-to-all traffic and time of token dispatch and combine, the load imbalance.

Memory is priced on the TOTAL parameters (every expert is stored somewhere), FLOPs and MFU on the
ACTIVE ones (tenfold.models.presets.flops_per_token). Under `--ep N` a rank holds n_experts / N of
every MoE block's routed experts; the rest of the model is data-parallel as usual.

What tenfold's engine runs (techniques/expert_parallel.py): the ep ranks are dp ranks; the
experts are split over ep, and ZeRO-2/3 shard each rank's part further over the dp / ep replicas
that hold the same experts (each experts module an FSDP2 unit over them, `experts_sharded`), so a
rank keeps 1/dp of the experts' states as of the dense ones; FSDP2 gathers a block's experts with
the block. ZeRO-0/1 (DDP) and `replicate` under tensor parallelism keep them whole on each replica
and all-reduce their gradients over the replicas once per step; under `replicate` the experts
compute on 16-bit casts of their fp32 weights (`expert_working_copy_bytes`).

All-to-all (GShard, Lepikhin et al. 2020, section 2.2; Megatron-Core's MoE token dispatcher):
each MoE layer sends every token's k routed copies to the experts' ranks and back, forward
(dispatch + combine) and again in backward (their gradients): 4 all-to-alls of b s k d elements
per layer per micro-batch, 2 more per layer whose forward is recomputed. Of a rank's buffer,
(ep-1)/ep leaves the rank (balanced routing), the part addressed to other nodes through the rank's
own NIC, the rest over NVLink; not overlapped with compute (torchtitan's default; DeepSeek-V3's
DualPipe overlaps it, Liu et al. 2024 section 3.2.1).
"""

from __future__ import annotations

from dataclasses import replace

from tenfold.models.presets import ModelConfig, expert_param_count
from tenfold.plan import comm
from tenfold.plan.hardware import Hardware
from tenfold.plan.fp8 import block_param_bytes
from tenfold.run import ResolvedRun
from tenfold.terms import element_bytes

# Tokens the busiest expert rank receives over the mean, under the balance loss or bias. 1.0 is
# the balanced ideal the router is trained towards; not fitted to any run (docs/planner.md).
LOAD_IMBALANCE = 1.0


def expert_params_per_layer(cfg: ModelConfig) -> float:
    return expert_param_count(cfg) / cfg.n_layers if cfg.is_moe else 0.0


def rank_expert_params(cfg: ModelConfig, run: ResolvedRun, layers: int) -> float:
    """Routed-expert parameters a rank holding `layers` blocks keeps: 1/ep of each block's."""
    return layers * expert_params_per_layer(cfg) / run.ep


def experts_sharded(run: ResolvedRun) -> bool:
    """Whether FSDP2 shards the ep-split experts over their dp / ep replicas: ZeRO-2/3 (and ZeRO-1
    under tensor parallelism, which runs as 2); DDP and `replicate` keep them whole."""
    return run.ep > 1 and run.zero_runs_as >= 2


def expert_states_run(run: ResolvedRun) -> ResolvedRun:
    """`run` as the experts' states see it: sharded over their dp / ep replicas (one FSDP2 mesh,
    no hybrid split) under `experts_sharded`, whole on each replica (ZeRO-0) otherwise."""
    if experts_sharded(run):
        return replace(run, shard_group=run.dp // run.ep)
    return replace(run, zero_stage=0, shard_group=None)


def expert_working_copy_bytes(cfg: ModelConfig, run: ResolvedRun, pp_rank: int) -> float:
    """The copies of a rank's ep-split experts its grouped GEMMs compute on, at their high.
    Sharded (`experts_sharded`): FSDP2's gathered units in the compute dtype, each layer's from
    its forward to its backward when a unit persists (ZeRO-2, pipelining, or at most
    `param_persistence_threshold` elements, counted as FSDP2 counts a DTensor: every expert of the
    layer), else two layers' at once (the one computing and the one prefetched). Whole under
    `replicate` (tensor parallelism at ZeRO-0): autocast's 16-bit casts (models/moe.py
    `RoutedExperts.forward`), a block's from its forward to its backward, a recomputed block's
    only while it recomputes, so one at a time; none in fp32."""
    if run.ep <= 1 or not cfg.is_moe:
        return 0.0
    layers, per_layer = run.rank_layers(pp_rank), expert_params_per_layer(cfg)
    if experts_sharded(run):
        persist = run.zero_runs_as == 2 or run.pp > 1 or per_layer <= run.param_persistence_threshold
        return block_param_bytes(run) * (layers if persist else min(2, layers)) * per_layer / run.ep
    if run.precision == "fp32":
        return 0.0
    recomputed = recomputed_layers(run, pp_rank)
    held = layers - recomputed + min(recomputed, 1)
    return 2.0 * held * per_layer / run.ep


def ep_group(run: ResolvedRun, hw: Hardware) -> comm.Group:
    """The ep ranks are consecutive dp ranks, tp apart (the engine's mesh: tp fastest)."""
    return comm.group_layout(run.ep, run.tp, hw.gpus_per_node)


def all_to_all_time(nbytes: float, hw: Hardware, g: comm.Group) -> float:
    """One all-to-all of an `nbytes` buffer per rank: (n-1)/n of it leaves; the part for other nodes
    crosses this rank's NIC, the part for its node NVLink, both at once (NCCL runs the n-1 sends
    concurrently); one collective latency, plus a network hop when it crosses nodes."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    n = g.size
    remote = (n - min(n, g.per_node)) / n * nbytes
    local = (min(n, g.per_node) - 1) / n * nbytes
    t = max(local / (hw.intra_node_bw * hw.bus_efficiency), remote / (hw.nic_bw * hw.bus_efficiency))
    return t + hw.collective_latency_s + (hw.inter_latency_s if g.crosses_nodes else hw.intra_latency_s)


def all_to_all_bytes(cfg: ModelConfig, run: ResolvedRun) -> float:
    """One dispatch (or combine) buffer of one layer and micro-batch: b s k d activations."""
    return run.micro_batch * run.seq_len * cfg.experts_per_token * cfg.d_model * element_bytes(run.precision)


def ep_comm_time(cfg: ModelConfig | None, run: ResolvedRun, hw: Hardware, layers: int, recomputed: int) -> float:
    """All-to-all seconds of one micro-batch on a rank with `layers` blocks, `recomputed` of them
    replaying their forward (2 more all-to-alls each)."""
    if cfg is None or not cfg.is_moe or run.ep <= 1:
        return 0.0
    one = all_to_all_time(all_to_all_bytes(cfg, run), hw, ep_group(run, hw)) * LOAD_IMBALANCE
    return (4 * layers + 2 * recomputed) * one


def ep_volume_per_step(cfg: ModelConfig | None, run: ResolvedRun, layers: int, recomputed: int = 0) -> float:
    """Bytes one rank sends by all-to-all in a step: 4 per layer per micro-batch, 2 more per
    layer whose forward is recomputed."""
    if cfg is None or not cfg.is_moe or run.ep <= 1:
        return 0.0
    return (4 * layers + 2 * recomputed) * run.grad_accum * all_to_all_bytes(cfg, run) * (run.ep - 1) / run.ep


def recomputed_layers(run: ResolvedRun, pp_rank: int) -> int:
    """Blocks of a pipeline rank whose forward (and so its all-to-alls) runs again in backward."""
    if run.recompute.kind == "op":
        return 0
    return sum(len(run.recompute.recomputed_blocks(n)) for n in run.rank_stage_layers(pp_rank))


def ep_bytes_per_step(cfg: ModelConfig | None, run: ResolvedRun) -> float:
    """`ep_volume_per_step` of the busiest pipeline rank (tenfold plan --json's ep_bytes_per_step)."""
    return max(ep_volume_per_step(cfg, run, run.rank_layers(r), recomputed_layers(run, r)) for r in run.busiest_ranks())
