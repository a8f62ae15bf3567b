"""The planner's view of a `tenfold train` run: the resolved run (tenfold.run) as a planner
`Strategy`, so that the prediction printed at the start of a run and `tenfold plan` for the
same config come from one translation."""

from __future__ import annotations

from tenfold.plan.api import Plan, predict
from tenfold.plan.strategy import Strategy
from tenfold.run import ResolvedRun


def strategy_for_run(run: ResolvedRun, precision: str | None = None) -> Strategy:
    """How tenfold's engine trains: fp32 parameters under torch.amp autocast (no 16-bit
    master split), eager PyTorch activations (fp32 residual stream, no dropout, SDPA without
    an s^2 term). `precision`: the one the engine really runs (bf16 falls back to fp32 on a
    device without it); default the configured one."""
    return Strategy(
        precision=precision or run.precision, micro_batch=run.micro_batch, grad_accum=run.grad_accum,
        global_batch=run.global_batch, seq_len=run.seq_len, ac=str(run.recompute), zero=engine_zero_stage(run),
        pp=run.pp, pp_schedule=run.pp_schedule, virtual_stages=run.virtual_stages,
        tp=run.tp, sequence_parallel=run.sequence_parallel, master_weights=False, dropout=False, flash_attention=True, activation_style="tenfold",
    )


def engine_zero_stage(run: ResolvedRun) -> int:
    """The ZeRO stage whose memory the engine really holds: under tensor parallelism ZeRO-1 runs
    on FSDP2 like stage 2 (DDP and ZeroRedundancyOptimizer take no DTensor parameters), so its
    gradients are 1/N at the optimizer step too (docs/zero.md)."""
    return 2 if run.zero_stage == 1 and run.tp > 1 and run.dp > 1 else run.zero_stage


def predict_run(run: ResolvedRun, hardware: str, precision: str | None = None, model=None) -> Plan:
    """`model`: what the planner is given instead of the run's configured shape (a parameter
    count for a user's own module: then only model states are predicted)."""
    shape = model if model is not None else run.model
    return predict(shape, hardware, run.world_size, strategy_for_run(run, precision))
