"""Data-parallel and ZeRO communication per optimizer step, layer by layer, and the part of it
that compute does not hide.

What each stage moves (ZeRO §7 volumes; the engines tenfold runs, techniques/zero.py):

  stage 0  DDP: one all-reduce of the gradients per step, bucketed during the last
           micro-batch's backward (the others run under no_sync).
  stage 1  DDP + ZeroRedundancyOptimizer: the same once-per-step reduce, then every rank
           sends its updated shard to the others (an all-gather of the 16-bit parameters),
           after the step, with nothing to overlap it.
  stage 2  FSDP2, reshard_after_forward=False: each layer's parameters are all-gathered
           before its first forward of the step and kept to the last backward (resharding
           after backward is switched off until the last micro-batch); its gradients are
           reduce-scattered after each micro-batch's backward.
  stage 3  FSDP2, reshard_after_forward=True: per micro-batch, each layer is all-gathered for
           its forward, all-gathered again for its backward, and reduce-scattered; blocks under
           the persistence threshold stay gathered to their backward, and so, without
           pipelining, do the last block and the root (their backward follows at once).
           A layer recomputed inside a checkpointed segment of several blocks
           (`segments:K`) runs its forward hooks again in backward before its own backward
           hook fired, so it is gathered a third time; a block checkpointed on its own
           (`full`, `every:N`) recomputes inside its backward gather.
  pp > 1   torch.distributed.pipelining runs every micro-batch's backward with FSDP2's
           gradient sync and resharding after backward off and reduces once, at the end
           (PipelineStage.backward_maybe_with_nosync, perform_reduce_grad): one gather and one
           reduce-scatter per step; stage 3 still reshards after each forward, so each
           backward gathers again. (memory.model_states holds the unreduced gradients.)

Overlap only with the compute that is really concurrent (FSDP2 prefetches one layer ahead):
in forward, layer l+1's all-gather runs while layer l computes; in backward, layer l-1's
all-gather and layer l+1's reduce-scatter share the network while layer l computes. So per
layer max(compute, communication), and the first gather and last reduce-scatter of a pass are
exposed, as are the embedding/output unit's (FSDP2's root). DDP's all-reduce overlaps only
the last micro-batch's backward, and its last bucket waits for the backward to end.
Hidden communication is not free: NCCL kernels take SMs and HBM bandwidth from the GEMMs,
charged as OVERLAP_CONTENTION of the hidden time (an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass

from tenfold.plan import comm
from tenfold.plan.hardware import Hardware
from tenfold.terms import DDP_BUCKET_BYTES

OVERLAP_CONTENTION = 0.15  # assumption: overlapped comm slows the concurrent GEMMs by 15% of its time


@dataclass(frozen=True)
class StageWork:
    """One micro-batch on the slowest pipeline stage, as DP/ZeRO sees it."""

    layers: int
    layer_fwd_s: float  # one layer's forward window (compute + its TP all-reduces)
    layer_bwd_s: float  # one layer's backward window (backward + recompute + TP)
    bwd_s: float  # the whole micro-batch's backward on the stage (DDP's overlap window)
    layer_param_bytes: float  # one layer's parameters as all-gathered (16-bit, or fp32)
    layer_grad_bytes: float  # one layer's gradients as reduced
    root_param_bytes: float  # embedding / final norm / output layer on this stage
    root_grad_bytes: float
    regathered_layers: float  # layers gathered a third time for recompute, per micro-batch
    micro_batches: int
    pp: int
    reduce_once: bool = False  # FSDP2 reducing at the last micro-batch only (ZeRO-1 under TP)
    blocks_persist: bool = False  # ZeRO-3 blocks under the persistence threshold: gathered forward to backward


@dataclass(frozen=True)
class DpComm:
    total_s: float  # every DP/ZeRO collective of one step
    exposed_s: float  # what the step waits for (incl. contention of the hidden part)
    formula: str


def layer_pipelined_exposed(layers: int, compute: float, first: float, per_layer: float, last: float = 0.0) -> float:
    """Communication a layer-by-layer pass waits for: the first transfer before any compute,
    then each layer's compute hides the next layer's `per_layer` transfer, then `last`."""
    if layers <= 0:
        return first + last
    return first + (layers - 1) * max(0.0, per_layer - compute) + last


def dp_step_comm(stage: int, w: StageWork, hw: Hardware, g: comm.Group, overlap: bool,
                 replicas: comm.Group | None = None) -> DpComm:
    """Per-step DP/ZeRO communication of one rank and the part of it not hidden by compute.
    `g`: the group a ZeRO state is split over (the shard group under hybrid sharding);
    `replicas`: with hybrid sharding, the group of ranks holding the same shard."""
    if g.size <= 1 and (replicas is None or replicas.size <= 1):
        return DpComm(0.0, 0.0, "one data-parallel rank: nothing to reduce")
    if stage <= 1:
        total, exposed, formula = _ddp(stage, w, hw, g, overlap)
    else:
        total, exposed, formula = _fsdp(stage, w, hw, g, overlap)
    if replicas is not None and replicas.size > 1:
        t, e, f = _across_replicas(w, hw, g.size, replicas, overlap)
        total, exposed, formula = total + t, exposed + e, formula + f
    exposed += OVERLAP_CONTENTION * max(0.0, total - exposed)
    return DpComm(total, exposed, formula)


def _across_replicas(w: StageWork, hw: Hardware, shard: int, replicas: comm.Group,
                     overlap: bool) -> tuple[float, float, str]:
    """Hybrid sharding (FSDP2 on a (replicate, shard) mesh, PyTorch HSDP; MiCS, Zhang et al.
    2022): after each unit's reduce-scatter inside its shard group, the 1/shard gradient shard is
    all-reduced across the replicas, once per step (the engine defers it to the last
    micro-batch), under the last backward."""
    ar = comm.all_reduce_time(w.layer_grad_bytes / shard, hw, replicas)
    ar_root = comm.all_reduce_time(w.root_grad_bytes / shard, hw, replicas)
    L = w.layers
    total = L * ar + ar_root
    exposed = total if not overlap else (layer_pipelined_exposed(L, w.layer_bwd_s, 0.0, ar, ar + ar_root)
                                         - layer_pipelined_exposed(L, w.layer_bwd_s, 0.0, 0.0))
    return total, min(total, exposed), f"; across {replicas.size} replicas: all-reduce of each 1/{shard} shard once per step"


def _ddp(stage: int, w: StageWork, hw: Hardware, g: comm.Group, overlap: bool) -> tuple[float, float, str]:
    grads = w.layers * w.layer_grad_bytes + w.root_grad_bytes
    ar = comm.all_reduce_time(grads, hw, g)
    last_bucket = comm.all_reduce_time(min(grads, DDP_BUCKET_BYTES), hw, g)
    exposed = max(last_bucket, ar - w.bwd_s) if overlap else ar
    formula = "all-reduce of the gradients once per step, overlapped with the last micro-batch's backward"
    if stage == 1:
        ag = comm.all_gather_time(w.layers * w.layer_param_bytes + w.root_param_bytes, hw, g)
        return ar + ag, exposed + ag, formula + " + all-gather of the updated 16-bit parameters (exposed)"
    return ar, exposed, formula


@dataclass(frozen=True)
class FsdpSchedule:
    """How often FSDP2 gathers and reduces a unit: per micro-batch (`fwd_ag`, `bwd_ag` per
    layer, `rs_mb`), or once per step (`ag_once`, 1 - `rs_mb`)."""

    fwd_ag: float
    bwd_ag: float
    ag_once: float
    rs_mb: float
    root_bwd_ag: float

    def gathers(self, layers: int, m: int) -> tuple[float, float]:
        """(layer gathers, root gathers) per step."""
        return (m * layers * (self.fwd_ag + self.bwd_ag) + self.ag_once * layers,
                m * (self.fwd_ag + self.root_bwd_ag) + self.ag_once)

    def reduces(self, m: int) -> float:
        """Reduce-scatters of each unit per step."""
        return m * self.rs_mb + (1.0 - self.rs_mb)


def fsdp_schedule(stage: int, w: StageWork) -> FsdpSchedule:
    L = w.layers
    pipelined = w.pp > 1
    # ZeRO-1 under tensor parallelism (FSDP2 without gradient sync until the last micro-batch)
    # reduce-scatters once per step and gathers every micro-batch (it reshards after backward).
    once = w.reduce_once and not pipelined
    # Forward gathers per micro-batch: stage 3 (reshards after forward) and ZeRO-1 under TP.
    # Stage 2 keeps its gathered units across micro-batches (techniques/zero.py `_keep_gathered`)
    # and a pipeline gathers at its first forward: once per step.
    fwd_ag = 1.0 if (stage == 3 or once) and not pipelined else 0.0
    # Stage 3 gathers a block again for its backward unless it stays gathered: blocks under the
    # persistence threshold, and without pipelining the last block and the root, whose backward
    # follows their forward at once (techniques/zero.py `_backward_follows_forward`).
    resharded = 0.0 if w.blocks_persist else (L if pipelined else max(0, L - 1))
    bwd_ag = ((resharded + w.regathered_layers) / L if L else 0.0) if stage == 3 else 0.0
    return FsdpSchedule(fwd_ag=fwd_ag, bwd_ag=bwd_ag, ag_once=1.0 - fwd_ag, rs_mb=0.0 if pipelined or once else 1.0,
                        root_bwd_ag=1.0 if stage == 3 and pipelined and not w.blocks_persist else 0.0)


def dp_step_bytes(stage: int, w: StageWork, shard: int, replicas: int = 1) -> float:
    """Bytes one rank sends per step over its data-parallel groups, in a ring (nccl-tests'
    bus factors: (n-1)/n of an all-gather's output or a reduce-scatter's input, 2 (n-1)/n of an
    all-reduce's buffer): what `tenfold plan --trace` records on the dp groups."""
    ring = (shard - 1) / shard if shard > 1 else 0.0
    grads = w.layers * w.layer_grad_bytes + w.root_grad_bytes
    if stage <= 1:  # DDP's all-reduce; ZeRO-1 also all-gathers the updated parameters
        params = w.layers * w.layer_param_bytes + w.root_param_bytes
        return 2 * ring * grads + (ring * params if stage == 1 else 0.0)
    sched = fsdp_schedule(stage, w)
    layer_gathers, root_gathers = sched.gathers(w.layers, w.micro_batches)
    sent = ring * (layer_gathers * w.layer_param_bytes + root_gathers * w.root_param_bytes
                   + sched.reduces(w.micro_batches) * grads)
    if replicas > 1:  # hybrid sharding: each 1/shard gradient shard all-reduced across the replicas
        sent += 2 * (replicas - 1) / replicas * grads / shard
    return sent


def _fsdp(stage: int, w: StageWork, hw: Hardware, g: comm.Group, overlap: bool) -> tuple[float, float, str]:
    ag = comm.all_gather_time(w.layer_param_bytes, hw, g)
    rs = comm.reduce_scatter_time(w.layer_grad_bytes, hw, g)
    ag_root = comm.all_gather_time(w.root_param_bytes, hw, g)
    rs_root = comm.reduce_scatter_time(w.root_grad_bytes, hw, g)
    L, m = w.layers, w.micro_batches
    pipelined = w.pp > 1
    sched = fsdp_schedule(stage, w)
    fwd_ag, bwd_ag, ag_once, rs_mb = sched.fwd_ag, sched.bwd_ag, sched.ag_once, sched.rs_mb
    layer_gathers, root_gathers = sched.gathers(L, m)
    total = layer_gathers * ag + root_gathers * ag_root + sched.reduces(m) * (L * rs + rs_root)
    what = f"FSDP2 stage {stage}: all-gather fwd " + ("per layer per micro-batch" if fwd_ag else "once per step")
    what += " + all-gather bwd per layer per micro-batch" if stage == 3 else ""
    what += (" + reduce-scatter per layer per micro-batch" if rs_mb else
             f", reduce-scatter once per step ({'pipelining' if pipelined else 'gradient sync at the last micro-batch'})")
    if not overlap:
        return total, total, what + ", not overlapped"
    bwd_root = ag_root if stage == 3 else 0.0
    fwd_exposed = layer_pipelined_exposed(L, w.layer_fwd_s, fwd_ag * (ag_root + ag), fwd_ag * ag)
    bwd_exposed = layer_pipelined_exposed(L, w.layer_bwd_s, bwd_root + bwd_ag * ag, bwd_ag * ag + rs_mb * rs,
                                          rs_mb * (rs + rs_root))
    # The one gather hides under the first forward, the one reduce under the last backward.
    step_exposed = ag_once * layer_pipelined_exposed(L, w.layer_fwd_s, ag_root + ag, ag)
    if not rs_mb:
        step_exposed += (layer_pipelined_exposed(L, w.layer_bwd_s, 0.0, bwd_ag * ag + rs, rs + rs_root)
                         - layer_pipelined_exposed(L, w.layer_bwd_s, 0.0, bwd_ag * ag))
    exposed = m * (fwd_exposed + bwd_exposed) + step_exposed
    return total, min(total, exposed), what + ", each hidden under one layer's compute"
