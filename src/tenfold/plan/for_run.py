"""The planner's view of a `tenfold train` run: the resolved run (tenfold.run) as a planner
`Strategy`, so that the prediction printed at the start of a run and `tenfold plan` for the
same config come from one translation, and the prediction as the run reports it (the keys of
summary.json's `memory.predicted`, the line printed at the start)."""

from __future__ import annotations

from tenfold import capabilities
from tenfold.config import TenfoldConfig
from tenfold.models.presets import ModelConfig
from tenfold.plan.api import MemoryBreakdown, Plan, predict
from tenfold.plan.strategy import Strategy
from tenfold.run import ResolvedRun, sequence_parallel_for
from tenfold.terms import virtual_stages_for

# How tenfold's engine trains: fp32 parameters under torch.amp autocast (no 16-bit master
# split), eager PyTorch activations (fp32 residual stream, no dropout, SDPA without an s^2 term).
ENGINE_STACK = {"master_weights": False, "grads_fp32": False, "dropout": False, "flash_attention": True,
                "activation_style": "tenfold"}


def strategy_for_run(run: ResolvedRun, precision: str | None = None) -> Strategy:
    """`precision`: the one the engine really runs (bf16 falls back to fp32 on a device without
    it); default the configured one."""
    return Strategy(
        precision=precision or run.precision, micro_batch=run.micro_batch, grad_accum=run.grad_accum,
        global_batch=run.global_batch, seq_len=run.seq_len, ac=str(run.recompute), zero=engine_zero_stage(run),
        pp=run.pp, pp_schedule=run.pp_schedule, virtual_stages=run.virtual_stages, tp=run.tp,
        sequence_parallel=run.sequence_parallel, offload=run.offload, **ENGINE_STACK,
    )


def strategy_for_config(cfg: TenfoldConfig, seq_len: int | None) -> Strategy:
    """A config's strategy for a model the config does not describe (`tenfold plan --params N`):
    the batch triplet is resolved by the planner, with the same rule (tenfold.terms)."""
    t, par = cfg.train, cfg.parallel
    return Strategy(
        precision=cfg.precision.dtype, micro_batch=t.micro_batch, grad_accum=t.grad_accum, global_batch=t.global_batch,
        seq_len=seq_len, ac=cfg.recompute.policy, zero=par.zero_stage, pp=par.pp_degree, pp_schedule=par.pp_schedule,
        virtual_stages=par.virtual_stages, tp=par.tp_degree,
        sequence_parallel=sequence_parallel_for(par.tp_degree, par.sequence_parallel), offload=par.offload, **ENGINE_STACK,
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


def strategy_problems(s: Strategy, model: ModelConfig, gpus: int, micro_batches: int,
                      model_kind: str = "tenfold", hf_model_type: str = "") -> list[str]:
    """Why `tenfold train` cannot run strategy `s` (tenfold.capabilities); empty when it can."""
    v = virtual_stages_for(s.pp_schedule, s.virtual_stages) if s.pp > 1 else 1
    return capabilities.problems(capabilities.Layout(
        model=model, world_size=gpus, pp=s.pp, zero=s.zero, recompute=s.policy, precision=s.precision,
        micro_batches=micro_batches, schedule=s.pp_schedule, virtual_stages=v, tp=s.tp, offload=s.offload,
        model_kind=model_kind, hf_model_type=hf_model_type,
    ))


def stack_departures(s: Strategy) -> list[str]:
    """The modelling choices in `s` that describe another training stack than tenfold's."""
    return [f"{key}={getattr(s, key)}" for key, value in ENGINE_STACK.items() if getattr(s, key) != value]


# --------------------------------------------------------------------------- as a run reports it

MEMORY_LINE_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")


def memory_by_category(m: MemoryBreakdown) -> dict[str, int]:
    """The planner's per-rank memory under the engine's measured keys (summary.json's
    `memory.predicted`; tenfold.engine.memory.MEMORY_KEYS).

    activations_bytes includes the autocast 16-bit weight copies (a tensor tracker sees them as
    activations: created in forward, saved for backward); peak_bytes is the planner's allocated
    total (model states + activations + communication buffers, no allocator reserve or CUDA
    context, which no tensor tracker sees); total_bytes = params + grads + optimizer + activations."""
    act = (m.activations_bytes or 0.0) + (m.autocast_weight_copies_bytes or 0.0)
    out = {
        "params_bytes": m.params_bytes, "grads_bytes": m.grads_bytes, "optimizer_bytes": m.optimizer_bytes,
        "activations_bytes": act, "buffers_bytes": 0, "other_bytes": m.comm_buffers_bytes,
        "peak_bytes": m.peak_bytes,
    }
    out["total_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"] + act
    return {k: int(round(v)) for k, v in out.items()}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def memory_line(predicted: dict[str, int]) -> str:
    """The line `tenfold train` prints at its start, and `tenfold plan` for the same run."""
    return ("memory per rank, predicted (planner): "
            + " | ".join(f"{k.removesuffix('_bytes')} {fmt_bytes(predicted[k])}" for k in MEMORY_LINE_KEYS)
            + f" | peak {fmt_bytes(predicted['peak_bytes'])}")


def batch_line(batch: dict, dp: int) -> str:
    """`batch 16 = 8 x 1 x dp 2 | seq 256`, as the run's header line says it."""
    return (f"batch {batch['global_batch']} = {batch['micro_batch']} x {batch['grad_accum']} x dp {dp} "
            f"| seq {batch['seq_len']}")
