"""Gathered parameters: the unsharded working copies of parameters a rank holds beside its own
(`gathered_params_bytes`, a memory term of its own, never activations): FSDP2's gathered units
and their all-gather buffers, the pipeline's unsharded stages, torch.amp's 16-bit weight casts
(docs/planner.md, "Gathered parameters")."""

from __future__ import annotations

from tenfold.models.presets import embedding_param_count, norm_param_count
from tenfold.plan import lora as lora_plan
from tenfold.plan.fp8 import block_param_bytes
from tenfold.run import ResolvedRun
from tenfold.terms import CPU_UNIT_BUCKET, MULTI_STAGE_SCHEDULES, element_bytes, runs_on_fsdp2


def gathered_param_bytes(stage_params: float, run: ResolvedRun, largest_unit: float,
                         next_unit: float | None = None, on_cpu: bool = False, block: float | None = None) -> float:
    """Unsharded working copies of parameters on the device, beyond the rank's own parameters
    (`params_bytes`), at their high (the start of backward): FSDP2's all-gathered units in the
    compute dtype (MixedPrecisionPolicy param_dtype; float8 blocks with --fp8). ZeRO-3 without
    pipelining: `zero3_gathered_params` and the all-gather buffers of the units fetched ahead
    (PyTorch PR #128884; DeepSpeed's ZeRO-3 likewise). ZeRO-2, `replicate` under tensor parallelism and any
    FSDP2 stage under pipelining (torch.distributed.pipelining keeps the stage unsharded until
    its last micro-batch): every unit of the stage, from its forward to its backward. DDP and
    one process keep fp32 parameters under torch.amp: `autocast_weight_copy_bytes`, which the
    caller adds. A 16-bit stack (master weights) computes on its own 16-bit parameters."""
    unit_bytes = _gathered_bytes_per_param(run)
    if not _fsdp2_gathers(run):
        return 0.0
    if run.zero_runs_as == 3 and run.pp == 1:
        return unit_bytes * (zero3_gathered_params(stage_params, run, largest_unit, block)
                             + all_gather_buffer(run, largest_unit, next_unit, on_cpu))
    return unit_bytes * (stage_params * active_stage_share(run)
                         + all_gather_buffer(run, largest_unit, next_unit, on_cpu))


def _fsdp2_gathers(run: ResolvedRun) -> bool:
    """Whether FSDP2 gathers the rank's parameters into working copies: ZeRO-3 without
    pipelining, or any FSDP2 layout whose parameters are not a 16-bit stack's own."""
    return (run.zero_runs_as == 3 and run.pp == 1) or (
        runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload) and not run.stack.master_weights)


def _gathered_bytes_per_param(run: ResolvedRun) -> float:
    if run.lora is not None and run.model is not None:  # the frozen base (16-bit or NF4) and the adapters
        return lora_plan.unit_bytes_per_param(run)[0]
    return block_param_bytes(run)


def all_gather_buffer_bytes(run: ResolvedRun, largest_unit: float, next_unit: float | None = None,
                            on_cpu: bool = False) -> float:
    """Bytes of `all_gather_buffer`. They are held in forward, before the activations reach their
    high; in backward FSDP2 frees each buffer at its copy-out, so they are left out of the peak
    (the trace's peaks agree: tests/test_trace.py)."""
    if not _fsdp2_gathers(run):
        return 0.0
    return _gathered_bytes_per_param(run) * all_gather_buffer(run, largest_unit, next_unit, on_cpu)


def all_gather_buffer(run: ResolvedRun, largest_unit: float, next_unit: float | None = None,
                      on_cpu: bool = False) -> float:
    """Parameters in FSDP2's all-gather buffers beside the gathered ones: a unit's parameters are
    all-gathered into one flat buffer and copied out into their own storages; in forward the
    buffer is freed only after the next unit's copy-out (FSDP2's `wait_for_unshard`, so that the
    copy-out overlaps the next all-gather), so two units' buffers exist at once: the largest and
    `next_unit` (None: one as large; a block's expert-parallel experts are a unit of their own
    after it). None where FSDP2 does not shard (one rank, `replicate`). `on_cpu`: the engine's
    CPU units (tenfold.techniques.zero: ZeRO-2 groups blocks up to `CPU_UNIT_BUCKET` elements,
    and each unit's gather is issued ahead as async work), one unit's buffer at a time."""
    if run.zero_runs_as < 2 or run.shard_size <= 1:
        return 0.0
    if on_cpu:
        bucket = run.reduce_bucket_size or CPU_UNIT_BUCKET
        grouped = max(1, int(bucket // largest_unit)) if run.zero_runs_as == 2 and largest_unit else 1
        return min(grouped, max(run.rank_layers(0), 1)) * largest_unit
    if run.pp > 1 and run.pp_schedule in MULTI_STAGE_SCHEDULES:
        # the runtime schedules unshard whole stages ahead of their compute (`active_stage_share`)
        # and wait for them outside forward, which frees each buffer at its own copy-out
        return largest_unit
    return largest_unit + (largest_unit if next_unit is None else next_unit)


# torch.distributed.pipelining's runtime schedules (interleaved, zero-bubble) unshard at most this
# many of a rank's stage modules at once: they prefetch the next three stages to compute and
# reshard the others (`_add_unshard_reshard(max_active_stages=3)`, torch 2.13 schedules.py).
MAX_ACTIVE_STAGES = 3


def active_stage_share(run: ResolvedRun) -> float:
    """The share of a pipeline rank's stage modules whose FSDP2 units are gathered at once: all of
    them under 1F1B and GPipe (one stage a rank), 3 of v under the multi-stage schedules
    (`MAX_ACTIVE_STAGES`; stages taken as equal)."""
    if run.pp <= 1 or run.pp_schedule not in MULTI_STAGE_SCHEDULES:
        return 1.0
    return min(run.virtual_stages, MAX_ACTIVE_STAGES) / run.virtual_stages




def zero3_gathered_params(stage_params: float, run: ResolvedRun, largest_unit: float,
                          block: float | None = None) -> float:
    """Parameters ZeRO-3 holds gathered at once without pipelining (techniques/zero.py
    `_wrap_fsdp2`): block units of at most `parallel.param_persistence_threshold` elements
    (DeepSpeed's stage3_param_persistence_threshold) stay gathered from forward to backward, and
    the root unit (embedding, final norm, head) is never freed after forward (its backward
    follows at once: `_backward_follows_forward`), so with persistent blocks the whole stage is
    gathered (tests/test_trace.py: exact). Blocks above the threshold are freed after forward:
    the root and the block computing are gathered, the next block's copy is its all-gather
    buffer (`all_gather_buffer`; in backward the prefetched block and one buffer: as much). The
    threshold is compared with a block's whole parameter count, as FSDP2 counts a DTensor's
    elements (`largest_unit` x tp: the block's tp-split weights). `block`: one block's
    parameters on the rank (unknown: two of the largest units)."""
    layers = run.rank_layers(0) if run.model is not None else 0
    if not layers:  # --params: the whole stage is one unit
        return stage_params
    if blocks_persist(run, largest_unit):
        return stage_params  # every block persists, and the root with them
    if block is None:
        return min(2, layers) * largest_unit
    return stage_params - (layers - 1) * block  # the root and one block


def blocks_persist(run: ResolvedRun, block_params: float) -> bool:
    """ZeRO-3 keeps a block unit gathered from forward to backward when its whole parameter
    count (FSDP2 counts a DTensor's elements: the rank's share x tp) is at most
    `parallel.param_persistence_threshold` (techniques/zero.py `_reshard_after_forward`)."""
    return block_params * run.tp <= run.param_persistence_threshold


def autocast_weight_copy_bytes(stage_params: float, run: ResolvedRun, uncast_params: float = 0.0) -> float:
    """torch.amp with fp32 params outside FSDP2 (DDP, one process): each Linear saves the
    16-bit cast of its weight for backward, so a full 16-bit copy of the rank's matmul weights
    is alive from forward to backward (2 bytes/param); `uncast_params` are the rank's weights no
    matmul reads (`uncast_param_count`). Under FSDP2 the layers compute on its gathered 16-bit
    copies instead (gathered_param_bytes); a 16-bit stack on its own params."""
    if run.precision == "fp32" or run.stack.master_weights or runs_on_fsdp2(run.zero_stage, run.tp, run.dp, run.offload):
        return 0.0
    return element_bytes(run.precision) * max(0.0, stage_params - uncast_params)


def uncast_param_count(cfg, blocks: int, first: bool, last: bool) -> float:
    """Weights of a rank of tenfold's GPT that torch.amp leaves in fp32: the lookup tables on
    the first stage (an embedding is on none of autocast's lists; a token table tied to the
    output projection is cast for that matmul) and the norms' weights, which compute in fp32
    (tenfold/models/gpt.py)."""
    if cfg is None:
        return 0.0
    tied = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    tables = embedding_param_count(cfg) - tied if first else 0
    return tables + norm_param_count(cfg) * (2 * blocks + (1 if last else 0))
