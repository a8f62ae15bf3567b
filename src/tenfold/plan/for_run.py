"""The prediction as a `tenfold train` run reports it: the planner's figures for the resolved
run (tenfold.run) under the engine's measured keys (summary.json's `memory.predicted`), the
line printed at the start of a run and by `tenfold plan` for the same config, and the batch
line."""

from __future__ import annotations

from dataclasses import replace

from tenfold.plan.api import MemoryBreakdown, Plan, predict, predict_memory
from tenfold.run import ResolvedRun


def _as_run(run: ResolvedRun, precision: str | None, params: float | None) -> ResolvedRun:
    if precision is not None and precision != run.precision:
        run = run.with_(precision=precision, check=False)
    if params is not None:
        run = replace(run, model=None, params=float(params))
    return run


def predict_run(run: ResolvedRun, hardware, precision: str | None = None, params: float | None = None) -> Plan:
    """`precision`: the one the engine really runs (bf16 falls back to fp32 on a device without
    it); default the configured one. `params`: the parameter count of a user's own module, whose
    shape the config does not describe (then only model states are predicted)."""
    return predict(_as_run(run, precision, params), hardware)


def predict_run_memory(run: ResolvedRun, hardware, precision: str | None = None,
                       params: float | None = None) -> MemoryBreakdown:
    """Only the memory of `predict_run`: no time, so no peak FLOP/s (on a CPU: no measurement)."""
    return predict_memory(_as_run(run, precision, params), hardware)


# --------------------------------------------------------------------------- as a run reports it

MEMORY_LINE_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_params_bytes", "activations_bytes",
                    "total_bytes")
MEMORY_LINE_NAMES = {"gathered_params_bytes": "gathered params"}


def memory_by_category(m: MemoryBreakdown) -> dict[str, int]:
    """The planner's per-rank memory under the engine's measured keys (summary.json's
    `memory.predicted`; tenfold.engine.memory.measure.MEMORY_KEYS).

    gathered_params_bytes: the unsharded working copies of parameters beside the rank's own
    (FSDP2's all-gathered units, torch.amp's 16-bit weight casts: `memory.gathered_params_bytes`
    of `tenfold plan --json`, the same term); activations_bytes: saved tensors and temporaries
    only. peak_bytes is the planner's allocated total (model states + gathered params +
    activations + communication buffers, no allocator reserve or CUDA context, which no tensor
    tracker sees); total_bytes = params + grads + optimizer + gathered params + activations."""
    out = {
        "params_bytes": m.params_bytes, "grads_bytes": m.grads_bytes, "optimizer_bytes": m.optimizer_bytes,
        "gathered_params_bytes": m.gathered_params_bytes, "activations_bytes": m.activations_bytes or 0.0,
        "buffers_bytes": 0, "other_bytes": m.comm_buffers_bytes, "peak_bytes": m.peak_bytes,
    }
    out["total_bytes"] = sum(out[k] for k in MEMORY_LINE_KEYS[:-1])
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
            + " | ".join(f"{MEMORY_LINE_NAMES.get(k, k.removesuffix('_bytes'))} {fmt_bytes(predicted.get(k, 0))}"
                         for k in MEMORY_LINE_KEYS)
            + f" | peak {fmt_bytes(predicted['peak_bytes'])}")


def batch_line(batch: dict, dp: int) -> str:
    """`batch 16 = 8 x 1 x dp 2 | seq 256`, as the run's header line says it."""
    return (f"batch {batch['global_batch']} = {batch['micro_batch']} x {batch['grad_accum']} x dp {dp} "
            f"| seq {batch['seq_len']}")
