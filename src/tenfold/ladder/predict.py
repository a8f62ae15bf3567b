"""The planner's forecast for a rung, and the micro-batch the memory budget allows.

The prediction uses the same config the rung trains with: `build_config(user layers, rung
overrides)` -> `tenfold.engine.memory.planner_strategy` (how tenfold's engine runs it: fp32
parameters under autocast, eager activations) -> `tenfold.plan.api.predict` on the planner's
hardware entry for this device (`cpu`: peak FLOP/s measured by `tenfold.engine.peak`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tenfold.ladder.rungs import LadderSetup, RungSpec, divisors, recompute_rung


@dataclass
class Prediction:
    tokens_per_s: float | None = None
    peak_bytes: float | None = None
    memory: dict[str, int] = field(default_factory=dict)  # the measurement's keys (engine/memory.py)
    step_time_s: float | None = None
    mfu: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "peak_bytes": self.peak_bytes, "memory": self.memory,
                "step_time_s": self.step_time_s, "mfu": self.mfu, "error": self.error}


def rung_config(spec: RungSpec, user_layers: list[dict]):
    from tenfold.config import build_config

    return build_config(*user_layers, spec.overrides)


def predict_rung(spec: RungSpec, user_layers: list[dict], device_type: str = "cpu") -> Prediction:
    """The planner's tokens/s and per-rank memory for this rung (never raises: a planner that
    cannot answer is reported in `error`, beside the measurement)."""
    try:
        import torch

        from tenfold.engine.memory import planner_hardware_name, planner_strategy, predicted_memory
        from tenfold.plan.api import predict

        cfg = rung_config(spec, user_layers)
        k = spec.knobs
        device = torch.device(device_type)
        dist = SimpleNamespace(dp_size=k["dp"], world_size=spec.nproc, device=device)
        dtype = k["precision"]
        plan = predict(cfg.model_config_resolved(), planner_hardware_name(device), spec.nproc,
                       planner_strategy(cfg, dist, dtype))
        mem = predicted_memory(cfg, dist, dtype, plan=plan)
        return Prediction(plan.tokens_per_s, mem["peak_bytes"], mem, plan.step_time_s, plan.mfu)
    except Exception as exc:  # the planner is another component: report, don't stop the ladder
        return Prediction(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])


@dataclass
class MicroBatchChoice:
    micro_batch: int
    note: str
    candidates: list[dict]  # per micro-batch: predicted peak with and without recompute


def choose_micro_batch(setup: LadderSetup, user_layers: list[dict], budget_bytes: float,
                       activation_scale: float = 1.0, device_type: str = "cpu") -> MicroBatchChoice:
    """The largest micro-batch (a divisor of the global batch) whose predicted peak with
    recompute fits `budget_bytes`; the prediction's activations are scaled by
    `activation_scale` = measured / predicted activations of the rung before (same precision,
    micro-batch 1, no recompute), so a planner that is off by a constant factor still picks a
    micro-batch that fits (DeepSpeed's autotuner does the same: profile activation memory at
    micro-batch 1, then extrapolate)."""
    rows = []
    for mb in divisors(setup.global_batch):
        with_ac = predict_rung(recompute_rung(setup, mb, ""), user_layers, device_type)
        plain = predict_rung(recompute_rung(_without_ac(setup), mb, ""), user_layers, device_type)
        if with_ac.error or plain.error:
            return MicroBatchChoice(1, f"micro-batch 1: the planner could not predict memory ({with_ac.error or plain.error})", [])
        rows.append({"micro_batch": mb, "with_recompute": _scaled_peak(with_ac, activation_scale),
                     "without_recompute": _scaled_peak(plain, activation_scale)})
    fits_ac = [r["micro_batch"] for r in rows if r["with_recompute"] <= budget_bytes]
    fits_plain = [r["micro_batch"] for r in rows if r["without_recompute"] <= budget_bytes]
    mb = max(fits_ac, default=1)
    peak = next(r["with_recompute"] for r in rows if r["micro_batch"] == mb)
    scale = f" (activations x{activation_scale:.2f}, measured/predicted on the rung before)" if activation_scale != 1.0 else ""
    if not fits_ac:
        note = (f"nothing fits the {_mib(budget_bytes)} budget even with recompute (micro-batch 1 needs "
                f"{_mib(peak)}{scale}); running micro-batch 1")
    else:
        without = f"micro-batch {max(fits_plain)}" if fits_plain else "not even micro-batch 1"
        note = (f"micro-batch {mb}: predicted peak {_mib(peak)} <= budget {_mib(budget_bytes)}{scale}; "
                f"without recompute {without} would fit")
    return MicroBatchChoice(mb, note, rows)


def _without_ac(setup: LadderSetup) -> LadderSetup:
    from dataclasses import replace

    return replace(setup, ac_policy="none")


def _scaled_peak(p: Prediction, activation_scale: float) -> float:
    act = float(p.memory.get("activations_bytes", 0))
    return float(p.peak_bytes or 0) + (activation_scale - 1.0) * act


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"
