"""One short note per row of the predicted-vs-measured memory table, where the two numbers do
not count the same thing (summary.json `memory.notes`, the summary table).

The planner describes a run the way DeepSpeed's ZeRO paper counts it (Rajbhandari et al. 2020,
Table 1); the engine runs ZeRO-2/3 on FSDP2 and measures tensors at fixed moments of one step
(engine/memory/measure.py). Where those differ, the row says how, instead of leaving a bare percentage.
"""

from __future__ import annotations

from tenfold.plan.for_run import fmt_bytes


def row_notes(predicted: dict | None, measured: dict | None, zero_stage: int, dp: int,
              user_module: bool, offload: str = "none", on_cpu: bool = False) -> dict[str, str]:
    """{memory key: note} for the rows whose predicted and measured figures differ in kind."""
    if not measured:
        return {}
    notes: dict[str, str] = {}
    p = predicted or {}
    sharded = dp > 1 and zero_stage >= 2
    if sharded and zero_stage == 2 and p.get("params_bytes") and measured["params_bytes"] < 0.9 * p["params_bytes"]:
        notes["params_bytes"] = ("measured: this rank's fp32 shard (FSDP2); predicted: whole parameters, as "
                                 "DeepSpeed's ZeRO-2 keeps them; the copies FSDP2 gathers are `gathered params`")
    elif sharded:
        notes["params_bytes"] = "this rank's fp32 shard; the copies FSDP2 gathers to compute with are `gathered params`"
    if offload != "none" and on_cpu:
        notes["optimizer_bytes"] = ("measured: what the optimizer holds in host memory too (on a CPU the device is "
                                    "the host); predicted: device memory only (the host's share is planned apart)")
    if user_module:
        notes["activations_bytes"] = "not predicted for your own module: the planner knows only its parameter count"
    notes["total_bytes"] = "each term at its own high (states at the optimizer step): an upper bound of the peak"
    notes["peak_bytes"] = _peak_note(p, measured)
    return notes


def _peak_note(predicted: dict, measured: dict) -> str:
    parts = []
    if measured.get("peak_bytes", 0) <= measured.get("total_bytes", 0):
        parts.append("measured: the step's highest moment, below the sum")
    other = predicted.get("other_bytes") or 0
    if other:
        # What the planner prices for the engine that runs: DDP's two 25 MiB gradient buckets
        # (ZeRO-0/1), FSDP2's unsharded gradient unit (and at ZeRO-3 two gathered units).
        parts.append(f"predicted: the sum + {fmt_bytes(other)} of communication buffers")
    return "; ".join(parts)
