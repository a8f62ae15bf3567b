"""Pipeline layout without torch: how many stages a schedule makes and which rank owns which,
how the blocks are divided among the stages (by FQN, torchtitan's
`generate_llm_fqn_per_model_part`), and the checks a run must pass before any process group
exists. `tenfold.techniques.pipeline` builds the stages from this; `tenfold train --dry-run`
and the launcher run the same checks without importing torch.
"""

from __future__ import annotations

from typing import Sequence

from tenfold.errors import UserError
from tenfold.terms import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES


# --------------------------------------------------------------------------- validation


def num_stages(pp_size: int, schedule: str, virtual_stages: int) -> int:
    """Total pipeline stages: P for single-stage schedules, P*V for interleaved ones."""
    return pp_size * (virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1)


def validate_pipeline(
    *,
    n_layers: int,
    world_size: int,
    pp_size: int,
    schedule: str,
    virtual_stages: int,
    n_microbatches: int,
    pp_split: Sequence[int] | None = None,
    tie_embeddings: bool = False,
    zero_stage: int = 0,
) -> None:
    """Every way a pipeline config can be wrong, as a `UserError` (exit 2) naming the field,
    the value and what is allowed, before any process group or model is touched."""
    if schedule not in PIPELINE_SCHEDULES:
        raise UserError(
            f"parallel.pp_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}"
        )
    check_pp_degree(pp_size, world_size)
    if virtual_stages < 1:
        raise UserError(f"parallel.virtual_stages must be >= 1, got {virtual_stages}")
    if virtual_stages > 1 and schedule not in MULTI_STAGE_SCHEDULES:
        raise UserError(
            f"parallel.virtual_stages={virtual_stages} needs an interleaved schedule "
            f"({' or '.join(MULTI_STAGE_SCHEDULES)}); parallel.pp_schedule is {schedule!r}"
        )
    if pp_size == 1:
        return
    if tie_embeddings:
        raise UserError(
            "model.tie_embeddings=true cannot be pipelined: the embedding (first stage) and the "
            "output head (last stage) would share one weight across ranks; set "
            "model.tie_embeddings=false or use --pp 1"
        )
    stages = num_stages(pp_size, schedule, virtual_stages)
    if stages > n_layers:
        raise UserError(
            f"{stages} pipeline stages (parallel.pp_degree={pp_size} x virtual_stages="
            f"{virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1}) is more than the "
            f"model's {n_layers} layers; use fewer stages"
        )
    if pp_split is not None:
        check_manual_split(pp_split, stages, n_layers)
    _check_microbatches(schedule, pp_size, n_microbatches, world_size // pp_size, zero_stage)


def _check_microbatches(schedule: str, pp_size: int, n_microbatches: int, dp_size: int, zero_stage: int) -> None:
    # Every stage must see every micro-batch at least once per step, otherwise the
    # schedule deadlocks or idles (torch's Schedule1F1B raises for m < P itself).
    if n_microbatches < pp_size:
        raise UserError(
            f"pipeline needs at least as many micro-batches per step as stages: "
            f"train.grad_accum={n_microbatches} < parallel.pp_degree={pp_size}; "
            f"raise --grad-accum to >= {pp_size}"
        )
    # The interleaved schedules run in rounds of P micro-batches (torch: m % rounds == 0,
    # rounds = m // P); we ask for the simpler sufficient rule m % P == 0.
    if schedule in MULTI_STAGE_SCHEDULES and n_microbatches % pp_size:
        raise UserError(
            f"the {schedule} schedule needs train.grad_accum ({n_microbatches}) to be a multiple "
            f"of parallel.pp_degree ({pp_size})"
        )
    # Zero-bubble computes weight gradients in separate W passes after the input-gradient
    # pass that DDP's reducer takes as the last backward: DDP all-reduces before the last
    # W passes have accumulated (measured: the loss drifts 5e-3 from one process by step 2
    # on tiny, torch 2.13). FSDP2 reduces in the schedule's explicit REDUCE_GRAD action.
    if schedule == "zero-bubble" and dp_size > 1 and zero_stage <= 1:
        raise UserError(
            f"the zero-bubble schedule with data parallelism needs parallel.zero_stage 2 or 3 "
            f"(FSDP2), got {zero_stage} (DDP); use --zero 2/3 or --pp-schedule interleaved"
        )


def check_pp_degree(pp_size: int, world_size: int) -> None:
    if pp_size < 1:
        raise UserError(f"parallel.pp_degree must be >= 1, got {pp_size}")
    if world_size % pp_size:
        raise UserError(
            f"parallel.pp_degree ({pp_size}) must divide the number of processes ({world_size}); "
            f"world = pp x dp, so use --pp in {divisors(world_size)} or change --nproc"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_manual_split(pp_split: Sequence[int], stages: int, n_layers: int) -> None:
    if len(pp_split) != stages:
        raise UserError(
            f"parallel.pp_split has {len(pp_split)} entries but there are {stages} stages; "
            f"give one block count per stage"
        )
    if any(n < 0 for n in pp_split) or sum(pp_split) != n_layers:
        raise UserError(
            f"parallel.pp_split {list(pp_split)} must be non-negative block counts summing to "
            f"model.n_layers ({n_layers})"
        )
    if any(n == 0 for n in pp_split[1:-1]):
        raise UserError(
            f"parallel.pp_split {list(pp_split)}: a middle stage with no blocks would do no "
            f"work; only the first (embedding) and last (head) stage may have 0 blocks"
        )


# --------------------------------------------------------------------------- the split


def layer_counts(n_layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """Blocks per stage with the embedding and the head weighted as `input_weight` and
    `output_weight` layers (torchtitan `generate_llm_fqn_per_model_part`): the
    L + w_in + w_out "effective layers" are cut into equal parts, earlier stages taking
    the remainder, and the first/last stage give up w_in/w_out of their share."""
    if stages == 1:
        return [n_layers]
    effective = n_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, stages)
    if per_stage < max(input_weight, output_weight):
        raise UserError(
            f"cannot split {n_layers} layers into {stages} stages with the embedding and head "
            f"weighted as layers; use fewer stages or --pp-split"
        )
    counts, left = [], n_layers
    for s in range(stages):
        share = per_stage + (1 if s < extra else 0)
        if s == 0:
            share -= input_weight
        if s == stages - 1:
            share -= output_weight
        take = min(share, left) if s < stages - 1 else left
        counts.append(take)
        left -= take
    return counts


def split_fqns(n_layers: int, counts: Sequence[int], has_pos_emb: bool) -> list[list[str]]:
    """Module names (FQNs in `GPT`) owned by each stage, given blocks per stage."""
    out, start = [], 0
    for s, n in enumerate(counts):
        names = []
        if s == 0:
            names += ["tok_emb"] + (["pos_emb"] if has_pos_emb else [])
        names += [f"layers.{i}" for i in range(start, start + n)]
        if s == len(counts) - 1:
            names += ["norm", "output"]
        out.append(names)
        start += n
    return out


def local_stage_ids(pp_rank: int, pp_size: int, n_stages: int) -> list[int]:
    """Looped placement: rank r runs stages r, r+P, ... (Megatron's interleaving)."""
    return list(range(pp_rank, n_stages, pp_size))


# --------------------------------------------------------------------------- a run's checks


def validate_run(run) -> None:
    """`validate_pipeline` for a resolved run (tenfold.run.ResolvedRun); call it before the
    process group exists."""
    validate_pipeline(
        n_layers=run.model.n_layers, world_size=run.world_size, pp_size=run.pp, schedule=run.pp_schedule,
        virtual_stages=run.virtual_stages, n_microbatches=run.grad_accum,
        pp_split=run.config.parallel.pp_split, tie_embeddings=run.model.tie_embeddings, zero_stage=run.zero_stage,
    )
