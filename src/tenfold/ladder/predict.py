"""The planner's forecast for a rung, and the micro-batch the memory budget allows.

The prediction uses the same config the rung trains with: `build_config(user layers, rung
overrides)` -> `tenfold.run.resolve_run` (the run the engine builds: fp32
parameters under autocast, eager activations) -> `tenfold.plan.api.predict` on the planner's
hardware entry for this device (`cpu`: peak FLOP/s measured by `tenfold.engine.observe.peak`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from tenfold.ladder.rungs import LadderSetup, RungSpec, divisors, recompute_rung


@dataclass
class Prediction:
    tokens_per_s: float | None = None
    peak_bytes: float | None = None
    memory: dict[str, int] = field(default_factory=dict)  # the measurement's keys (engine/memory/measure.py)
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

        from tenfold.engine.memory.measure import planner_hardware_name, predicted_memory
        from tenfold.plan.for_run import predict_run
        from tenfold.run import resolve_run

        run = resolve_run(rung_config(spec, user_layers), spec.nproc)
        device = torch.device(device_type)
        dtype = spec.knobs["precision"]
        plan = predict_run(run, planner_hardware_name(device), dtype)
        mem = predicted_memory(run, device, dtype, plan=plan)
        return Prediction(plan.tokens_per_s, mem["peak_bytes"], mem, plan.step_time_s, plan.mfu)
    except Exception as exc:  # the planner is another component: report, don't stop the ladder
        return Prediction(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])


@dataclass
class MicroBatchChoice:
    micro_batch: int
    policy: str
    note: str
    candidates: list[dict]  # per (policy, micro-batch): predicted peak and tokens/s


def recompute_policies(requested: str, n_layers: int) -> list[str]:
    """`auto`: every policy that recomputes something, from the cheapest to `full`; else the one asked for."""
    if requested != "auto":
        return [requested]
    return ["selective", *[f"every:{n}" for n in range(n_layers, 1, -1)], "full"]


def choose_micro_batch(setup: LadderSetup, user_layers: list[dict], budget_bytes: float,
                       activation_scale: float = 1.0, device_type: str = "cpu") -> MicroBatchChoice:
    """The recompute rung's micro-batch and policy under a per-rank memory budget.

    1. the largest micro-batch (a divisor of the global batch: bigger GEMMs run closer to
       peak) whose predicted peak fits `budget_bytes` with the most memory-saving policy;
    2. at that micro-batch, the policy the planner predicts fastest (the least recompute)
       among those that fit (`--ac auto`; a fixed `--ac` skips the search).
    Predicted activations are scaled by `activation_scale` = measured / predicted activations
    of the rung before (same precision, micro-batch 1, no recompute), so a planner that is off
    by a constant factor still picks a micro-batch that fits (DeepSpeed's autotuner does the
    same: profile activation memory at micro-batch 1, then extrapolate)."""
    policies = recompute_policies(setup.ac_policy, _n_layers(recompute_rung(setup, 1, ""), user_layers))
    rows = []
    for mb in divisors(setup.global_batch):
        for policy in [*policies, "none"]:
            row = _candidate(recompute_rung(replace(setup, ac_policy=policy), mb, ""), user_layers, activation_scale,
                             device_type, micro_batch=mb, policy=policy)
            if "error" in row:
                return MicroBatchChoice(1, policies[-1], f"micro-batch 1: the planner could not predict memory ({row['error']})", [])
            rows.append(row)
    peak = {(r["micro_batch"], r["policy"]): r["peak_bytes"] for r in rows}
    strongest = max(policies, key=lambda pol: -peak[(setup.global_batch, pol)])  # least memory at the largest batch
    fitting = [mb for mb in divisors(setup.global_batch) if peak[(mb, strongest)] <= budget_bytes]
    scale = f" (activations x{activation_scale:.2f}, measured/predicted on the rung before)" if activation_scale != 1.0 else ""
    if not fitting:
        return MicroBatchChoice(1, strongest, (
            f"nothing fits the {_mib(budget_bytes)} budget even with recompute {strongest} (micro-batch 1 needs "
            f"{_mib(peak[(1, strongest)])}{scale}); running micro-batch 1"), rows)
    mb = max(fitting)
    ok = [r for r in rows if r["micro_batch"] == mb and r["policy"] in policies and r["peak_bytes"] <= budget_bytes]
    policy = _fastest(ok)["policy"]
    plain_fit = [m for m in divisors(setup.global_batch) if peak[(m, "none")] <= budget_bytes]
    without = f"micro-batch {max(plain_fit)}" if plain_fit else "not even micro-batch 1"
    note = (f"micro-batch {mb}, recompute {policy}: predicted peak {_mib(peak[(mb, policy)])} <= budget "
            f"{_mib(budget_bytes)}{scale}; without recompute {without} would fit")
    return MicroBatchChoice(mb, policy, note, rows)


@dataclass
class PolicyChoice:
    policy: str
    note: str
    candidates: list[dict]  # per policy: predicted peak (scaled) and tokens/s


def choose_policy(build: Callable[[str], RungSpec], user_layers: list[dict], budget_bytes: float,
                  activation_scale: float = 1.0, device_type: str = "cpu") -> PolicyChoice:
    """`--ac auto` for a rung whose micro-batch is already set (zero, pipeline): the policy the
    planner predicts fastest among those whose predicted per-rank peak fits `budget_bytes`,
    "none" included. Sharding the model states (ZeRO) and splitting the layers (pipeline) free
    per-rank memory, and recompute is a memory technique: the rung keeps only as much of it as
    the budget still needs. When nothing fits: the policy that needs the least memory."""
    rows = []
    for policy in ["none", *recompute_policies("auto", _n_layers(build("none"), user_layers))]:
        row = _candidate(build(policy), user_layers, activation_scale, device_type, policy=policy)
        if "error" in row:
            return PolicyChoice("full", f"recompute full: the planner could not predict memory ({row['error']})", [])
        rows.append(row)
    fitting = [r for r in rows if r["peak_bytes"] <= budget_bytes]
    scale = f" (activations x{activation_scale:.2f})" if activation_scale != 1.0 else ""
    if not fitting:
        least = min(rows, key=lambda r: r["peak_bytes"])
        return PolicyChoice(least["policy"], f"recompute {least['policy']}: nothing fits the {_mib(budget_bytes)} budget "
                                             f"(needs {_mib(least['peak_bytes'])}{scale})", rows)
    best = _fastest(fitting)
    what = "recompute off" if best["policy"] == "none" else f"recompute {best['policy']}"
    return PolicyChoice(best["policy"], f"{what}: predicted peak per rank {_mib(best['peak_bytes'])} <= budget "
                                        f"{_mib(budget_bytes)}{scale}, the least recompute that fits", rows)


def _n_layers(spec: RungSpec, user_layers: list[dict]) -> int:
    """The model's layer count (the rung's recompute setting may still be `auto`, which only
    the ladder reads, so it is left out)."""
    from tenfold.config import build_config

    overrides = {k: v for k, v in spec.overrides.items() if k != "recompute"}
    return build_config(*user_layers, overrides).model.build().n_layers


def _candidate(spec: RungSpec, user_layers: list[dict], activation_scale: float, device_type: str, **key) -> dict:
    """One searched config: `key` (micro_batch, policy) + its predicted peak (activations
    scaled) and tokens/s; or {"error": ...} when the planner cannot answer."""
    p = predict_rung(spec, user_layers, device_type)
    if p.error:
        return {"error": p.error}
    return {**key, "peak_bytes": _scaled_peak(p, activation_scale), "tokens_per_s": p.tokens_per_s}


def _fastest(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["tokens_per_s"] or 0)


def _scaled_peak(p: Prediction, activation_scale: float) -> float:
    act = float(p.memory.get("activations_bytes", 0))
    return float(p.peak_bytes or 0) + (activation_scale - 1.0) * act


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"
